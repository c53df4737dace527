"""RaaS's decode book-keeping (``raas_update``) as one kernel, one program per (sequence, KV head) row: the
``top_fraction`` rule's threshold by a radix select of the row's score keys (no sort): held in registers, as
``select_pages`` does, for rows of up to ``TUNING["raas_one_program"]`` slots, else streamed in blocks (a pass of
digit histograms per digit, ``selection._digit_counts`` and ``_next_digit``); or the ``alpha`` rule's softmax (max,
then sum, streamed); then one streamed pass that writes the stamps, counts the pages held and keeps the oldest
decode page, which it frees when the next token starts a page in a full row. In place of a sort, an argmin and a
dozen small kernels per layer and step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING
from .selection import _digit_counts, _key_of, _next_digit, _pieces, _radix_bin

_NEVER = tl.constexpr(9223372036854775807)  # the victim key of a slot that is not a candidate


@triton.jit
def _row_key(sc, c, n):
    """Order-preserving uint32 keys of the scores of slots c (0 past the row); -0.0 and 0.0 compare equal, so
    they take one key."""
    x = tl.load(sc + c, mask=c < n, other=0.0)
    return _key_of(tl.where(x == 0.0, 0.0, x), c, n, -1)


@triton.jit
def _raas_update_kernel(sc_ptr, sp_ptr, cur_ptr, st_ptr, step_ptr, seq_ptr, lim_ptr, pp_ptr, n, capacity, page_size,
                        fraction, alpha, scale, sc_b, sc_h, sp_b, sp_h, st_b, st_h, cu_b, cu_h,
                        HKV: tl.constexpr, BY_ALPHA: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                        HEAD: tl.constexpr, TAIL: tl.constexpr, SELECT_BITS: tl.constexpr):
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    sc = sc_ptr + b * sc_b + h * sc_h
    sp = sp_ptr + b * sp_b + h * sp_h
    st = st_ptr + b * st_b + h * st_h
    offs = tl.arange(0, BLOCK)
    prefix = tl.zeros((), tl.uint32)
    done = tl.zeros((), tl.uint32)
    # Per-lane partial results, reduced once after each loop.
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    if BY_ALPHA:
        for start in range(0, n, BLOCK):
            c = start + offs
            top = tl.maximum(top, tl.load(sc + c, mask=c < n, other=float("-inf")) * scale)
        top = tl.max(top, 0)
        for start in range(0, n, BLOCK):
            c = start + offs
            total += tl.exp(tl.load(sc + c, mask=c < n, other=float("-inf")) * scale - top)
        total = tl.sum(total, 0)
    else:
        count = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, n, BLOCK):
            c = start + offs
            count += (tl.load(sp + c, mask=c < n, other=-1) >= 0).to(tl.int32)
        count = tl.sum(count, 0)
        take = tl.maximum(tl.math.ceil(count.to(tl.float32) * fraction).to(tl.int32), 1)
        # The take-th largest key's bin: the keys sharing ``prefix`` on the ``done`` bits are all at least it, and
        # the keys below that prefix all below it (the whole bin is taken, or done covers every bit).
        if HEAD > 0:
            # The row fits in registers as two power-of-two pieces: the radix select of ``select_pages``.
            prefix, done, _ = _radix_bin(_row_key(sc, tl.arange(0, HEAD), n),
                                         _row_key(sc, HEAD + tl.arange(0, TAIL), n), take, SELECT_BITS)
        else:
            left = take
            in_bin = n + tl.zeros((), tl.int32)
            tl.static_assert(32 % BITS == 0)
            for p in tl.static_range(32 // BITS):
                shift = tl.full((), 32 - BITS * (p + 1), tl.int32)
                hist = tl.zeros([1 << BITS], tl.int32)
                for start in range(0, n, BLOCK):
                    hist += _digit_counts(_row_key(sc, start + offs, n), done, prefix, shift, BITS)
                prefix, done, left, in_bin = _next_digit(hist, in_bin, left, prefix, done, shift, BITS)

    step = tl.load(step_ptr)
    cur = tl.load(cur_ptr + b * cu_b + h * cu_h)
    first_decode = tl.load(pp_ptr + b)
    best = tl.full((BLOCK,), _NEVER, tl.int64)
    victim = tl.zeros((BLOCK,), tl.int64)
    held = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n, BLOCK):
        c = start + offs
        inside = c < n
        page = tl.load(sp + c, mask=inside, other=-1)
        valid = page >= 0
        if BY_ALPHA:
            x = tl.load(sc + c, mask=inside, other=float("-inf"))
            used = valid & (tl.exp(x * scale - top) / total >= alpha)
        else:
            used = valid & ((_row_key(sc, c, n) & done) >= prefix)
        stamp = tl.where(used | (c == cur), step, tl.load(st + c, mask=inside, other=0))
        tl.store(st + c, stamp, mask=inside)
        kept = c < capacity
        held += (kept & valid).to(tl.int32)
        # Oldest stamp first; among equal stamps the older page (stamps and pages both fit in 31 bits).
        key = tl.where(kept & (page >= first_decode), stamp * 2147483648 + page, _NEVER)
        victim = tl.where(key < best, c.to(tl.int64), victim)
        best = tl.minimum(best, key)
    low = tl.min(best, 0)
    victim = tl.min(tl.where(best == low, victim, _NEVER), 0)  # candidates' keys are distinct (their pages are)
    evict = (tl.load(seq_ptr + b) % page_size == 0) & (tl.sum(held, 0) >= tl.load(lim_ptr + b)) & (low < _NEVER)
    tl.store(sp + victim, -1, mask=evict)


def raas_update(scores: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor, stamp: torch.Tensor,
                step: torch.Tensor, seq_len: torch.Tensor, limit: torch.Tensor, prompt_pages: torch.Tensor,
                page_size: int, capacity: int, top_fraction: float | None, alpha: float | None,
                scale: float) -> None:
    if scores.dtype != torch.float32:
        return reference.raas_update(scores, slot_page, cur_slot, stamp, step, seq_len, limit, prompt_pages,
                                     page_size, capacity, top_fraction, alpha, scale)
    b, hkv, n = scores.shape
    for name, t in (("scores", scores), ("slot_page", slot_page), ("stamp", stamp)):
        if t.stride(-1) != 1:
            raise ValueError(f"raas_update: {name}'s last (slot) dimension must be contiguous")
    head, tail = _pieces(n) if n <= TUNING["raas_one_program"] else (0, 0)
    _raas_update_kernel[(b * hkv,)](
        scores, slot_page, cur_slot, stamp, step, seq_len, limit, prompt_pages, n, capacity, page_size,
        0.0 if top_fraction is None else top_fraction, 0.0 if alpha is None else alpha, scale,
        scores.stride(0), scores.stride(1), slot_page.stride(0), slot_page.stride(1), stamp.stride(0),
        stamp.stride(1), cur_slot.stride(0), cur_slot.stride(1),
        HKV=hkv, BY_ALPHA=alpha is not None, BLOCK=min(triton.next_power_of_2(n), TUNING["raas_block"]),
        BITS=TUNING["raas_digit_bits"], HEAD=head, TAIL=tail, SELECT_BITS=TUNING["select_digit_bits"],
        num_warps=TUNING["raas_warps"])
