"""Page scores from low-bit key codes (``reference.coded_scores``).

One program per (sequence, KV head, block of ``coded_block`` slots) dequantizes the keys of its pages from their
codes and the pages' min/max (``min + code * (max - min) / L``), takes the estimated logits of all query heads of
the group in one product, and writes each head's log-sum-exp per page; the bounds and codes are read once per KV
head. ``reference.page_mass`` then turns these into each page's share of its heads' attention (a few elementwise
ops and reductions over (B, H, C), fused by torch.compile)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fused, reference
from .common import TUNING, block_d, check, group_pad, interpreted_bf16, precision


@triton.jit
def _coded_lse_kernel(q_ptr, kmin_ptr, kmax_ptr, codes_ptr, sp_ptr, len_ptr, out_ptr, n_slots, scale,
                      sq_b, sq_h, sm_b, sm_h, sm_c, sc_b, sc_h, sc_c, sc_p, ss_b, ss_h, so_b, so_h,
                      HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1)
    used = page >= 0
    m_off = b * sm_b + kvh * sm_h + c[:, None].to(tl.int64) * sm_c + d[None, :]
    m_mask = used[:, None] & (d[None, :] < D)
    lo = tl.load(kmin_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
    step = (tl.load(kmax_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32) - lo) / ((1 << BITS) - 1)
    # Every token of the block's pages: row t is token t % P of slot c[t // P].
    t = tl.arange(0, BLOCK_C * P)
    slot = tl.program_id(1) * BLOCK_C + t // P
    j = t % P
    per: tl.constexpr = 8 // BITS
    c_off = (b * sc_b + kvh * sc_h + slot[:, None].to(tl.int64) * sc_c + j[:, None] * sc_p + d[None, :] // per)
    t_page = tl.reshape(tl.broadcast_to(page[:, None], (BLOCK_C, P)), (BLOCK_C * P,))
    byte = tl.load(codes_ptr + c_off, mask=(t_page >= 0)[:, None] & (d[None, :] < D), other=0)
    code = ((byte >> ((d[None, :] % per) * BITS).to(tl.uint8)) & ((1 << BITS) - 1)).to(tl.float32)
    lo_t = tl.reshape(tl.broadcast_to(lo[:, None, :], (BLOCK_C, P, BLOCK_D)), (BLOCK_C * P, BLOCK_D))
    step_t = tl.reshape(tl.broadcast_to(step[:, None, :], (BLOCK_C, P, BLOCK_D)), (BLOCK_C * P, BLOCK_D))
    q = tl.load(q_ptr + b * sq_b + (kvh * G + g)[:, None] * sq_h + d[None, :],
                mask=(g[:, None] < G) & (d[None, :] < D), other=0.0)
    keys = lo_t + step_t * code
    if UPCAST:
        q = q.to(tl.float32)
    else:
        keys = keys.to(q.dtype)
    logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # (G_PAD, BLOCK_C * P)
    n = tl.load(len_ptr + b)
    ok = (t_page >= 0) & (t_page * P + j < n)
    logits = tl.where(ok[None, :], logits, float("-inf"))
    logits = tl.reshape(logits, (G_PAD, BLOCK_C, P))
    top = tl.max(logits, axis=2)
    safe = tl.where(top > float("-inf"), top, 0.0)
    lse = safe + tl.log(tl.sum(tl.exp(logits - safe[:, :, None]), axis=2))
    lse = tl.where(top > float("-inf"), lse, float("-inf"))
    tl.store(out_ptr + b * so_b + (kvh * G + g)[:, None] * so_h + c[None, :], lse,
             mask=(g[:, None] < G) & in_c[None, :])


def coded_page_lse(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                   slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int) -> torch.Tensor:
    """``reference.coded_page_lse``: (B, H, C) float32."""
    check(q, kmin, "coded_page_lse")
    b, h, d = q.shape
    hkv, c, p = codes.shape[1], codes.shape[2], codes.shape[3]
    reference.check_code_bits(bits, d)
    if codes.stride(-1) != 1 or codes.stride(-2) != codes.shape[-1]:
        codes = codes.contiguous()
    out = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    # At least 16 tokens per block: tl.dot's smallest tile.
    block_c = max(max(1, 16 // p), min(max(1, TUNING["coded_block"] // p), triton.next_power_of_2(c)))
    _coded_lse_kernel[(b * hkv, triton.cdiv(c, block_c))](
        q, kmin, kmax, codes, slot_page, seq_len, out, c, scale,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        slot_page.stride(0), slot_page.stride(1), out.stride(0), out.stride(1),
        HKV=hkv, G=h // hkv, G_PAD=group_pad(h // hkv), D=d, BLOCK_D=block_d(d), P=p, BLOCK_C=block_c, BITS=bits,
        PRECISION=precision(q.dtype), UPCAST=interpreted_bf16(q.dtype), num_warps=TUNING["coded_warps"])
    return out


page_mass = fused(reference.page_mass)


def coded_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                 slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                 per_query_head: bool = False) -> torch.Tensor:
    """``reference.coded_scores``: the kernel's per-head page log-sum-exps, then ``page_mass``."""
    if q.dtype == torch.float64:
        return reference.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head)
    return page_mass(coded_page_lse(q, kmin, kmax, codes, slot_page, seq_len, scale, bits), kmin.shape[1],
                     per_query_head)
