"""Decode attention over an fp8 page cache (``fp8kv.cu``: ``split_attention``) on tensor cores, with the cache's
tiles converted from e4m3 in the fragments' registers: Triton's kernel stages them through shared memory as 16-bit
tiles (and reads the 8-bit value tile byte by byte for its transposed product). Same partial outputs as
``triton.attention``'s page mode, which merges them.
"""

from __future__ import annotations

import torch

from .. import programmatic_launch
from . import available, module

HEAD_DIMS = (64, 128)
PAGE_SIZE = 16
MAX_GROUP = 8  # query heads per selection row: the columns of one product
WARPS = 4  # warps per block, each taking its own pages of the block's split


def supported(q: torch.Tensor, k: torch.Tensor, rows_per_b: int) -> bool:
    """Whether ``split_attention`` takes these operands (else the Triton kernel does): bf16 or fp16 queries, an e4m3
    cache of pages of 16 tokens with a head dim of ``HEAD_DIMS``, each page contiguous and 16-byte aligned, at most 8
    query heads per selection row, on a GPU where the kernels are built (sm_89 or later: e4m3 conversions)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == torch.float8_e4m3fn
            and d in HEAD_DIMS and k.shape[3] == PAGE_SIZE and q.shape[1] // rows_per_b <= MAX_GROUP
            and k.stride(4) == 1 and k.stride(3) == d and k.stride(2) == PAGE_SIZE * d
            and k.stride(1) % 16 == 0 and k.stride(0) % 16 == 0 and k.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(q.device) >= (8, 9) and available(q.device, "fp8kv"))


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor, sel: torch.Tensor,
                    seq_len: torch.Tensor, scale: float, splits: int, per_split: int, in_order: bool,
                    count: bool, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(part (B, H, splits, D), stats (B, H, splits, 2), counts (B * Hs, splits) int32) float32 partial outputs of
    each selection row's ``splits`` ranges of ``per_split`` entries of sel (B, Hs, N), as the Triton kernel's (counts
    empty unless ``count``), through the rows' page ``table`` (B, C) into a store of shared pages when given;
    operands as ``supported`` takes them."""
    return tuple(module("fp8kv").split_attention(q, k, v, slot_page, sel, seq_len, scale, splits, per_split,
                                                 in_order, count, table, programmatic_launch()))
