"""The products of group-quantized weights (``reference.linear_quantized``) for a few input rows: decode steps at
batch 1 to ``qgemv_max_rows``.

The weights stay in their codes. Each program reads ``qmm*_block_n`` output rows' codes in slices of
``qmm*_block_g`` groups of 32 inputs as 32-bit words (8 codes of 4 bits or 4 of 8) and turns them into x's dtype
with bit operations alone: a 4-bit code q or-ed into the bits of the 16-bit float 128 (bf16) or 1024 (fp16) is that
float plus q, so the tile holds ``q + OFFSET`` exactly, two codes per 32-bit operation. The group-wise scale and
minimum are applied after a tensor-core product rather than to every weight: x's tile is laid out block-diagonally
(column ``g * M + m`` holds row m of x on group g's inputs, zero elsewhere), so one ``tl.dot`` gives every group's
sum of ``(q + OFFSET) * x`` apart, and ``sum_g scale * dot + (minimum - OFFSET * scale) * sum(x over g)`` in fp32 is
the product of the weight ``scale * q + minimum`` with no rounding of the weight at all. Per weight that is one
or-and of two codes plus a share of the product (idle tensor-core lanes); the per-group work is spread over ``32 /
M`` weights.
More rows (the prefill) go to the reference, which dequantizes the weight and calls cuBLAS.

On CUDA, up to ``tinygemm_rows`` rows of bf16 with 4-bit codes go to torch's own int4 kernel (tinygemm,
``torch._weight_int4pack_mm``) instead: on the H200 at Llama-3-8B's products it takes 11.5 / 7.8 / 41.2 / 21.6 us at
one row (q/k/v, o, gate/up, down; 32-42% of the copy bandwidth) where this kernel's best launch takes 24.3 / 13.5 /
83.6 / 39.7 (the block-diagonal product is bound by its instructions' latency, not by memory), and 15.5 / 10.1 /
52.2 / 30.0 at 4 rows against 16.6 / 13.6 / 62.3 / 39.6; at 16 rows this kernel is the faster (28.3 / 22.3 / 83.8
/ 70.7 against 36.1 / 23.4 / 138.1 / 71.3). tinygemm takes its own layout and a bf16 scale and zero per group
(``w = (q - 8) * scale + zero``): each weight's codes are repacked once, on first use, and kept while they live
(0.625 bytes a weight more); ``scale`` and ``minimum + 8 * scale`` rounded to bf16 make its product differ from
the reference's by about bf16's rounding of the weight (relative error 3.0e-3 against the float64 reference on
the H200, torch's bf16 product of the dequantized weight 2.1e-3; ``tests/test_quant.py`` checks it on a GPU).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from .. import reference
from .common import TUNING, interpreted_bf16, precision


@triton.jit
def _halves(p, DTYPE: tl.constexpr):
    """The two 16-bit floats of each 32-bit word of p: the low and the high half."""
    lo = (p & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
    hi = (p >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return lo, hi


@triton.jit
def _unpack(w, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """Words (R, W) int32 of codes as (R, W * 32 // BITS) floats of DTYPE: ``q + OFFSET`` for 4 bits (OFFSET 128
    for bf16, 1024 for fp16; a word holds 8 consecutive inputs, the even ones in its low 16 bits and the odd ones
    in its high 16, the first in the lowest nibble of each), q for 8 (a word: 4 consecutive inputs, the first in
    its lowest byte)."""
    if BITS == 4:
        MAGIC: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
        # Each or-and gives the 16-bit floats of two consecutive inputs: 0 and 1, 2 and 3, ... in its halves.
        a0, a1 = _halves((w & 0x000F000F) | MAGIC, DTYPE)
        b2, b3 = _halves(((w >> 4) & 0x000F000F) | MAGIC, DTYPE)
        c4, c5 = _halves(((w >> 8) & 0x000F000F) | MAGIC, DTYPE)
        d6, d7 = _halves(((w >> 12) & 0x000F000F) | MAGIC, DTYPE)
        # join appends an axis: the innermost pair lands 4 apart, the middle 2, the outer 1.
        q = tl.join(tl.join(tl.join(a0, c4), tl.join(b2, d6)), tl.join(tl.join(a1, c5), tl.join(b3, d7)))
        return tl.reshape(q, (w.shape[0], w.shape[1] * 8))
    else:
        b0 = ((w & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # q as a float, no conversion
        b1 = (((w >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        b2 = (((w >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        b3 = (((w >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        q = tl.join(tl.join(b0, b2), tl.join(b1, b3))
        return tl.reshape(q, (w.shape[0], w.shape[1] * 4)).to(DTYPE)


@triton.jit
def _qmm_kernel(x_ptr, c_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, rows_x, n, k, groups,
                BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                SPLIT: tl.constexpr, EVEN: tl.constexpr, BIAS: tl.constexpr, DTYPE: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """out (rows_x, n) = x (rows_x, k) @ weight.T: acc (BLOCK_N, BLOCK_G * BLOCK_M) holds per output row the sums
    of each group slot and x row, summed over the slots at the end. With SPLIT > 1 the groups are split in SPLIT
    ranges (program axis 1): each program writes its sums (BLOCK_N, BLOCK_M) to ws (SPLIT, n blocks, BLOCK_M,
    BLOCK_N) fp32 and counts itself in count (n blocks,) int32 (zero between launches); the last to count adds
    them up, writes out and sets the count back to zero."""
    WORDS: tl.constexpr = BITS  # 32-bit words of a group: 32 codes of BITS bits
    OFFSET: tl.constexpr = (128.0 if DTYPE == tl.bfloat16 else 1024.0) if BITS == 4 else 0.0
    BLOCK_K: tl.constexpr = BLOCK_G * 32
    COLS: tl.constexpr = BLOCK_G * BLOCK_M
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    wj = tl.arange(0, BLOCK_G * WORDS)
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, COLS)
    col_g, col_m = col // BLOCK_M, col % BLOCK_M
    gi = tl.arange(0, BLOCK_G)
    # x's block-diagonal tile (BLOCK_K, COLS): input kk of column (g, m) is x[m, kk] on group g, else 0.
    diag = ((kk // 32)[:, None] == col_g[None, :]) & (col_m < rows_x)[None, :]
    x_at = x_ptr + col_m[None, :] * k + kk[:, None]
    xm = tl.arange(0, BLOCK_M)
    words_at = c_ptr + rows.to(tl.int64)[:, None] * (groups * WORDS) + wj[None, :]
    scales_at = rows.to(tl.int64)[:, None] * groups + gi[None, :]
    acc = tl.zeros((BLOCK_N, COLS), tl.float32)
    per_split = tl.cdiv(tl.cdiv(groups, BLOCK_G), SPLIT) * BLOCK_G
    start = tl.program_id(1) * per_split
    for g0 in tl.range(start, tl.minimum(groups, start + per_split), BLOCK_G):
        if EVEN:
            w = tl.load(words_at + g0 * WORDS, mask=in_rows[:, None], other=0)
            xt = tl.load(x_at + g0 * 32, mask=diag, other=0.0)
            xc = tl.load(x_ptr + xm[:, None] * k + g0 * 32 + kk[None, :], mask=(xm < rows_x)[:, None], other=0.0)
            s_mask = in_rows[:, None]
        else:
            w = tl.load(words_at + g0 * WORDS, mask=in_rows[:, None] & (g0 * WORDS + wj < groups * WORDS)[None, :],
                        other=0)
            xt = tl.load(x_at + g0 * 32, mask=diag & (g0 * 32 + kk < k)[:, None], other=0.0)
            xc = tl.load(x_ptr + xm[:, None] * k + g0 * 32 + kk[None, :],
                         mask=(xm < rows_x)[:, None] & (g0 * 32 + kk < k)[None, :], other=0.0)
            s_mask = in_rows[:, None] & (g0 + gi < groups)[None, :]
        q = _unpack(w, BITS, DTYPE)
        if UPCAST:
            q, xt = q.to(tl.float32), xt.to(tl.float32)
        d = tl.dot(q, xt, input_precision=PRECISION)
        # The groups' sums of x (BLOCK_M, BLOCK_G), in the columns' order (g, m).
        xs = tl.sum(tl.reshape(xc.to(tl.float32), (BLOCK_M, BLOCK_G, 32)), axis=2)
        xs = tl.reshape(tl.trans(xs), (COLS,))
        s = tl.load(s_ptr + scales_at + g0, mask=s_mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + scales_at + g0, mask=s_mask, other=0.0).to(tl.float32) - OFFSET * s
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_G, BLOCK_M)), (BLOCK_N, COLS))
        mn = tl.reshape(tl.broadcast_to(mn[:, :, None], (BLOCK_N, BLOCK_G, BLOCK_M)), (BLOCK_N, COLS))
        acc += s * d + mn * xs[None, :]
    out = tl.sum(tl.reshape(acc, (BLOCK_N, BLOCK_G, BLOCK_M)), axis=1)
    if SPLIT > 1:
        block = tl.program_id(0)
        at = (block * BLOCK_M + xm[None, :]) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        stride = tl.num_programs(0) * BLOCK_M * BLOCK_N
        tl.store(ws_ptr + tl.program_id(1) * stride + at, out)
        tl.debug_barrier()  # every thread's sums stored before the count (acq_rel) publishes them
        if tl.atomic_add(count_ptr + block, 1) != SPLIT - 1:
            return
        out = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i in tl.static_range(SPLIT):
            out += tl.load(ws_ptr + i * stride + at, cache_modifier=".cg")
        tl.store(count_ptr + block, 0)
    if BIAS:
        out += tl.load(b_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + xm[None, :] * n + rows[:, None], out.to(out_ptr.dtype.element_ty),
             mask=in_rows[:, None] & (xm < rows_x)[None, :])


def launch_parameters(rows: int) -> tuple[int, int, int, int, int]:
    """(block_n, block_g, split, warps, stages) for ``rows`` input rows: TUNING's entry of the smallest class that
    holds them (1, 4 or 16 rows)."""
    size = 1 if rows == 1 else 4 if rows <= 4 else 16
    return tuple(TUNING[f"qmm{size}_{name}"] for name in ("block_n", "block_g", "split", "warps", "stages"))


# Split-K scratch per (device, split, n blocks, block_m, block_n): the partial sums and the counts, kept (the counts
# return to zero after every launch) so that a CUDA graph replays with the same buffers.
_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, split: int, blocks: int, block_m: int, block_n: int):
    key = (device, split, blocks, block_m, block_n)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(split * blocks * block_m * block_n, dtype=torch.float32, device=device),
                         torch.zeros(blocks, dtype=torch.int32, device=device))
    return _SCRATCH[key]


# tinygemm's inner K tiles: K must be a multiple of 16 times this, N of 8.
TINYGEMM_K_TILES = 8


# tinygemm's operands per weight, keyed by the addresses and shape of codes, scale and minimum: an entry lives as
# long as the storage of the codes it was made for, not the tensor object: the decode step's fused weights are new
# tensors over the same storage each time a step is built (every generate), and an alias passed by torch.compile
# finds the entry by address.
_TINYGEMM: dict[tuple, tuple] = {}


def _tinygemm_operands(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, k: int):
    """tinygemm's packed weight and (G, N, 2) bf16 scales and zeros for 4-bit ``codes``, made on first use."""
    key = (codes.data_ptr(), tuple(codes.shape), scale.data_ptr(), minimum.data_ptr())
    # In-place changes (load_state_dict's copies) bump the version; inference tensors have none. A tensor object
    # counts its own versions: a new one over the same storage may repack once more.
    versions = tuple(-1 if t.is_inference() else t._version for t in (codes, scale, minimum))
    kept = _TINYGEMM.get(key)
    if kept is None or kept[0] != versions:
        q = reference.dequantize(codes, torch.ones_like(scale), torch.zeros_like(minimum), k).to(torch.int32)
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), TINYGEMM_K_TILES)
        s = scale.float()
        zeros = torch.stack([s, minimum.float() + 8 * s], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
        if kept is None:
            weakref.finalize(codes.untyped_storage(), _TINYGEMM.pop, key, None)
        kept = _TINYGEMM[key] = (versions, packed, zeros)
    return kept[1], kept[2]


def linear_quantized(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n, groups = scale.shape
    rows = x.numel() // k
    if (rows > TUNING["qgemv_max_rows"] or x.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or not (codes.is_contiguous() and scale.is_contiguous() and minimum.is_contiguous())
            or (bias is not None and bias.stride(0) != 1) or codes.data_ptr() % 4):
        return reference.linear_quantized(x, codes, scale, minimum, bias)
    bits = codes.shape[1] * 8 // (groups * reference.GROUP)
    if bits not in (4, 8) or -(-k // reference.GROUP) != groups:
        return reference.linear_quantized(x, codes, scale, minimum, bias)  # its error names the shapes
    if (rows <= TUNING["tinygemm_rows"] and bits == 4 and x.is_cuda and x.dtype == torch.bfloat16
            and k % (16 * TINYGEMM_K_TILES) == 0 and n % 8 == 0):
        packed, zeros = _tinygemm_operands(codes, scale, minimum, k)
        out = torch._weight_int4pack_mm(x.reshape(rows, k).contiguous(), packed, reference.GROUP, zeros)
        return (out if bias is None else out + bias).view(*x.shape[:-1], n)
    rounded = interpreted_bf16(x.dtype)  # the interpreter rounds bf16 stores toward zero: torch rounds instead
    out = torch.empty(rows, n, dtype=torch.float32 if rounded else x.dtype, device=x.device)
    block_m = triton.next_power_of_2(rows)
    block_n, block_g, split, warps, stages = launch_parameters(rows)
    block_g = max(block_g, 16 // block_m)  # tl.dot wants at least 16 columns
    split = max(1, min(split, triton.cdiv(groups, block_g)))
    dtype = tl.float16 if x.dtype == torch.float16 else tl.bfloat16
    blocks = triton.cdiv(n, block_n)
    ws, count = _scratch(x.device, split, blocks, block_m, block_n) if split > 1 else (out, out)
    _qmm_kernel[(blocks, split)](
        x.contiguous(), codes.view(torch.int32), scale, minimum, codes if bias is None else bias, out, ws, count,
        rows, n, k, groups, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, SPLIT=split,
        EVEN=k % (block_g * reference.GROUP) == 0, BIAS=bias is not None, DTYPE=dtype,
        UPCAST=rounded or x.dtype == torch.float32, PRECISION=precision(x.dtype), num_warps=warps,
        num_stages=stages)
    return out.to(x.dtype).view(*x.shape[:-1], n)
