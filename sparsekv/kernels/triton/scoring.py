"""OmniKV's token scores at its filter layers: ``window_token_maxima``, for each window query and stored token the
max over query heads of the query's (causal, candidates-only) softmax probability, in two passes over the keys,
each read in its own dtype with fp32 products:

- pass 1, program (sequence, KV head, chunk of its query heads, split): the logits of the chunk's heads x window
  queries against the split's blocks of tokens (one ``tl.dot`` per block), their running max and sum of exp;
- a small kernel merges the splits into each query row's log-sum-exp (log2 units), 0 for a row with no visible
  candidate (an empty window entry), whose logits are all masked anyway;
- pass 2, program (sequence, block of tokens): for every KV head and chunk the logits again, ``exp2(logit - lse)``
  where the query sees the token (a candidate at or before its position), else 0, the max over the heads, and the
  (W, block) tile of the output, -inf for tokens that are not candidates.

The output has the reference's exact masks: -inf exactly on non-candidates, 0 exactly where no head's query sees
a candidate. Logits are not stored between the passes: at W = 16 they would be as large as the keys. Key rows that
no query of the window can see (non-candidates, positions after the window) are not loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import LOG2E, TUNING, block_d, check, dependent_launch, interpreted_bf16, num_sms, pdl_launch, precision

_MAX_SPLITS = 256  # the merge holds one row's splits in one tile


@triton.jit
def _rows(q_ptr, qp_ptr, b, kvh, part, sq_b, sq_h, sq_w, sq_d, sp_b, sp_w,
          G: tl.constexpr, W: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr, W_PAD: tl.constexpr,
          D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """The tile of query rows of chunk ``part`` of KV head ``kvh``'s group: row i * W_PAD + w is window query w of
    the chunk's head i. Returns the queries (HC_PAD * W_PAD, BLOCK_D), each row's position (-1 for padding rows,
    which then see nothing), its query head and whether it is a real row."""
    r = tl.arange(0, HC_PAD * W_PAD)
    gi = part * HC + r // W_PAD
    w = r % W_PAD
    real = (r // W_PAD < HC) & (gi < G) & (w < W)
    head = kvh * G + gi
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + w[:, None] * sq_w + d[None, :] * sq_d,
                mask=real[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    pos = tl.load(qp_ptr + b * sp_b + w * sp_w, mask=real, other=-1)
    return q, pos, head, real


@triton.jit
def _tokens(kp_ptr, b, j, n, sk_b, sk_n, lim_ptr, sl_b):
    """Positions of tokens j and which are candidates (0 <= position < the sequence's limit)."""
    kpos = tl.load(kp_ptr + b * sk_b + j * sk_n, mask=j < n, other=-1)
    lim = tl.load(lim_ptr + b * sl_b)
    return kpos, (kpos >= 0) & (kpos < lim)


@triton.jit
def _logits(q, k_row, sk_n, j, load, D: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """q . k of the query rows and tokens j (rows, BLOCK_N) in fp32; only the keys of ``load`` are read (the
    others give 0, masked by the caller)."""
    d = tl.arange(0, BLOCK_D)
    kt = tl.load(k_row + j[:, None].to(tl.int64) * sk_n + d[None, :], mask=load[:, None] & (d[None, :] < D),
                 other=0.0)
    return tl.dot(q, tl.trans(kt.to(q.dtype)), input_precision=PRECISION)  # an fp8 cache is dequantized here


@triton.jit
def _window_stats_kernel(q_ptr, k_ptr, kp_ptr, qp_ptr, lim_ptr, stat_ptr, n, blocks_per_split, n_splits,
                         scale_log2, sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n, skp_b, skp_n, sp_b, sp_w, sl_b,
                         HKV: tl.constexpr, G: tl.constexpr, W: tl.constexpr, HC: tl.constexpr,
                         HC_PAD: tl.constexpr, W_PAD: tl.constexpr, CHUNKS: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr, PDL: tl.constexpr):
    """Pass 1: per query row, the max (log2 units) and the sum of exp2 of its masked logits over the split's
    blocks, written to stats (B, H, W, splits, 2)."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // (HKV * CHUNKS)).to(tl.int64)
    kvh = (row // CHUNKS) % HKV
    part = row % CHUNKS
    q, pos, head, real = _rows(q_ptr, qp_ptr, b, kvh, part, sq_b, sq_h, sq_w, sq_d, sp_b, sp_w,
                               G, W, HC, HC_PAD, W_PAD, D, BLOCK_D, UPCAST)
    last_pos = tl.max(pos, axis=0)  # no query of the window sees a later token
    k_row = k_ptr + b * sk_b + kvh.to(tl.int64) * sk_h
    m_i = tl.full((HC_PAD * W_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((HC_PAD * W_PAD,), tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n, BLOCK_N))
    for blk in range(first, last):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        kpos, cand = _tokens(kp_ptr, b, j, n, skp_b, skp_n, lim_ptr, sl_b)
        s = _logits(q, k_row, sk_n, j, cand & (kpos <= last_pos), D, BLOCK_D, PRECISION) * scale_log2
        s = tl.where(cand[None, :] & (kpos[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), axis=1)
        m_i = m_new
    w = tl.arange(0, HC_PAD * W_PAD) % W_PAD
    out = ((b * HKV * G + head) * W + w) * n_splits + split
    tl.store(stat_ptr + out * 2, m_i, mask=real)
    tl.store(stat_ptr + out * 2 + 1, l_i, mask=real)


@triton.jit
def _window_lse_kernel(stat_ptr, lse_ptr, n_splits, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Merges one query row's splits into its log-sum-exp in log2 units; 0 when the row sees no candidate."""
    dependent_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    ok = s < n_splits
    m = tl.load(stat_ptr + (row * n_splits + s) * 2, mask=ok, other=float("-inf"))
    l = tl.load(stat_ptr + (row * n_splits + s) * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.sum(l * tl.math.exp2(m - m_use), axis=0)
    tl.store(lse_ptr + row, m_use + tl.math.log2(tl.where(total > 0, total, 1.0)))


@triton.jit
def _window_maxima_kernel(q_ptr, k_ptr, kp_ptr, qp_ptr, lim_ptr, lse_ptr, out_ptr, n, scale_log2,
                          sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n, skp_b, skp_n, sp_b, sp_w, sl_b, so_b, so_w,
                          HKV: tl.constexpr, G: tl.constexpr, W: tl.constexpr, HC: tl.constexpr,
                          HC_PAD: tl.constexpr, W_PAD: tl.constexpr, CHUNKS: tl.constexpr, D: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, PDL: tl.constexpr):
    """Pass 2: the (W, BLOCK_N) tile of the output for one sequence, the max over all query heads."""
    dependent_launch(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kpos, cand = _tokens(kp_ptr, b, j, n, skp_b, skp_n, lim_ptr, sl_b)
    # Probabilities are >= 0, so 0 is the max's neutral element: rows that see nothing (padding included) add 0.
    best = tl.zeros((HC_PAD * W_PAD, BLOCK_N), tl.float32)
    for hc in range(HKV * CHUNKS):
        kvh = hc // CHUNKS + tl.zeros((), tl.int64)  # the loop index may be a plain int (interpreter)
        q, pos, head, real = _rows(q_ptr, qp_ptr, b, kvh, hc % CHUNKS, sq_b, sq_h, sq_w, sq_d, sp_b, sp_w,
                                   G, W, HC, HC_PAD, W_PAD, D, BLOCK_D, UPCAST)
        w = tl.arange(0, HC_PAD * W_PAD) % W_PAD
        lse = tl.load(lse_ptr + (b * HKV * G + head) * W + w, mask=real, other=0.0)
        k_row = k_ptr + b * sk_b + kvh * sk_h
        s = _logits(q, k_row, sk_n, j, cand & (kpos <= tl.max(pos, axis=0)), D, BLOCK_D, PRECISION)
        sees = cand[None, :] & (kpos[None, :] <= pos[:, None])
        best = tl.maximum(best, tl.where(sees, tl.math.exp2(s * scale_log2 - lse[:, None]), 0.0))
    maxima = tl.max(tl.reshape(best, (HC_PAD, W_PAD, BLOCK_N)), axis=0)  # rows are (head, query) row-major
    maxima = tl.where(cand[None, :], maxima, float("-inf"))
    wo = tl.arange(0, W_PAD)
    tl.store(out_ptr + b * so_b + wo[:, None] * so_w + j[None, :], maxima, mask=(wo[:, None] < W) & (j < n)[None, :])


def window_token_maxima(q: torch.Tensor, k: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor,
                        limit: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference's result (B, W, N) fp32 from q (B, H, W, D) and the flat store k (B, Hkv, N, D) in their own
    dtype, key_pos (B, N), q_pos (B, W), limit (B,) int64; fp64 runs the reference."""
    if q.dtype == torch.float64:
        return reference.window_token_maxima(q, k, key_pos, q_pos, limit, scale)
    check(q, k, "window_token_maxima")
    b, h, w, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"window_token_maxima: query heads ({h}) must be a multiple of KV heads ({hkv})")
    out = torch.empty(b, w, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    g = h // hkv
    w_pad = triton.next_power_of_2(w)
    hc = min(triton.next_power_of_2(g), max(1, TUNING["window_rows"] // w_pad))  # query heads per chunk
    hc_pad = max(hc, 16 // w_pad)  # tl.dot wants at least 16 rows
    chunks = triton.cdiv(g, hc)
    tile_rows = hc_pad * w_pad
    block_n = TUNING["window_block_n"]
    while block_n > 16 and tile_rows * block_n > TUNING["window_tile"]:
        block_n //= 2
    if q.dtype == torch.float32:
        block_n = 16  # full-precision fp32 products need registers (as in the attention kernel)
    n_blocks = triton.cdiv(n, block_n)
    rows = b * hkv * chunks
    want = triton.cdiv(TUNING["window_programs_per_sm"] * num_sms(q.device), rows)
    splits = max(1, min(want, n_blocks, _MAX_SPLITS))
    per_split = triton.cdiv(n_blocks, splits)
    splits = triton.cdiv(n_blocks, per_split)
    stats = torch.empty(b, h, w, splits, 2, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, w, dtype=torch.float32, device=q.device)
    strides = (*q.stride(), k.stride(0), k.stride(1), k.stride(2), key_pos.stride(0), key_pos.stride(1),
               q_pos.stride(0), q_pos.stride(1), limit.stride(0))
    meta = dict(HKV=hkv, G=g, W=w, HC=hc, HC_PAD=hc_pad, W_PAD=w_pad, CHUNKS=chunks, D=d, BLOCK_D=block_d(d),
                BLOCK_N=block_n, PRECISION=precision(q.dtype), UPCAST=interpreted_bf16(q.dtype),
                num_warps=TUNING["window_warps"], num_stages=TUNING["window_stages"])
    scale_log2 = scale * LOG2E
    _window_stats_kernel[(rows, splits)](q, k, key_pos, q_pos, limit, stats, n, per_split, splits, scale_log2,
                                         *strides, **meta, **pdl_launch())
    _window_lse_kernel[(b * h * w,)](stats, lse, splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                                     num_warps=1, **pdl_launch())
    _window_maxima_kernel[(b, n_blocks)](q, k, key_pos, q_pos, limit, lse, out, n, scale_log2, *strides,
                                         out.stride(0), out.stride(1), **meta, **pdl_launch())
    return out
