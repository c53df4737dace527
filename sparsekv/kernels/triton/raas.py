"""RaaS's decode book-keeping (``raas_update``) in two kernels, parallel over each row's slots:

1. ``_raas_rank_kernel``, one program per (row, block of slots): with the ``top_fraction`` rule, the block's valid
   pages and, for every candidate decode slot of the row (slots ``[prompt_pages, limit)``), how many of the block's
   pages score strictly above it; with the ``alpha`` rule, the block's softmax maximum and sum.
2. ``_raas_evict_kernel``, one program per row: adds the blocks' partial results (a candidate chunk's counts of
   every block in one load, as a serial add over the blocks would wait on each); a candidate is refreshed when
   fewer than ``take`` pages score above it (the same as scoring at least the take-th largest score, ties
   included), or when its probability reaches ``alpha``; writes the candidates' stamps (the row's length) and frees
   the oldest one when the next token starts a page in a full row.

No selection over the row is needed: only the decode pages' stamps are ever read (prompt pages are never evicted),
so ranking the few candidates against every page replaces finding the threshold itself."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING, dependent_launch, pdl_launch

_NEVER = tl.constexpr(9223372036854775807)  # the victim key of a slot that is not a candidate


@triton.jit
def _raas_rank_kernel(sc_ptr, sp_ptr, pp_ptr, lim_ptr, cnt_ptr, rank_ptr, soft_ptr, n, n_blocks, n_cand, capacity,
                      scale, sc_b, sc_h, sp_b, sp_h,
                      HKV: tl.constexpr, BY_ALPHA: tl.constexpr, BLOCK: tl.constexpr, CAND: tl.constexpr,
                      PDL: tl.constexpr):
    dependent_launch(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    sc = sc_ptr + b * sc_b + h * sc_h
    c = blk * BLOCK + tl.arange(0, BLOCK)
    inside = c < n
    x = tl.load(sc + c, mask=inside, other=float("-inf"))
    out = row.to(tl.int64) * n_blocks + blk
    if BY_ALPHA:  # free slots score -inf: they add nothing to the softmax
        y = x * scale
        m = tl.max(y, 0)
        tl.store(soft_ptr + out * 2, m)
        tl.store(soft_ptr + out * 2 + 1, tl.sum(tl.exp(y - tl.where(m == float("-inf"), 0.0, m)), 0))
    page = tl.load(sp_ptr + b * sp_b + h * sp_h + c, mask=inside, other=-1)
    valid = page >= 0
    tl.store(cnt_ptr + out, tl.sum((valid & (c < capacity)).to(tl.int32), 0))
    if not BY_ALPHA:
        first = tl.load(pp_ptr + b)
        last = tl.load(lim_ptr + b)
        for j0 in range(0, n_cand, CAND):
            j = j0 + tl.arange(0, CAND)
            slot = first + j
            xc = tl.load(sc + slot, mask=(j < n_cand) & (slot < last), other=float("inf"))
            above = tl.sum((valid[None, :] & (x[None, :] > xc[:, None])).to(tl.int32), 1)
            tl.store(rank_ptr + out * n_cand + j, above, mask=j < n_cand)


@triton.jit
def _raas_evict_kernel(sc_ptr, sp_ptr, cur_ptr, st_ptr, seq_ptr, lim_ptr, pp_ptr, cnt_ptr, rank_ptr,
                       soft_ptr, n_blocks, n_cand, capacity, page_size, fraction, alpha, scale,
                       sc_b, sc_h, sp_b, sp_h, st_b, st_h, cu_b, cu_h,
                       HKV: tl.constexpr, BY_ALPHA: tl.constexpr, CAND: tl.constexpr, NB: tl.constexpr,
                       PDL: tl.constexpr):
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    sc = sc_ptr + b * sc_b + h * sc_h
    sp = sp_ptr + b * sp_b + h * sp_h
    st = st_ptr + b * st_b + h * st_h
    base = row.to(tl.int64) * n_blocks
    blocks = tl.arange(0, NB)
    in_blocks = blocks < n_blocks
    held = tl.sum(tl.load(cnt_ptr + base + blocks, mask=in_blocks, other=0), 0)
    if BY_ALPHA:
        m = tl.load(soft_ptr + (base + blocks) * 2, mask=in_blocks, other=float("-inf"))
        s = tl.load(soft_ptr + (base + blocks) * 2 + 1, mask=in_blocks, other=0.0)
        top = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0)
    else:
        take = tl.maximum(tl.math.ceil(held.to(tl.float32) * fraction).to(tl.int32), 1)
    length = tl.load(seq_ptr + b)
    cur = tl.load(cur_ptr + b * cu_b + h * cu_h)
    first = tl.load(pp_ptr + b)
    last = tl.minimum(tl.load(lim_ptr + b), capacity)
    best = tl.full((CAND,), _NEVER, tl.int64)
    victim = tl.zeros((CAND,), tl.int64)
    for j0 in range(0, n_cand, CAND):
        j = j0 + tl.arange(0, CAND)
        slot = first + j
        inside = (j < n_cand) & (slot < last)
        page = tl.load(sp + slot, mask=inside, other=-1)
        candidate = inside & (page >= first)
        if BY_ALPHA:
            x = tl.load(sc + slot, mask=candidate, other=float("-inf"))
            used = tl.exp(x * scale - top) / total >= alpha
        else:
            counts = tl.load(rank_ptr + (base + blocks[:, None]) * n_cand + j[None, :],
                             mask=in_blocks[:, None] & (j < n_cand)[None, :], other=0)
            used = tl.sum(counts, 0) < take
        stamp = tl.load(st + slot, mask=candidate, other=0)
        stamp = tl.where(used | (slot == cur), length, stamp)
        tl.store(st + slot, stamp, mask=candidate)
        # Oldest stamp first; among equal stamps the older page (stamps and pages both fit in 31 bits).
        key = tl.where(candidate, stamp * 2147483648 + page, _NEVER)
        victim = tl.where(key < best, slot, victim)
        best = tl.minimum(best, key)
    low = tl.min(best, 0)
    victim = tl.min(tl.where(best == low, victim, _NEVER), 0)  # candidates' keys are distinct (their pages are)
    evict = (length % page_size == 0) & (held >= tl.load(lim_ptr + b)) & (low < _NEVER)
    tl.store(sp + victim, -1, mask=evict)


def raas_update(scores: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor, stamp: torch.Tensor,
                seq_len: torch.Tensor, limit: torch.Tensor, prompt_pages: torch.Tensor,
                page_size: int, capacity: int, decode_pages: int, top_fraction: float | None, alpha: float | None,
                scale: float) -> None:
    if scores.dtype != torch.float32:
        return reference.raas_update(scores, slot_page, cur_slot, stamp, seq_len, limit, prompt_pages,
                                     page_size, capacity, decode_pages, top_fraction, alpha, scale)
    b, hkv, n = scores.shape
    for name, t in (("scores", scores), ("slot_page", slot_page), ("stamp", stamp)):
        if t.stride(-1) != 1:
            raise ValueError(f"raas_update: {name}'s last (slot) dimension must be contiguous")
    rows, by_alpha = b * hkv, alpha is not None
    block = min(triton.next_power_of_2(n), TUNING["raas_block"])
    n_blocks = triton.cdiv(n, block)
    cand = TUNING["raas_cand"]
    counts = torch.empty(rows, n_blocks, dtype=torch.int32, device=scores.device)
    ranks = torch.empty(rows, n_blocks, 1 if by_alpha else max(decode_pages, 1), dtype=torch.int32,
                        device=scores.device)
    soft = torch.empty(rows, n_blocks, 2 if by_alpha else 1, dtype=torch.float32, device=scores.device)
    _raas_rank_kernel[(rows, n_blocks)](
        scores, slot_page, prompt_pages, limit, counts, ranks, soft, n, n_blocks, decode_pages, capacity, scale,
        scores.stride(0), scores.stride(1), slot_page.stride(0), slot_page.stride(1),
        HKV=hkv, BY_ALPHA=by_alpha, BLOCK=block, CAND=cand, num_warps=TUNING["raas_warps"], **pdl_launch())
    _raas_evict_kernel[(rows,)](
        scores, slot_page, cur_slot, stamp, seq_len, limit, prompt_pages, counts, ranks, soft, n_blocks,
        decode_pages, capacity, page_size, 0.0 if top_fraction is None else top_fraction,
        0.0 if alpha is None else alpha, scale, scores.stride(0), scores.stride(1), slot_page.stride(0),
        slot_page.stride(1), stamp.stride(0), stamp.stride(1), cur_slot.stride(0), cur_slot.stride(1),
        HKV=hkv, BY_ALPHA=by_alpha, CAND=cand, NB=max(2, triton.next_power_of_2(n_blocks)), num_warps=4, **pdl_launch())
