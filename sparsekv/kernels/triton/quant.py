"""The products of group-quantized weights (``reference.linear_quantized``) for a few input rows: decode steps at
batch 1 to ``qgemv_max_rows``.

The weights stay in their codes. Each program reads ``qmm_block_n`` output rows' codes in slices of ``qmm_block_g``
groups of 32 inputs as 32-bit words (8 codes of 4 bits or 4 of 8) and dequantizes every weight in registers: a
shift and an or-and put a code q in the top mantissa bits of the float 1.0, which is then the float ``1 + q / L``
(L = 2^bits), and one FMA with ``L * scale`` and ``minimum - L * scale`` gives ``scale * q + minimum`` (in fp32,
within a rounding or two of the exact weight). The weight is rounded once to x's dtype, as the reference's
dequantized weight is for the prefill's products, and one tensor-core product per slice adds ``weight @ x^T`` into
an fp32 accumulator carried over the slices, x's rows padded to 16 columns. The dequantization is the work: a
launch takes about the same time for 1 to 16 rows. The groups may be split in ranges (split-K) when the row
blocks are too few to fill the device; the last program of a block to finish adds up the ranges' sums.
More rows (the prefill) go to the reference, which dequantizes the weight and calls cuBLAS.

On the H200 at Llama-3-8B's products (q/k/v, o, gate/up, down; us): 14.6 / 11.1 / 56.1 / 29.5 at one row, 14.7 /
11.4 / 57.0 / 30.3 at 16 rows, where torch's bf16 product of the unquantized weight takes 15.9 / 12.5 / 57.6 / 32.0.
The kernel this one replaced (the per-group scaling applied after a product against x laid out block-diagonally,
no rounded weight) took 24.4 / 13.5 / 83.6 / 39.7 at one row and 28.3 / 22.3 / 83.8 / 70.7 at 16, bound by waiting
for each slice's product before scaling it.

Codes in the CUDA kernel's own layout (``reference.to_tiles``, which ``quant.fit_kernels`` gives a model's 4-bit
layers where that kernel is built) take that kernel for up to ``cuda_int4_rows`` rows (at most 16;
``kernels.cuda.quant.int4_products``: 8.7 / 6.1 / 22.9 / 14.0 us at one row, 9.8 / 8.6 / 27.4 / 19.5 at 8, 14.3 /
11.3 / 36.2 / 27.2 at 16), and for more rows (the prefill) are dequantized by one launch of ``_untile_kernel``
(one read of the codes, one write of the weight) for torch's product. Codes in rows of groups (where the CUDA
kernel cannot be built, or in a model not fitted), up to ``tinygemm_rows`` rows of bf16, go to torch's own int4
kernel (tinygemm, ``torch._weight_int4pack_mm``: 11.6 / 7.7 / 40.2 / 21.1 us at one row) on its layout and a bf16
scale and zero per group (``w = (q - 8) * scale + zero``): ``scale`` and ``minimum + 8 * scale`` rounded to bf16
make its product differ from the reference's by about bf16's rounding of the weight (relative error 3.0e-3 against
the float64 reference on the H200; the CUDA kernel's 1.7e-3, this kernel's and torch's bf16 product of the
dequantized weight 2.1e-3; ``tests/test_quant.py`` checks them on a GPU).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from .. import reference
from ..cuda import available
from ..cuda import quant as cuda_int4
from .common import TUNING, dependent_launch, interpreted_bf16, num_sms, pdl_launch, precision

# Chunks of 64 inputs per program of ``_untile_kernel``.
UNTILE_CHUNKS = 4


@triton.jit
def _field(w, AT: tl.constexpr, BITS: tl.constexpr):
    """The float ``1 + q / 2^BITS`` of the BITS-bit code q at bit AT of each word of w: q moved to the top of the
    mantissa of 1.0."""
    TOP: tl.constexpr = 23 - BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << TOP
    if AT <= TOP:
        v = (w << (TOP - AT)) & MASK
    else:
        v = (w >> (AT - TOP)) & MASK
    return (v | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _levels(w, BITS: tl.constexpr):
    """Words (R, W) int32 of codes as (R, W * 32 // BITS) fp32 ``1 + q / 2^BITS``, in input order. A word of 4-bit
    codes holds 8 consecutive inputs, input i in nibble ``4 * (i % 2) + i // 2`` (the even ones in its low 16 bits,
    the odd ones in its high 16); a word of 8-bit codes 4 inputs, the first in its lowest byte."""
    if BITS == 4:
        v0, v1, v2, v3 = _field(w, 0, 4), _field(w, 16, 4), _field(w, 4, 4), _field(w, 20, 4)
        v4, v5, v6, v7 = _field(w, 8, 4), _field(w, 24, 4), _field(w, 12, 4), _field(w, 28, 4)
        # join appends an axis: the innermost pair lands 4 apart, the middle 2, the outer 1.
        q = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        return tl.reshape(q, (w.shape[0], w.shape[1] * 8))
    else:
        b0, b1, b2, b3 = _field(w, 0, 8), _field(w, 8, 8), _field(w, 16, 8), _field(w, 24, 8)
        q = tl.join(tl.join(b0, b2), tl.join(b1, b3))
        return tl.reshape(q, (w.shape[0], w.shape[1] * 4))


@triton.jit
def _qmm_kernel(x_ptr, c_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, rows_x, n, k, groups,
                BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                SPLIT: tl.constexpr, EVEN: tl.constexpr, BIAS: tl.constexpr, DTYPE: tl.constexpr,
                PRECISION: tl.constexpr, PDL: tl.constexpr):
    """out (rows_x, n) = x (rows_x, k) @ weight.T, each slice's weight (BLOCK_N, BLOCK_G * 32) dequantized in DTYPE
    and multiplied with x's slice (BLOCK_G * 32, BLOCK_M) into out (BLOCK_N, BLOCK_M) fp32. With SPLIT > 1 the
    groups are split in SPLIT ranges (program axis 1): each program writes its sums (BLOCK_N, BLOCK_M) to ws
    (SPLIT, n blocks, BLOCK_M, BLOCK_N) fp32 and counts itself in count (n blocks,) int32 (zero between launches);
    the last to count adds them up, writes out and sets the count back to zero."""
    dependent_launch(PDL)
    WORDS: tl.constexpr = BITS  # 32-bit words of a group: 32 codes of BITS bits
    LEVEL: tl.constexpr = (1 << BITS) * 1.0
    BLOCK_K: tl.constexpr = BLOCK_G * 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    wj = tl.arange(0, BLOCK_G * WORDS)
    kk = tl.arange(0, BLOCK_K)
    gi = tl.arange(0, BLOCK_G)
    xm = tl.arange(0, BLOCK_M)
    words_at = c_ptr + rows.to(tl.int64)[:, None] * (groups * WORDS) + wj[None, :]
    scales_at = rows.to(tl.int64)[:, None] * groups + gi[None, :]
    x_at = x_ptr + xm[None, :] * k + kk[:, None]
    out = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    per_split = tl.cdiv(tl.cdiv(groups, BLOCK_G), SPLIT) * BLOCK_G
    start = tl.program_id(1) * per_split
    for g0 in tl.range(start, tl.minimum(groups, start + per_split), BLOCK_G):
        if EVEN:
            w = tl.load(words_at + g0 * WORDS, mask=in_rows[:, None], other=0)
            xt = tl.load(x_at + g0 * 32, mask=(xm < rows_x)[None, :], other=0.0)
            s_mask = in_rows[:, None]
        else:
            w = tl.load(words_at + g0 * WORDS, mask=in_rows[:, None] & (g0 * WORDS + wj < groups * WORDS)[None, :],
                        other=0)
            xt = tl.load(x_at + g0 * 32, mask=(xm < rows_x)[None, :] & (g0 * 32 + kk < k)[:, None], other=0.0)
            s_mask = in_rows[:, None] & (g0 + gi < groups)[None, :]
        # scale * q + minimum = (L * scale) * (1 + q / L) + (minimum - L * scale)
        s = tl.load(s_ptr + scales_at + g0, mask=s_mask, other=0.0).to(tl.float32) * LEVEL
        z = tl.load(m_ptr + scales_at + g0, mask=s_mask, other=0.0).to(tl.float32) - s
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_G, 32)), (BLOCK_N, BLOCK_K))
        z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, BLOCK_G, 32)), (BLOCK_N, BLOCK_K))
        weight = (_levels(w, BITS) * s + z).to(DTYPE)
        out = tl.dot(weight, xt.to(DTYPE), out, input_precision=PRECISION)
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


@triton.jit
def _untile_kernel(c_ptr, s_ptr, m_ptr, out_ptr, k, sc, ss, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """The weight rows of tile ``program_id(0)`` (16, k), inputs of CHUNKS chunks from ``program_id(1) * CHUNKS``,
    from codes, scale and minimum in ``reference.to_tiles``' layout (chunk strides sc and ss, the rest contiguous):
    each value looks up its lane's word and nibble, ``scale * q + minimum`` in fp32 (the product exact: q < 16 and
    an fp16 scale), stored in out's dtype."""
    dependent_launch(PDL)
    tile = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, 16)[:, None]  # row g + 8p of the tile
    i = tl.program_id(1) * CHUNKS * 64 + tl.arange(0, CHUNKS * 64)[None, :]
    c, j, col = (i // 64).to(tl.int64), (i % 64) // 16, i % 16  # chunk, step, input of the step: 2t + e + 8h
    g, p, h, t, e = r % 8, r // 8, col // 8, (col % 8) // 2, col % 2
    inside = (i < k) & (r < 16)
    word = tl.load(c_ptr + c * sc + tile * 128 + (4 * g + t) * 4 + j, mask=inside, other=0)
    q = (word >> (4 * (4 * e + 2 * h + p))) & 15
    at = c * ss + tile * 32 + g * 4 + ((i % 64) // 32) * 2 + p
    s = tl.load(s_ptr + at, mask=inside, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + (tile * 16 + r) * k + i, (q.to(tl.float32) * s + m).to(out_ptr.dtype.element_ty), mask=inside)


def untile(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``reference.dequantize`` of codes in ``reference.to_tiles``' layout (or views of some of its tiles): the (N,
    K) weight in ``dtype``."""
    chunks, tiles = codes.shape[:2]
    if codes.stride()[1:] != (128, 4, 1) or scale.stride()[1:] != (32, 4, 2, 1) or minimum.stride() != scale.stride():
        codes, scale, minimum = codes.contiguous(), scale.contiguous(), minimum.contiguous()
    k = chunks * reference.CHUNK_K
    rounded = interpreted_bf16(dtype)  # the interpreter rounds bf16 stores toward zero: torch rounds instead
    out = torch.empty(tiles * reference.TILE_N, k, dtype=torch.float32 if rounded else dtype, device=codes.device)
    _untile_kernel[(tiles, triton.cdiv(chunks, UNTILE_CHUNKS))](codes, scale, minimum, out, k, codes.stride(0),
                                                                 scale.stride(0), CHUNKS=UNTILE_CHUNKS, **pdl_launch())
    return out.to(dtype)


def _tiled_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_quantized`` of codes in ``reference.to_tiles``' layout: the CUDA kernel for a few rows of a 16-bit x,
    else the weight dequantized (``untile``) and torch's product."""
    k = x.shape[-1]
    rows, n = x.numel() // k, codes.shape[1] * reference.TILE_N
    if codes.shape[0] * reference.CHUNK_K != k:
        return reference.linear_quantized(x, codes, scale, minimum, bias)  # its error names the shapes
    if (rows <= min(TUNING["cuda_int4_rows"], cuda_int4.MAX_ROWS) and x.dtype in (torch.float16, torch.bfloat16)
            and available(x.device, "quant")):
        return cuda_int4.int4_products(x.reshape(rows, k).contiguous(), codes, scale, minimum, bias,
                                       num_sms(x.device)).view(*x.shape[:-1], n)
    weight = untile(codes, scale, minimum, torch.float64 if x.dtype == torch.float64 else x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def split_for(blocks: int, groups: int, block_g: int) -> int:
    """Ranges the groups are split in for ``blocks`` row blocks: enough that the programs reach ``qmm_programs``,
    a power of two up to ``qmm_split``, no more than the slices."""
    wanted = triton.next_power_of_2(triton.cdiv(TUNING["qmm_programs"], blocks))
    return max(1, min(TUNING["qmm_split"], wanted, triton.cdiv(groups, block_g)))


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


# Operands repacked per weight for tinygemm, keyed by the addresses and shape of codes, scale and minimum: an entry
# lives as long as the storage of the codes it was made for, not the tensor object: the decode step's fused weights
# are new tensors over the same storage each time a step is built (every generate), and an alias passed by
# torch.compile finds the entry by address.
_TINYGEMM: dict[tuple, tuple] = {}


def _kept(table: dict, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, make):
    """The tensors ``make()`` returns for these codes, scale and minimum, made on first use and kept in ``table``;
    None while a CUDA graph is captured and none are kept (the capture would record the repacking, not run it)."""
    key = (codes.data_ptr(), tuple(codes.shape), scale.data_ptr(), minimum.data_ptr())
    # In-place changes (load_state_dict's copies) bump the version; inference tensors have none. A tensor object
    # counts its own versions: a new one over the same storage may repack once more.
    versions = tuple(-1 if t.is_inference() else t._version for t in (codes, scale, minimum))
    kept = table.get(key)
    if codes.is_cuda and torch.cuda.is_current_stream_capturing():
        return None if kept is None else kept[1]
    if kept is None:
        weakref.finalize(codes.untyped_storage(), table.pop, key, None)
        kept = table[key] = (versions, make())
    elif kept[0] != versions:
        for old, new in zip(kept[1], make()):
            old.copy_(new)  # in place: the graphs captured so far read these tensors' memory
        table[key] = (versions, kept[1])
    return kept[1]


def _tinygemm_operands(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, k: int):
    """tinygemm's packed weight and (G, N, 2) bf16 scales and zeros for 4-bit ``codes``."""
    q = reference.code_values(codes, scale, k)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), TINYGEMM_K_TILES)
    s = scale.float()
    zeros = torch.stack([s, minimum.float() + 8 * s], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, zeros


def linear_quantized(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    if reference.tiled(codes):
        return _tiled_product(x, codes, scale, minimum, bias)
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
            and k % (16 * TINYGEMM_K_TILES) == 0 and n % 8 == 0 and (operands := _kept(
                _TINYGEMM, codes, scale, minimum, lambda: _tinygemm_operands(codes, scale, minimum, k))) is not None):
        packed, zeros = operands
        out = torch._weight_int4pack_mm(x.reshape(rows, k).contiguous(), packed, reference.GROUP, zeros)
        return (out if bias is None else out + bias).view(*x.shape[:-1], n)
    rounded = interpreted_bf16(x.dtype)  # the interpreter rounds bf16 stores toward zero: torch rounds instead
    out = torch.empty(rows, n, dtype=torch.float32 if rounded else x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(rows))  # tl.dot wants at least 16 columns
    block_n, block_g = TUNING["qmm_block_n"], TUNING["qmm_block_g"]
    blocks = triton.cdiv(n, block_n)
    split = split_for(blocks, groups, block_g)
    # The weight is rounded to x's dtype for the product (fp32 in the interpreter, whose bf16 rounding differs).
    dtype = tl.float32 if rounded or x.dtype == torch.float32 else {torch.float16: tl.float16}.get(x.dtype, tl.bfloat16)
    ws, count = _scratch(x.device, split, blocks, block_m, block_n) if split > 1 else (out, out)
    _qmm_kernel[(blocks, split)](
        x.contiguous(), codes.view(torch.int32), scale, minimum, codes if bias is None else bias, out, ws, count,
        rows, n, k, groups, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, SPLIT=split,
        EVEN=k % (block_g * reference.GROUP) == 0, BIAS=bias is not None, DTYPE=dtype,
        PRECISION=precision(x.dtype), num_warps=TUNING["qmm_warps"], num_stages=TUNING["qmm_stages"], **pdl_launch())
    return out.to(x.dtype).view(*x.shape[:-1], n)
