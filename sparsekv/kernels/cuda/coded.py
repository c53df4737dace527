"""lowbit's page log-sum-exps from low-bit key codes (``coded.cu``: ``coded_lse``, ``reference.coded_page_lse``) on
tensor cores: per page and head the part of the logits that is the page's, ``q . min`` (an exact product summed in
fp32) and ``w = q * (max - min)`` (in the cache's 16-bit type), and per 16 tokens one product of their exact levels,
read as they are stored, against ``w``; given the keys, each row's current page is coded first, in the codes
(``reference.code_page``). Relative error against the float64 estimate 3.2e-4 on the H200 (Triton's
kernel: 3.7e-5, its keys rounded once; ``w`` is rounded twice and its terms are larger than the keys).
"""

from __future__ import annotations

import torch

from .. import programmatic_launch
from . import available, module

HEAD_DIMS = (64, 128)  # head dims with a kernel (at least 128 bits of codes per token)
PAGE_SIZE = 16
MAX_GROUP = 8  # query heads per KV head: the columns of one product


def supported(q: torch.Tensor, kmin: torch.Tensor, codes: torch.Tensor, bits: int) -> bool:
    """Whether ``coded_lse`` takes these operands (else the Triton kernel does): bf16 or fp16 queries and bounds of
    that dtype, a head dim of ``HEAD_DIMS`` with at least 128 bits of codes per token, pages of 16 tokens, at most 8
    query heads per KV head, on a GPU where the kernels are built. (In fp16, ``q * (max - min)`` is formed in fp16:
    a product past fp16's range, 65504, would make its page's score inf or NaN.)"""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kmin.dtype == q.dtype and d in HEAD_DIMS
            and d * bits >= 128 and codes.shape[3] == PAGE_SIZE and q.shape[1] // kmin.shape[1] <= MAX_GROUP
            and available(q.device, "coded"))


def _aligned(x: torch.Tensor, items: int) -> bool:
    """Whether x's rows of the last dim start at 16-byte boundaries (the kernel copies them in 16-byte pieces)."""
    return x.data_ptr() % 16 == 0 and all(s % items == 0 for s in x.stride()[:3])


def _codes_as_read(codes: torch.Tensor) -> bool:
    return codes.stride(4) == 1 and codes.stride(3) == codes.shape[4] and _aligned(codes, 16)


def codes_in_place(k: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether ``coded_lse`` can code the current pages of keys k (B, Hkv, C, P, D) into codes itself: both laid
    out as it reads them (rows of 16-byte aligned keys, codes contiguous per page)."""
    return _codes_as_read(codes) and k.stride(4) == 1 and k.stride(3) % 8 == 0 and _aligned(k, 8)


def coded_lse(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor, slot_page: torch.Tensor,
              seq_len: torch.Tensor, scale: float, bits: int, gate: tuple[torch.Tensor, int] | None, chunk: int,
              current: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.coded_page_lse`` (B, H, C) float32 and each head's log-sum-exp over each block of ``chunk`` slots
    (B * H, blocks) float32 (``triton.coded.coded_lse_parts``'s outputs), for operands ``supported`` takes; chunk
    even, at most 256.
    gate: (first, reuse) of ``reference.due_rows``; the rows not due are skipped (their outputs left unset).
    current: (k, cur_slot) with ``codes_in_place(k, codes)``: the block holding each row's current page codes it
    first (``reference.code_page``), in codes, for every row, due or not."""
    if not (kmin.stride() == kmax.stride() and kmin.stride(-1) == 1 and _aligned(kmin, 8) and _aligned(kmax, 8)):
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    if current is not None and not codes_in_place(current[0], codes):
        raise ValueError("coded_lse: the keys and codes are not laid out to code the current pages in place")
    if not _codes_as_read(codes):
        codes = codes.contiguous()
    first, reuse = gate or (seq_len, 1)
    k, cur_slot = current or (None, None)
    return tuple(module("coded").coded_lse(q.contiguous(), kmin, kmax, codes, k, cur_slot, slot_page, seq_len, first,
                                           scale, bits, reuse, chunk, programmatic_launch()))
