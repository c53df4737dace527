"""The attention each stored token receives, summed over many queries (``reference.attention_mass``: H2O's prompt
scores), in two passes over the keys, read in their own dtype with fp32 products:

- pass 1, program (sequence, query head, block of queries): each query's log-sum-exp (log2 units) over the tokens
  it sees, a running max and sum of exp2 over the blocks of tokens;
- pass 2, program (sequence, query head, block of tokens): the logits again against every block of queries,
  ``exp2(logit - lse)`` where the query sees the token, summed over the queries.

A prompt pass's own attention computes pass 1's result: given it (``lse``), only pass 2 runs. In a prompt's layer
(``in_order``: slot j holds page j) token t is at position t, so no slot list is read and pass 1 stops at each block
of queries' last position.

A block of tokens that no query of a block sees (free slots, positions after the queries) is skipped in both passes,
so a causal prompt costs about half of the products, and nothing of size queries x tokens is stored: the reference
materialises the weights chunk by chunk, which at a 128K-token prompt means thousands of gathers of every key per
layer. With one query (a decode step) the mass is the query's weights: ``attend_with_weights`` takes them from here
from the split-K attention's log-sum-exp and pass 2, for H2O's and TOVA's steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .attention import sparse_decode_lse
from .common import LOG2E, TUNING, block_d, check, dependent_launch, interpreted_bf16, pdl_launch, precision

_NONE = tl.constexpr(2 ** 62)  # the position of a token no query sees, above every real one


@triton.jit
def _program(H: tl.constexpr, HS: tl.constexpr, HKV: tl.constexpr):
    """The sequence, query head, selection row and KV head of program (b * H + h, ...)."""
    h = tl.program_id(0) % H
    r = h // (H // HS)
    return (tl.program_id(0) // H).to(tl.int64), h, r, r // (HS // HKV)


@triton.jit
def _tokens(sl_ptr, sp_ptr, b, r, kvh, t, T, sl_b, sl_h, sl_k, sp_b, sp_h, sp_c, P: tl.constexpr,
            IN_ORDER: tl.constexpr):
    """Slots and positions of tokens t (token t % P of slot column t // P of selection row r); -1 for the tokens of
    free slots and t >= T. IN_ORDER: column j is slot j, which holds page j or is free, so token t is at position
    t and no load waits on another."""
    if IN_ORDER:
        slot = tl.where(t < T, t // P, -1).to(tl.int64)
        page = tl.load(sp_ptr + b * sp_b + kvh * sp_h + (t // P) * sp_c, mask=t < T, other=-1)
        kpos = tl.where(page >= 0, t.to(tl.int64), -1)
    else:
        slot = tl.load(sl_ptr + b * sl_b + r * sl_h + (t // P) * sl_k, mask=t < T, other=-1)
        page = tl.load(sp_ptr + b * sp_b + kvh * sp_h + tl.maximum(slot, 0) * sp_c, mask=slot >= 0, other=-1)
        kpos = tl.where(page >= 0, page * P + t % P, -1)
    return slot, kpos


@triton.jit
def _keys(k_ptr, b, kvh, slot, t, load, sk_b, sk_h, sk_c, sk_p, P: tl.constexpr, D: tl.constexpr,
          BLOCK_D: tl.constexpr):
    """The key rows (BLOCK_K, BLOCK_D) of tokens t, read where ``load`` (else 0)."""
    d = tl.arange(0, BLOCK_D)
    row = b * sk_b + kvh * sk_h + tl.maximum(slot, 0) * sk_c + (t % P) * sk_p
    return tl.load(k_ptr + row[:, None] + d[None, :], mask=load[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def _queries(q_ptr, b, h, s, S, sq_b, sq_h, sq_s, sq_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
             UPCAST: tl.constexpr):
    """Queries s (BLOCK_Q, BLOCK_D) of head h (0 past S)."""
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + s[:, None] * sq_s + d[None, :] * sq_d,
                mask=(s < S)[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _mass_lse_kernel(q_ptr, k_ptr, sp_ptr, sl_ptr, qp_ptr, lse_ptr, S, T, scale_log2, sq_b, sq_h, sq_s, sq_d,
                     sk_b, sk_h, sk_c, sk_p, sp_b, sp_h, sp_c, sl_b, sl_h, sl_k, qp_b, qp_s,
                     H: tl.constexpr, HS: tl.constexpr, HKV: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, IN_ORDER: tl.constexpr, PDL: tl.constexpr):
    """Pass 1: lse (B, H, S) in log2 units, 0 for a query that sees no token."""
    dependent_launch(PDL)
    b, h, r, kvh = _program(H, HS, HKV)
    s = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q = _queries(q_ptr, b, h, s, S, sq_b, sq_h, sq_s, sq_d, D, BLOCK_D, UPCAST)
    pos = tl.load(qp_ptr + b * qp_b + s * qp_s, mask=s < S, other=-1)
    last = tl.max(pos, axis=0)
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    end = T
    if IN_ORDER:  # token t is at position t: none past the block's last query is seen
        end = tl.minimum(T, last + 1)
    for t0 in range(0, end, BLOCK_K):
        t = t0 + tl.arange(0, BLOCK_K)
        slot, kpos = _tokens(sl_ptr, sp_ptr, b, r, kvh, t, T, sl_b, sl_h, sl_k, sp_b, sp_h, sp_c, P, IN_ORDER)
        seen = (kpos >= 0) & (kpos <= last)
        if tl.max(seen.to(tl.int32), axis=0) > 0:
            kt = _keys(k_ptr, b, kvh, slot, t, seen, sk_b, sk_h, sk_c, sk_p, P, D, BLOCK_D)
            x = tl.dot(q, tl.trans(kt.to(q.dtype)), input_precision=PRECISION) * scale_log2
            x = tl.where((kpos[None, :] >= 0) & (kpos[None, :] <= pos[:, None]), x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
            l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(x - m_use[:, None]), axis=1)
            m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    tl.store(lse_ptr + (b * H + h) * S + s, lse, mask=s < S)


@triton.jit
def _mass_sum_kernel(q_ptr, k_ptr, sp_ptr, sl_ptr, qp_ptr, last_ptr, lse_ptr, out_ptr, S, T, scale_log2, lse_log2,
                     sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_c, sk_p, sp_b, sp_h, sp_c, sl_b, sl_h, sl_k, qp_b, qp_s,
                     la_b, H: tl.constexpr, HS: tl.constexpr, HKV: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, IN_ORDER: tl.constexpr, PDL: tl.constexpr):
    """Pass 2: out (B, H, T) float32, each token's weights summed over the queries that see it; lse (B, H, S) times
    ``lse_log2`` is in log2 units; last_ptr: each row's largest query position (row b at b * la_b)."""
    dependent_launch(PDL)
    b, h, r, kvh = _program(H, HS, HKV)
    t = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    slot, kpos = _tokens(sl_ptr, sp_ptr, b, r, kvh, t, T, sl_b, sl_h, sl_k, sp_b, sp_h, sp_c, P, IN_ORDER)
    first = tl.min(tl.where(kpos >= 0, kpos, _NONE), axis=0)
    acc = tl.zeros((BLOCK_K,), tl.float32)
    # A block that no query sees (free slots, positions past every query: most of a layer sized for the whole
    # prompt while its first passes run) writes its zeros without reading a query.
    if first <= tl.load(last_ptr + b * la_b):
        kt = _keys(k_ptr, b, kvh, slot, t, kpos >= 0, sk_b, sk_h, sk_c, sk_p, P, D, BLOCK_D)
        for s0 in range(0, S, BLOCK_Q):
            s = s0 + tl.arange(0, BLOCK_Q)
            # Queries and positions are loaded together: reading the queries only after the positions showed one
            # seeing the block would add a round trip to every block of a decode step's single query.
            pos = tl.load(qp_ptr + b * qp_b + s * qp_s, mask=s < S, other=-1)
            q = _queries(q_ptr, b, h, s, S, sq_b, sq_h, sq_s, sq_d, D, BLOCK_D, UPCAST)
            if tl.max(pos, axis=0) >= first:
                x = tl.dot(q, tl.trans(kt.to(q.dtype)), input_precision=PRECISION) * scale_log2
                lse = tl.load(lse_ptr + (b * H + h) * S + s, mask=s < S, other=0.0) * lse_log2
                sees = (kpos[None, :] >= 0) & (kpos[None, :] <= pos[:, None])
                acc += tl.sum(tl.where(sees, tl.math.exp2(x - lse[:, None]), 0.0), axis=0)
    tl.store(out_ptr + (b * H + h) * T + t, acc, mask=t < T)


def _launch(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor, q_pos: torch.Tensor,
            name: str) -> tuple[tuple, dict, tuple, tuple]:
    """The checks, strides and constants of both passes, and their (queries, tokens) blocks (pass 1, pass 2)."""
    check(q, k, name)
    b, h, s, d = q.shape
    hkv, p = k.shape[1], k.shape[3]
    hs = slots.shape[1]
    if h % hs or hs % hkv:
        raise ValueError(f"{name}: selection rows ({hs}) must divide the query heads ({h}) and be a "
                         f"multiple of the KV heads ({hkv})")
    wide = q.dtype == torch.float32 or interpreted_bf16(q.dtype)  # fp32 tiles: half the block, 16 at least (a dot's)
    blocks = TUNING["step_mass_blocks" if s == 1 else "prompt_mass_blocks"]
    lse_blocks, sum_blocks = (tuple(max(16, x // 2) if wide else x for x in pair) for pair in blocks)
    strides = (*q.stride(), k.stride(0), k.stride(1), k.stride(2), k.stride(3), *slot_page.stride(), *slots.stride(),
               *q_pos.stride())
    meta = dict(H=h, HS=hs, HKV=hkv, P=p, D=d, BLOCK_D=block_d(d), PRECISION=precision(q.dtype),
                UPCAST=interpreted_bf16(q.dtype), num_warps=TUNING["prompt_mass_warps"],
                num_stages=TUNING["prompt_mass_stages"])
    return strides, meta, lse_blocks, sum_blocks


def attention_mass(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
                   q_pos: torch.Tensor, scale: float, in_order: bool = False,
                   lse: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's result (B, H, K * P) float32 from q (B, H, S, D) and the paged keys k (B, Hkv, C, P, D) in
    their own dtype (or an fp8 cache); fp64 runs the reference. ``in_order`` (the caller's promise, unchecked
    here): pass 1 walks each block of queries' tokens only up to its last query, and neither pass reads slots.
    With ``lse`` (B, H, S) given, pass 1 is not run."""
    if q.dtype == torch.float64:
        return reference.attention_mass(q, k, slot_page, slots, q_pos, scale, in_order, lse)
    strides, meta, (lse_q, lse_k), (sum_q, sum_k) = _launch(q, k, slot_page, slots, q_pos, "attention_mass")
    b, h, s, _ = q.shape
    n = slots.shape[2] * k.shape[3]
    out = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or s == 0:
        return out.zero_()  # no query: every token receives nothing (pass 2 writes every entry otherwise)
    scale_log2 = scale * LOG2E
    last = q_pos.amax(dim=1)
    if lse is None:
        lse, lse_log2 = torch.empty(b, h, s, dtype=torch.float32, device=q.device), 1.0
        _mass_lse_kernel[(b * h, triton.cdiv(s, lse_q))](q, k, slot_page, slots, q_pos, lse, s, n, scale_log2,
                                                         *strides, BLOCK_Q=lse_q, BLOCK_K=lse_k, IN_ORDER=in_order,
                                                         **meta, **pdl_launch())
    else:
        if lse.shape != (b, h, s):
            raise ValueError(f"attention_mass: lse must have shape {(b, h, s)} (B, H, S), got {tuple(lse.shape)}")
        lse, lse_log2 = lse.float().contiguous(), LOG2E
    _mass_sum_kernel[(b * h, triton.cdiv(n, sum_k))](q, k, slot_page, slots, q_pos, last, lse, out, s, n, scale_log2,
                                                     lse_log2, *strides, last.stride(0), BLOCK_Q=sum_q, BLOCK_K=sum_k,
                                                     IN_ORDER=in_order, **meta, **pdl_launch())
    return out


def attend_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor,
                        slots: torch.Tensor, q_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (out, weights) for one query a row (S = 1, a decode step: H2O's and TOVA's): the split-K
    attention over the tokens at positions <= q_pos (``sparse_decode``'s kernels), whose merge also gives the
    query's log-sum-exp, then ``attention_mass``'s pass 2 with it (``step_mass_blocks``), which forms the weights:
    (B, H, 1, D) in q's dtype and (B, H, 1, K * P) float32. Pass 1 would walk a row's tokens in one program; the
    split attention walks them in many. Several queries a row and fp64 run the reference."""
    if q.shape[2] != 1 or q.dtype == torch.float64:
        return reference.attend_with_weights(q, k, v, slot_page, slots, q_pos, scale)
    strides, meta, _, (sum_q, sum_k) = _launch(q, k, slot_page, slots, q_pos, "attend_with_weights")
    b, h = q.shape[:2]
    n = slots.shape[2] * k.shape[3]
    out, lse = sparse_decode_lse(q[:, :, 0], k, v, slot_page, slots, q_pos[:, 0] + 1, scale)
    weights = torch.empty(b, h, 1, n, dtype=torch.float32, device=q.device)
    if weights.numel():
        _mass_sum_kernel[(b * h, triton.cdiv(n, sum_k))](q, k, slot_page, slots, q_pos, q_pos, lse, weights, 1, n,
                                                         scale * LOG2E, LOG2E, *strides, q_pos.stride(0),
                                                         BLOCK_Q=sum_q, BLOCK_K=sum_k, IN_ORDER=False, **meta,
                                                         **pdl_launch())
    return out.unsqueeze(2), weights
