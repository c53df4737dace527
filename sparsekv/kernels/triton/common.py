"""What the Triton kernel families share: the launch parameters (``TUNING``), the checks of the cache's layout and
dtype, how a dtype's products are computed (including in Triton's CPU interpreter, where the tests run), and the
device's multiprocessor count that sizes split-K grids."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from .. import programmatic_launch

# Launch parameters, chosen on the H200 by ``python -m sparsekv.bench.attention --tune`` (see KERNEL_NOTES.md).
# page_block_k: the page-score kernel reads its block of key bounds in head-dim slices of this many, through a loop
# of page_stages stages (slices of 64 in 4 stages need ~94 registers instead of ~128 for the whole tile, so
# twice as many programs fit per multiprocessor). 3 stages rather than 4: Quest's choice over a serving pool's 9 rows
# of 38K-100K tokens in rows of 131K, through the page table, 75.8 -> 69.4 us a layer (rows of their own 67.0 ->
# 64.2; floor 43.8), at batch 16 of 128K 147.5 -> 143.4 us, at batch 1 within 0.25 us at 32K-512K; blocks of 128
# slots gain 2.7 us more in the pool but lose 0.5-0.9 us at 512K, batch 1 (the page_scores_table probe in
# benchmarks/results/serve/README.md).
# programs_per_sm: the attention kernel splits each row's pages until rows * splits reaches this many programs per
# multiprocessor (at most attn_max_splits splits), so that enough loads are in flight even for batch 1; with at most
# attn_few_rows rows it takes the attn_few_* block, stages and programs instead (-0.3 to -0.6 us at Llama-3-8B
# batch 1). Rows of at least attn_long_tokens tokens (dense layers) take the attn_long_* values: on the H200 at
# Llama-3-8B batch 1, 45.5 / 139.1 us at 32K / 128K (block 64, 2 stages, 4 programs per SM, up to 128 splits, 4
# warps; the best of 108 launches swept) against 49.1 / 152.0 with the attn_few_* ones; SDPA 40.1 / 129.8, floor
# 31.6 / 126.3. A layer read in order (``sparse_decode(in_order=True)``: dense layers) also takes at least one split
# per attn_in_order_tokens slots' tokens, so that rows shorter than the layer's slots (a serving pool's rows, sized
# for its longest request) leave no programs idle: on the H200, 6 rows of 38K-100K tokens in 131K-token rows 625 ->
# 487 us per layer (floor 455), 16 rows of 32K 666 -> 517, 4 of 128K 705 -> 513 (floor 505), 1 of 128K unchanged.
# select_warps / select_digit_bits: warps and digit width of the radix select (one program per row); rows of more
# than select_one_program slots are first cut down, unless more than select_max_k pages are selected: with at
# least select_group_rows rows, through groups of select_group_scale * sqrt(slots / k) slots (maxima by programs
# of select_group_block slots; up to select_group_cand * k candidates compacted), else to the top of each segment
# of select_block slots (select_block_warps); rows of more than select_max_slots slots go to torch.topk.
# quest_select takes the group filter with at least select_fused_rows rows, groups of select_fused_scale *
# sqrt(slots / k), the maxima written by the page-score kernel (faster than a separate pass on every grid
# measured, up to 65536 programs); else select_pages. lowbit_select likewise, the maxima written by its share
# kernel (at Llama-3-8B, batch 1, 128K: its top-k 7.7 us, select_pages 12.0).
# window_*: OmniKV's window token scores (``scoring``), not yet tuned on a GPU: blocks of window_block_n tokens,
# halved while a block's logit tile (heads x window queries x tokens) exceeds window_tile entries (registers); the
# query heads of a group are split into chunks of at most window_rows tile rows (heads x padded window); pass 1
# splits each row's blocks until rows * splits reaches window_programs_per_sm programs per multiprocessor.
# raas_*: RaaS's book-keeping (``raas``): programs of raas_block slots (raas_warps warps) rank the candidate decode
# slots, raas_cand at a time, against their block's pages.
# gemv_*: the weights' products of one input row (``linear``): programs of gemv_block_n output rows read them in
# pipelined slices of gemv_block_k inputs (one row per program: the most loads in flight; the best of 240 launches
# swept per Llama-3-8B shape, or within 0.4 us of it); inputs longer than gemv_max_in (not measured) go to cuBLAS.
# qmm_*: the products of group-quantized weights (``quant``) for up to qgemv_max_rows input rows: programs of
# qmm_block_n output rows read slices of qmm_block_g groups of 32 inputs; the groups are split in up to qmm_split
# ranges (split-K, programs of one row block adding up their sums through a count) until the programs number
# qmm_programs. More rows go to the reference (dequantized weight, cuBLAS). Up to cuda_int4_rows rows (at most 16)
# of 4-bit codes take the CUDA kernel (``kernels.cuda``) instead; where it cannot be built, up to tinygemm_rows
# rows of bf16 take torch's tinygemm (faster than this kernel at one row). On the H200 at Llama-3-8B's four
# products of a layer at 16 rows (``bench.linear --tune``: block_n 64-128, block_g 2-8, split 1-4, 4-8 warps,
# stages 2-3), the least summed time: 64 / 8 / 4 / 4 warps / 3 stages (113.9 us; stages 2: 117.3).
# coded_*: page scores from low-bit key codes (``coded``): programs of coded_block tokens (coded_block / page_size
# pages), coded_warps warps, the group's query heads padded to at least coded_heads columns of the product. On the
# H200 at Llama-3-8B, batch 1, 128K, 2-bit codes (``python -m sparsekv.bench.lowbit``): 96 us per layer with
# 128 / 4 / 8; 111 with blocks of 64, 120 with 256 tokens and 8 warps, 128 with 16 head columns. Where the CUDA
# kernel takes the operands (``cuda_coded``; ``kernels.cuda.coded.supported``) it runs instead, in blocks of
# cuda_coded_block slots (at most 256): at the shape above 41.6 us with 128, 45.4 with 64, 47.7 with 256.
# mass_*: the page shares from the coded kernel's log-sum-exps: programs of mass_block slots (mass_warps warps)
# that read the per-block totals mass_parts at a time (on the H200 at the shape above, scores 91.1 -> 88.1 us with
# blocks of 256 slots instead of 1024: 8 times more programs).
# landmark_*: landmark's page scores from stored landmarks (``landmark``): programs of landmark_block slots
# (landmark_warps warps) take their runs' log-sum-exps, reading the landmarks in head-dim slices of landmark_block_k
# through landmark_stages stages; the shares take the mass_* launch. On the H200 at Llama-3-8B, batch 1, 128K,
# budget 2048, landmark_select (the three launches) 29.6 us a layer with 32 / 4 / 64 / 3, 30.3-34 with blocks of
# 64 or 128, 8 warps, slices of 32 or 128 or 2-4 stages, 33.2 with the whole head dim in one tile (KERNEL_NOTES.md).
# prompt_mass_*: the attention each token receives from a prompt pass's queries (``mass``, H2O's prompt scores):
# prompt_mass_blocks, the (queries, tokens) of a block in pass 1 (programs of queries) and in pass 2 (programs of
# tokens), half that for fp32 tiles. On the H200 at Llama-3-8B, 4096 queries over 32K tokens (a sweep in
# benchmarks/results/KERNEL_NOTES.md, H2O's prompt scores): pass 1 7.54 ms with 64 x 64, 6.71 with 128 x 32;
# pass 2 6.03 with 64 x 64, the best. step_mass_blocks: the same for a pass of one query (TOVA's prompt score; a
# decode step's weights, H2O's and TOVA's, take pass 2 alone, after the split-K attention's log-sum-exp): at
# Llama-3-8B, 128K, budget 2048, H2O's step took 10.20 ms with prompt_mass_blocks, 6.93 with 16 x 128 and 16 x 64
# (both passes, before its eviction was fused).
# fp8_*: an fp8 cache's launch where it differs from the key without the prefix (``fp8_launch``). Its attention
# kernel loads the next block's tiles into registers before the current block's products (the tiles' addresses
# come from the page table, so Triton's pipeliner cannot prefetch them), converts them there and stages them in
# shared memory for the products as 16-bit tiles; that takes ~220 registers, so dense rows run 2 programs per
# multiprocessor in 1 stage. On the H200 at Llama-3-8B batch 1 (``python -m sparsekv.bench.kv_dtype``), dense at
# 1M tokens 1409 us with fp16 products alone, 1323 with the prefetch (bf16 cache: 1008); the page scores read
# blocks of 128 slots (45.4 -> 39.6 us at 1M).
# cuda_fp8_attn: decode attention over an fp8 cache takes the CUDA kernel (``kernels.cuda.fp8kv``) where it applies,
# for rows read in order or of at least attn_long_tokens tokens, in blocks of 4 warps, cuda_fp8_blocks_per_sm
# blocks a multiprocessor. On the H200 at Llama-3-8B batch 1 (``python -m sparsekv.bench.kv_dtype``), dense at 1M
# tokens 485.6 us with 2 blocks (0.95x the floor), 493.7 with 4, 546.1 with 3 (a second wave), 792.2 with 1; at 128K
# 71.5 with 2 blocks, 76.0 with 4; the Triton kernel 1322.0 and 179.6. Budgets of 2048 tokens (8 rows) stay with the
# Triton kernel: 7.8 us against 8.3, a latency both pay.
# append_search: slot-table entries the append kernel scans at a time for the lowest free slot (only when a token
# starts a page in a cache with freed slots), with append_warps warps; append_pages_tokens: tokens of a prompt pass
# (whole pages) a program of the pages' append writes.
TUNING = {"page_block": 64, "page_block_k": 64, "page_chunks": 1, "page_warps": 4, "page_stages": 3,
          "select_warps": 8, "select_one_program": 4096, "select_block": 512, "select_block_warps": 4,
          "select_digit_bits": 5, "select_max_k": 1024, "select_max_slots": 65536,
          "select_group_rows": 32, "select_group_scale": 2, "select_group_block": 4096, "select_group_cand": 2,
          "select_fused_rows": 8, "select_fused_scale": 1,
          "attn_block_n": 128, "attn_warps": 4, "attn_stages": 2, "programs_per_sm": 4,
          "attn_few_rows": 8, "attn_few_block_n": 64, "attn_few_stages": 1, "attn_few_programs_per_sm": 8,
          "attn_max_splits": 64, "attn_long_tokens": 16384, "attn_long_block_n": 64, "attn_long_stages": 2,
          "attn_long_programs_per_sm": 4, "attn_long_max_splits": 128, "attn_long_warps": 4,
          "attn_in_order_tokens": 2048,
          "window_block_n": 64, "window_tile": 8192, "window_rows": 128, "window_warps": 4, "window_stages": 2,
          "window_programs_per_sm": 4,
          "raas_block": 1024, "raas_warps": 4, "raas_cand": 16,
          "gemv_block_n": 1, "gemv_block_k": 2048, "gemv_warps": 4, "gemv_stages": 2, "gemv_max_in": 16384,
          "qgemv_max_rows": 16, "cuda_int4_rows": 16, "tinygemm_rows": 4,
          "qmm_block_n": 64, "qmm_block_g": 8, "qmm_split": 4, "qmm_programs": 256, "qmm_warps": 4, "qmm_stages": 3,
          "coded_block": 128, "coded_warps": 4, "coded_heads": 8, "cuda_coded": True, "cuda_coded_block": 128,
          "mass_block": 256, "mass_parts": 1024, "mass_warps": 4,
          "landmark_block": 32, "landmark_block_k": 64, "landmark_warps": 4, "landmark_stages": 3,
          "prompt_mass_blocks": ((128, 32), (64, 64)), "step_mass_blocks": ((16, 128), (16, 64)),
          "prompt_mass_warps": 4, "prompt_mass_stages": 2,
          "append_search": 4096, "append_warps": 4, "append_pages_tokens": 64, "merge_block": 64,
          "fp8_attn_block_n": 64, "fp8_attn_long_programs_per_sm": 2, "fp8_attn_long_stages": 1,
          "fp8_attn_few_programs_per_sm": 4, "fp8_page_block": 128,
          "cuda_fp8_attn": True, "cuda_fp8_blocks_per_sm": 2}

LOG2E = 1.4426950408889634


def check(q: torch.Tensor, k: torch.Tensor, name: str) -> None:
    """q and a cache tensor: the same dtype, or an fp8 cache (its tiles are converted to q's dtype in registers)."""
    if q.dtype != k.dtype and k.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: q ({q.dtype}) must have the cache's dtype ({k.dtype}) or the cache float8_e4m3fn "
                         "on the Triton path")
    if k.stride(-1) != 1:
        raise ValueError(f"{name}: the cache's last (head_dim) dimension must be contiguous")


def f16_products(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q's products with the tiles of the cache k are taken in fp16 (``F16`` of ``product_query``; the
    tiles are converted to q's dtype): for an fp8 cache and 16-bit queries, since e4m3 converts to fp16 exactly in
    one instruction per pair, to bf16 only through fp16 and two more (on the H200 at Llama-3-8B batch 1, 1M
    tokens: dense attention 1634 -> 1409 us, page scores 57.4 -> 45.4 us; benchmarks/results/KERNEL_NOTES.md)."""
    return k.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)


def fp8_launch(key: str, fp8: bool):
    """``TUNING[key]``, or for an fp8 cache ``TUNING["fp8_" + key]`` where it has one: its tiles are half the bytes
    and its kernels convert them, so some launches differ."""
    return TUNING.get(f"fp8_{key}", TUNING[key]) if fp8 else TUNING[key]


@triton.jit
def product_query(q, F16: tl.constexpr):
    """q as it enters the products with cache tiles: with F16, fp16 (bf16 values past fp16's range clamped)."""
    if F16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """With PDL (``kernels.set_programmatic_launch``), where a kernel begins to touch memory: waits until the kernel
    before it in the stream has finished and its writes are visible, then lets the kernel after it launch (its
    programs then start on the multiprocessors this one leaves and wait there in turn)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch() -> dict:
    """The launch arguments of a kernel that calls ``dependent_launch``: PDL on where the process asks for it, off
    in the CPU interpreter (which has no grid dependencies)."""
    on = programmatic_launch() and not knobs.runtime.interpret
    return {"PDL": on, "launch_pdl": on}


def interpreted_bf16(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter computes bf16 products and comparisons on the raw bits and rounds bf16 stores
    toward zero; there (tests only) bf16 tiles are upcast to fp32 and outputs rounded by torch."""
    return dtype == torch.bfloat16 and knobs.runtime.interpret


def precision(dtype: torch.dtype) -> str:
    # fp32 tiles keep full fp32 products (a tf32 dot would lose 13 bits); fp16/bf16 products are exact anyway.
    return "ieee" if dtype == torch.float32 or interpreted_bf16(dtype) else "tf32"


@triton.jit
def kept(len_ptr, first_ptr, b, REUSE: tl.constexpr):
    """Whether row b keeps the pages it chose at an earlier step (``reference.due_rows`` false), so that the kernels
    of a choice skip it: its position is neither a multiple of REUSE nor its first decode position."""
    pos = tl.load(len_ptr + b) - 1
    return (pos % REUSE != 0) & (pos != tl.load(first_ptr + b))


def block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def group_pad(g: int) -> int:
    return max(16, triton.next_power_of_2(g))  # tl.dot wants at least 16 rows


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device, which size the split-K grids."""
    if device.type != "cuda":
        return 2  # the CPU interpreter: few programs, so small test shapes still split
    return torch.cuda.get_device_properties(device).multi_processor_count
