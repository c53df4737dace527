"""The products of group-quantized weights (``reference.linear_quantized``) for a few input rows: decode steps at
batch 1 to ``qgemv_max_rows``.

The weights stay in their codes, dequantized in registers: for one input row each program reads ``qgemv_block_n``
output rows' codes, scales and minima in slices of ``qgemv_block_g`` groups of 32 inputs and adds ``(scale * q +
minimum) * x`` into fp32 sums; for 2 to 16 rows it dequantizes tiles of ``qgemm_block_n`` rows and ``qgemm_block_g``
groups to x's dtype and multiplies them with tensor cores (x padded to 16 rows). A 4-bit group is 16 bytes in
GGUF's order (low nibbles: inputs 0-15, high: 16-31), an 8-bit group 32 bytes; both read as two halves of 16
inputs, so one kernel serves both. More rows (the prefill) go to the reference, which dequantizes the weight and
calls cuBLAS.

On the H200 at Llama-3-8B's shapes (``python -m sparsekv.bench.linear --tune``; floor of the int4 bytes at 4.25
TB/s in brackets) one row takes 15.0 us (3.7) for q/k/v, 10.1 (2.5) for o, 52.3 (17.3) for gate/up, 28.9 (8.6)
for down and 216.0 (77.3) for the head: 25-36% of the copy bandwidth, about the bf16 kernel's time for 3.2x fewer
bytes. The kernel is bound by its instructions, not by memory (codes or-ed into a float's bits instead of
converted already took it from 17% to 25-36%); 4 and 16 rows take 10-12x the one-row time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING, interpreted_bf16, precision

# 2**23 as a float's bits: a code q (0..255) or-ed into them is the float 2**23 + q, so one subtraction gives q as a
# float without an integer-to-float conversion (whose throughput, a quarter of the fp32 units', bounds the kernel).
MAGIC = tl.constexpr(0x4B000000)
TWO_23 = tl.constexpr(8388608.0)


@triton.jit
def _codes(at, mask, BITS: tl.constexpr):
    """The codes of a tile of 16-input half groups at ``at`` as floats: the first and the second half's."""
    if BITS == 4:
        c = tl.load(at, mask=mask, other=0).to(tl.int32)
        lo, hi = c & 15, c >> 4
    else:
        lo = tl.load(at, mask=mask, other=0).to(tl.int32)
        hi = tl.load(at + 16, mask=mask, other=0).to(tl.int32)
    lo = (lo | MAGIC).to(tl.float32, bitcast=True) - TWO_23
    hi = (hi | MAGIC).to(tl.float32, bitcast=True) - TWO_23
    return lo, hi


@triton.jit
def _qgemv_kernel(x_ptr, c_ptr, s_ptr, m_ptr, b_ptr, out_ptr, n, k, groups, BITS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, EVEN: tl.constexpr, BIAS: tl.constexpr):
    """One input row: each thread dequantizes and multiplies its codes into a tile of fp32 sums, reduced once at
    the end."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    j = tl.arange(0, 16)
    row_codes = rows.to(tl.int64)[:, None, None] * (groups * BITS * 4)
    row_scales = rows.to(tl.int64)[:, None] * groups
    acc = tl.zeros((BLOCK_N, BLOCK_G, 16), tl.float32)
    for g0 in tl.range(0, groups, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        if EVEN:
            w_mask = in_rows[:, None, None]
            s_mask = in_rows[:, None]
        else:
            w_mask = in_rows[:, None, None] & (g < groups)[None, :, None]
            s_mask = in_rows[:, None] & (g < groups)[None, :]
        lo, hi = _codes(c_ptr + row_codes + g[None, :, None] * (BITS * 4) + j[None, None, :], w_mask, BITS)
        s = tl.load(s_ptr + row_scales + g[None, :], mask=s_mask, other=0.0).to(tl.float32)[:, :, None]
        mn = tl.load(m_ptr + row_scales + g[None, :], mask=s_mask, other=0.0).to(tl.float32)[:, :, None]
        cols = g[:, None] * 32 + j[None, :]
        if EVEN:
            xl = tl.load(x_ptr + cols).to(tl.float32)
            xh = tl.load(x_ptr + cols + 16).to(tl.float32)
        else:
            xl = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
            xh = tl.load(x_ptr + cols + 16, mask=cols + 16 < k, other=0.0).to(tl.float32)
        acc += (lo * s + mn) * xl[None, :, :] + (hi * s + mn) * xh[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if BIAS:
        out += tl.load(b_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=in_rows)


@triton.jit
def _qgemm_kernel(x_ptr, c_ptr, s_ptr, m_ptr, b_ptr, out_ptr, rows_x, n, k, groups, BITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, EVEN: tl.constexpr,
                  BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Several input rows: the weight's tile dequantized to x's dtype in the halves' order (the inputs of each
    group's first 16 codes, then of its second 16), x's tile read in the same order, through tensor cores."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    xr = tl.arange(0, BLOCK_M)
    in_x = xr < rows_x
    i = tl.arange(0, BLOCK_G * 16)
    gi, ji = i // 16, i % 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g0 in tl.range(0, groups, BLOCK_G):
        g = g0 + gi
        if EVEN:
            w_mask = in_rows[:, None]
        else:
            w_mask = in_rows[:, None] & (g < groups)[None, :]
        scales = rows.to(tl.int64)[:, None] * groups + g[None, :]
        at = c_ptr + rows.to(tl.int64)[:, None] * (groups * BITS * 4) + (g * (BITS * 4) + ji)[None, :]
        lo, hi = _codes(at, w_mask, BITS)
        s = tl.load(s_ptr + scales, mask=w_mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + scales, mask=w_mask, other=0.0).to(tl.float32)
        cols = g * 32 + ji
        x_at = x_ptr + xr[:, None] * k + cols[None, :]
        if EVEN:
            xl = tl.load(x_at, mask=in_x[:, None], other=0.0)
            xh = tl.load(x_at + 16, mask=in_x[:, None], other=0.0)
        else:
            xl = tl.load(x_at, mask=in_x[:, None] & (cols < k)[None, :], other=0.0)
            xh = tl.load(x_at + 16, mask=in_x[:, None] & (cols + 16 < k)[None, :], other=0.0)
        if UPCAST:
            xl, xh = xl.to(tl.float32), xh.to(tl.float32)
        wl, wh = (lo * s + mn).to(xl.dtype), (hi * s + mn).to(xl.dtype)
        acc += tl.dot(xl, tl.trans(wl), input_precision=PRECISION)
        acc += tl.dot(xh, tl.trans(wh), input_precision=PRECISION)
    if BIAS:
        acc += tl.load(b_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + xr[:, None] * n + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=in_x[:, None] & in_rows[None, :])


def linear_quantized(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n, groups = scale.shape
    rows = x.numel() // k
    if (rows > TUNING["qgemv_max_rows"] or x.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or not (codes.is_contiguous() and scale.is_contiguous() and minimum.is_contiguous())
            or (bias is not None and bias.stride(0) != 1)):
        return reference.linear_quantized(x, codes, scale, minimum, bias)
    bits = codes.shape[1] * 8 // (groups * reference.GROUP)
    if bits not in (4, 8) or -(-k // reference.GROUP) != groups:
        return reference.linear_quantized(x, codes, scale, minimum, bias)  # its error names the shapes
    rounded = interpreted_bf16(x.dtype)  # the interpreter rounds bf16 stores toward zero: torch rounds instead
    out = torch.empty(rows, n, dtype=torch.float32 if rounded else x.dtype, device=x.device)
    even = k % reference.GROUP == 0
    bias_ptr = codes if bias is None else bias
    if rows == 1:
        block_n, block_g = TUNING["qgemv_block_n"], TUNING["qgemv_block_g"]
        _qgemv_kernel[(triton.cdiv(n, block_n),)](
            x.contiguous(), codes, scale, minimum, bias_ptr, out, n, k, groups, BITS=bits, BLOCK_N=block_n,
            BLOCK_G=block_g, EVEN=even and groups % block_g == 0, BIAS=bias is not None,
            num_warps=TUNING["qgemv_warps"], num_stages=TUNING["qgemv_stages"])
    else:
        block_n, block_g = TUNING["qgemm_block_n"], TUNING["qgemm_block_g"]
        _qgemm_kernel[(triton.cdiv(n, block_n),)](
            x.contiguous(), codes, scale, minimum, bias_ptr, out, rows, n, k, groups, BITS=bits,
            BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_G=block_g,
            EVEN=even and groups % block_g == 0, BIAS=bias is not None, UPCAST=rounded,
            PRECISION=precision(x.dtype), num_warps=TUNING["qgemm_warps"], num_stages=TUNING["qgemm_stages"])
    return out.to(x.dtype).view(*x.shape[:-1], n)
