"""The cache's writes, each one kernel. ``append_token``: one decode token's key and value into its page (through the
row's page table into a pool's shared pages, where given), the page's key bounds, and the slot of a page the token
starts (the lowest free one, by a scan of the slot table) and the current slot. ``append_pages``: a prompt pass's
tokens into their pages with the pages' bounds, the slot table and the current slots, in one read of the new keys
and values (torch's slice copies and reductions per run of pages read the keys twice and launch a dozen kernels
a run). ``page_bounds``: the bounds of the pages a pass wrote by slot numbers (vLLM's blocks), from their keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING, dependent_launch, pdl_launch


@triton.jit
def _append_token_kernel(k_ptr, v_ptr, kmin_ptr, kmax_ptr, sp_ptr, cur_ptr, pos_ptr, kn_ptr, vn_ptr, table_ptr,
                         n_free, sk_b, sk_h, sk_c, sk_p, sv_b, sv_h, sv_c, sv_p, sm_b, sm_h, sm_c, ss_b, ss_h, sc_b,
                         sc_h, skn_b, skn_h, svn_b, svn_h, st_b,
                         HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr,
                         HAS_HOLES: tl.constexpr, SEARCH: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    h = (row % HKV).to(tl.int64)  # times a head's stride: past 2**31 in a large store of shared pages
    pos = tl.load(pos_ptr + b)
    if pos >= 0:
        off = pos % P
        slot = tl.load(cur_ptr + b * sc_b + h * sc_h)
        if off == 0:
            if HAS_HOLES:  # the lowest free slot of the first n_free (slot 0 if none, as argmax), SEARCH at a time
                found = n_free + tl.zeros((), tl.int64)
                start = 0
                while (start < n_free) & (found == n_free):
                    c = start + tl.arange(0, SEARCH)
                    page = tl.load(sp_ptr + b * ss_b + h * ss_h + c, mask=c < n_free, other=0)
                    found = tl.min(tl.where(page < 0, c, n_free), 0).to(tl.int64)
                    start += SEARCH
                slot = tl.where(found < n_free, found, 0)
            else:
                slot = pos // P
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        kn = tl.load(kn_ptr + b * skn_b + h * skn_h + d, mask=d_ok).to(k_ptr.dtype.element_ty)
        vn = tl.load(vn_ptr + b * svn_b + h * svn_h + d, mask=d_ok).to(v_ptr.dtype.element_ty)
        if TABLE:  # the slot's page in the pool's shared pages (one batch row): its keys, values and bounds
            kv_slot = tl.load(table_ptr + b * st_b + slot)
            kv_b = 0
        else:
            kv_slot = slot
            kv_b = b
        tl.store(k_ptr + kv_b * sk_b + h * sk_h + kv_slot * sk_c + off * sk_p + d, kn, mask=d_ok)
        tl.store(v_ptr + kv_b * sv_b + h * sv_h + kv_slot * sv_c + off * sv_p + d, vn, mask=d_ok)
        m_off = kv_b * sm_b + h * sm_h + kv_slot * sm_c + d
        if off == 0:  # a fresh page: its bounds restart from this key
            tl.store(kmin_ptr + m_off, kn, mask=d_ok)
            tl.store(kmax_ptr + m_off, kn, mask=d_ok)
        else:
            # Compared in fp32 (exact for every cache dtype; the CPU interpreter cannot compare bf16).
            k32 = kn.to(tl.float32)
            lo = tl.minimum(tl.load(kmin_ptr + m_off, mask=d_ok).to(tl.float32), k32)
            up = tl.maximum(tl.load(kmax_ptr + m_off, mask=d_ok).to(tl.float32), k32)
            tl.store(kmin_ptr + m_off, lo.to(kmin_ptr.dtype.element_ty), mask=d_ok)
            tl.store(kmax_ptr + m_off, up.to(kmax_ptr.dtype.element_ty), mask=d_ok)
        tl.store(sp_ptr + b * ss_b + h * ss_h + slot, pos // P)
        tl.store(cur_ptr + b * sc_b + h * sc_h, slot)


def append_token(k: torch.Tensor, v: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                 cur_slot: torch.Tensor, position: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 has_holes: bool, table: torch.Tensor | None = None) -> None:
    if k.dtype == torch.float64:
        return reference.append_token(k, v, kmin, kmax, slot_page, cur_slot, position, k_new, v_new, has_holes,
                                      table)
    b, hkv, c = slot_page.shape
    p, d = k.shape[3:]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kmin.stride() != kmax.stride() or kmin.stride(-1) != 1:
        raise ValueError("append_token: k, v, kmin and kmax must be contiguous in head_dim, kmin/kmax alike")
    if k.dtype == reference.FP8:  # saturated by torch, as the reference does (Triton's cast need not saturate)
        k_new, v_new = reference.to_cache(k_new, k.dtype), reference.to_cache(v_new, v.dtype)
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    _append_token_kernel[(b * hkv,)](
        k, v, kmin, kmax, slot_page, cur_slot, position, k_new, v_new, slot_page if table is None else table, c - 1,
        k.stride(0), k.stride(1), k.stride(2), k.stride(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        kmin.stride(0), kmin.stride(1), kmin.stride(2), slot_page.stride(0), slot_page.stride(1),
        cur_slot.stride(0), cur_slot.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        0 if table is None else table.stride(0),
        HKV=hkv, D=d, BLOCK_D=triton.next_power_of_2(d), P=p, HAS_HOLES=has_holes,
        SEARCH=TUNING["append_search"], TABLE=table is not None, num_warps=TUNING["append_warps"], **pdl_launch())


# A pass's positions vary with every chunk: specializing on them (Triton's divisibility by 16) would compile the
# kernel anew in the middle of serving (0.4 s a compilation on the H200).
@triton.jit(do_not_specialize=["start", "end", "row0", "skn_b", "svn_b"])
def _append_pages_kernel(k_ptr, v_ptr, kmin_ptr, kmax_ptr, sp_ptr, cur_ptr, kn_ptr, vn_ptr, table_ptr, start, end,
                         row0, sk_b, sk_h, sk_c, sk_p, sv_b, sv_h, sv_c, sv_p, sm_b, sm_h, sm_c, ss_b, ss_h, sc_b, sc_h,
                         skn_b, skn_h, skn_s, svn_b, svn_h, svn_s, st_b,
                         HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr,
                         PAGES: tl.constexpr, BOUNDS: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr):
    """Program (row and KV head, block of PAGES pages from the first the pass reaches)."""
    dependent_launch(PDL)
    pid = tl.program_id(0)
    r = (pid // HKV).to(tl.int64)
    h = (pid % HKV).to(tl.int64)  # times a head's stride: past 2**31 in a large store of shared pages
    b = row0 + r
    first = start // P
    last = (end - 1) // P
    page = first + tl.program_id(1) * PAGES + tl.arange(0, PAGES).to(tl.int64)  # (PAGES,)
    in_pass = page <= last
    pos = page[:, None] * P + tl.arange(0, P)[None, :]  # (PAGES, P)
    real = (pos >= start) & (pos < end)
    d = tl.arange(0, BLOCK_D)
    ok = real[:, :, None] & (d < D)[None, None, :]
    t = (pos - start)[:, :, None]
    kn = tl.load(kn_ptr + r * skn_b + h * skn_h + t * skn_s + d, mask=ok)
    vn = tl.load(vn_ptr + r * svn_b + h * svn_h + t * svn_s + d, mask=ok)
    if TABLE:  # the slots' pages in the pool's shared pages (one batch row)
        slot = tl.load(table_ptr + b * st_b + page, mask=in_pass, other=0)
        kv_b = 0
    else:
        slot = page
        kv_b = b
    c = slot[:, None, None]
    o = tl.arange(0, P)[None, :, None]
    tl.store(k_ptr + kv_b * sk_b + h * sk_h + c * sk_c + o * sk_p + d, kn, mask=ok)
    tl.store(v_ptr + kv_b * sv_b + h * sv_h + c * sv_c + o * sv_p + d, vn, mask=ok)
    if BOUNDS:
        # Compared in fp32 (exact for every cache dtype; the CPU interpreter cannot compare bf16). The page the rows
        # were filling (it starts before the pass) merges its bound so far.
        k32 = kn.to(tl.float32)
        lo = tl.min(tl.where(ok, k32, float("inf")), axis=1)  # (PAGES, BLOCK_D)
        up = tl.max(tl.where(ok, k32, float("-inf")), axis=1)
        m_off = kv_b * sm_b + h * sm_h + slot[:, None] * sm_c + d[None, :]
        m_ok = in_pass[:, None] & (d < D)[None, :]
        had = m_ok & (page * P < start)[:, None]
        # (The loads take no infinite ``other``: fp8 has no infinity.)
        lo = tl.where(had, tl.minimum(lo, tl.load(kmin_ptr + m_off, mask=had).to(tl.float32)), lo)
        up = tl.where(had, tl.maximum(up, tl.load(kmax_ptr + m_off, mask=had).to(tl.float32)), up)
        tl.store(kmin_ptr + m_off, lo.to(kmin_ptr.dtype.element_ty), mask=m_ok)
        tl.store(kmax_ptr + m_off, up.to(kmax_ptr.dtype.element_ty), mask=m_ok)
    tl.store(sp_ptr + b * ss_b + h * ss_h + page, page, mask=in_pass)
    if tl.program_id(1) == 0:
        tl.store(cur_ptr + b * sc_b + h * sc_h, last)


def append_pages(k: torch.Tensor, v: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                 cur_slot: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, start: int, row: int,
                 table: torch.Tensor | None = None) -> None:
    if k.dtype == torch.float64:
        return reference.append_pages(k, v, kmin, kmax, slot_page, cur_slot, k_new, v_new, start, row, table)
    r, hkv, s, d = k_new.shape
    p = k.shape[3]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kmin.stride() != kmax.stride() or kmin.stride(-1) != 1:
        raise ValueError("append_pages: k, v, kmin and kmax must be contiguous in head_dim, kmin/kmax alike")
    # In the cache's dtype by torch, as the reference rounds (and saturates fp8; Triton's casts need not).
    k_new, v_new = reference.to_cache(k_new, k.dtype), reference.to_cache(v_new, v.dtype)
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    pages = (start + s - 1) // p - start // p + 1
    block = max(1, min(TUNING["append_pages_tokens"] // p, triton.next_power_of_2(pages)))
    _append_pages_kernel[(r * hkv, triton.cdiv(pages, block))](
        k, v, kmin, kmax, slot_page, cur_slot, k_new, v_new, slot_page if table is None else table, start,
        start + s, row, k.stride(0), k.stride(1), k.stride(2), k.stride(3), v.stride(0), v.stride(1), v.stride(2),
        v.stride(3), kmin.stride(0), kmin.stride(1), kmin.stride(2), slot_page.stride(0), slot_page.stride(1),
        cur_slot.stride(0), cur_slot.stride(1), k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0),
        v_new.stride(1), v_new.stride(2), 0 if table is None else table.stride(0),
        HKV=hkv, D=d, BLOCK_D=triton.next_power_of_2(d), P=p, PAGES=block, BOUNDS=p > 1, TABLE=table is not None,
        num_warps=TUNING["append_warps"], **pdl_launch())


@triton.jit
def last_of_page(slot_ptr, t, n, P: tl.constexpr):
    """(slot, whether entry t of a pass's slot numbers (n of them, -1 for none) is its page's last of the pass): the
    one program that writes what the page keeps, no other touching it, as a page's tokens are consecutive entries in
    order of offset."""
    slot = tl.load(slot_ptr + t)
    nxt = tl.load(slot_ptr + t + 1, mask=t + 1 < n, other=-1)
    return slot, (slot >= 0) & ((slot % P == P - 1) | (nxt != slot + 1))


@triton.jit
def _page_bounds_kernel(k_ptr, kmin_ptr, kmax_ptr, slot_ptr, n, sk_h, sk_c, sk_p, sm_h, sm_c,
                        P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    slot, last = last_of_page(slot_ptr, t, n, P)
    if last:  # the page's bounds over its offsets up to this one
        off = slot % P
        page = slot // P
        p = tl.arange(0, P)
        d = tl.arange(0, BLOCK_D)
        ok = (p[:, None] <= off) & (d[None, :] < D)
        keys = tl.load(k_ptr + h * sk_h + page * sk_c + p[:, None] * sk_p + d[None, :], mask=ok).to(tl.float32)
        lo = tl.min(tl.where(ok, keys, float("inf")), 0)
        up = tl.max(tl.where(ok, keys, float("-inf")), 0)
        m_off = h * sm_h + page * sm_c + d
        tl.store(kmin_ptr + m_off, lo.to(kmin_ptr.dtype.element_ty), mask=d < D)
        tl.store(kmax_ptr + m_off, up.to(kmax_ptr.dtype.element_ty), mask=d < D)


def page_bounds(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if k.dtype == torch.float64:
        return reference.page_bounds(k, kmin, kmax, slot_mapping)
    if k.stride(-1) != 1 or kmin.stride(-1) != 1 or kmax.stride() != kmin.stride() or slot_mapping.stride(0) != 1:
        raise ValueError("page_bounds: keys and bounds must be contiguous in head_dim, kmin and kmax of one layout, "
                         "slot_mapping contiguous")
    n = slot_mapping.shape[0]
    hkv, d = k.shape[1], k.shape[4]
    if n:
        _page_bounds_kernel[(n, hkv)](k, kmin, kmax, slot_mapping, n, k.stride(1), k.stride(2), k.stride(3),
                                      kmin.stride(1), kmin.stride(2), P=k.shape[3], D=d,
                                      BLOCK_D=triton.next_power_of_2(d), **pdl_launch())
