"""landmark's ops: the current page's landmarks (``reference.landmark_means``) in one launch, and page scores from
stored landmarks (``reference.landmark_page_scores``) in two.

``_landmark_means_kernel``: one program per (sequence, KV head) reads its current page's keys (through the page
table in shared pages) and writes the mean of each run's stored tokens.

``_landmark_lse_kernel``: one program per (sequence, KV head, block of ``landmark_block`` slots) reads the block's
landmarks once, as the rows of one tensor-core product with the group's query heads as columns, takes each run's
logit ``scale * q . mean + log(count)`` (count: its stored tokens, from the page table and the row's length; a run
without any is left out) and writes per head the log-sum-exp of each page's runs and of the block's.

``_landmark_mass_kernel``: per (sequence, KV head, block of ``mass_block`` slots), each head's total from the
blocks' log-sum-exps, then each page's share ``exp(page - total)``, summed over the group's heads unless per query
head; free slots -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .. import reference
from .coded import _lse, head_totals
from .common import TUNING, block_d, check, group_pad, interpreted_bf16, precision


@triton.jit
def _landmark_means_kernel(k_ptr, m_ptr, sp_ptr, cur_ptr, len_ptr, tab_ptr, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h,
                           sm_c, sm_l, ss_b, ss_h, su_b, su_h, st_b, HKV: tl.constexpr, L: tl.constexpr,
                           L_PAD: tl.constexpr, RUN: tl.constexpr, RUN_PAD: tl.constexpr, D: tl.constexpr,
                           D_PAD: tl.constexpr, TABLE: tl.constexpr, FP8: tl.constexpr):
    """The landmarks of row (sequence, KV head)'s current slot, slot 0 for a row without pages."""
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    slot = tl.maximum(tl.load(cur_ptr + b * su_b + h * su_h), 0)
    page = tl.load(sp_ptr + b * ss_b + h * ss_h + slot)
    stored_end = tl.where(page >= 0, tl.load(len_ptr + b) - page * (L * RUN), 0)  # the page's tokens below it
    if TABLE:  # the slot's page in the store, the same for keys and landmarks
        at = tl.load(tab_ptr + b * st_b + slot)
        k_at = k_ptr + h * sk_h + at * sk_c
        m_at = m_ptr + h * sm_h + at * sm_c
    else:
        k_at = k_ptr + b * sk_b + h * sk_h + slot * sk_c
        m_at = m_ptr + b * sm_b + h * sm_h + slot * sm_c
    run = tl.arange(0, L_PAD)
    r = tl.arange(0, RUN_PAD)
    d = tl.arange(0, D_PAD)
    j = run[:, None] * RUN + r[None, :]  # (L_PAD, RUN_PAD): the token of the page
    stored = (run[:, None] < L) & (r[None, :] < RUN) & (j < stored_end)
    keys = tl.load(k_at + j[:, :, None] * sk_p + d[None, None, :], mask=stored[:, :, None] & (d < D)[None, None, :],
                   other=0.0).to(tl.float32)
    count = tl.maximum(tl.sum(stored.to(tl.float32), axis=1), 1.0)
    mean = tl.math.div_rn(tl.sum(keys, axis=1), count[:, None])  # (L_PAD, D_PAD), as the reference divides
    if FP8:  # saturated, as ``reference.to_cache`` (e4m3fn has no infinity)
        mean = tl.clamp(mean, -448.0, 448.0)
    tl.store(m_at + run[:, None] * sm_l + d[None, :], mean.to(m_ptr.dtype.element_ty),
             mask=(run < L)[:, None] & (d < D)[None, :])


def landmark_means(k: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                   seq_len: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """``reference.landmark_means`` in one launch (float64 landmarks: the reference)."""
    b, hkv = cur_slot.shape
    p, d = k.shape[3], k.shape[4]
    landmarks = means.shape[3]
    reference.check_landmarks(landmarks, p)
    if means.dtype == torch.float64:
        return reference.landmark_means(k, means, slot_page, cur_slot, seq_len, table)
    if k.stride(-1) != 1 or means.stride(-1) != 1:
        raise ValueError("landmark_means: k and means must be contiguous in their last (head_dim) dimension")
    # Triton's CPU interpreter rounds bf16 and fp8 stores otherwise than a GPU does: there (tests only) the landmarks
    # are written into a float32 copy, which torch rounds (the other slots round-trip exactly).
    out = means.float() if knobs.runtime.interpret and means.dtype in (torch.bfloat16, reference.FP8) else means
    run = p // landmarks
    _landmark_means_kernel[(b * hkv,)](
        k, out, slot_page, cur_slot, seq_len, cur_slot if table is None else table, k.stride(0), k.stride(1),
        k.stride(2), k.stride(3), out.stride(0), out.stride(1), out.stride(2), out.stride(3), slot_page.stride(0),
        slot_page.stride(1), cur_slot.stride(0), cur_slot.stride(1), 0 if table is None else table.stride(0),
        HKV=hkv, L=landmarks, L_PAD=triton.next_power_of_2(landmarks), RUN=run, RUN_PAD=triton.next_power_of_2(run),
        D=d, D_PAD=triton.next_power_of_2(d), TABLE=table is not None, FP8=out.dtype == reference.FP8)
    if out is not means:
        means.copy_(reference.to_cache(out, means.dtype))


@triton.jit
def _landmark_lse_kernel(q_ptr, m_ptr, sp_ptr, len_ptr, tab_ptr, out_ptr, part_ptr, n_slots, n_parts, scale, sq_b,
                         sq_h, sm_b, sm_h, sm_c, sm_l, ss_b, ss_h, st_b, so_b, so_h, HKV: tl.constexpr,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         L: tl.constexpr, L_PAD: tl.constexpr, RUN: tl.constexpr, BLOCK_C: tl.constexpr,
                         TABLE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Per head, the log-sum-exp of each page's run logits (out, (B, H, C)) and of the program's block of BLOCK_C
    slots (part, (B * H, n_parts))."""
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    blk = tl.program_id(1)
    i = tl.arange(0, BLOCK_C * L_PAD)  # the tile's rows: run i % L_PAD of slot i // L_PAD of the block
    c = blk * BLOCK_C + i // L_PAD
    run = i % L_PAD
    in_row = (c < n_slots) & (run < L)
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_row, other=-1)
    if TABLE:
        at = tl.load(tab_ptr + b * st_b + c, mask=in_row, other=0)
        m_off = kvh * sm_h + at * sm_c
    else:
        m_off = b * sm_b + kvh * sm_h + c.to(tl.int64) * sm_c
    d = tl.arange(0, D_PAD)
    g = tl.arange(0, G_PAD)
    in_g = g < G
    # A free slot's or an empty run's landmark (any value) gives NaN or inf in its own row only, replaced below.
    means = tl.load(m_ptr + m_off[:, None] + run[:, None] * sm_l + d[None, :], mask=in_row[:, None] & (d < D)[None, :],
                    other=0.0)
    q = tl.load(q_ptr + b * sq_b + (kvh * G + g)[:, None] * sq_h + d[None, :], mask=in_g[:, None] & (d < D)[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        means = means.to(tl.float32)
    else:
        means = means.to(q.dtype)
    logits = tl.dot(means, tl.trans(q), input_precision=PRECISION)  # (BLOCK_C * L_PAD, G_PAD)
    count = tl.minimum(tl.maximum(tl.load(len_ptr + b) - page * (L * RUN) - run * RUN, 0), RUN)
    count = tl.where(page >= 0, count, 0)
    logits = tl.where((count > 0)[:, None], logits * scale + tl.log(tl.maximum(count, 1).to(tl.float32))[:, None],
                      float("-inf"))
    lse = _lse(tl.reshape(logits, (BLOCK_C, L_PAD, G_PAD)), 1)  # (BLOCK_C, G_PAD)
    cs = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + b * so_b + (kvh * G + g)[None, :] * so_h + cs[:, None], lse,
             mask=(cs < n_slots)[:, None] & in_g[None, :])
    tl.store(part_ptr + (row * G + g).to(tl.int64) * n_parts + blk, _lse(lse, 0), mask=in_g)


@triton.jit
def _landmark_mass_kernel(lse_ptr, part_ptr, sp_ptr, out_ptr, n_slots, n_parts, sl_b, sl_h, ss_b, ss_h, so_b, so_h,
                          HKV: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_P: tl.constexpr, PER_HEAD: tl.constexpr):
    """Each page's share of its heads' attention (out), -inf for free slots."""
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    g = tl.arange(0, G_P2)
    in_g = g < G
    total = head_totals(part_ptr, row, g, in_g, n_parts, G, G_P2, BLOCK_P)  # a head without runs: shares 0
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    head = kvh * G + g
    share = tl.exp(tl.load(lse_ptr + b * sl_b + head[:, None] * sl_h + c[None, :],
                           mask=in_g[:, None] & in_c[None, :], other=float("-inf")) - total[:, None])
    free = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1) < 0
    if PER_HEAD:
        tl.store(out_ptr + b * so_b + head[:, None] * so_h + c[None, :], tl.where(free[None, :], float("-inf"), share),
                 mask=in_g[:, None] & in_c[None, :])
    else:
        tl.store(out_ptr + b * so_b + kvh * so_h + c, tl.where(free, float("-inf"), tl.sum(share, axis=0)), mask=in_c)


def landmark_page_scores(q: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor,
                         page_size: int, scale: float, per_query_head: bool = False,
                         table: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.landmark_page_scores``: the pages' and blocks' log-sum-exps, then the shares (float32)."""
    if q.dtype == torch.float64:
        return reference.landmark_page_scores(q, means, slot_page, seq_len, page_size, scale, per_query_head, table)
    check(q, means, "landmark_page_scores")
    b, h, d = q.shape
    hkv, landmarks = means.shape[1], means.shape[3]
    c = slot_page.shape[2]
    reference.check_landmarks(landmarks, page_size)
    l_pad = triton.next_power_of_2(landmarks)
    # At least 16 rows (runs) a tile: tl.dot's smallest.
    block_c = max(max(1, 16 // l_pad), min(TUNING["landmark_block"], triton.next_power_of_2(c)))
    n_parts = triton.cdiv(c, block_c)
    lse = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    part = torch.empty(b * h, n_parts, dtype=torch.float32, device=q.device)
    _landmark_lse_kernel[(b * hkv, n_parts)](
        q, means, slot_page, seq_len, slot_page if table is None else table, lse, part, c, n_parts, scale,
        q.stride(0), q.stride(1), means.stride(0), means.stride(1), means.stride(2), means.stride(3),
        slot_page.stride(0), slot_page.stride(1), 0 if table is None else table.stride(0), lse.stride(0),
        lse.stride(1), HKV=hkv, G=h // hkv, G_PAD=group_pad(h // hkv), D=d, D_PAD=block_d(d), L=landmarks,
        L_PAD=l_pad, RUN=page_size // landmarks, BLOCK_C=block_c, TABLE=table is not None,
        PRECISION=precision(q.dtype), UPCAST=interpreted_bf16(q.dtype), num_warps=TUNING["landmark_warps"])
    out = torch.empty(b, h if per_query_head else hkv, c, dtype=torch.float32, device=q.device)
    block = min(TUNING["mass_block"], triton.next_power_of_2(c))
    _landmark_mass_kernel[(b * hkv, triton.cdiv(c, block))](
        lse, part, slot_page, out, c, n_parts, lse.stride(0), lse.stride(1), slot_page.stride(0), slot_page.stride(1),
        out.stride(0), out.stride(1), HKV=hkv, G=h // hkv, G_P2=triton.next_power_of_2(h // hkv), BLOCK_C=block,
        BLOCK_P=min(TUNING["mass_parts"], triton.next_power_of_2(n_parts)), PER_HEAD=per_query_head,
        num_warps=TUNING["mass_warps"])
    return out
