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
from .append import last_of_page
from .common import TUNING, check, dependent_launch, interpreted_bf16, kept, pdl_launch, precision
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
def _coded_lse_kernel(q_ptr, kmin_ptr, kmax_ptr, codes_ptr, sp_ptr, len_ptr, first_ptr, table_ptr, out_ptr, part_ptr,
                      n_slots, n_parts, scale, sq_b, sq_h, sm_b, sm_h, sm_c, sc_b, sc_h, sc_c, sc_p, ss_b, ss_h, st_b,
                      so_b, so_h, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_B: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, REUSE: tl.constexpr, TABLE: tl.constexpr,
                      IN_ORDER: tl.constexpr, PDL: tl.constexpr):
    """Per head, the log-sum-exp of each page's estimated logits (out, (B, H, C)) and of the program's block of
    BLOCK_C slots (part, (B * H, n_parts)); rows that keep their choice (``kept``) are skipped. TABLE: codes and
    bounds are a store of shared pages (strides of batch 0), slot c of row b in page ``table[b, c]``. IN_ORDER:
    slot j holds page j or is free, so nothing is read past the row's last page (a block table or a pool's row
    wider than the row)."""
    dependent_launch(PDL)
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
    read = in_c & (c < tl.cdiv(n, P)) if IN_ORDER else in_c  # the slots whose pages are read
    if TABLE:
        c3 = tl.load(table_ptr + b * st_b + c, mask=read, other=0)[:, None, None].to(tl.int64)
    else:
        c3 = c[:, None, None].to(tl.int64)
    # Codes and bounds are loaded without waiting for the slot table: a free slot's rows (any codes, +-inf bounds)
    # give NaN or inf in their own rows of the product only, which the mask below replaces.
    m_mask = read[:, None, None] & in_b  # (BLOCK_C, 1, BLOCK_B)
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
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=read, other=-1)
    ok = (page[:, None] >= 0) & (page[:, None] * P + j[None, :] < n)  # (BLOCK_C, P)
    logits = tl.where(ok[:, :, None], tl.reshape(logits * scale, (BLOCK_C, P, G_PAD)), float("-inf"))
    lse = _lse(logits, 1)  # (BLOCK_C, G_PAD)
    tl.store(out_ptr + b * so_b + (kvh * G + g)[None, :] * so_h + c[:, None], lse, mask=in_c[:, None] & in_g[None, :])
    tl.store(part_ptr + (row * G + g).to(tl.int64) * n_parts + blk, _lse(lse, 0), mask=in_g)


@triton.jit
def head_totals(part_ptr, row, g, in_g, n_parts, G: tl.constexpr, G_P2: tl.constexpr, BLOCK_P: tl.constexpr):
    """(G_P2,) each head g of the group of row (sequence, KV head)'s total log-sum-exp: an online log-sum-exp over
    its blocks' log-sum-exps (part, (B * H, n_parts)); 0 for a head without any (its pages' shares stay -inf)."""
    part = part_ptr + (row * G + g)[:, None].to(tl.int64) * n_parts
    top = tl.full((G_P2,), float("-inf"), tl.float32)
    total = tl.zeros((G_P2,), tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        x = tl.load(part + p[None, :], mask=in_g[:, None] & (p < n_parts)[None, :], other=float("-inf"))
        new = tl.maximum(top, tl.max(x, axis=1))
        safe = tl.where(new > float("-inf"), new, 0.0)
        total = total * tl.exp(top - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
        top = new
    return tl.where(top > float("-inf"), top + tl.log(tl.where(top > float("-inf"), total, 1.0)), 0.0)


@triton.jit
def _page_mass_kernel(lse_ptr, part_ptr, out_ptr, len_ptr, first_ptr, cur_ptr, gmax_ptr, sp_ptr, n_slots, n_parts,
                      n_groups, sl_b, sl_h, so_b, so_h, cu_b, cu_h, ss_b, ss_h, HKV: tl.constexpr, G: tl.constexpr,
                      G_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, PER_HEAD: tl.constexpr,
                      REUSE: tl.constexpr, GS: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr):
    """The shares (out), +inf for the slots of the first SINKS pages of their row, and with GS > 0 the group maxima
    of their keys (``selection.group_maxima``)."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    if REUSE > 1:
        if kept(len_ptr, first_ptr, b, REUSE):
            return
    kvh = row % HKV
    g = tl.arange(0, G_P2)
    in_g = g < G
    total = head_totals(part_ptr, row, g, in_g, n_parts, G, G_P2, BLOCK_P)  # a head without pages: shares -inf
    c0 = tl.program_id(1) * BLOCK_C
    c = c0 + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    head = kvh * G + g
    share = tl.load(lse_ptr + b * sl_b + head[:, None] * sl_h + c[None, :], mask=in_g[:, None] & in_c[None, :],
                    other=float("-inf")) - total[:, None]
    if not PER_HEAD:
        share = _lse(share, 0)
    if SINKS > 0:
        page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1)
        sink = (page >= 0) & (page < SINKS)
        if PER_HEAD:
            share = tl.where(sink[None, :], float("inf"), share)
        else:
            share = tl.where(sink, float("inf"), share)
    if PER_HEAD:
        tl.store(out_ptr + b * so_b + head[:, None] * so_h + c[None, :], share, mask=in_g[:, None] & in_c[None, :])
    else:
        tl.store(out_ptr + b * so_b + kvh * so_h + c, share, mask=in_c)
    if GS > 0:
        cur = tl.maximum(tl.load(cur_ptr + b * cu_b + kvh * cu_h), 0)
        group_maxima(gmax_ptr, share, c, c0, cur, n_slots, n_groups, row, g, G, G_P2, GS, BLOCK_C, PER_HEAD)


def page_shares(lse: torch.Tensor, part: torch.Tensor, kv_heads: int, seq_len: torch.Tensor,
                per_query_head: bool = False, gate: tuple[torch.Tensor, int] | None = None,
                cur_slot: torch.Tensor | None = None, gs: int = 0,
                sinks: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``reference.page_mass`` of per-head page log-sum-exps lse (B, H, C) float32 and their blocks' (part, (B * H,
    blocks)) in one launch: (B, Hs, C) float32, and with gs > 0 the group maxima of the scores' keys for the group
    filter of the top-k (B * Hs, cdiv(C, gs)) int32 (else None), cur_slot (B, Hkv) then given. gate: (first,
    reuse) of ``reference.due_rows``, the rows not due skipped; sinks: (slot_page (B, Hkv, C), n), the slots of
    each row's first n pages scored +inf (``reference.with_sinks``)."""
    first, reuse = gate or (seq_len, 1)
    b, h, c = lse.shape
    out = torch.empty(b, h if per_query_head else kv_heads, c, dtype=torch.float32, device=lse.device)
    n_groups = triton.cdiv(c, gs) if gs else 0
    gmax = torch.empty(b * out.shape[1], n_groups, dtype=torch.int32, device=lse.device) if gs else None
    cur = cur_slot if gs else seq_len.view(-1, 1)
    slot_page, n_sinks = sinks or (cur, 0)
    block = max(min(TUNING["mass_block"], triton.next_power_of_2(c)), gs)
    _page_mass_kernel[(b * kv_heads, triton.cdiv(c, block))](
        lse, part, out, seq_len, first, cur, out if gmax is None else gmax, slot_page, c, part.shape[1], n_groups,
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), cur.stride(0), cur.stride(1),
        slot_page.stride(0), slot_page.stride(1), HKV=kv_heads, G=h // kv_heads,
        G_P2=triton.next_power_of_2(h // kv_heads), BLOCK_C=block,
        BLOCK_P=min(TUNING["mass_parts"], triton.next_power_of_2(part.shape[1])), PER_HEAD=per_query_head,
        REUSE=reuse, GS=gs, SINKS=n_sinks, num_warps=TUNING["mass_warps"], **pdl_launch())
    return out, gmax


@triton.jit
def _code_keys(k_ptr, lo_ptr, hi_ptr, codes_ptr, sk_p, sc_p, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """The codes of one page's P keys (at k_ptr, token stride sk_p) on its bounds (lo_ptr, hi_ptr), as
    ``reference.key_codes`` rounds them (float32 division rounded to nearest, then half to even), into codes_ptr
    (token stride sc_p)."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    j = tl.arange(0, P)
    i = tl.arange(0, D // PER)
    f = tl.arange(0, PER)
    d = i[:, None] * PER + f[None, :]  # (D / PER, PER): channel of field f of byte i
    lo = tl.load(lo_ptr + d).to(tl.float32)
    width = tl.load(hi_ptr + d).to(tl.float32) - lo
    keys = tl.load(k_ptr + j[:, None, None] * sk_p + d[None]).to(tl.float32)
    x = tl.where(width > 0, tl.math.div_rn(keys - lo, tl.where(width > 0, width, 1.0)) * LEVELS, 0.0)
    x = tl.where(x == x, x, 0.0)  # NaN codes 0
    # Half to even, as torch.round: adding 1.5 * 2^23 leaves the nearest integer in the mantissa for |x| < 2^22,
    # and a larger x is clamped to the top level either way.
    x = (x + 12582912.0) - 12582912.0
    code = tl.minimum(tl.maximum(x, 0.0), LEVELS).to(tl.int32)
    byte = tl.sum(code << (f * BITS)[None, None, :], axis=2)  # (P, D / PER)
    tl.store(codes_ptr + j[:, None] * sc_p + i[None, :], byte.to(tl.uint8))


@triton.jit
def _code_page_kernel(k_ptr, kmin_ptr, kmax_ptr, codes_ptr, cur_ptr, table_ptr, sk_b, sk_h, sk_c, sk_p, sm_b, sm_h,
                      sm_c, sc_b, sc_h, sc_c, sc_p, su_b, su_h, st_b, HKV: tl.constexpr, P: tl.constexpr,
                      D: tl.constexpr, BITS: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr):
    """One program per (sequence, KV head): the codes of its current page. TABLE: a store of shared pages (strides
    of batch 0), slot s of row b in page ``table[b, s]``."""
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = row % HKV
    slot = tl.maximum(tl.load(cur_ptr + b * su_b + h * su_h), 0)
    if TABLE:
        slot = tl.load(table_ptr + b * st_b + slot)
    _code_keys(k_ptr + b * sk_b + h * sk_h + slot * sk_c, kmin_ptr + b * sm_b + h * sm_h + slot * sm_c,
               kmax_ptr + b * sm_b + h * sm_h + slot * sm_c, codes_ptr + b * sc_b + h * sc_h + slot * sc_c, sk_p,
               sc_p, P, D, BITS)


@triton.jit
def _page_codes_kernel(k_ptr, kmin_ptr, kmax_ptr, codes_ptr, slot_ptr, n, sk_h, sk_c, sk_p, sm_h, sm_c, sc_h, sc_c,
                       sc_p, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (token written, KV head); the page's last token of the pass codes the page."""
    dependent_launch(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    slot, last = last_of_page(slot_ptr, t, n, P)
    if last:
        page = slot // P
        _code_keys(k_ptr + h * sk_h + page * sk_c, kmin_ptr + h * sm_h + page * sm_c,
                   kmax_ptr + h * sm_h + page * sm_c, codes_ptr + h * sc_h + page * sc_c, sk_p, sc_p, P, D, BITS)


def _check_codes(name: str, k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor) -> None:
    if k.stride(-1) != 1 or kmin.stride() != kmax.stride() or kmin.stride(-1) != 1 or codes.stride(-1) != 1:
        raise ValueError(f"{name}: k, kmin, kmax and codes must be contiguous in their last dimension, kmin/kmax "
                         "alike")


def _coded_in_triton(k: torch.Tensor, bits: int) -> bool:
    """Whether the Triton coding kernels take these keys (power-of-two page and head sizes, not float64)."""
    p, d = k.shape[3], k.shape[4]
    reference.check_code_bits(bits, d)
    return k.dtype != torch.float64 and not p & (p - 1) and not d & (d - 1)


def code_page(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor, cur_slot: torch.Tensor,
              bits: int, table: torch.Tensor | None = None) -> None:
    """``reference.code_page`` in one launch."""
    if not _coded_in_triton(k, bits):
        return reference.code_page(k, kmin, kmax, codes, cur_slot, bits, table)
    _check_codes("code_page", k, kmin, kmax, codes)
    b, hkv = cur_slot.shape
    batch = 0 if table is not None else 1  # a store of shared pages is one batch row: its batch stride unused
    _code_page_kernel[(b * hkv,)](
        k, kmin, kmax, codes, cur_slot, cur_slot if table is None else table, batch * k.stride(0), k.stride(1),
        k.stride(2), k.stride(3), batch * kmin.stride(0), kmin.stride(1), kmin.stride(2), batch * codes.stride(0),
        codes.stride(1), codes.stride(2), codes.stride(3), cur_slot.stride(0), cur_slot.stride(1),
        0 if table is None else table.stride(0), HKV=hkv, P=k.shape[3], D=k.shape[4], BITS=bits,
        TABLE=table is not None, **pdl_launch())


def page_codes(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
               slot_mapping: torch.Tensor, bits: int) -> None:
    """``reference.page_codes`` in one launch: a program per token written and KV head, the page's last token of
    the pass coding the page."""
    if not _coded_in_triton(k, bits):
        return reference.page_codes(k, kmin, kmax, codes, slot_mapping, bits)
    _check_codes("page_codes", k, kmin, kmax, codes)
    if slot_mapping.stride(0) != 1:
        raise ValueError("page_codes: slot_mapping must be contiguous")
    n = slot_mapping.shape[0]
    if n:
        _page_codes_kernel[(n, k.shape[1])](
            k, kmin, kmax, codes, slot_mapping, n, k.stride(1), k.stride(2), k.stride(3), kmin.stride(1),
            kmin.stride(2), codes.stride(1), codes.stride(2), codes.stride(3), P=k.shape[3], D=k.shape[4],
            BITS=bits, **pdl_launch())


def coded_lse_parts(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                    slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                    gate: tuple[torch.Tensor, int] | None = None,
                    current: tuple[torch.Tensor, torch.Tensor] | None = None,
                    table: torch.Tensor | None = None, in_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.coded_page_lse`` (B, H, C) float32, and each head's log-sum-exp over each block of
    ``coded_block`` tokens (B * H, blocks) float32, from which ``coded_scores`` takes the heads' totals.
    gate: (first, reuse) of ``reference.due_rows``; the rows not due are skipped (their outputs left unset).
    current: (k, cur_slot); each row's current page is coded first (``reference.code_page``), in codes: within the
    CUDA kernel where it takes the operands, else in a launch of its own. table: (B, C) int64 over a store of
    shared pages (``reference.coded_page_lse``), read by the Triton kernel (the CUDA one reads rows' own pages).
    in_order: slot j holds page j or is free (``reference.quest_select``'s promise)."""
    check(q, kmin, "coded_scores")
    if table is None and TUNING["cuda_coded"] and cuda_coded.supported(q, kmin, codes, bits):
        if current is not None and not cuda_coded.codes_in_place(current[0], codes):
            code_page(current[0], kmin, kmax, codes, current[1], bits)
            current = None
        return cuda_coded.coded_lse(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, gate,
                                    TUNING["cuda_coded_block"], current)
    if current is not None:
        code_page(current[0], kmin, kmax, codes, current[1], bits, table)
    b, h, d = q.shape
    hkv, c, p = codes.shape[1], slot_page.shape[2], codes.shape[3]
    reference.check_code_bits(bits, d)
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    # At least 16 tokens and 16 bytes per field: tl.dot's smallest tile.
    block_c = max(max(1, 16 // p), min(max(1, TUNING["coded_block"] // p), triton.next_power_of_2(c)))
    n_parts = triton.cdiv(c, block_c)
    out = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    part = torch.empty(b * h, n_parts, dtype=torch.float32, device=q.device)
    first, reuse = gate or (seq_len, 1)
    batch = 0 if table is not None else 1  # a store of shared pages is one batch row: its batch stride unused
    _coded_lse_kernel[(b * hkv, n_parts)](
        q, kmin, kmax, codes, slot_page, seq_len, first, slot_page if table is None else table, out, part, c,
        n_parts, scale, q.stride(0), q.stride(1), batch * kmin.stride(0), kmin.stride(1), kmin.stride(2),
        batch * codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        slot_page.stride(0), slot_page.stride(1), 0 if table is None else table.stride(0), out.stride(0),
        out.stride(1),
        HKV=hkv, G=h // hkv, G_PAD=max(TUNING["coded_heads"], triton.next_power_of_2(h // hkv)), D=d,
        BLOCK_B=max(16, triton.next_power_of_2(d * bits // 8)), P=p, BLOCK_C=block_c, BITS=bits,
        PRECISION=precision(q.dtype), UPCAST=interpreted_bf16(q.dtype), REUSE=reuse, TABLE=table is not None,
        IN_ORDER=in_order, num_warps=TUNING["coded_warps"], **pdl_launch())
    return out, part


def coded_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                 slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                 per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.coded_scores``: the page log-sum-exps (``coded_lse_parts``), then the shares."""
    if q.dtype == torch.float64:
        return reference.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, table)
    return _coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, table=table)[0]


def _coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, gate=None, current=None,
                  gs=0, table=None, in_order=False):
    """``coded_scores`` for the rows that ``gate`` (see ``coded_lse_parts``) leaves due, after coding the current
    pages (``current``, as there), and with gs > 0 the group maxima (``page_shares``)."""
    lse, part = coded_lse_parts(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, gate, current, table,
                                in_order)
    return page_shares(lse, part, kmin.shape[1], seq_len, per_query_head, gate, current[1] if gs else None, gs)


def lowbit_select(q: torch.Tensor, k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                  slot_page: torch.Tensor, cur_slot: torch.Tensor, seq_len: torch.Tensor, first: torch.Tensor,
                  chosen: torch.Tensor, scale: float, bits: int, num_pages: int, reuse: int = 1,
                  per_query_head: bool = False, table: torch.Tensor | None = None, in_order: bool = False) -> None:
    """``reference.lowbit_select`` in three launches where the CUDA scoring kernel applies: the current pages' codes
    and the page log-sum-exps, the shares with the group maxima (the top-k's group filter, where it applies), the
    top-k; the rows that keep their choice this step launch programs that return at once."""
    if q.dtype == torch.float64:
        return reference.lowbit_select(q, k, kmin, kmax, codes, slot_page, cur_slot, seq_len, first, chosen, scale,
                                       bits, num_pages, reuse, per_query_head, table, in_order)
    reference.check_reuse(reuse)
    reference.check_num_pages(num_pages)
    b, h, _ = q.shape
    hs, c = h if per_query_head else kmin.shape[1], slot_page.shape[2]
    check_out("chosen", chosen, (b, hs, min(num_pages, c)))
    gate = (first, reuse) if reuse > 1 else None
    gs = fused_group_size(b * hs, c, num_pages)
    scores, gmax = _coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, gate,
                                 (k, cur_slot), gs, table, in_order)
    select_from_maxima(scores, cur_slot, num_pages, gs, gmax, chosen, (seq_len, *gate) if gate else None)
