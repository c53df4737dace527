"""landmark's ops: the landmarks of each row's current page (``reference.landmark_means``) or of the pages a pass
wrote by slot numbers (``reference.page_means``, vLLM's blocks) in one launch, the page scores from stored
landmarks (``reference.landmark_page_scores``) in two, and a step's choice (``reference.landmark_select``) in three.

``_page_landmarks``: one page's landmarks from its keys, the mean of each run's stored tokens; the three kernels
that write landmarks call it.

``_landmark_lse_kernel``: one program per (sequence, KV head, block of ``landmark_block`` slots) reads the block's
landmarks once, as the rows of one tensor-core product with the group's query heads as columns, takes each run's
logit ``scale * q . mean + log(count)`` (count: its stored tokens, from the page table and the row's length; a run
without any is left out) and writes per head the log-sum-exp of each page's runs and of the block's. For
``landmark_select`` the program whose block holds the row's current slot first writes that page's landmarks (the
current page gains a token every step), and rows without holes read nothing past their last page.

The shares (and for ``landmark_select`` the top-k's group maxima, the sink pages at +inf) are ``coded.page_shares``'
launch, lowbit's; the top-k is ``selection.select_from_maxima``'s."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .. import reference
from .append import last_of_page
from .coded import _lse, page_shares
from .common import TUNING, block_d, check, dependent_launch, group_pad, interpreted_bf16, pdl_launch, precision
from .selection import fused_group_size, select_from_maxima


@triton.jit
def _page_landmarks(k_at, m_at, stored_end, sk_p, sm_l, L: tl.constexpr, L_PAD: tl.constexpr, RUN: tl.constexpr,
                    RUN_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr):
    """Writes one page's landmarks (at m_at, runs sm_l apart) from its keys (at k_at, tokens sk_p apart), of which
    the first stored_end are stored: the mean of each run's stored keys, 0 for a run without one."""
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
    tl.store(m_at + run[:, None] * sm_l + d[None, :], mean.to(m_at.dtype.element_ty),
             mask=(run < L)[:, None] & (d < D)[None, :])


@triton.jit
def _current_landmarks(k_ptr, m_ptr, sp_ptr, tab_ptr, b, h, slot, n, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h, sm_c, sm_l,
                       ss_b, ss_h, st_b, L: tl.constexpr, L_PAD: tl.constexpr, RUN: tl.constexpr,
                       RUN_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, TABLE: tl.constexpr,
                       FP8: tl.constexpr):
    """Writes the landmarks of slot ``slot`` of row (b, h), a row of n tokens (through the page table in shared
    pages, where keys and landmarks lie in the same store page)."""
    page = tl.load(sp_ptr + b * ss_b + h * ss_h + slot)
    stored_end = tl.where(page >= 0, n - page * (L * RUN), 0)  # the page's tokens below the row's length
    if TABLE:
        at = tl.load(tab_ptr + b * st_b + slot)
        k_at = k_ptr + h * sk_h + at * sk_c
        m_at = m_ptr + h * sm_h + at * sm_c
    else:
        k_at = k_ptr + b * sk_b + h * sk_h + slot * sk_c
        m_at = m_ptr + b * sm_b + h * sm_h + slot * sm_c
    _page_landmarks(k_at, m_at, stored_end, sk_p, sm_l, L, L_PAD, RUN, RUN_PAD, D, D_PAD, FP8)


@triton.jit
def _landmark_means_kernel(k_ptr, m_ptr, sp_ptr, cur_ptr, len_ptr, tab_ptr, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h,
                           sm_c, sm_l, ss_b, ss_h, su_b, su_h, st_b, HKV: tl.constexpr, L: tl.constexpr,
                           L_PAD: tl.constexpr, RUN: tl.constexpr, RUN_PAD: tl.constexpr, D: tl.constexpr,
                           D_PAD: tl.constexpr, TABLE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """The landmarks of row (sequence, KV head)'s current slot, slot 0 for a row without pages."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    slot = tl.maximum(tl.load(cur_ptr + b * su_b + h * su_h), 0)
    _current_landmarks(k_ptr, m_ptr, sp_ptr, tab_ptr, b, h, slot, tl.load(len_ptr + b), sk_b, sk_h, sk_c, sk_p, sm_b,
                       sm_h, sm_c, sm_l, ss_b, ss_h, st_b, L, L_PAD, RUN, RUN_PAD, D, D_PAD, TABLE, FP8)


@triton.jit
def _page_means_kernel(k_ptr, m_ptr, slot_ptr, n, sk_h, sk_c, sk_p, sm_h, sm_c, sm_l, P: tl.constexpr,
                       L: tl.constexpr, L_PAD: tl.constexpr, RUN: tl.constexpr, RUN_PAD: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """One program per (token written, KV head); the page's last token of the pass writes the page's landmarks."""
    dependent_launch(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    slot, last = last_of_page(slot_ptr, t, n, P)
    if last:
        page = slot // P
        _page_landmarks(k_ptr + h * sk_h + page * sk_c, m_ptr + h * sm_h + page * sm_c, slot % P + 1, sk_p, sm_l, L,
                        L_PAD, RUN, RUN_PAD, D, D_PAD, FP8)


def _rounded_by_torch(means: torch.Tensor) -> torch.Tensor:
    """Where a kernel writes landmarks: ``means``, or under Triton's CPU interpreter, which rounds bf16 and fp8
    stores otherwise than a GPU does, a float32 copy that ``_round_back`` rounds into means (tests only; the
    landmarks not written round-trip exactly)."""
    return means.float() if knobs.runtime.interpret and means.dtype in (torch.bfloat16, reference.FP8) else means


def _round_back(out: torch.Tensor, means: torch.Tensor) -> None:
    if out is not means:
        means.copy_(reference.to_cache(out, means.dtype))


def _launch_shape(k: torch.Tensor, means: torch.Tensor) -> dict:
    """The constexprs of a page's landmarks for keys k (..., P, D) and landmarks means (..., L, D)."""
    p, d, landmarks = k.shape[3], k.shape[4], means.shape[3]
    reference.check_landmarks(landmarks, p)
    if k.stride(-1) != 1 or means.stride(-1) != 1:
        raise ValueError("landmark ops: k and means must be contiguous in their last (head_dim) dimension")
    run = p // landmarks
    return dict(L=landmarks, L_PAD=triton.next_power_of_2(landmarks), RUN=run, RUN_PAD=triton.next_power_of_2(run),
                D=d, D_PAD=triton.next_power_of_2(d))


def landmark_means(k: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                   seq_len: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """``reference.landmark_means`` in one launch (float64 landmarks: the reference)."""
    if means.dtype == torch.float64:
        return reference.landmark_means(k, means, slot_page, cur_slot, seq_len, table)
    shape = _launch_shape(k, means)
    b, hkv = cur_slot.shape
    out = _rounded_by_torch(means)
    _landmark_means_kernel[(b * hkv,)](
        k, out, slot_page, cur_slot, seq_len, cur_slot if table is None else table, k.stride(0), k.stride(1),
        k.stride(2), k.stride(3), out.stride(0), out.stride(1), out.stride(2), out.stride(3), slot_page.stride(0),
        slot_page.stride(1), cur_slot.stride(0), cur_slot.stride(1), 0 if table is None else table.stride(0),
        HKV=hkv, TABLE=table is not None, FP8=out.dtype == reference.FP8, **shape, **pdl_launch())
    _round_back(out, means)


def page_means(k: torch.Tensor, means: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``reference.page_means`` in one launch: a program per token written and KV head, the page's last token of
    the pass writing the page's landmarks."""
    if means.dtype == torch.float64:
        return reference.page_means(k, means, slot_mapping)
    if slot_mapping.stride(0) != 1:
        raise ValueError("page_means: slot_mapping must be contiguous")
    shape = _launch_shape(k, means)
    n = slot_mapping.shape[0]
    out = _rounded_by_torch(means)
    if n:
        _page_means_kernel[(n, k.shape[1])](
            k, out, slot_mapping, n, k.stride(1), k.stride(2), k.stride(3), out.stride(1), out.stride(2),
            out.stride(3), P=k.shape[3], FP8=out.dtype == reference.FP8, **shape, **pdl_launch())
    _round_back(out, means)


@triton.jit
def _landmark_lse_kernel(q_ptr, k_ptr, m_ptr, sp_ptr, cur_ptr, len_ptr, tab_ptr, out_ptr, part_ptr, n_slots, n_parts,
                         scale, sq_b, sq_h, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h, sm_c, sm_l, ss_b, ss_h, su_b, su_h,
                         st_b, so_b, so_h, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_K: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
                         RUN: tl.constexpr, RUN_PAD: tl.constexpr, BLOCK_C: tl.constexpr, TABLE: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, CURRENT: tl.constexpr,
                         IN_ORDER: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """Per head, the log-sum-exp of each page's run logits (out, (B, H, C)) and of the program's block of BLOCK_C
    slots (part, (B * H, n_parts)). CURRENT: the row's current page's landmarks are written first (by the program
    whose block holds it, which alone reads them); IN_ORDER: slot j holds page j or is free."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    blk = tl.program_id(1)
    n = tl.load(len_ptr + b)
    if CURRENT:
        cur = tl.maximum(tl.load(cur_ptr + b * su_b + kvh * su_h), 0)
        if (cur >= blk * BLOCK_C) & (cur < blk * BLOCK_C + BLOCK_C):
            _current_landmarks(k_ptr, m_ptr, sp_ptr, tab_ptr, b, kvh, cur, n, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h,
                               sm_c, sm_l, ss_b, ss_h, st_b, L, L_PAD, RUN, RUN_PAD, D, D_PAD, TABLE, FP8)
            tl.debug_barrier()  # the block's threads read what others of them wrote
    i = tl.arange(0, BLOCK_C * L_PAD)  # the tile's rows: run i % L_PAD of slot i // L_PAD of the block
    c = blk * BLOCK_C + i // L_PAD
    run = i % L_PAD
    in_row = (c < n_slots) & (run < L)
    if IN_ORDER:
        in_row = in_row & (c < tl.cdiv(n, L * RUN))
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_row, other=-1)
    if TABLE:
        at = tl.load(tab_ptr + b * st_b + c, mask=in_row, other=0)
        m_off = kvh * sm_h + at * sm_c
    else:
        m_off = b * sm_b + kvh * sm_h + c.to(tl.int64) * sm_c
    g = tl.arange(0, G_PAD)
    in_g = g < G
    m_at = m_ptr + m_off[:, None] + run[:, None] * sm_l
    q_at = q_ptr + b * sq_b + (kvh * G + g)[:, None] * sq_h
    logits = tl.zeros((BLOCK_C * L_PAD, G_PAD), dtype=tl.float32)
    # Head-dim slices of BLOCK_K: a loop pipelined over the launch's stages, as the page-score kernel's.
    for d0 in range(0, D_PAD, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)
        # A free slot's or an empty run's landmark (any value) gives NaN or inf in its own row only, replaced below.
        means = tl.load(m_at + d[None, :], mask=in_row[:, None] & (d < D)[None, :], other=0.0)
        q = tl.load(q_at + d[None, :], mask=in_g[:, None] & (d < D)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            means = means.to(tl.float32)
        else:
            means = means.to(q.dtype)
        logits = tl.dot(means, tl.trans(q), logits, input_precision=PRECISION)  # (BLOCK_C * L_PAD, G_PAD)
    count = tl.minimum(tl.maximum(n - page * (L * RUN) - run * RUN, 0), RUN)
    count = tl.where(page >= 0, count, 0)
    logits = tl.where((count > 0)[:, None], logits * scale + tl.log(tl.maximum(count, 1).to(tl.float32))[:, None],
                      float("-inf"))
    lse = _lse(tl.reshape(logits, (BLOCK_C, L_PAD, G_PAD)), 1)  # (BLOCK_C, G_PAD)
    cs = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + b * so_b + (kvh * G + g)[None, :] * so_h + cs[:, None], lse,
             mask=(cs < n_slots)[:, None] & in_g[None, :])
    tl.store(part_ptr + (row * G + g).to(tl.int64) * n_parts + blk, _lse(lse, 0), mask=in_g)


def _landmark_lse(q, means, slot_page, seq_len, page_size, scale, table, current=None, in_order=False):
    """``reference.landmark_page_lse`` (B, H, C) float32 and each head's log-sum-exp over each block of slots (B * H,
    blocks) float32; current: (k, cur_slot), each row's current page's landmarks written first (in means)."""
    check(q, means, "landmark_page_scores")
    b, h, d = q.shape
    hkv, landmarks = means.shape[1], means.shape[3]
    c = slot_page.shape[2]
    reference.check_landmarks(landmarks, page_size)
    k, cur_slot = current or (means, slot_page[:, :, 0])  # without current: tensors the kernel does not read
    l_pad = triton.next_power_of_2(landmarks)
    # At least 16 rows (runs) a tile: tl.dot's smallest.
    block_c = max(max(1, 16 // l_pad), min(TUNING["landmark_block"], triton.next_power_of_2(c)))
    n_parts = triton.cdiv(c, block_c)
    lse = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    part = torch.empty(b * h, n_parts, dtype=torch.float32, device=q.device)
    out = _rounded_by_torch(means) if current else means
    batch = 0 if table is not None else 1  # a store of shared pages is one batch row: its batch stride unused
    run = page_size // landmarks
    _landmark_lse_kernel[(b * hkv, n_parts)](
        q, k, out, slot_page, cur_slot, seq_len, slot_page if table is None else table, lse, part, c, n_parts, scale,
        q.stride(0), q.stride(1), batch * k.stride(0), k.stride(1), k.stride(2), k.stride(3), batch * out.stride(0),
        out.stride(1), out.stride(2), out.stride(3), slot_page.stride(0), slot_page.stride(1), cur_slot.stride(0),
        cur_slot.stride(1), 0 if table is None else table.stride(0), lse.stride(0), lse.stride(1), HKV=hkv,
        G=h // hkv, G_PAD=group_pad(h // hkv), D=d, D_PAD=block_d(d),
        BLOCK_K=min(block_d(d), max(16, TUNING["landmark_block_k"])), L=landmarks, L_PAD=l_pad, RUN=run,
        RUN_PAD=triton.next_power_of_2(run), BLOCK_C=block_c, TABLE=table is not None, PRECISION=precision(q.dtype),
        UPCAST=interpreted_bf16(q.dtype), CURRENT=current is not None, IN_ORDER=in_order,
        FP8=out.dtype == reference.FP8, num_warps=TUNING["landmark_warps"], num_stages=TUNING["landmark_stages"],
        **pdl_launch())
    if current:
        _round_back(out, means)
    return lse, part


def landmark_page_scores(q: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor,
                         page_size: int, scale: float, per_query_head: bool = False,
                         table: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.landmark_page_scores``: the pages' and blocks' log-sum-exps, then the shares (float32)."""
    if q.dtype == torch.float64:
        return reference.landmark_page_scores(q, means, slot_page, seq_len, page_size, scale, per_query_head, table)
    lse, part = _landmark_lse(q, means, slot_page, seq_len, page_size, scale, table)
    return page_shares(lse, part, means.shape[1], seq_len, per_query_head)[0]


def landmark_select(q: torch.Tensor, k: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor,
                    cur_slot: torch.Tensor, seq_len: torch.Tensor, scale: float, num_pages: int, sink_pages: int = 0,
                    per_query_head: bool = False, in_order: bool = False,
                    table: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.landmark_select`` in three launches: the current pages' landmarks and the page log-sum-exps, the
    shares with the sink pages and the group maxima (the top-k's group filter, where it applies), the top-k."""
    if q.dtype == torch.float64:
        return reference.landmark_select(q, k, means, slot_page, cur_slot, seq_len, scale, num_pages, sink_pages,
                                         per_query_head, in_order, table)
    reference.check_num_pages(num_pages)
    _launch_shape(k, means)
    b, h, _ = q.shape
    hkv, c = slot_page.shape[1], slot_page.shape[2]
    hs = h if per_query_head else hkv
    gs = fused_group_size(b * hs, c, num_pages)
    lse, part = _landmark_lse(q, means, slot_page, seq_len, k.shape[3], scale, table, (k, cur_slot), in_order)
    scores, gmax = page_shares(lse, part, hkv, seq_len, per_query_head, cur_slot=cur_slot, gs=gs,
                               sinks=(slot_page, sink_pages))
    return select_from_maxima(scores, cur_slot, num_pages, gs, gmax)
