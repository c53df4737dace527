"""The products of 4-bit group-quantized weights with 1 to 8 input rows (``quant.cu``: ``int4_products``), on tensor
cores with operands in the fragments' own layout (``pack_int4``), which Triton's ``tl.dot`` reaches only through
shared memory.
"""

from __future__ import annotations

import torch

from .. import reference
from . import module

# An mma.sync product covers 8 input rows (its B operand's columns), 16 outputs and 16 inputs; a packed chunk 64.
MAX_ROWS = 8
TILE_N, CHUNK_K = 16, 64


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of ``int4_products`` for 4-bit codes in ``quant.pack_nibbles``'s layout: codes (N, K / 2)
    uint8, scale and minimum (N, K / 32) fp16, N a multiple of 16, K of 64.

    Returns words (N / 16, K / 64, 32, 4) int32: for each tile of 16 outputs and chunk of 64 inputs, lane l's four
    words for the chunk's four steps of 16 inputs; a word holds the 8 codes of the lane's A fragment of an m16n8k16
    product (rows g and g + 8, g = l // 4; inputs 2t, 2t + 1, 2t + 8, 2t + 9 of the step, t = l % 4), pair j (its
    fragment register j) in nibble j (first input) and nibble 4 + j (second). And sm (N / 16, K / 64, 8, 4, 2)
    fp16: per tile, chunk and g, (scale, minimum) of rows g and g + 8 for the chunk's first group, then its second.
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
    words = words.view(n // TILE_N, k // CHUNK_K, 4, 32).transpose(2, 3).contiguous()
    sm = torch.stack([scale, minimum], dim=2).view(n // TILE_N, 2, 8, k // CHUNK_K, 2, 2)
    return words, sm.permute(0, 3, 2, 4, 1, 5).reshape(n // TILE_N, k // CHUNK_K, 8, 4, 2)


def launch_for(n: int) -> tuple[int, int]:
    """(warps, tiles) of a block for N outputs: enough tiles a block that the loads in flight cover the memory's
    latency, few enough that the blocks fill the GPU (measured on the H200 at Llama-3-8B's products)."""
    tiles = n // TILE_N
    for r, least in ((8, 1536), (4, 384), (2, 0)):
        if tiles >= least and tiles % r == 0:
            return (4 if r == 8 else 16), r
    return 16, 1


def int4_products(x: torch.Tensor, words: torch.Tensor, sm: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16 or fp16, M 1-8, times the weight ``pack_int4`` packed (plus bias (N,)). Returns (M, N) in x's
    dtype: the products of the exact codes with x summed in fp32, each group scaled there."""
    n = words.shape[0] * TILE_N
    if x.data_ptr() % 16:  # the kernel reads x in 32-bit words: a view at an odd offset is copied
        x = x.clone()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    warps, tiles = launch_for(n)
    module("quant").int4_products(x, words, sm, None if bias is None else bias.to(x.dtype), out, warps, tiles)
    return out
