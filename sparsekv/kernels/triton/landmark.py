"""landmark's page scores from stored landmarks (``reference.landmark_page_scores``) in two launches and a step's
choice (``reference.landmark_select``) in three; the landmarks themselves are written by ``summary``'s kernels.

``_landmark_lse_kernel``: one program per (sequence, KV head, block of ``landmark_block`` slots) reads the block's
landmarks once, as the rows of one tensor-core product with the group's query heads as columns, takes each run's
logit ``scale * q . mean + log(count)`` (count: its stored tokens, from the page table and the row's length; a run
without any is left out) and writes per head the log-sum-exp of each page's runs and of the block's. For
``landmark_select`` the program whose block holds the row's current slot first writes that page's landmarks
(``summary.current_summary``: the current page gains a token every step), and rows without holes read nothing past
their last page.

The shares (and for ``landmark_select`` the top-k's group maxima, the sink pages at +inf) are ``coded.page_shares``'
launch, lowbit's; the top-k is ``selection.select_from_maxima``'s."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .coded import _lse, page_shares
from .common import TUNING, block_d, check, dependent_launch, group_pad, interpreted_bf16, pdl_launch, precision
from .selection import fused_group_size, select_from_maxima
from .summary import current_summary, round_back, rounded_by_torch, summary_shape


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
            current_summary(k_ptr, m_ptr, sp_ptr, tab_ptr, b, kvh, cur, n, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h, sm_c,
                            sm_l, ss_b, ss_h, st_b, L * RUN, L, L_PAD, RUN, RUN_PAD, D, D_PAD, TABLE, False, FP8)
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
    out = rounded_by_torch(means) if current else means
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
        round_back(out, means)
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
    summary_shape(k, means, False)
    b, h, _ = q.shape
    hkv, c = slot_page.shape[1], slot_page.shape[2]
    hs = h if per_query_head else hkv
    gs = fused_group_size(b * hs, c, num_pages)
    lse, part = _landmark_lse(q, means, slot_page, seq_len, k.shape[3], scale, table, (k, cur_slot), in_order)
    scores, gmax = page_shares(lse, part, hkv, seq_len, per_query_head, cur_slot=cur_slot, gs=gs,
                               sinks=(slot_page, sink_pages))
    return select_from_maxima(scores, cur_slot, num_pages, gs, gmax)
