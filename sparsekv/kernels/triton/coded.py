"""Page scores from low-bit key codes (``reference.coded_scores``), in two launches.

``_coded_lse_kernel``: one program per (sequence, KV head, block of ``coded_block`` tokens) reads the codes of its
pages once, as bytes. Channel ``PER * i + k`` of a key is field k of its byte i (PER = 8 // bits fields of ``bits``
bits), so the product over the head dim is PER products, one per field, over channels k, k + PER, ...: each takes
its field with a constant shift and no conversion instruction (the field in the top mantissa bits of 1.0 is the
float ``1 + level / 2^bits``), dequantizes it with its pages' min and step broadcast over their tokens
(``min + level * (max - min) / L`` as one FMA of that float) and adds the field's share of the logits, a
tensor-core product with the block's tokens as rows and the group's query heads as columns. The program writes each
head's log-sum-exp per page and over its whole block.

``_page_mass_kernel``: per (sequence, KV head, block of ``mass_block`` slots), each head's total from the blocks'
log-sum-exps, then each page's share of it, summed over the group's heads unless per query head
(``reference.page_mass``); for ``lowbit_select`` also the group maxima of the top-k's group filter, as
``quest_select``'s page-score kernel writes them, so that the selection is one more launch.

On CUDA the log-sum-exps come from a CUDA kernel where it takes the operands (``kernels.cuda.coded``: the levels
built in the tensor-core operand's registers, which ``tl.dot`` does not express; 37 us per layer at Llama-3-8B,
batch 1, 128K, 2 bits, against 88.7 for ``_coded_lse_kernel``); its outputs are the same two tensors. For
``lowbit_select`` it also codes each row's current page first, which elsewhere is ``code_page``'s launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ..cuda import coded as cuda_coded
from .common import TUNING, check, interpreted_bf16, kept, precision
from .selection import check_out, fused_group_size, group_maxima, select_from_maxima

_ONE_BITS = tl.constexpr(0x3F800000)  # float32 1.0


@triton.jit
def _lse(x, axis: tl.constexpr):
    """Log-sum-exp of x along axis, -inf where every entry is -inf."""
    top = tl.max(x, axis=axis)
    safe = tl.where(top > float("-inf"), top, 0.0)
    out = safe + tl.log(tl.sum(tl.exp(x - tl.expand_dims(safe, axis)), axis=axis))
    return tl.where(top > float("-inf"), out, float("-inf"))


@triton.jit
def _coded_lse_kernel(q_ptr, kmin_ptr, kmax_ptr, codes_ptr, sp_ptr, len_ptr, first_ptr, out_ptr, part_ptr, n_slots,
                      n_parts, scale, sq_b, sq_h, sm_b, sm_h, sm_c, sc_b, sc_h, sc_c, sc_p, ss_b, ss_h, so_b, so_h,
                      HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_B: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, REUSE: tl.constexpr):
    """Per head, the log-sum-exp of each page's estimated logits (out, (B, H, C)) and of the program's block of
    BLOCK_C slots (part, (B * H, n_parts)); rows that keep their choice (``kept``) are skipped."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    kvh = row % HKV
    j = tl.arange(0, P)
    i = tl.arange(0, BLOCK_B)
    g = tl.arange(0, G_PAD)
    in_g = g < G
    in_b = (i < D // PER)[None, None, :]
    q_off = b * sq_b + (kvh * G + g)[:, None] * sq_h + i[None, :] * PER
    q_mask = in_g[:, None] & (i < D // PER)[None, :]
    n = tl.load(len_ptr + b)
    blk = tl.program_id(1)
    c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    c3 = c[:, None, None].to(tl.int64)
    # Codes and bounds are loaded without waiting for the page table: a free slot's rows (any codes, +-inf bounds)
    # give NaN or inf in their own rows of the product only, which the mask below replaces.
    m_mask = in_c[:, None, None] & in_b  # (BLOCK_C, 1, BLOCK_B)
    byte = tl.load(codes_ptr + b * sc_b + kvh * sc_h + c3 * sc_c + j[None, :, None] * sc_p + i[None, None, :],
                   mask=m_mask, other=0).to(tl.int32)  # (BLOCK_C, P, BLOCK_B)
    m_off = b * sm_b + kvh * sm_h + c3 * sm_c + i[None, None, :] * PER
    logits = tl.zeros((BLOCK_C * P, G_PAD), dtype=tl.float32)
    for k in tl.static_range(PER):
        lo = tl.load(kmin_ptr + m_off + k, mask=m_mask, other=0.0).to(tl.float32)
        # The field as the float 1 + code / 2^BITS (shifted into the top mantissa bits of 1.0: a shift and an
        # and-or), so that min + code * step is base + wide * that, base and wide once per page and channel.
        wide = (tl.load(kmax_ptr + m_off + k, mask=m_mask, other=0.0).to(tl.float32) - lo) * ((1 << BITS) / LEVELS)
        field = (((byte << (23 - BITS - k * BITS)) & (LEVELS << (23 - BITS))) | _ONE_BITS).to(tl.float32,
                                                                                          bitcast=True)
        keys = tl.reshape((lo - wide) + wide * field, (BLOCK_C * P, BLOCK_B))
        q = tl.load(q_ptr + q_off + k, mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        else:
            keys = keys.to(q.dtype)
        logits = tl.dot(keys, tl.trans(q), logits, input_precision=PRECISION)  # (BLOCK_C * P, G_PAD)
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1)
    ok = (page[:, None] >= 0) & (page[:, None] * P + j[None, :] < n)  # (BLOCK_C, P)
    logits = tl.where(ok[:, :, None], tl.reshape(logits * scale, (BLOCK_C, P, G_PAD)), float("-inf"))
    lse = _lse(logits, 1)  # (BLOCK_C, G_PAD)
    tl.store(out_ptr + b * so_b + (kvh * G + g)[None, :] * so_h + c[:, None], lse, mask=in_c[:, None] & in_g[None, :])
    tl.store(part_ptr + (row * G + g).to(tl.int64) * n_parts + blk, _lse(lse, 0), mask=in_g)


@triton.jit
def _page_mass_kernel(lse_ptr, part_ptr, out_ptr, len_ptr, first_ptr, cur_ptr, gmax_ptr, n_slots, n_parts, n_groups,
                      sl_b, sl_h, so_b, so_h, cu_b, cu_h, HKV: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, PER_HEAD: tl.constexpr, REUSE: tl.constexpr,
                      GS: tl.constexpr):
    """The shares (out), and with GS > 0 the group maxima of their keys (``selection.group_maxima``)."""
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    kvh = row % HKV
    g = tl.arange(0, G_P2)
    in_g = g < G
    part = part_ptr + (row * G + g)[:, None].to(tl.int64) * n_parts
    # Each head's total, an online log-sum-exp over the blocks' log-sum-exps.
    top = tl.full((G_P2,), float("-inf"), tl.float32)
    total = tl.zeros((G_P2,), tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        x = tl.load(part + p[None, :], mask=in_g[:, None] & (p < n_parts)[None, :], other=float("-inf"))
        new = tl.maximum(top, tl.max(x, axis=1))
        safe = tl.where(new > float("-inf"), new, 0.0)
        total = total * tl.exp(top - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
        top = new
    total = tl.where(top > float("-inf"), top + tl.log(total), 0.0)  # a head without pages: its shares stay -inf
    c0 = tl.program_id(1) * BLOCK_C
    c = c0 + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    head = kvh * G + g
    share = tl.load(lse_ptr + b * sl_b + head[:, None] * sl_h + c[None, :], mask=in_g[:, None] & in_c[None, :],
                    other=float("-inf")) - total[:, None]
    if PER_HEAD:
        tl.store(out_ptr + b * so_b + head[:, None] * so_h + c[None, :], share, mask=in_g[:, None] & in_c[None, :])
    else:
        share = _lse(share, 0)
        tl.store(out_ptr + b * so_b + kvh * so_h + c, share, mask=in_c)
    if GS > 0:
        cur = tl.maximum(tl.load(cur_ptr + b * cu_b + kvh * cu_h), 0)
        group_maxima(gmax_ptr, share, c, c0, cur, n_slots, n_groups, row, g, G, G_P2, GS, BLOCK_C, PER_HEAD)


@triton.jit
def _code_page_kernel(k_ptr, kmin_ptr, kmax_ptr, codes_ptr, cur_ptr, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h, sm_c,
                      sc_b, sc_h, sc_c, sc_p, su_b, su_h, HKV: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                      BITS: tl.constexpr):
    """One program per (sequence, KV head): the codes of its current page, as ``reference.key_codes`` rounds them
    (float32 division rounded to nearest, then half to even)."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    slot = tl.maximum(tl.load(cur_ptr + b * su_b + h * su_h), 0)
    j = tl.arange(0, P)
    i = tl.arange(0, D // PER)
    f = tl.arange(0, PER)
    d = i[:, None] * PER + f[None, :]  # (D / PER, PER): channel of field f of byte i
    bound = b * sm_b + h * sm_h + slot * sm_c + d
    lo = tl.load(kmin_ptr + bound).to(tl.float32)
    width = tl.load(kmax_ptr + bound).to(tl.float32) - lo
    keys = tl.load(k_ptr + b * sk_b + h * sk_h + slot * sk_c + j[:, None, None] * sk_p + d[None]).to(tl.float32)
    x = tl.where(width > 0, tl.math.div_rn(keys - lo, tl.where(width > 0, width, 1.0)) * LEVELS, 0.0)
    x = tl.where(x == x, x, 0.0)  # NaN codes 0
    # Half to even, as torch.round: adding 1.5 * 2^23 leaves the nearest integer in the mantissa for |x| < 2^22,
    # and a larger x is clamped to the top level either way.
    x = (x + 12582912.0) - 12582912.0
    code = tl.minimum(tl.maximum(x, 0.0), LEVELS).to(tl.int32)
    byte = tl.sum(code << (f * BITS)[None, None, :], axis=2)  # (P, D / PER)
    tl.store(codes_ptr + b * sc_b + h * sc_h + slot * sc_c + j[:, None] * sc_p + i[None, :], byte.to(tl.uint8))


def code_page(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor, cur_slot: torch.Tensor,
              bits: int) -> None:
    """``reference.code_page`` in one launch."""
    b, hkv, _, p, d = k.shape
    reference.check_code_bits(bits, d)
    if k.dtype == torch.float64 or p & (p - 1) or d & (d - 1):
        return reference.code_page(k, kmin, kmax, codes, cur_slot, bits)
    if k.stride(-1) != 1 or kmin.stride() != kmax.stride() or kmin.stride(-1) != 1 or codes.stride(-1) != 1:
        raise ValueError("code_page: k, kmin, kmax and codes must be contiguous in their last dimension, kmin/kmax "
                         "alike")
    _code_page_kernel[(b * hkv,)](
        k, kmin, kmax, codes, cur_slot, k.stride(0), k.stride(1), k.stride(2), k.stride(3), kmin.stride(0),
        kmin.stride(1), kmin.stride(2), codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        cur_slot.stride(0), cur_slot.stride(1), HKV=hkv, P=p, D=d, BITS=bits)


def coded_lse_parts(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                    slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                    gate: tuple[torch.Tensor, int] | None = None,
                    current: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.coded_page_lse`` (B, H, C) float32, and each head's log-sum-exp over each block of
    ``coded_block`` tokens (B * H, blocks) float32, from which ``coded_scores`` takes the heads' totals.
    gate: (first, reuse) of ``reference.due_rows``; the rows not due are skipped (their outputs left unset).
    current: (k, cur_slot); each row's current page is coded first (``reference.code_page``), in codes: within the
    CUDA kernel where it takes the operands, else in a launch of its own."""
    check(q, kmin, "coded_scores")
    if TUNING["cuda_coded"] and cuda_coded.supported(q, kmin, codes, bits):
        if current is not None and not cuda_coded.codes_in_place(current[0], codes):
            code_page(current[0], kmin, kmax, codes, current[1], bits)
            current = None
        return cuda_coded.coded_lse(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, gate,
                                    TUNING["cuda_coded_block"], current)
    if current is not None:
        code_page(current[0], kmin, kmax, codes, current[1], bits)
    b, h, d = q.shape
    hkv, c, p = codes.shape[1], codes.shape[2], codes.shape[3]
    reference.check_code_bits(bits, d)
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    # At least 16 tokens and 16 bytes per field: tl.dot's smallest tile.
    block_c = max(max(1, 16 // p), min(max(1, TUNING["coded_block"] // p), triton.next_power_of_2(c)))
    n_parts = triton.cdiv(c, block_c)
    out = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    part = torch.empty(b * h, n_parts, dtype=torch.float32, device=q.device)
    first, reuse = gate or (seq_len, 1)
    _coded_lse_kernel[(b * hkv, n_parts)](
        q, kmin, kmax, codes, slot_page, seq_len, first, out, part, c, n_parts, scale,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        slot_page.stride(0), slot_page.stride(1), out.stride(0), out.stride(1),
        HKV=hkv, G=h // hkv, G_PAD=max(TUNING["coded_heads"], triton.next_power_of_2(h // hkv)), D=d,
        BLOCK_B=max(16, triton.next_power_of_2(d * bits // 8)), P=p, BLOCK_C=block_c, BITS=bits,
        PRECISION=precision(q.dtype), UPCAST=interpreted_bf16(q.dtype), REUSE=reuse,
        num_warps=TUNING["coded_warps"])
    return out, part


def coded_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                 slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                 per_query_head: bool = False) -> torch.Tensor:
    """``reference.coded_scores``: the page log-sum-exps (``coded_lse_parts``), then the shares."""
    if q.dtype == torch.float64:
        return reference.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head)
    return _coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head)[0]


def _coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, gate=None, current=None,
                  gs=0):
    """``coded_scores`` for the rows that ``gate`` (see ``coded_lse_parts``) leaves due, after coding the current
    pages (``current``, as there), and with gs > 0 the group maxima of the scores' keys for the group filter of the
    top-k (B * Hs, cdiv(C, gs)) int32 (else None)."""
    lse, part = coded_lse_parts(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, gate, current)
    first, reuse = gate or (seq_len, 1)
    b, h, c = lse.shape
    hkv = kmin.shape[1]
    out = torch.empty(b, h if per_query_head else hkv, c, dtype=torch.float32, device=q.device)
    n_groups = triton.cdiv(c, gs) if gs else 0
    gmax = torch.empty(b * out.shape[1], n_groups, dtype=torch.int32, device=q.device) if gs else None
    cur = current[1] if gs else seq_len.view(-1, 1)
    block = max(min(TUNING["mass_block"], triton.next_power_of_2(c)), gs)
    _page_mass_kernel[(b * hkv, triton.cdiv(c, block))](
        lse, part, out, seq_len, first, cur, out if gmax is None else gmax, c, part.shape[1], n_groups,
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), cur.stride(0), cur.stride(1), HKV=hkv,
        G=h // hkv, G_P2=triton.next_power_of_2(h // hkv), BLOCK_C=block,
        BLOCK_P=min(TUNING["mass_parts"], triton.next_power_of_2(part.shape[1])), PER_HEAD=per_query_head,
        REUSE=reuse, GS=gs, num_warps=TUNING["mass_warps"])
    return out, gmax


def lowbit_select(q: torch.Tensor, k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                  slot_page: torch.Tensor, cur_slot: torch.Tensor, seq_len: torch.Tensor, first: torch.Tensor,
                  chosen: torch.Tensor, scale: float, bits: int, num_pages: int, reuse: int = 1,
                  per_query_head: bool = False) -> None:
    """``reference.lowbit_select`` in three launches where the CUDA scoring kernel applies: the current pages' codes
    and the page log-sum-exps, the shares with the group maxima (the top-k's group filter, where it applies), the
    top-k; the rows that keep their choice this step launch programs that return at once."""
    if q.dtype == torch.float64:
        return reference.lowbit_select(q, k, kmin, kmax, codes, slot_page, cur_slot, seq_len, first, chosen, scale,
                                       bits, num_pages, reuse, per_query_head)
    reference.check_reuse(reuse)
    reference.check_num_pages(num_pages)
    b, h, _ = q.shape
    hs, c = h if per_query_head else kmin.shape[1], kmin.shape[2]
    check_out("chosen", chosen, (b, hs, min(num_pages, c)))
    gate = (first, reuse) if reuse > 1 else None
    gs = fused_group_size(b * hs, c, num_pages)
    scores, gmax = _coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, gate,
                                 (k, cur_slot), gs)
    select_from_maxima(scores, cur_slot, num_pages, gs, gmax, chosen, (seq_len, *gate) if gate else None)
