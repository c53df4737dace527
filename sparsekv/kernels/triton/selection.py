"""Quest's page choice: page scores and their exact top-k selection.

- ``page_scores``: Quest's bound ``sum_i max(q_i max_i, q_i min_i)`` written as two matrix products,
  ``relu(q) . kmax + min(q, 0) . kmin``, one program per (sequence, KV head, block of slots), all query heads of
  the group at once, so the min/max metadata is read once; the bounds are read in pipelined head-dim slices.
- ``select_pages``: exact top-k by radix select, one program per row holding the row's scores in registers as
  order-preserving uint32 keys: 5-bit digit histograms (``tl.histogram``; its cost grows with the bins), from below
  the leading bits that the row's finite keys share, narrow down the k-th largest key until its whole bin is
  selected, then the keys above it (ties: the lower slots) are compacted with a prefix sum. Long rows are first
  cut down in parallel: with many rows (batch * rows >= ``select_group_rows``), to the slots of the groups of
  consecutive slots whose maximum reaches the k-th largest group maximum (a radix select of the maxima), and of
  those to the keys that reach it; with few rows, to the bitonic ``tl.topk`` of each segment of slots. It replaces
  ``torch.topk`` (35 of the 47 us of a Llama-3-8B step at 32K on the H200); rows longer than ``TUNING`` allows still
  use ``torch.topk`` (benchmarks/results/KERNEL_NOTES.md has the numbers).
- ``quest_select``: scores and selects in one op. Where the selection takes the group filter (from
  ``select_fused_rows`` rows, e.g. Llama-3-8B at batch 1), the page-score kernel writes the group maxima, which
  saves a kernel and a pass over the scores; otherwise it is ``select_pages(page_scores(...))``.
- ``spread_page_scores`` and ``spread_select``: spread's estimate through the same two kernels. The page-score
  kernel reads each page's mean and deviation where Quest's reads its min and max (the same bytes) and takes
  ``q . mean`` and ``sum_i q_i^2 dev_i^2`` as two products; for ``spread_select`` the program whose slots hold a
  row's current page first writes that page's mean and deviation from its keys (``summary.current_summary``), and
  the sink pages score +inf."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton import knobs

from .. import reference
from .common import (TUNING, block_d, check, dependent_launch, f16_products, fp8_launch, group_pad, interpreted_bf16,
                     kept, pdl_launch, precision, product_query)
from .summary import current_summary, round_back, rounded_by_torch, summary_shape


@triton.jit
def _chunk_scores(q_ptr, kmin_ptr, kmax_ptr, b, kvh, head, g, c, load, sq_b, sq_h, sm_b, sm_h, sm_c, table_ptr,
                  st_b, spread, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_C: tl.constexpr, G_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  F16: tl.constexpr, TABLE: tl.constexpr, SPREAD: tl.constexpr, SQ_BF16: tl.constexpr):
    """The scores (G_PAD, BLOCK_C) fp32 of the group's query heads over slots c, whose metadata is read where
    ``load`` (0 elsewhere); with TABLE from the pages of a pool's shared store that row b's table names. Quest's
    bounds from kmin and kmax, or with SPREAD ``q . mean + spread * sqrt(sum_i q_i^2 dev_i^2)`` from the pages'
    means (at kmin_ptr) and deviations (at kmax_ptr)."""
    s = tl.zeros((G_PAD, BLOCK_C), tl.float32)
    if SPREAD:
        var = tl.zeros((G_PAD, BLOCK_C), tl.float32)
    if TABLE:
        slot = tl.load(table_ptr + b * st_b + c, mask=load, other=0)
        bm = 0
    else:
        slot = c
        bm = b
    # Head-dim slices of BLOCK_K: a pipelined loop whose loads go to shared memory (num_stages), so that the
    # tile need not be held in registers.
    for d0 in range(0, BLOCK_D, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + d[None, :],
                    mask=(g[:, None] < G) & (d[None, :] < D), other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q = product_query(q, F16)
        # Metadata is loaded without waiting for the page table; free slots' values (+-inf bounds) give NaN/inf in
        # their own columns only, which the caller masks.
        m_off = bm * sm_b + kvh * sm_h + slot[:, None].to(tl.int64) * sm_c + d[None, :]
        m_mask = load[:, None] & (d[None, :] < D)
        kmax = tl.load(kmax_ptr + m_off, mask=m_mask, other=0.0)
        kmin = tl.load(kmin_ptr + m_off, mask=m_mask, other=0.0)
        if SPREAD:
            s += tl.dot(q, tl.trans(kmin.to(q.dtype)), input_precision=PRECISION)
            # The squares in fp32, their products in bf16 for 16-bit queries (fp16's range would not hold them;
            # in fp32 where the interpreter computes bf16 products on the raw bits, ``interpreted_bf16``).
            sq_dtype = tl.bfloat16 if SQ_BF16 else tl.float32
            qf = q.to(tl.float32)
            dev = kmax.to(q.dtype).to(tl.float32)  # fp8 through q's 16-bit type, as the bounds convert
            var += tl.dot((qf * qf).to(sq_dtype), tl.trans((dev * dev).to(sq_dtype)), input_precision=PRECISION)
        else:
            zero = tl.zeros_like(q)
            q_plus = tl.maximum(q, zero).to(q.dtype)  # triton may compute bf16 max in fp32
            q_minus = tl.minimum(q, zero).to(q.dtype)
            kmax, kmin = kmax.to(q.dtype), kmin.to(q.dtype)  # an fp8 cache's bounds are dequantized here
            s += tl.dot(q_plus, tl.trans(kmax), input_precision=PRECISION)
            s += tl.dot(q_minus, tl.trans(kmin), input_precision=PRECISION)  # (G_PAD, BLOCK_C)
    if SPREAD:
        s += spread * tl.sqrt(var)
    return s


@triton.jit
def _page_scores_kernel(q_ptr, kmin_ptr, kmax_ptr, sp_ptr, out_ptr, cur_ptr, gmax_ptr, table_ptr, k_ptr, len_ptr,
                        from_ptr, forced_ptr, n_slots, n_groups, spread, sinks, sq_b, sq_h, sm_b, sm_h, sm_c, sm_l,
                        ss_b, ss_h, so_b, so_h, cu_b, cu_h, st_b, sk_b, sk_h, sk_c, sk_p,
                        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr,
                        PER_HEAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, GS: tl.constexpr,
                        F16: tl.constexpr, IN_ORDER: tl.constexpr, TABLE: tl.constexpr, SPREAD: tl.constexpr,
                        CURRENT: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, FP8: tl.constexpr,
                        SQ_BF16: tl.constexpr, FORCE: tl.constexpr, PDL: tl.constexpr):
    """Scores of BLOCK_C slots per chunk; with GS > 0 also the maxima of the score keys (``_key_of``) of each group
    of GS consecutive slots, per selection row, for the group filter of the top-k (rows of n_groups int32). With
    IN_ORDER (slot j holds page j or is free) the metadata past the row's current slot is not read. SPREAD: spread's
    scores (``_chunk_scores``), the pages numbered below ``sinks`` at +inf; with CURRENT the program whose slots
    hold the row's current one first writes that page's mean and deviation (at kmin_ptr, deviations sm_l after)
    from its keys (k_ptr, pages of P tokens, len_ptr the rows' lengths). Its score here may read the stale ones:
    the top-k takes the current page whatever its score. FORCE (one row per KV head): the scores also go to
    forced_ptr with the pages numbered from the row's from_ptr[b] on at +inf, and the group maxima are those of the
    forced scores (RaaS's decode pages, always attended)."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    g = tl.arange(0, G_PAD)
    head = kvh * G + g
    if GS > 0 or IN_ORDER or CURRENT:
        cur = tl.maximum(tl.load(cur_ptr + b * cu_b + kvh * cu_h), 0)
    if CURRENT:
        lo = tl.program_id(1) * CHUNKS * BLOCK_C
        if (cur >= lo) & (cur < lo + CHUNKS * BLOCK_C):
            current_summary(k_ptr, kmin_ptr, sp_ptr, table_ptr, b, kvh, cur, tl.load(len_ptr + b), sk_b, sk_h, sk_c,
                            sk_p, sm_b, sm_h, sm_c, sm_l, ss_b, ss_h, st_b, P, 2, 2, P, P_PAD, D, BLOCK_D, TABLE,
                            True, FP8)
    if IN_ORDER:  # a row without holes holds no page after its current slot
        live = cur + 1
    else:
        live = n_slots
    for i in range(CHUNKS):  # a loop, so that the loads of the next chunk overlap this one's products
        c0 = (tl.program_id(1) * CHUNKS + i) * BLOCK_C
        c = c0 + tl.arange(0, BLOCK_C)
        in_c = c < n_slots
        page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1)
        if IN_ORDER:  # a chunk past the row's current slot scores -inf without its metadata being read
            s = tl.zeros((G_PAD, BLOCK_C), tl.float32)
            if c0 < live:
                s = _chunk_scores(q_ptr, kmin_ptr, kmax_ptr, b, kvh, head, g, c, in_c & (c < live), sq_b, sq_h,
                                  sm_b, sm_h, sm_c, table_ptr, st_b, spread, G, D, BLOCK_D, BLOCK_K, BLOCK_C, G_PAD,
                                  PRECISION, UPCAST, F16, TABLE, SPREAD, SQ_BF16)
        else:
            s = _chunk_scores(q_ptr, kmin_ptr, kmax_ptr, b, kvh, head, g, c, in_c, sq_b, sq_h, sm_b, sm_h, sm_c,
                              table_ptr, st_b, spread, G, D, BLOCK_D, BLOCK_K, BLOCK_C, G_PAD, PRECISION, UPCAST,
                              F16, TABLE, SPREAD, SQ_BF16)
        s = tl.where((page >= 0)[None, :], s, float("-inf"))
        if SPREAD:
            s = tl.where(((page >= 0) & (page < sinks))[None, :], float("inf"), s)
        if PER_HEAD:
            tl.store(out_ptr + b * so_b + head[:, None] * so_h + c[None, :], s,
                     mask=(g[:, None] < G) & in_c[None, :])
        else:
            s = tl.max(tl.where(g[:, None] < G, s, float("-inf")), axis=0)
            tl.store(out_ptr + b * so_b + kvh * so_h + c, s, mask=in_c)
            if FORCE:
                s = tl.where(page >= tl.load(from_ptr + b), float("inf"), s)
                tl.store(forced_ptr + b * so_b + kvh * so_h + c, s, mask=in_c)
        if GS > 0:
            group_maxima(gmax_ptr, s, c, c0, cur, n_slots, n_groups, row, g, G, G_PAD, GS, BLOCK_C, PER_HEAD)


@triton.jit
def group_maxima(gmax_ptr, s, c, c0, cur, n_slots, n_groups, row, g, G: tl.constexpr, G_PAD: tl.constexpr,
                 GS: tl.constexpr, BLOCK_C: tl.constexpr, PER_HEAD: tl.constexpr):
    """Writes the maxima of the score keys (``_key_of``) of each group of GS slots among the scores s of slots c (a
    block of BLOCK_C from c0), as int32 bits, for the group filter of the top-k: per head s is (G_PAD, BLOCK_C), head
    g's maxima go to row row * G + g of gmax (rows of n_groups); else s is (BLOCK_C,), to row ``row``."""
    gi = c0 // GS + tl.arange(0, BLOCK_C // GS)
    if PER_HEAD:
        key = tl.reshape(_key_of(s, c[None, :], n_slots, cur), (G_PAD, BLOCK_C // GS, GS))
        tl.store(gmax_ptr + (row * G + g)[:, None].to(tl.int64) * n_groups + gi[None, :],
                 tl.max(key, axis=2).to(tl.int32, bitcast=True), mask=(g[:, None] < G) & (gi < n_groups)[None, :])
    else:
        # A masked reduction per group (0.6 us faster than a reshape at Llama-3 512K, batch 1)
        in_group = (tl.arange(0, BLOCK_C)[None, :] // GS) == tl.arange(0, BLOCK_C // GS)[:, None]
        gk = tl.max(tl.where(in_group, _key_of(s, c, n_slots, cur)[None, :], 0), axis=1)
        tl.store(gmax_ptr + row.to(tl.int64) * n_groups + gi, gk.to(tl.int32, bitcast=True), mask=gi < n_groups)


_NEG_INF_KEY = tl.constexpr(8388607)  # _score_key of -inf (a free slot)
_INF_KEY = tl.constexpr(0xFF800000)  # _score_key of +inf (the current page)


@triton.jit
def _score_key(row_ptr, c, n, cur):
    """The keys (``_key_of``) of the scores of slots c of a row."""
    return _key_of(tl.load(row_ptr + c, mask=c < n, other=0.0), c, n, cur)


@triton.jit
def _key_of(x, c, n, cur):
    """Scores x of slots c as uint32 keys in the same order (the float's bits with the sign bit flipped, all bits
    flipped for negative floats); the current page gets the key of +inf, so that it is always selected, and padding
    (c >= n) the key 0, below every score."""
    x = tl.where(c == cur, float("inf"), x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)
    return tl.where(c < n, key, 0)


@triton.jit
def _packed(row_ptr, c, n, cur):
    """(score key, lower slot first) in one signed int64: key - 2^31 in the high half, ~slot in the low half, so
    that one integer top-k also carries the slot."""
    return ((_score_key(row_ptr, c, n, cur).to(tl.int64) - 2147483648) << 32) | (0xFFFFFFFF - c.to(tl.int64))


@triton.jit
def _topk_segment_kernel(scores_ptr, cur_ptr, cand_ptr, len_ptr, first_ptr, n, n_seg, sc_b, sc_h, cu_b, cu_h,
                         HS: tl.constexpr, ROWS_PER_KV: tl.constexpr, SEG: tl.constexpr, KP: tl.constexpr,
                         REUSE: tl.constexpr, PDL: tl.constexpr):
    """The top KP of each segment of SEG slots, packed, in descending order (so ties list the lower slot first)."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    b = (row // HS).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    r = row % HS
    cur = tl.maximum(tl.load(cur_ptr + b * cu_b + (r // ROWS_PER_KV) * cu_h), 0)
    c = seg * SEG + tl.arange(0, SEG)
    top = tl.topk(_packed(scores_ptr + b * sc_b + r * sc_h, c, n, cur), KP)
    tl.store(cand_ptr + (row.to(tl.int64) * n_seg + seg) * KP + tl.arange(0, KP), top)


@triton.jit
def _row_keys(src, i, n, cur, FROM_SCORES: tl.constexpr):
    """(uint32 key, slot) of entry i of a row: a score (slot i), or a segment candidate. Candidates are listed by
    segment and, within one, ties by slot, so among equal keys a lower index is a lower slot, as for scores."""
    if FROM_SCORES:
        key, slot = _score_key(src, i, n, cur), i.to(tl.int64)
    else:
        packed = tl.load(src + i, mask=i < n, other=-9223372036854775808)  # padding: key 0
        key, slot = ((packed >> 32) + 2147483648).to(tl.uint32), 0xFFFFFFFF - (packed & 0xFFFFFFFF)
    return key, slot


@triton.jit
def _digit_counts(key, done, prefix, shift, BITS: tl.constexpr):
    """Histogram of the BITS-bit digit at ``shift`` of the keys whose ``done`` bits equal ``prefix``; the other
    keys land in bin 0, which the caller recounts."""
    digit = ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32)
    return tl.histogram(tl.where((key & done) == prefix, digit, 0), 1 << BITS)


@triton.jit
def _above_equal(key, done, prefix):
    """Per key, 1 in the low 16-bit half if it is above ``prefix`` on the ``done`` bits and 1 in the high half if
    equal to it, so that one sum or scan counts both (pieces hold fewer than 2^16 keys)."""
    tl.static_assert(key.shape[0] < 65536)
    return ((key & done) > prefix).to(tl.int32) | (((key & done) == prefix).to(tl.int32) << 16)


@triton.jit
def _ranked(key, done, prefix, left):
    """Which keys are selected (those above ``prefix`` on the ``done`` bits, and the first ``left`` of those equal
    to it by index), the place of each among the selected in index order, how many are selected and how many are
    equal: one scan and one reduction of ``_above_equal`` (in place of two of each: ~0.4 us less per 2K keys)."""
    left = tl.maximum(left, 0)
    both = _above_equal(key, done, prefix)
    run = tl.cumsum(both, 0)
    total = tl.sum(both, 0)
    rank, n_eq = run >> 16, total >> 16
    take = ((both & 1) == 1) | ((both >> 16 == 1) & (rank <= left))
    place = (run & 0xFFFF) + tl.minimum(rank, left) - 1
    return take, place, (total & 0xFFFF) + tl.minimum(n_eq, left), n_eq


@triton.jit
def _max_min(a, b, c, d):
    return tl.maximum(a, c), tl.minimum(b, d)


@triton.jit
def _finite_range(key):
    """The largest and smallest finite keys of a piece (not the forced current page, free slots or padding), in one
    reduction; (0, 2^32 - 1) when there are none."""
    return tl.reduce((tl.where(key < _INF_KEY, key, 0), tl.where(key > _NEG_INF_KEY, key, 0xFFFFFFFF)), 0,
                     _max_min)


@triton.jit
def _radix_bin(key, tail, k, BITS: tl.constexpr):
    """Radix select of the k-th largest of the keys of two pieces (HEAD >= TAIL; tail None: one piece), BITS bits
    at a time from the top: returns ``prefix``, the k-th key's known bits (those set in ``done``), and ``left``, how
    many of the keys that share them are still to select (the first ones by index); k - left keys lie above them.
    It stops as soon as the whole bin is to be selected, usually after 2-3 digits. A last digit that would reach
    below bit 0 is taken at bit 0, overlapping known bits (the same for every key in the bin).

    The scores of a row share their sign and exponent bits, so that the first digits would put every key in one bin
    (0.5-1.2 us per select): the digits start below the leading bits that the finite keys (not the forced
    current page, free slots or padding) share, the keys above those bits taken, unless the k-th key lies outside
    them (then from the top)."""
    hi, lo = _finite_range(key)
    n_keys = key.shape[0] + tl.zeros((), tl.int32)
    if tail is not None:
        tl.static_assert(key.shape[0] + tail.shape[0] < 65536)  # the counts of both pieces share 16-bit halves
        hi_tail, lo_tail = _finite_range(tail)
        hi, lo = tl.maximum(hi, hi_tail), tl.minimum(lo, lo_tail)
        n_keys += tail.shape[0]
    low_bits = hi ^ lo  # then every bit below its highest set bit
    for i in tl.static_range(5):
        low_bits |= low_bits >> (1 << i)
    shared = ~low_bits
    head_bits = hi & shared
    counts = tl.sum(_above_equal(key, shared, head_bits), 0)
    if tail is not None:
        counts += tl.sum(_above_equal(tail, shared, head_bits), 0)
    above, same = counts & 0xFFFF, counts >> 16
    if (hi >= lo) & (above < k) & (same >= k - above):
        prefix, done, left, in_bin = head_bits, shared, k - above, same
        # the number of bits below the shared ones, log2(low_bits + 1), exact after rounding for every 2^m - 1
        top = (tl.math.log2(low_bits.to(tl.float32) + 1.0) + 0.5).to(tl.int32) - BITS
    else:
        prefix = tl.zeros((), tl.uint32)
        done = tl.zeros((), tl.uint32)
        left = k + tl.zeros((), tl.int32)
        in_bin = n_keys
        top = 32 - BITS + tl.zeros((), tl.int32)
    while (top > -BITS) & (in_bin != left):
        shift = tl.maximum(top, 0)
        h = _digit_counts(key, done, prefix, shift, BITS)
        if tail is not None:
            h += _digit_counts(tail, done, prefix, shift, BITS)
        prefix, done, left, in_bin = _next_digit(h, in_bin, left, prefix, done, shift, BITS)
        top -= BITS
    return prefix, done, left


@triton.jit
def _next_digit(h, in_bin, left, prefix, done, shift, BITS: tl.constexpr):
    """One digit of a radix select: ``h`` the histogram of the digit at ``shift`` among the ``in_bin`` keys that
    share ``prefix`` (``_digit_counts``: bin 0 is recounted here), ``left`` of which are to select. Returns the
    bin of the ``left``-th largest: its prefix, known bits, the keys still to select in it and its size."""
    bins = tl.arange(0, 1 << BITS)
    h = tl.where(bins == 0, in_bin - tl.sum(tl.where(bins > 0, h, 0), 0), h)
    at_or_above = in_bin - tl.cumsum(h, 0) + h
    digit = tl.max(tl.where(at_or_above >= left, bins, 0), 0)
    left -= tl.sum(tl.where(bins == digit, at_or_above - h, 0), 0)
    in_bin = tl.sum(tl.where(bins == digit, h, 0), 0)
    prefix |= digit.to(tl.uint32) << shift.to(tl.uint32)
    done |= tl.full((), (1 << BITS) - 1, tl.uint32) << shift.to(tl.uint32)
    return prefix, done, left, in_bin


@triton.jit
def _emit(out, key, val, start, done, prefix, left):
    """Stores ``val`` of the selected keys of one piece (above ``prefix``, and the first ``left`` equal to it) at
    out[start:], in index order. Returns the new ``start`` and ``left``."""
    take, place, n_taken, n_eq = _ranked(key, done, prefix, left)
    tl.store(out + start + place, val, mask=take)
    return start + n_taken, left - n_eq


@triton.jit
def _topk_radix_kernel(src_ptr, cur_ptr, out_ptr, len_ptr, first_ptr, n, k, sc_b, sc_h, cu_b, cu_h, so_b, so_h,
                       HS: tl.constexpr, ROWS_PER_KV: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
                       FROM_SCORES: tl.constexpr, BITS: tl.constexpr, REUSE: tl.constexpr, PDL: tl.constexpr):
    """Top k of a row of n scores, or of n segment candidates per row."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HS).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    r = row % HS
    cur = tl.maximum(tl.load(cur_ptr + b * cu_b + (r // ROWS_PER_KV) * cu_h), 0)
    if FROM_SCORES:
        src = src_ptr + b * sc_b + r * sc_h
    else:
        src = src_ptr + row.to(tl.int64) * n
    # The row stays in registers as two power-of-two pieces (HEAD >= TAIL), so that 2^m + 2 slots are not padded
    # to 2^(m+1).
    key, c = _row_keys(src, tl.arange(0, HEAD), n, cur, FROM_SCORES)
    tail, t = _row_keys(src, HEAD + tl.arange(0, TAIL), n, cur, FROM_SCORES)
    prefix, done, left = _radix_bin(key, tail, k, BITS)
    # Exactly k keys are taken (keys are unique per slot by the rank among equals): compact them in index order.
    out = out_ptr + b * so_b + r * so_h
    start, left = _emit(out, key, tl.where(key == _NEG_INF_KEY, -1, c), 0, done, prefix, left)
    _emit(out, tail, tl.where(tail == _NEG_INF_KEY, -1, t), start, done, prefix, left)


@triton.jit
def _group_max_kernel(scores_ptr, cur_ptr, gmax_ptr, len_ptr, first_ptr, n, n_groups, sc_b, sc_h, cu_b, cu_h,
                      HS: tl.constexpr, ROWS_PER_KV: tl.constexpr, GS: tl.constexpr, BLOCK: tl.constexpr,
                      REUSE: tl.constexpr, PDL: tl.constexpr):
    """Group maxima of the score keys (as int32 bits), BLOCK groups per program."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HS).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    r = row % HS
    cur = tl.maximum(tl.load(cur_ptr + b * cu_b + (r // ROWS_PER_KV) * cu_h), 0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tl.max(_score_key(scores_ptr + b * sc_b + r * sc_h, i[:, None] * GS + tl.arange(0, GS)[None, :], n, cur),
               axis=1)  # padding past the row: key 0
    tl.store(gmax_ptr + row.to(tl.int64) * n_groups + i, m.to(tl.int32, bitcast=True), mask=i < n_groups)


@triton.jit
def _topk_group_kernel(scores_ptr, cur_ptr, gmax_ptr, ids_ptr, cand_ptr, out_ptr, len_ptr, first_ptr, n, n_groups, k,
                       sc_b, sc_h, cu_b, cu_h, so_b, so_h,
                       HS: tl.constexpr, ROWS_PER_KV: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
                       GS: tl.constexpr, KP: tl.constexpr, CAND: tl.constexpr, BITS: tl.constexpr,
                       REUSE: tl.constexpr, PDL: tl.constexpr):
    """Top k of a row of n scores through its groups of GS slots: the radix select of the k-th largest group
    maximum bounds the k-th largest key from below, so the top k lie in the groups whose maximum reaches that bound
    (at most KP >= k of them, see below); a second radix select over those groups' slots gives the top k. The
    group maxima come from ``_group_max_kernel``, or from the page-score kernel (``quest_select``)."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HS).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    r = row % HS
    cur = tl.maximum(tl.load(cur_ptr + b * cu_b + (r // ROWS_PER_KV) * cu_h), 0)
    src = scores_ptr + b * sc_b + r * sc_h
    i = tl.arange(0, HEAD)
    it = HEAD + tl.arange(0, TAIL)
    gmax = gmax_ptr + row.to(tl.int64) * n_groups
    key = tl.load(gmax + i, mask=i < n_groups, other=0).to(tl.uint32, bitcast=True)
    tail = tl.load(gmax + it, mask=it < n_groups, other=0).to(tl.uint32, bitcast=True)
    prefix, done, left = _radix_bin(key, tail, k, BITS)
    # Groups above the k-th maximum's bin (fewer than k: each holds a key above the k-th largest), and of the groups
    # in it the first KP - above by slot. Usually the bin is exactly what remains to select, so k groups in all.
    # When the bits run out first (ties on the whole key), the top k take the first of the keys equal to the bound
    # by slot, and those lie in the first KP - above such groups: each earlier group holds one at a lower slot.
    above = k - left
    ids = ids_ptr + row.to(tl.int64) * KP
    start, cap = _emit(ids, key, i, 0, done, prefix, KP - above)
    count, _ = _emit(ids, tail, it, start, done, prefix, cap)
    tl.debug_barrier()  # the group list goes through memory: the compaction above is a scatter
    g = tl.arange(0, KP)
    grp = tl.load(ids + g, mask=g < count, other=0)
    slot = tl.where((g < count)[:, None], grp[:, None] * GS + tl.arange(0, GS)[None, :], n)  # padding: key 0
    slot = tl.reshape(slot, (KP * GS,))  # row-major: slot order
    ckey = _score_key(src, slot, n, cur)
    # Candidates: the keys that reach the bound (with ties on the whole key, the first k equal to it), usually
    # little more than k; compacted when they fit in CAND entries, else the whole tile is selected from.
    cand, place, count, _ = _ranked(ckey, done, prefix, tl.where(~done == 0, k, KP * GS))
    out = out_ptr + b * so_b + r * so_h
    if count <= CAND:
        buf = cand_ptr + row.to(tl.int64) * CAND
        packed = ((ckey.to(tl.int64) - 2147483648) << 32) | (0xFFFFFFFF - slot.to(tl.int64))
        tl.store(buf + place, packed, mask=cand)
        tl.debug_barrier()
        fkey, fslot = _row_keys(buf, tl.arange(0, CAND), count, cur, False)
        fprefix, fdone, fleft = _radix_bin(fkey, None, k, BITS)
        _emit(out, fkey, tl.where(fkey == _NEG_INF_KEY, -1, fslot), 0, fdone, fprefix, fleft)
    else:
        wprefix, wdone, wleft = _radix_bin(ckey, None, k, BITS)
        _emit(out, ckey, tl.where(ckey == _NEG_INF_KEY, -1, slot).to(tl.int64), 0, wdone, wprefix, wleft)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    if q.dtype == torch.float64:
        return reference.page_scores(q, kmin, kmax, slot_page, per_query_head, table)
    return _page_scores(q, kmin, kmax, slot_page, per_query_head, table=table)[0]


def spread_page_scores(q: torch.Tensor, stats: torch.Tensor, slot_page: torch.Tensor, spread: float,
                       per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.spread_page_scores``: Quest's page-score kernel on the pages' means and deviations."""
    if q.dtype == torch.float64:
        return reference.spread_page_scores(q, stats, slot_page, spread, per_query_head, table)
    return _page_scores(q, stats[:, :, :, 0], stats[:, :, :, 1], slot_page, per_query_head, table=table,
                        spread=(spread, 0, None))[0]


def _page_scores(q, kmin, kmax, slot_page, per_query_head, cur_slot=None, gs=0, in_order=False, table=None,
                 spread=None, force=None):
    """Scores (B, Hs, C) fp32 and, with gs > 0, the group maxima of their keys (B * Hs, cdiv(C, gs)) int32; with
    ``in_order`` (cur_slot given) only the metadata up to each row's current slot is read; with ``table`` it is a
    pool's shared pages (``reference.page_scores``). spread: (weight, sink pages, current) for spread's scores,
    kmin and kmax then views of the means and deviations (B, Hkv, C, D) of one stats tensor (B, Hkv, C, 2, D);
    current: None, or (k, seq_len, stats' stride between a page's mean and deviation), the current pages' stats
    written first (cur_slot given; the caller checks the dtypes, as the stats may be the interpreter's float32
    copy, ``summary.rounded_by_torch``). force: None, or (B,) int64, per row the first page number forced in, every
    page from it on at +inf (``raas_select``): then it returns the scores, the group maxima of the forced scores and
    the forced scores."""
    weight, sinks, current = spread or (0.0, 0, None)
    if current is None:
        check(q, kmin, "page_scores")
    b, h, d = q.shape
    hkv, c = slot_page.shape[1], slot_page.shape[2]
    if kmax.stride() != kmin.stride():
        raise ValueError("page_scores: kmin and kmax must have the same layout")
    g = h // hkv
    k, seq_len, sm_l = current or (kmin, slot_page, 0)  # without current: what the kernel does not read
    out = torch.empty(b, h if per_query_head else hkv, c, dtype=torch.float32, device=q.device)
    forced = out if force is None else torch.empty_like(out)
    n_groups = triton.cdiv(c, gs) if gs else 0
    gmax = torch.empty(b * out.shape[1], n_groups, dtype=torch.int32, device=q.device) if gs else out
    cur = cur_slot if gs or in_order or current else slot_page
    block_c = max(fp8_launch("page_block", kmin.dtype == torch.float8_e4m3fn), gs)  # groups within one block
    chunks = TUNING["page_chunks"]
    page_size = k.shape[3] if current else 1
    _page_scores_kernel[(b * hkv, triton.cdiv(c, block_c * chunks))](
        q, kmin, kmax, slot_page, out, cur, gmax, slot_page if table is None else table, k, seq_len,
        slot_page if force is None else force, forced, c, n_groups,
        float(weight), int(sinks), q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        sm_l,
        slot_page.stride(0), slot_page.stride(1), out.stride(0), out.stride(1), cur.stride(0), cur.stride(1),
        0 if table is None else table.stride(0), *(k.stride()[:4] if current else (0, 0, 0, 0)),
        HKV=hkv, G=g, G_PAD=group_pad(g), D=d, BLOCK_D=block_d(d),
        BLOCK_K=min(block_d(d), TUNING["page_block_k"]), BLOCK_C=block_c, CHUNKS=chunks,
        PER_HEAD=per_query_head, PRECISION=precision(q.dtype), UPCAST=interpreted_bf16(q.dtype), GS=gs,
        F16=f16_products(q, kmin), IN_ORDER=in_order, TABLE=table is not None, SPREAD=spread is not None,
        CURRENT=current is not None, P=page_size, P_PAD=triton.next_power_of_2(page_size),
        FP8=kmin.dtype == torch.float8_e4m3fn,
        SQ_BF16=q.dtype != torch.float32 and not knobs.runtime.interpret, FORCE=force is not None,
        num_warps=TUNING["page_warps"],
        num_stages=TUNING["page_stages"],
        **pdl_launch())
    return (out, gmax) if force is None else (out, gmax, forced)


def check_out(name: str, out: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """Raises unless ``out``, a selection's destination called ``name``, has ``shape`` (B, Hs, min(num_pages, C))
    with its last dimension contiguous."""
    if out.shape != shape or out.stride(2) != 1:
        raise ValueError(f"{name} must have shape {shape} (B, Hs, min(num_pages, C)) with its last dimension "
                         f"contiguous, got {tuple(out.shape)}")


def select_pages(scores: torch.Tensor, cur_slot: torch.Tensor, num_pages: int, out: torch.Tensor | None = None,
                 gate: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """The reference's selection (ties to the lower slot), listed in slot order, or by segment for long rows cut
    down by segments: a radix select over the row held in registers (one program per row); rows longer than
    ``TUNING["select_one_program"]`` are first cut down in parallel, through groups of slots when there are many
    rows, else to the bitonic top-k of each segment of slots.

    out: (B, Hs, min(num_pages, C)) int64 to write the selection into (a new tensor when None); gate:
    (seq_len, first, reuse) of ``reference.due_rows``, the rows not due are skipped and keep what out holds."""
    reference.check_num_pages(num_pages)
    b, hs, c = scores.shape
    k = min(num_pages, c)
    if out is not None:
        check_out("out", out, (b, hs, k))
    if scores.dtype != torch.float32 or c > TUNING["select_max_slots"]:
        new = reference.select_pages(scores, cur_slot, num_pages)  # torch.topk: rows this long are rare
        if out is None:
            return new
        return out.copy_(new if gate is None else torch.where(reference.due_rows(*gate).view(-1, 1, 1), new, out))
    if out is None:
        out = torch.empty(b, hs, k, dtype=torch.long, device=scores.device)
    if scores.stride(2) != 1:
        scores = scores.contiguous()
    seq_len, first, reuse = gate or (cur_slot, cur_slot, 1)
    src, n, rows = scores, c, (scores.stride(0), scores.stride(1))
    kp = _padded_k(k)
    gs = _group_filter(b * hs, c, num_pages, TUNING["select_group_rows"], TUNING["select_group_scale"])
    if gs:
        _select_by_groups(scores, cur_slot, out, k, kp, gs, gate=gate)
        return out
    seg = max(TUNING["select_block"], 2 * kp)
    if c > TUNING["select_one_program"] and kp <= TUNING["select_max_k"] and c > seg:
        n = triton.cdiv(c, seg) * kp
        src = torch.empty(b * hs, n, dtype=torch.long, device=scores.device)
        _topk_segment_kernel[(b * hs, n // kp)](scores, cur_slot, src, seq_len, first, c, n // kp, *rows,
                                                cur_slot.stride(0), cur_slot.stride(1), HS=hs,
                                                ROWS_PER_KV=hs // cur_slot.shape[1], SEG=seg, KP=kp, REUSE=reuse,
                                                num_warps=TUNING["select_block_warps"], **pdl_launch())
    head, tail = _pieces(n)
    _topk_radix_kernel[(b * hs,)](src, cur_slot, out, seq_len, first, n, k, *rows, cur_slot.stride(0),
                                  cur_slot.stride(1), out.stride(0), out.stride(1), HS=hs,
                                  ROWS_PER_KV=hs // cur_slot.shape[1], HEAD=head, TAIL=tail,
                                  FROM_SCORES=src is scores, BITS=TUNING["select_digit_bits"], REUSE=reuse,
                                  num_warps=TUNING["select_warps"], **pdl_launch())
    return out


def quest_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                 cur_slot: torch.Tensor, num_pages: int, per_query_head: bool = False,
                 in_order: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """``select_pages(page_scores(...))``; when the selection takes the group filter, the page-score kernel also
    writes the group maxima, so the filter needs no pass of its own over the scores."""
    if q.dtype == torch.float64:
        return reference.quest_select(q, kmin, kmax, slot_page, cur_slot, num_pages, per_query_head, in_order,
                                      table)
    reference.check_num_pages(num_pages)  # before the groups are sized from it
    b, h, _ = q.shape
    gs = fused_group_size(b * (h if per_query_head else slot_page.shape[1]), slot_page.shape[2], num_pages)
    scores, gmax = _page_scores(q, kmin, kmax, slot_page, per_query_head, cur_slot, gs, in_order, table)
    return select_from_maxima(scores, cur_slot, num_pages, gs, gmax)


def raas_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                cur_slot: torch.Tensor, prompt_pages: torch.Tensor,
                num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.raas_select`` in Quest's two launches: the page-score kernel writes the bounds and, beside them,
    the bounds with each row's decode pages at +inf (with their group maxima where the top-k takes the group
    filter), then Quest's top-k of the latter."""
    if q.dtype == torch.float64:
        return reference.raas_select(q, kmin, kmax, slot_page, cur_slot, prompt_pages, num_pages)
    reference.check_num_pages(num_pages)
    gs = fused_group_size(q.shape[0] * slot_page.shape[1], slot_page.shape[2], num_pages)
    scores, gmax, forced = _page_scores(q, kmin, kmax, slot_page, False, cur_slot, gs, force=prompt_pages)
    return scores, select_from_maxima(forced, cur_slot, num_pages, gs, gmax)


def spread_select(q: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, slot_page: torch.Tensor,
                  cur_slot: torch.Tensor, seq_len: torch.Tensor, spread: float, num_pages: int, sink_pages: int = 0,
                  per_query_head: bool = False, in_order: bool = False,
                  table: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.spread_select`` in Quest's two launches: the page-score kernel on the means and deviations (the
    program holding each row's current page writing its stats first, the sink pages at +inf, the group maxima
    where the top-k takes the group filter), then the top-k."""
    if q.dtype == torch.float64:
        return reference.spread_select(q, k, stats, slot_page, cur_slot, seq_len, spread, num_pages, sink_pages,
                                       per_query_head, in_order, table)
    reference.check_num_pages(num_pages)
    check(q, stats, "spread_select")
    summary_shape(k, stats, True)
    b, h, _ = q.shape
    gs = fused_group_size(b * (h if per_query_head else slot_page.shape[1]), slot_page.shape[2], num_pages)
    out = rounded_by_torch(stats)
    scores, gmax = _page_scores(q, out[:, :, :, 0], out[:, :, :, 1], slot_page, per_query_head, cur_slot, gs,
                                in_order, table, (spread, sink_pages, (k, seq_len, out.stride(3))))
    round_back(out, stats)
    return select_from_maxima(scores, cur_slot, num_pages, gs, gmax)


def fused_group_size(rows: int, c: int, num_pages: int) -> int:
    """Slots per group of the group filter when the scoring kernel writes the group maxima (``quest_select``,
    ``lowbit_select``; at least select_fused_rows rows), else 0."""
    return _group_filter(rows, c, num_pages, TUNING["select_fused_rows"], TUNING["select_fused_scale"])


def select_from_maxima(scores: torch.Tensor, cur_slot: torch.Tensor, num_pages: int, gs: int,
                       gmax: torch.Tensor | None, out: torch.Tensor | None = None,
                       gate: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """``select_pages`` (out and gate as there), through the group filter with the maxima gmax the scoring kernel
    wrote when gs (``fused_group_size``) > 0."""
    if not gs:
        return select_pages(scores, cur_slot, num_pages, out=out, gate=gate)
    b, hs, c = scores.shape
    k = min(num_pages, c)
    if out is None:
        out = torch.empty(b, hs, k, dtype=torch.long, device=scores.device)
    _select_by_groups(scores, cur_slot, out, k, _padded_k(k), gs, gmax, gate)
    return out


def _group_filter(rows: int, c: int, num_pages: int, min_rows: int, scale: int) -> int:
    """Slots per group when ``rows`` rows of c fp32 scores are cut down through groups (see ``select_pages``; at
    least ``min_rows`` rows, ``scale`` as in ``_group_size``), else 0."""
    kp = _padded_k(min(num_pages, c))
    if (c <= TUNING["select_one_program"] or c > TUNING["select_max_slots"] or rows < min_rows
            or kp > TUNING["select_max_k"]):
        return 0
    gs = _group_size(c, kp, scale)
    return gs if gs > 1 and triton.cdiv(c, gs) >= kp else 0


def _padded_k(k: int) -> int:
    """k selected pages as a power-of-two tile width, at least 2: tl.topk does not compile for k = 1 (triton 3.6)."""
    return max(2, triton.next_power_of_2(k))


def _pieces(n: int) -> tuple[int, int]:
    """Two power-of-two pieces (HEAD >= TAIL >= 32) that hold n entries with little padding."""
    head = max(32, triton.next_power_of_2(n + 1) // 2)
    return head, max(32, triton.next_power_of_2(n - head)) if n > head else 32


def _group_size(c: int, kp: int, scale: int) -> int:
    """Slots per group for the group filter: scale times about sqrt(c / kp), so that the group maxima (c / gs) and
    the slots of the kp groups kept (kp * gs) are about as many."""
    return triton.next_power_of_2(max(1, math.isqrt(c // kp))) * scale


def _select_by_groups(scores, cur_slot, out, k, kp, gs, gmax=None, gate=None):
    """Top k of each row through the group filter; gmax: the group maxima if the page-score kernel wrote them;
    gate: as ``select_pages``'."""
    b, hs, c = scores.shape
    seq_len, first, reuse = gate or (cur_slot, cur_slot, 1)
    n_groups = triton.cdiv(c, gs)
    head, tail = _pieces(n_groups)
    ids = torch.empty(b * hs, kp, dtype=torch.int32, device=scores.device)
    n_cand = kp * TUNING["select_group_cand"]
    cand = torch.empty(b * hs, n_cand, dtype=torch.long, device=scores.device)
    rows = (scores.stride(0), scores.stride(1), cur_slot.stride(0), cur_slot.stride(1))
    common = dict(HS=hs, ROWS_PER_KV=hs // cur_slot.shape[1], GS=gs)
    if gmax is None:
        gmax = torch.empty(b * hs, n_groups, dtype=torch.int32, device=scores.device)
        block = max(2, TUNING["select_group_block"] // gs)
        _group_max_kernel[(b * hs, triton.cdiv(n_groups, block))](scores, cur_slot, gmax, seq_len, first, c,
                                                                  n_groups, *rows, BLOCK=block, REUSE=reuse,
                                                                  **common, num_warps=4, **pdl_launch())
    _topk_group_kernel[(b * hs,)](scores, cur_slot, gmax, ids, cand, out, seq_len, first, c, n_groups, k, *rows,
                                  out.stride(0), out.stride(1), HEAD=head, TAIL=tail, KP=kp, CAND=n_cand,
                                  BITS=TUNING["select_digit_bits"], REUSE=reuse, **common,
                                  num_warps=TUNING["select_warps"], **pdl_launch())

