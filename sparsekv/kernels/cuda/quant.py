"""The products of 4-bit group-quantized weights with 1 to 16 input rows (``quant.cu``: ``int4_products``), on tensor
cores with operands in the fragments' own layout (``pack_int4``), which Triton's ``tl.dot`` reaches only through
shared memory.
"""

from __future__ import annotations

import torch

from .. import reference
from . import module

# An mma.sync product covers 8 input rows (its B operand's columns), 16 outputs and 16 inputs; the kernel takes two
# for up to 16 rows. A packed chunk holds 64 inputs.
MAX_ROWS = 16
TILE_N, CHUNK_K = 16, 64
# The launches quant.cu builds (its SPARSEKV_LAUNCHES): (warps, tiles, stages), all that ``launch_for`` picks.
LAUNCHES = ((16, 1, 2), (16, 2, 2), (16, 4, 2), (8, 2, 2), (4, 4, 3), (4, 8, 2))


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of ``int4_products`` for 4-bit codes in ``quant.pack_nibbles``'s layout: codes (N, K / 2)
    uint8, scale and minimum (N, K / 32) fp16, N a multiple of 16, K of 64.

    Returns words (K / 64, N / 16, 32, 4) int32: for each chunk of 64 inputs and tile of 16 outputs, lane l's four
    words for the chunk's four steps of 16 inputs; a word holds the 8 codes of the lane's A fragment of an m16n8k16
    product (rows g and g + 8, g = l // 4; inputs 2t, 2t + 1, 2t + 8, 2t + 9 of the step, t = l % 4), pair j (its
    fragment register j) in nibble j (first input) and nibble 4 + j (second). And sm (K / 64, N / 16, 8, 4, 2)
    fp16: per chunk, tile and g, (scale, minimum) of rows g and g + 8 for the chunk's first group, then its second.
    A chunk's tiles lie next to each other, so that a block's tiles of one chunk are one contiguous read.
    """
    n = scale.shape[0]
    if n % TILE_N or k % CHUNK_K:
        raise ValueError(f"pack_int4: N must be a multiple of {TILE_N} and K of {CHUNK_K}, got {n} x {k}")
    q = reference.code_values(codes, scale, k)
    q = q.view(n // TILE_N, TILE_N, k // 16, 16).transpose(1, 2)  # tile, step, row, input
    lane = torch.arange(32, device=q.device)
    g, t = lane // 4, lane % 4
    words = torch.zeros(n // TILE_N, k // 16, 32, dtype=torch.int32, device=q.device)
    for j in range(4):
        row, col = g + 8 * (j % 2), 2 * t + 8 * (j // 2)
        words |= q[:, :, row, col] << (4 * j)
        words |= q[:, :, row, col + 1] << (16 + 4 * j)
    words = words.view(n // TILE_N, k // CHUNK_K, 4, 32).permute(1, 0, 3, 2).contiguous()
    sm = torch.stack([scale, minimum], dim=2).view(n // TILE_N, 2, 8, k // CHUNK_K, 2, 2)
    return words, sm.permute(3, 0, 2, 4, 1, 5).reshape(k // CHUNK_K, n // TILE_N, 8, 4, 2)


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


def int4_products(x: torch.Tensor, words: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None,
                  sms: int) -> torch.Tensor:
    """x (M, K) bf16 or fp16, M 1-16, times the weight ``pack_int4`` packed (plus bias (N,)), launched for a device
    of ``sms`` multiprocessors (``launch_for``). Returns (M, N) in x's dtype: the products of the exact codes with x
    summed in fp32, each group scaled there."""
    n = words.shape[1] * TILE_N
    if x.data_ptr() % 16:  # the kernel reads x in 32-bit words: a view at an odd offset is copied
        x = x.clone()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    module("quant").int4_products(x, words, sm, None if bias is None else bias.to(x.dtype), out,
                                  *launch_for(n, x.shape[0], sms))
    return out
