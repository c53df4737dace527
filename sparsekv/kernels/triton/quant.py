"""The products of group-quantized weights (``reference.linear_quantized``) for a few input rows: decode steps at
batch 1 to ``qgemv_max_rows``.

The weights stay in their codes: each program reads ``qgemv_block_n`` output rows' codes, scales and minima in
slices of ``qgemv_block_g`` groups of 32 inputs and sums, for every input row, ``scale * (codes . x) + minimum *
sum(x)`` per group in fp32, so a weight is never written out in floats. A 4-bit group is 16 bytes in GGUF's order
(low nibbles: inputs 0-15, high: 16-31), an 8-bit group 32 bytes; both read as two halves of 16 inputs, so one
kernel serves both. More rows (the prefill) go to the reference, which dequantizes the weight and calls cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING, interpreted_bf16

@triton.jit
def _qgemv_kernel(x_ptr, c_ptr, s_ptr, m_ptr, b_ptr, out_ptr, rows_x, n, k, groups, BITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, EVEN: tl.constexpr,
                  BIAS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    xr = tl.arange(0, BLOCK_M)
    in_x = xr < rows_x
    j = tl.arange(0, 16)
    row_codes = rows.to(tl.int64)[:, None, None] * (groups * BITS * 4)
    row_scales = rows.to(tl.int64)[:, None] * groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g0 in tl.range(0, groups, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        if EVEN:
            w_mask = in_rows[:, None, None]
            s_mask = in_rows[:, None]
        else:
            w_mask = in_rows[:, None, None] & (g < groups)[None, :, None]
            s_mask = in_rows[:, None] & (g < groups)[None, :]
        at = c_ptr + row_codes + g[None, :, None] * (BITS * 4) + j[None, None, :]
        if BITS == 4:
            c = tl.load(at, mask=w_mask, other=0)
            lo = (c & 15).to(tl.float32)
            hi = (c >> 4).to(tl.float32)
        else:
            lo = tl.load(at, mask=w_mask, other=0).to(tl.float32)
            hi = tl.load(at + 16, mask=w_mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + row_scales + g[None, :], mask=s_mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + row_scales + g[None, :], mask=s_mask, other=0.0).to(tl.float32)
        cols = g[None, :, None] * 32 + j[None, None, :]
        x_at = x_ptr + xr[:, None, None] * k + cols
        if EVEN:
            xl = tl.load(x_at, mask=in_x[:, None, None], other=0.0).to(tl.float32)
            xh = tl.load(x_at + 16, mask=in_x[:, None, None], other=0.0).to(tl.float32)
        else:
            xl = tl.load(x_at, mask=in_x[:, None, None] & (cols < k), other=0.0).to(tl.float32)
            xh = tl.load(x_at + 16, mask=in_x[:, None, None] & (cols + 16 < k), other=0.0).to(tl.float32)
        dot = tl.sum(lo[None, :, :, :] * xl[:, None, :, :] + hi[None, :, :, :] * xh[:, None, :, :], axis=3)
        xsum = tl.sum(xl + xh, axis=2)
        acc += tl.sum(s[None, :, :] * dot + mn[None, :, :] * xsum[:, None, :], axis=2)
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
    block_m, block_n, block_g = triton.next_power_of_2(rows), TUNING["qgemv_block_n"], TUNING["qgemv_block_g"]
    while block_g > 1 and block_m * block_n * block_g * reference.GROUP > TUNING["qgemv_tile"]:
        block_g //= 2  # several rows: fewer groups a slice, so that the product tile stays in registers
    _qgemv_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), codes, scale, minimum, codes if bias is None else bias, out, rows, n, k, groups,
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g,
        EVEN=groups % block_g == 0 and k % reference.GROUP == 0, BIAS=bias is not None,
        num_warps=TUNING["qgemv_warps"], num_stages=TUNING["qgemv_stages"])
    return out.to(x.dtype).view(*x.shape[:-1], n)
