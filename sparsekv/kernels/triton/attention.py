"""Split-K flash decoding: ``sparse_decode`` over selected pages, ``sparse_decode_tokens`` over listed rows of a
flat token store. Program (selection row, split) gathers the key/value rows of its share of the selected pages (or
of the listed rows), runs an online softmax in fp32 for the row's query heads, and writes an unnormalised partial
output with its running max and sum (and, when counted, its attended tokens). A second kernel, one program per query
head, merges the splits (log-sum-exp) and, for the token variant, writes the fp32 output with its log-sum-exp
(``merge_attention`` combines such parts); for the page variant it can add each row's attended tokens into a running
total (``attended``), so that the decode statistics cost no kernel of their own. Invalid entries (-1, free slots,
positions after the current token) are masked, never branched on. Over an fp8 cache a program loads the next
block's tiles into registers before the current block's products (their addresses come from the page table, so
Triton's pipeliner cannot prefetch them), and with 16-bit queries multiplies in fp16 (``f16_products``). Rows of an
fp8 cache read in order or long enough go to the CUDA kernel ``kernels.cuda.fp8kv`` where it applies (at 2.6x its
floor, this kernel is not bandwidth-bound there), which writes the same partial outputs for the merge kernel.

Merging in the row's last program to finish (an arrival counter per row) instead of a second kernel measured slower
on the H200 at Llama-3-8B batch 1: 45.1 against 43.2 us per layer at 32K and 138.1 against 134.9 at 128K, one
program reading all its heads' partials where the merge kernel spreads them over one program per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ..cuda import fp8kv as cuda_fp8kv
from .common import (LOG2E, TUNING, block_d, check, dependent_launch, f16_products, fp8_launch, group_pad,
                     interpreted_bf16, num_sms, pdl_launch, precision, product_query)


@triton.jit
def _block_tiles(blk, last, n_tok, k_base, v_base, sel_base, sp_base, tb_base, q_pos, sk_c, sk_t, sv_c, sv_t, d,
                 d_ok, BLOCK_N: tl.constexpr, P: tl.constexpr, TOKENS: tl.constexpr, IN_ORDER: tl.constexpr,
                 TABLE: tl.constexpr):
    """Key and value tiles (BLOCK_N, BLOCK_D) of block blk of the row's tokens (nothing read past block last) and
    which tokens are attended; with TABLE a slot's tokens are those of the store page the row's table names. Token
    ``off`` of page ``c`` lies at ``c * sk_c + off * sk_t`` (a page may be longer than its tokens: vLLM's padded
    blocks)."""
    j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_j = j < tl.minimum(n_tok, last * BLOCK_N)
    if TOKENS:  # rows of a flat token store; every listed token is attended
        tpage = tl.load(sel_base + j, mask=in_j, other=-1)
        off = 0
        ok = tpage >= 0
    else:
        if IN_ORDER:  # entry j // P is slot j // P: no selection to read, so no load waits on another
            slot = tl.where(in_j, j // P, -1)
        else:
            slot = tl.load(sel_base + j // P, mask=in_j, other=-1)
        off = j % P
        page = tl.load(sp_base + slot, mask=slot >= 0, other=-1)
        ok = (slot >= 0) & (page >= 0) & (page * P + off <= q_pos)
        if TABLE:
            tpage = tl.load(tb_base + slot, mask=slot >= 0, other=0)
        else:
            tpage = slot
    k_at = tpage * sk_c + off * sk_t
    v_at = tpage * sv_c + off * sv_t
    kt = tl.load(k_base + k_at[:, None] + d[None, :], mask=ok[:, None] & d_ok, other=0.0)
    vt = tl.load(v_base + v_at[:, None] + d[None, :], mask=ok[:, None] & d_ok, other=0.0)
    return kt, vt, ok


@triton.jit
def _split_attention_kernel(q_ptr, k_ptr, v_ptr, sp_ptr, sel_ptr, seq_ptr, table_ptr, part_ptr, stat_ptr,
                            split_count_ptr, n_sel, blocks_per_split, n_splits, scale_log2,
                            sq_b, sq_h, sk_b, sk_h, sk_c, sk_t, sv_b, sv_h, sv_c, sv_t, ss_b, ss_h, sl_b, sl_h, st_b,
                            HS: tl.constexpr, ROWS_PER_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
                            TOKENS: tl.constexpr, COUNT: tl.constexpr, PRECISION: tl.constexpr,
                            UPCAST: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
                            IN_ORDER: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // HS).to(tl.int64)
    r = row % HS
    kvh = (r // ROWS_PER_KV).to(tl.int64)  # times a head's stride: past 2**31 in a large store of shared pages
    n_tok = n_sel if TOKENS else n_sel * P
    q_pos = 0 if TOKENS else tl.load(seq_ptr + b) - 1
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < D
    head = r * G + g
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + d[None, :], mask=(g[:, None] < G) & d_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q = product_query(q, F16)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    sel_base = sel_ptr + b * sl_b + r * sl_h
    sp_base = sp_ptr + b * ss_b + kvh * ss_h
    tb_base = table_ptr + b * st_b

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    n_ok = tl.zeros((BLOCK_N,), tl.int32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n_tok, BLOCK_N))
    if IN_ORDER:  # entry j // P holds page j // P: the blocks past the current token attend nothing
        last = tl.minimum(last, tl.cdiv(q_pos + 1, BLOCK_N))
    if PREFETCH:  # block first's tiles; each iteration loads the next block's before its products
        kt, vt, ok = _block_tiles(first, last, n_tok, k_base, v_base, sel_base, sp_base, tb_base, q_pos, sk_c,
                                  sk_t, sv_c, sv_t, d, d_ok, BLOCK_N, P, TOKENS, IN_ORDER, TABLE)
    for blk in range(first, last):
        if PREFETCH:
            k_next, v_next, ok_next = _block_tiles(blk + 1, last, n_tok, k_base, v_base, sel_base, sp_base,
                                                   tb_base, q_pos, sk_c, sk_t, sv_c, sv_t, d, d_ok, BLOCK_N, P,
                                                   TOKENS, IN_ORDER, TABLE)
        else:
            kt, vt, ok = _block_tiles(blk, last, n_tok, k_base, v_base, sel_base, sp_base, tb_base, q_pos, sk_c,
                                      sk_t, sv_c, sv_t, d, d_ok, BLOCK_N, P, TOKENS, IN_ORDER, TABLE)
        kt, vt = kt.to(q.dtype), vt.to(q.dtype)  # an fp8 cache is dequantized here; otherwise q's own dtype
        qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale_log2  # (G_PAD, BLOCK_N)
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep exp2 finite
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if TOKENS:  # fp32 outputs that callers merge: the probabilities as two halves, near-fp32 error
            p_hi = p.to(vt.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(vt.dtype)
            pv = tl.dot(p_hi, vt, input_precision=PRECISION) + tl.dot(p_lo, vt, input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        if COUNT:
            n_ok += ok.to(tl.int32)
        if PREFETCH:
            kt, vt, ok = k_next, v_next, ok_next

    out_row = (b * HS * G + head) * n_splits + split  # partials laid out (B, H, splits, ...)
    g_ok = g < G
    tl.store(part_ptr + out_row[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok)
    tl.store(stat_ptr + out_row * 2, m_i, mask=g_ok)
    tl.store(stat_ptr + out_row * 2 + 1, l_i, mask=g_ok)
    if COUNT:
        tl.store(split_count_ptr + row * n_splits + split, tl.sum(n_ok, axis=0))


@triton.jit
def _merge_kernel(part_ptr, stat_ptr, split_count_ptr, out_ptr, lse_ptr, count_ptr, n_splits, so_b, so_h, sc_b,
                  sc_h, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    bh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    m = tl.load(stat_ptr + (bh * n_splits + s) * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(stat_ptr + (bh * n_splits + s) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(w * l, axis=0)
    part = tl.load(part_ptr + (bh * n_splits + s)[:, None] * D + d[None, :], mask=s_ok[:, None] & (d[None, :] < D),
                   other=0.0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)  # nothing attended: zeros
    tl.store(out_ptr + (bh // H) * so_b + (bh % H) * so_h + d, o.to(out_ptr.dtype.element_ty), mask=d < D)
    if WRITE_LSE:  # natural log; the partial maxima are in log2 units
        tl.store(lse_ptr + bh, tl.where(total > 0, (m_max + tl.math.log2(total)) * 0.6931471805599453,
                                        float("-inf")))
    if COUNT:  # the first head of each selection row adds the row's tokens to its total
        if bh % G == 0:
            row = bh // G  # b * HS + r
            n = tl.sum(tl.load(split_count_ptr + row * n_splits + s, mask=s_ok, other=0).to(tl.int64), axis=0)
            count_at = count_ptr + (bh // H) * sc_b + ((bh % H) // G) * sc_h
            tl.store(count_at, tl.load(count_at) + n)


def _split_attention(q, k, v, slot_page, sel, seq_len, scale, attended=None, in_order=False, table=None,
                     with_lse=False):
    """Page mode (slot_page given): sparse_decode, output in q's dtype, each row's attended tokens added into
    attended (B, Hs) int64 when given, each row read up to its length when ``in_order``, through the rows' page
    ``table`` (B, C) into a store of shared pages (1, Hkv, N, P, D) when given, with its log-sum-exp when
    ``with_lse``. Token mode (slot_page None): k, v are flat (B, Hkv, N, D) stores, sel lists their rows; returns the
    fp32 output and its log-sum-exp."""
    tokens = slot_page is None
    name = "sparse_decode_tokens" if tokens else "sparse_decode"
    check(q, k, name)
    if v.stride(-1) != 1 or (not tokens and v.stride() != k.stride()):
        raise ValueError(f"{name}: k and v must be contiguous in head_dim (pages: one layout)")
    b, h, d = q.shape
    hkv = k.shape[1]
    p = 1 if tokens else k.shape[3]
    hs, n_sel = sel.shape[1], sel.shape[2]
    allowed = (1, hkv, h) if tokens else (hkv, h)
    if hs not in allowed or h % hkv:
        raise ValueError(f"{name}: selection rows must be one of {allowed} (KV heads {hkv}, query heads {h}), got {hs}")
    if attended is not None:
        reference.check_attended(attended, sel)
    if sel.stride(2) != 1:
        sel = sel.contiguous()
    if table is not None and (table.dtype != torch.int64 or table.stride(1) != 1 or k.shape[0] != 1
                              or table.shape != (b, slot_page.shape[2])):
        raise ValueError(f"{name}: table must be ({b}, {slot_page.shape[2]}) int64 (each slot's store page, contiguous "
                         f"in the slots) over a store of one row, got {tuple(table.shape)} {table.dtype} and a store "
                         f"of {k.shape[0]} rows")
    rows_per_b = max(hs, hkv)  # a single token set (hs == 1) is read by every KV head: row stride 0
    g = h // rows_per_b
    rows = b * rows_per_b
    # With few rows (Llama-3-8B at batch 1: 8) the programs are few too: smaller blocks, more of them in flight.
    # Rows of many tokens (a dense layer's whole context) stream far more than they compute: their own blocks,
    # stages and split count.
    long_rows = n_sel * p >= TUNING["attn_long_tokens"]
    keys = ("attn_block_n", "attn_stages", "programs_per_sm", "attn_max_splits", "attn_warps")
    if long_rows:
        keys = ("attn_long_block_n", "attn_long_stages", "attn_long_programs_per_sm", "attn_long_max_splits",
                "attn_long_warps")
    elif rows <= TUNING["attn_few_rows"]:
        keys = ("attn_few_block_n", "attn_few_stages", "attn_few_programs_per_sm", "attn_max_splits", "attn_warps")
    counting = attended is not None
    if (not tokens and (long_rows or in_order) and TUNING["cuda_fp8_attn"]
            and cuda_fp8kv.supported(q, k, rows_per_b)):
        # Pages of the same split per block of WARPS warps, at least one page a warp.
        splits, per_split = _splits(n_sel, TUNING["cuda_fp8_blocks_per_sm"], rows, q.device, n_sel * p, in_order,
                                    TUNING["attn_long_max_splits"], cuda_fp8kv.WARPS)
        part, stats, split_counts = cuda_fp8kv.split_attention(q, k, v, slot_page, sel, seq_len, scale, splits,
                                                               per_split, in_order, counting, table)
        return _merge(q, part, stats, split_counts, attended, rows_per_b, tokens, with_lse)
    fp8 = k.dtype == torch.float8_e4m3fn
    block_n, stages, per_sm, max_splits, warps = (fp8_launch(key, fp8) for key in keys)
    if d > 128:
        block_n //= 2
    if q.dtype == torch.float32:
        block_n = 16  # full-precision fp32 products need registers: larger tiles spill (ptxas, sm_90)
    splits, per_split = _splits(triton.cdiv(n_sel * p, block_n), per_sm, rows, q.device, n_sel * p, in_order,
                                max_splits)
    part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    split_counts = torch.empty(rows, splits, dtype=torch.int32, device=q.device) if counting else stats
    page_args = (sel, sel, 0, 0) if tokens else (slot_page, seq_len, slot_page.stride(0), slot_page.stride(1))
    store = table is not None  # every row reads the one store: no row stride
    _split_attention_kernel[(rows, splits)](
        q, k, v, page_args[0], sel, page_args[1], table if store else sel, part, stats, split_counts, n_sel,
        per_split, splits, scale * LOG2E, q.stride(0), q.stride(1), 0 if store else k.stride(0), k.stride(1),
        k.stride(2), k.stride(2 if tokens else 3), 0 if store else v.stride(0), v.stride(1), v.stride(2),
        v.stride(2 if tokens else 3),
        page_args[2], page_args[3], sel.stride(0), 0 if hs == 1 else sel.stride(1), table.stride(0) if store else 0,
        HS=rows_per_b, ROWS_PER_KV=rows_per_b // hkv, G=g, G_PAD=group_pad(g), D=d, BLOCK_D=block_d(d),
        BLOCK_N=block_n, P=p, TOKENS=tokens, COUNT=counting, PRECISION=precision(q.dtype),
        UPCAST=interpreted_bf16(q.dtype), F16=f16_products(q, k), PREFETCH=fp8, IN_ORDER=in_order, TABLE=store,
        num_warps=warps, num_stages=stages, **pdl_launch())
    return _merge(q, part, stats, split_counts, attended, rows_per_b, tokens, with_lse)


def _splits(n_blocks: int, per_sm: int, rows: int, device: torch.device, n_tokens: int, in_order: bool,
            max_splits: int, least: int = 1) -> tuple[int, int]:
    """(splits, blocks per split) of each row's n_blocks blocks: until rows * splits reaches per_sm programs per
    multiprocessor, with at most max_splits splits of at least ``least`` blocks each."""
    want = triton.cdiv(per_sm * num_sms(device), rows)
    if in_order and TUNING["attn_in_order_tokens"]:
        # Rows shorter than the layer's slots leave the programs of their tail idle: splits of a fixed size keep
        # the busy programs in proportion to the tokens there are.
        want = max(want, triton.cdiv(n_tokens, TUNING["attn_in_order_tokens"]))
    splits = max(1, min(want, triton.cdiv(max(n_blocks, 1), least), max_splits))
    per_split = triton.cdiv(max(n_blocks, 1), splits)
    return triton.cdiv(max(n_blocks, 1), per_split), per_split


def _merge(q, part, stats, split_counts, attended, rows_per_b, tokens, with_lse=False):
    """The splits' partial outputs merged (see ``_split_attention``)."""
    b, h, splits, d = part.shape
    g = h // rows_per_b
    counting = attended is not None
    fp32_out = tokens or interpreted_bf16(q.dtype)
    out = torch.empty(b, h, d, dtype=torch.float32 if fp32_out else q.dtype, device=q.device)
    write_lse = tokens or with_lse
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device) if write_lse else out
    count = attended if counting else stats
    split_counts = split_counts if counting else stats
    _merge_kernel[(b * h,)](part, stats, split_counts, out, lse, count, splits, out.stride(0), out.stride(1),
                            count.stride(0), count.stride(1), H=h, G=g, D=d, BLOCK_D=block_d(d),
                            BLOCK_S=max(2, triton.next_power_of_2(splits)), WRITE_LSE=write_lse, COUNT=counting,
                            num_warps=4, **pdl_launch())
    if tokens:
        return out, lse
    return (out.to(q.dtype), lse) if with_lse else out.to(q.dtype)


def sparse_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
                  seq_len: torch.Tensor, scale: float, attended: torch.Tensor | None = None,
                  in_order: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    if q.dtype == torch.float64:
        return reference.sparse_decode(q, k, v, slot_page, slots, seq_len, scale, attended, in_order, table)
    return _split_attention(q, k, v, slot_page, slots, seq_len, scale, attended, in_order, table)


def sparse_decode_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
                      seq_len: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_decode`` of q (B, H, D) in bf16 / fp16 / fp32 (no count, no table), with each head's log-sum-exp of
    the attention logits (B, H) float32, natural log, -inf for a head that attends nothing."""
    return _split_attention(q, k, v, slot_page, slots, seq_len, scale, with_lse=True)


def sparse_decode_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype == torch.float64:
        return reference.sparse_decode_tokens(q, k, v, tokens, scale)
    return _split_attention(q, k, v, None, tokens, None, scale)


# The strides, lengths and the log-sum-exps' addresses (views from a padded pass's first real query) vary with
# every prompt pass: specializing on them (Triton's divisibility by 16) compiled the kernel anew in the middle of
# serving (0.4 s a compilation on the H200).
@triton.jit(do_not_specialize=["s", "sa_b", "sa_h", "sa_s", "sb_b", "sb_h", "sb_s", "sla_b", "sla_h", "sla_s",
                               "slb_b", "slb_h", "slb_s"], do_not_specialize_on_alignment=["lse_a_ptr", "lse_b_ptr"])
def _merge_lse_kernel(a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, out_ptr, lse_ptr, s, sa_b, sa_h, sa_s, sb_b, sb_h, sb_s,
                      sla_b, sla_h, sla_s, slb_b, slb_h, slb_s, H: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Program (row and head, block of BLOCK_S positions): the two parts' outputs weighed by their shares."""
    dependent_launch(PDL)
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = i < s
    la = tl.load(lse_a_ptr + b * sla_b + h * sla_h + i * sla_s, mask=ok, other=float("-inf"))
    lb = tl.load(lse_b_ptr + b * slb_b + h * slb_h + i * slb_s, mask=ok, other=float("-inf"))
    top = tl.maximum(la, lb)
    top = tl.where(top == float("-inf"), 0.0, top)  # neither part has a key: both shares 0
    wa = tl.exp(la - top)
    wb = tl.exp(lb - top)
    total = wa + wb
    lse = tl.where(total > 0, top + tl.log(total), float("-inf"))
    total = tl.where(total > 0, total, 1.0)
    tile = ok[:, None] & (d < D)[None, :]
    a = tl.load(a_ptr + b * sa_b + h * sa_h + i[:, None] * sa_s + d[None, :], mask=tile, other=0.0)
    v = tl.load(b_ptr + b * sb_b + h * sb_h + i[:, None] * sb_s + d[None, :], mask=tile, other=0.0)
    out = (a.to(tl.float32) * (wa / total)[:, None] + v.to(tl.float32) * (wb / total)[:, None])
    row = bh.to(tl.int64) * s + i
    tl.store(out_ptr + row[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=tile)
    tl.store(lse_ptr + row, lse, mask=ok)


def merge_lse(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.dtype == torch.float64:
        return reference.merge_lse(a, lse_a, b, lse_b)
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("merge_lse: the parts' last (head_dim) dimension must be contiguous")
    n, h, s, d = a.shape
    fp32_out = interpreted_bf16(a.dtype)
    out = torch.empty(n, h, s, d, dtype=torch.float32 if fp32_out else a.dtype, device=a.device)
    lse = torch.empty(n, h, s, dtype=torch.float32, device=a.device)
    block = TUNING["merge_block"]
    _merge_lse_kernel[(n * h, triton.cdiv(s, block))](
        a, lse_a, b, lse_b, out, lse, s, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1),
        b.stride(2), lse_a.stride(0), lse_a.stride(1), lse_a.stride(2), lse_b.stride(0), lse_b.stride(1),
        lse_b.stride(2), H=h, D=d, BLOCK_D=block_d(d), BLOCK_S=block, num_warps=4, **pdl_launch())
    return out.to(a.dtype), lse
