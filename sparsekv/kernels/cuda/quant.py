"""The products of 4-bit group-quantized weights with 1 to 16 input rows (``quant.cu``: ``int4_products``), on tensor
cores with operands in the fragments' own layout (``reference.to_tiles``), which Triton's ``tl.dot`` reaches only
through shared memory.
"""

from __future__ import annotations

import torch

from ..reference import TILE_N
from .. import programmatic_launch
from . import module

# An mma.sync product covers 8 input rows (its B operand's columns), 16 outputs and 16 inputs; the kernel takes two
# for up to 16 rows.
MAX_ROWS = 16
# The launches quant.cu builds (its SPARSEKV_LAUNCHES): (warps, tiles, stages), all that ``launch_for`` picks.
LAUNCHES = ((16, 1, 2), (16, 2, 2), (16, 4, 2), (8, 2, 2), (4, 4, 3), (4, 8, 2))


def launch_for(n: int, rows: int, sms: int) -> tuple[int, int, int]:
    """(warps, tiles, stages) of a block for N outputs, the rows of x and the GPU's multiprocessors, as measured on
    the H200 at 1-16 rows (``benchmarks/results/quant/NOTES.md``): blocks of 2 tiles and 16 warps while they fit in
    one wave (o, down); up to 8 tiles a multiprocessor (q/k/v) blocks of 2 tiles and 8 warps, or of 4 tiles and 16
    warps for 2-8 rows up to 4 tiles a multiprocessor; beyond, blocks of 4 tiles, 4 warps and 3 stages, or of 8
    tiles, 4 warps and 2 stages where those fill one wave at two a multiprocessor (gate/up) and x has one row or
    more than 8."""
    tiles = n // TILE_N
    if tiles % 2:
        return 16, 1, 2
    if tiles <= 2 * sms:
        return 16, 2, 2
    if 1 < rows <= 8 and tiles <= 4 * sms and tiles % 4 == 0:
        return 16, 4, 2
    if tiles < 8 * sms or tiles % 4:
        return 8, 2, 2
    if (rows == 1 or rows > 8) and tiles % 8 == 0 and 1.6 * sms <= tiles // 8 <= 2 * sms:
        return 4, 8, 2
    return 4, 4, 3


def int4_products(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                  bias: torch.Tensor | None, sms: int) -> torch.Tensor:
    """x (M, K) bf16 or fp16, M 1-16, times the weight whose codes, scale and minimum are in ``reference.to_tiles``'
    layout, or views of some of its tiles (dim 1), plus bias (N,), launched for a device of ``sms`` multiprocessors
    (``launch_for``). Returns (M, N) in x's dtype: the products of the exact codes with x summed in fp32, each group
    scaled there."""
    n = codes.shape[1] * TILE_N
    if x.data_ptr() % 16:  # the kernel reads x in 32-bit words: a view at an odd offset is copied
        x = x.clone()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    module("quant").int4_products(x, codes, scale, minimum, None if bias is None else bias.to(x.dtype), out,
                                  *launch_for(n, x.shape[0], sms), programmatic_launch())
    return out
