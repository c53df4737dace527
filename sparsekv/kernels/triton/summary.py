"""What a page keeps of its keys besides their bounds, written as its keys arrive: landmark's mean keys of runs of
its tokens (``reference.page_landmarks``) and spread's channel-wise mean and deviation (``reference.page_spreads``).
Each is written for each row's current page (``reference.landmark_means``, ``reference.spread_stats``) or for the
pages a pass wrote by slot numbers (``reference.page_means``, ``reference.page_stats``: vLLM's blocks), in one
launch; the kernels that score pages from them (``landmark``, ``selection``) write the current page's the same way
(``current_summary``) before they read.

``page_summary``: one page's summary from its keys, a tile of its tokens' keys in registers: for landmarks the
mean of each run's stored tokens, for spread the mean of its stored tokens and their deviation from it (two
passes over the tile, as the reference computes it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .. import reference
from .append import last_of_page
from .common import dependent_launch, pdl_launch


@triton.jit
def page_summary(k_at, m_at, stored_end, sk_p, sm_l, L: tl.constexpr, L_PAD: tl.constexpr, RUN: tl.constexpr,
                 RUN_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPREAD: tl.constexpr,
                 FP8: tl.constexpr):
    """Writes one page's summary (at m_at, rows sm_l apart) from its keys (at k_at, tokens sk_p apart), of which
    the first stored_end are stored. Landmarks: L rows, the mean of each run of RUN tokens' stored keys, 0 for a
    run without one. SPREAD (L = 2, RUN the page's tokens): the mean of its stored keys, then their deviation."""
    d = tl.arange(0, D_PAD)
    if SPREAD:
        t = tl.arange(0, RUN_PAD)
        stored = (t < RUN) & (t < stored_end)
        keys = tl.load(k_at + t[:, None] * sk_p + d[None, :], mask=stored[:, None] & (d < D)[None, :],
                       other=0.0).to(tl.float32)
        count = tl.maximum(tl.sum(stored.to(tl.float32), axis=0), 1.0)
        mean = tl.math.div_rn(tl.sum(keys, axis=0), count)  # (D_PAD,)
        apart = tl.where(stored[:, None], keys - mean[None, :], 0.0)
        dev = tl.math.sqrt_rn(tl.math.div_rn(tl.sum(apart * apart, axis=0), count))
        if FP8:  # saturated, as ``reference.to_cache`` (e4m3fn has no infinity)
            mean = tl.clamp(mean, -448.0, 448.0)
            dev = tl.minimum(dev, 448.0)
        tl.store(m_at + d, mean.to(m_at.dtype.element_ty), mask=d < D)
        tl.store(m_at + sm_l + d, dev.to(m_at.dtype.element_ty), mask=d < D)
    else:
        run = tl.arange(0, L_PAD)
        r = tl.arange(0, RUN_PAD)
        j = run[:, None] * RUN + r[None, :]  # (L_PAD, RUN_PAD): the token of the page
        stored = (run[:, None] < L) & (r[None, :] < RUN) & (j < stored_end)
        keys = tl.load(k_at + j[:, :, None] * sk_p + d[None, None, :],
                       mask=stored[:, :, None] & (d < D)[None, None, :], other=0.0).to(tl.float32)
        count = tl.maximum(tl.sum(stored.to(tl.float32), axis=1), 1.0)
        mean = tl.math.div_rn(tl.sum(keys, axis=1), count[:, None])  # (L_PAD, D_PAD), as the reference divides
        if FP8:
            mean = tl.clamp(mean, -448.0, 448.0)
        tl.store(m_at + run[:, None] * sm_l + d[None, :], mean.to(m_at.dtype.element_ty),
                 mask=(run < L)[:, None] & (d < D)[None, :])


@triton.jit
def current_summary(k_ptr, m_ptr, sp_ptr, tab_ptr, b, h, slot, n, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h, sm_c, sm_l,
                    ss_b, ss_h, st_b, P: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, RUN: tl.constexpr,
                    RUN_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, TABLE: tl.constexpr,
                    SPREAD: tl.constexpr, FP8: tl.constexpr):
    """Writes the summary (``page_summary``) of slot ``slot`` of row (b, h), a row of n tokens in pages of P
    (through the page table in shared pages, where keys and summaries lie in the same store page)."""
    page = tl.load(sp_ptr + b * ss_b + h * ss_h + slot)
    stored_end = tl.where(page >= 0, n - page * P, 0)  # the page's tokens below the row's length
    if TABLE:
        at = tl.load(tab_ptr + b * st_b + slot)
        k_at = k_ptr + h * sk_h + at * sk_c
        m_at = m_ptr + h * sm_h + at * sm_c
    else:
        k_at = k_ptr + b * sk_b + h * sk_h + slot * sk_c
        m_at = m_ptr + b * sm_b + h * sm_h + slot * sm_c
    page_summary(k_at, m_at, stored_end, sk_p, sm_l, L, L_PAD, RUN, RUN_PAD, D, D_PAD, SPREAD, FP8)


@triton.jit
def _current_kernel(k_ptr, m_ptr, sp_ptr, cur_ptr, len_ptr, tab_ptr, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h, sm_c, sm_l,
                    ss_b, ss_h, su_b, su_h, st_b, HKV: tl.constexpr, P: tl.constexpr, L: tl.constexpr,
                    L_PAD: tl.constexpr, RUN: tl.constexpr, RUN_PAD: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, TABLE: tl.constexpr, SPREAD: tl.constexpr, FP8: tl.constexpr,
                    PDL: tl.constexpr):
    """The summary of row (sequence, KV head)'s current slot, slot 0 for a row without pages."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    slot = tl.maximum(tl.load(cur_ptr + b * su_b + h * su_h), 0)
    current_summary(k_ptr, m_ptr, sp_ptr, tab_ptr, b, h, slot, tl.load(len_ptr + b), sk_b, sk_h, sk_c, sk_p, sm_b,
                    sm_h, sm_c, sm_l, ss_b, ss_h, st_b, P, L, L_PAD, RUN, RUN_PAD, D, D_PAD, TABLE, SPREAD, FP8)


@triton.jit
def _written_kernel(k_ptr, m_ptr, slot_ptr, n, sk_h, sk_c, sk_p, sm_h, sm_c, sm_l, P: tl.constexpr, L: tl.constexpr,
                    L_PAD: tl.constexpr, RUN: tl.constexpr, RUN_PAD: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, SPREAD: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """One program per (token written, KV head); the page's last token of the pass writes the page's summary."""
    dependent_launch(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    slot, last = last_of_page(slot_ptr, t, n, P)
    if last:
        page = slot // P
        page_summary(k_ptr + h * sk_h + page * sk_c, m_ptr + h * sm_h + page * sm_c, slot % P + 1, sk_p, sm_l, L,
                     L_PAD, RUN, RUN_PAD, D, D_PAD, SPREAD, FP8)


def rounded_by_torch(state: torch.Tensor) -> torch.Tensor:
    """Where a kernel writes summaries: ``state``, or under Triton's CPU interpreter, which rounds bf16 and fp8
    stores otherwise than a GPU does, a float32 copy that ``round_back`` rounds into state (tests only; the
    entries not written round-trip exactly)."""
    return state.float() if knobs.runtime.interpret and state.dtype in (torch.bfloat16, reference.FP8) else state


def round_back(out: torch.Tensor, state: torch.Tensor) -> None:
    if out is not state:
        state.copy_(reference.to_cache(out, state.dtype))


def summary_shape(k: torch.Tensor, state: torch.Tensor, spread: bool) -> dict:
    """The constexprs of a page's summary for keys k (..., P, D) and summaries state (..., L, D): landmarks (L
    dividing P), or with ``spread`` a mean and a deviation (L = 2)."""
    p, d, rows = k.shape[3], k.shape[4], state.shape[3]
    if spread:
        if rows != 2:
            raise ValueError(f"spread ops: stats must hold 2 rows a page (mean, deviation), got {rows}")
        run = p
    else:
        reference.check_landmarks(rows, p)
        run = p // rows
    if k.stride(-1) != 1 or state.stride(-1) != 1:
        raise ValueError("page summaries: k and the summaries must be contiguous in their last (head_dim) dimension")
    return dict(P=p, L=rows, L_PAD=triton.next_power_of_2(rows), RUN=run, RUN_PAD=triton.next_power_of_2(run), D=d,
                D_PAD=triton.next_power_of_2(d), SPREAD=spread)


def _write_current(k, state, slot_page, cur_slot, seq_len, table, spread):
    shape = summary_shape(k, state, spread)
    b, hkv = cur_slot.shape
    out = rounded_by_torch(state)
    _current_kernel[(b * hkv,)](
        k, out, slot_page, cur_slot, seq_len, cur_slot if table is None else table, k.stride(0), k.stride(1),
        k.stride(2), k.stride(3), out.stride(0), out.stride(1), out.stride(2), out.stride(3), slot_page.stride(0),
        slot_page.stride(1), cur_slot.stride(0), cur_slot.stride(1), 0 if table is None else table.stride(0),
        HKV=hkv, TABLE=table is not None, FP8=out.dtype == reference.FP8, **shape, **pdl_launch())
    round_back(out, state)


def _write_pages(k, state, slot_mapping, spread):
    if slot_mapping.stride(0) != 1:
        raise ValueError("page summaries: slot_mapping must be contiguous")
    shape = summary_shape(k, state, spread)
    n = slot_mapping.shape[0]
    out = rounded_by_torch(state)
    if n:
        _written_kernel[(n, k.shape[1])](
            k, out, slot_mapping, n, k.stride(1), k.stride(2), k.stride(3), out.stride(1), out.stride(2),
            out.stride(3), FP8=out.dtype == reference.FP8, **shape, **pdl_launch())
    round_back(out, state)


def landmark_means(k: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                   seq_len: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """``reference.landmark_means`` in one launch (float64 landmarks: the reference)."""
    if means.dtype == torch.float64:
        return reference.landmark_means(k, means, slot_page, cur_slot, seq_len, table)
    _write_current(k, means, slot_page, cur_slot, seq_len, table, False)


def spread_stats(k: torch.Tensor, stats: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                 seq_len: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """``reference.spread_stats`` in one launch (float64 stats: the reference)."""
    if stats.dtype == torch.float64:
        return reference.spread_stats(k, stats, slot_page, cur_slot, seq_len, table)
    _write_current(k, stats, slot_page, cur_slot, seq_len, table, True)


def page_means(k: torch.Tensor, means: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``reference.page_means`` in one launch: a program per token written and KV head, the page's last token of
    the pass writing the page's landmarks."""
    if means.dtype == torch.float64:
        return reference.page_means(k, means, slot_mapping)
    _write_pages(k, means, slot_mapping, False)


def page_stats(k: torch.Tensor, stats: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``reference.page_stats`` in one launch, as ``page_means``."""
    if stats.dtype == torch.float64:
        return reference.page_stats(k, stats, slot_mapping)
    _write_pages(k, stats, slot_mapping, True)
