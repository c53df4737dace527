"""The weights' products of a decode step at batch 1: ``linear`` of one input row, a matrix-vector product.

One program per ``gemv_block_n`` output rows (one, as tuned) reads those rows of the weight whole, in pipelined
slices of ``gemv_block_k`` inputs, and sums in fp32: no split over the inputs, so no second kernel to add the splits
up. On the H200 at Llama-3-8B's shapes (32 weights in rotation, in a CUDA graph; floor at 4.25 TB/s in brackets):

| product | weight | this kernel | cuBLAS |
| --- | --- | --- | --- |
| q/k/v | 6144 x 4096 | 13.7 us (11.8) | 16.2 us |
| o | 4096 x 4096 | 9.8 (7.9) | 12.6 |
| gate/up | 28672 x 4096 | 54.2 (55.3) | 57.1 |
| down | 4096 x 14336 | 28.7 (27.6) | 31.3 (split-K and its reduction) |
| head | 128256 x 4096 | 237.5 (247.2) | 252.5 |

Programs of 8 rows in slices of 512 took 14.8, 12.0, 58.7, 34.8 and 238.6 us. Several rows (batch > 1) measured
2.5-3x slower than cuBLAS, so they, and fp32 or non-contiguous weights, go to ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING, dependent_launch, interpreted_bf16, pdl_launch


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in tl.range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = in_rows[:, None] if EVEN_K else in_rows[:, None] & (cols < k)[None, :]
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * k + cols[None, :], mask=mask, other=0.0)
        x = tl.load(x_ptr + cols, mask=True if EVEN_K else cols < k, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if BIAS:
        acc += tl.load(b_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=in_rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = weight.shape
    one_row = x.numel() == k
    if (not one_row or x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype
            or k > TUNING["gemv_max_in"] or not weight.is_contiguous() or (bias is not None and bias.stride(0) != 1)):
        return reference.linear(x, weight, bias)
    rounded = interpreted_bf16(x.dtype)  # the interpreter rounds bf16 stores toward zero: torch rounds instead
    out = torch.empty(n, dtype=torch.float32 if rounded else x.dtype, device=x.device)
    block_n, block_k = TUNING["gemv_block_n"], TUNING["gemv_block_k"]
    _gemv_kernel[(triton.cdiv(n, block_n),)](x.contiguous(), weight, weight if bias is None else bias, out, n, k,
                                             BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                                             BIAS=bias is not None, num_warps=TUNING["gemv_warps"],
                                             num_stages=TUNING["gemv_stages"], **pdl_launch())
    return out.to(x.dtype).view(*x.shape[:-1], n)
