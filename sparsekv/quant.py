"""Weight-only quantized linear layers: group-wise codes of 4 or 8 bits that the decode step reads as they are.

One format serves both our own quantization and GGUF's blocks: along the input, groups of ``GROUP`` (32) weights
share an fp16 ``scale`` and ``minimum`` and each weight is ``scale * q + minimum`` with q an unsigned code
(``kernels.reference.dequantize``).

- ``"int4"``: float weights quantized at load, asymmetric (the group's minimum and (max - min) / 15, both rounded to
  fp16, then q = round((w - minimum) / scale) in 0..15). 4 bits plus 32 bits of scale and minimum per 32 weights:
  5 bits a weight, 3.2x fewer bytes than bf16.
- ``"gguf"``: a GGUF file's Q4_0, Q4_1 and Q8_0 tensors taken with no requantization: Q4_1 blocks are this
  format (fp16 d and m; only the nibbles are reordered), Q4_0's ``d * (q - 8)`` is ``d * q + (-8 d)`` and Q8_0's
  ``d * q`` (q signed) is ``d * (q + 128) + (-128 d)``; the minima -8d and -128d are exact in fp16 and each weight
  is computed exactly as gguf's own dequantization computes it (fp32 products and sums of the same values).

The linear layers of the decoder's layers (attention and MLP projections) are replaced by ``QuantLinear``; the
embedding and the output head stay in the model's dtype: the head is the embedding itself in tied models (SmolLM2,
Llama-3.2), and the logits are the one product whose error is not averaged out by later layers.

Layout (internal): codes (N, G * 16) uint8 of 4 bits, each 4 bytes (a little-endian 32-bit word) holding 8
consecutive inputs: the even ones in the low 16 bits and the odd ones in the high 16, the first of each in the
lowest nibble (``pack_nibbles``), so that one or-and of a word with a 16-bit float's bits gives the floats of two
consecutive inputs in the order a tensor-core product takes them; GGUF's 4-bit blocks (byte j: inputs j and
j + 16) are reordered so at load. 8-bit codes are one byte per input, as GGUF's Q8_0 has them. On a GPU where our
CUDA kernel is built, ``fit_kernels`` moves the 4-bit layers to that kernel's own layout (``reference.to_tiles``:
tiles of 16 outputs, each lane's codes in one word), in place: the model keeps one copy of its codes, which the
decode step and the prefill read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import kernels
from .errors import ConfigError
from .kernels.reference import CHUNK_K, GROUP, TILE_N, dequantize, quantized_outputs, tiled, to_tiles

WEIGHTS = ("float", "int4", "gguf")


def check_weights(weights: str, choices: tuple[str, ...] = WEIGHTS) -> str:
    """``weights`` if it is one of ``choices``, else a ConfigError naming them."""
    if weights not in choices:
        raise ConfigError("weights", f"one of {', '.join(choices)}", weights)
    return weights


class QuantLinear(nn.Module):
    """A linear layer of group-quantized weights: codes (out, G * 16) uint8 of 4 bits or (out, G * 32) of 8 bits,
    scale and minimum (out, G) fp16, bias (out,) or None; G = ceil(in / 32); or 4-bit codes, scale and minimum in
    ``reference.to_tiles``' layout (``fit_kernels``). Computes ``kernels.linear_quantized`` (on CUDA our kernels for
    up to 16 rows, the dequantized weight's product otherwise)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = quantized_outputs(codes, scale)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def bits(self) -> int:
        return 4 if tiled(self.codes) else self.codes.shape[1] * 8 // (self.scale.shape[1] * GROUP)

    def fit(self, device: torch.device) -> bool:
        """Moves 4-bit codes in rows of groups to ``reference.to_tiles``' layout when our CUDA kernel runs them on
        ``device`` (and N, K are multiples of 16 and 64); the old buffers are freed. Returns whether it did."""
        from .kernels.cuda import available

        n, k = self.out_features, self.in_features
        if (tiled(self.codes) or self.bits != 4 or n % TILE_N or k % CHUNK_K or device.type != "cuda"
                or not available(device, "quant")):
            return False
        self.codes, self.scale, self.minimum = to_tiles(self.codes, self.scale, self.minimum, k)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in). Returns (..., out) in x's dtype."""
        return kernels.linear_quantized(x, self.codes, self.scale, self.minimum, self.bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight the codes stand for."""
        return dequantize(self.codes, self.scale, self.minimum, self.in_features, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, " \
               f"bias={self.bias is not None}"


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (..., 8 * J) uint8 in 0..15 packed as the module's docstring says: (..., 4 * J) uint8."""
    q = q.view(*q.shape[:-1], -1, 4, 2).to(torch.int32)  # (word, pair, even/odd)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device).view(2, 4).T  # (pair, even/odd)
    words = (q << shifts).sum((-2, -1), dtype=torch.int32)
    return words.view(torch.uint8).view(*q.shape[:-3], -1)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (N, K) float. Returns codes (N, G * 16) uint8, scale and minimum (N, G) fp16, G = ceil(K / 32): each
    group's minimum and (max - min) / 15 rounded to fp16, the codes rounded to nearest against those (a last
    partial group is padded with its last weight, so its range is that of its own weights)."""
    n, k = weight.shape
    groups = -(-k // GROUP)
    w = weight.detach().float()
    if groups * GROUP != k:
        w = nn.functional.pad(w.unsqueeze(0), (0, groups * GROUP - k), mode="replicate").squeeze(0)
    w = w.view(n, groups, GROUP)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale, minimum = ((high - low) / 15).half(), low.half()
    if not (scale.isfinite().all() and minimum.isfinite().all()):
        raise ValueError("weights: a weight beyond fp16's range (65504) cannot be quantized to int4 with fp16 scales")
    s, m = scale.float().unsqueeze(2), minimum.float().unsqueeze(2)
    q = torch.where(s > 0, ((w - m) / s.clamp(min=torch.finfo(torch.float32).tiny)).round(), 0).clamp(0, 15)
    codes = pack_nibbles(q.to(torch.uint8))
    return codes.reshape(n, groups * GROUP // 2).contiguous(), scale, minimum


def layer_linears(model) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of the linear layers inside the decoder's layers (attention and MLP projections)."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return [(f"{prefix}.layers.{name}" if prefix else f"layers.{name}", module)
            for name, module in decoder.layers.named_modules() if isinstance(module, (nn.Linear, QuantLinear))]


def _replace(model, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def quantize_model(model, weights: str) -> int:
    """Quantizes ``model``'s layer linears in place (``weights``: "float" leaves the model as it is, "int4"
    quantizes every ``nn.Linear`` of the decoder's layers; layers quantized already stay as they are), then lays
    them out for our CUDA kernel where it runs them (``fit_kernels``). The float weights are freed. Returns how many
    layers were quantized."""
    check_weights(weights, ("float", "int4"))
    if weights == "float":
        return 0
    done = 0
    for name, module in layer_linears(model):
        if isinstance(module, QuantLinear):
            continue
        if type(module.weight) is not nn.Parameter and type(module.weight) is not torch.Tensor:
            raise ConfigError("weights", "float for a model whose weights are sharded (tensor parallelism)", weights)
        codes, scale, minimum = quantize_int4(module.weight)
        _replace(model, name, QuantLinear(codes, scale, minimum, module.bias, module.in_features))
        done += 1
    fit_kernels(model)
    return done


def fit_kernels(model) -> int:
    """Lays ``model``'s 4-bit layer weights out for our CUDA kernel (``QuantLinear.fit``) when the model computes in
    16-bit floats on a GPU where that kernel is built (its products need a 16-bit x), in place. Returns how many
    layers it moved."""
    if getattr(model, "dtype", None) not in (torch.float16, torch.bfloat16):
        return 0
    return sum(module.fit(module.codes.device) for _, module in layer_linears(model) if isinstance(module, QuantLinear))


# GGUF block layouts of one block of 32 weights: (bytes, offset of the codes).
_GGUF_BLOCKS = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}


def gguf_blocks(data, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes, scale and minimum of a GGUF tensor's blocks: data (N, blocks * bytes) uint8 (as gguf's reader
    gives it) of ``kind`` Q4_0, Q4_1 or Q8_0. Lossless: ``dequantize`` gives gguf's own dequantization."""
    size, start = _GGUF_BLOCKS[kind]
    raw = torch.from_numpy(data.copy()).view(torch.uint8)
    n = raw.shape[0]
    blocks = raw.view(n, -1, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(2)
    codes = blocks[..., start:].reshape(n, -1)
    if kind != "Q8_0":  # byte j of a block: inputs j and j + 16
        codes = pack_nibbles(torch.cat([codes.view(n, -1, 16) & 15, codes.view(n, -1, 16) >> 4], dim=2))
        codes = codes.reshape(n, -1)
    if kind == "Q4_1":
        minimum = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(2)
    elif kind == "Q4_0":
        minimum = d * -8
    else:
        codes, minimum = codes ^ 0x80, d * -128  # signed q to q + 128
    return codes.contiguous(), d.contiguous(), minimum.contiguous()


def load_gguf_blocks(model, path: str | Path) -> dict[str, int]:
    """Replaces ``model``'s layer linears (``model`` loaded by transformers from the GGUF file ``path``) by
    ``QuantLinear`` layers of the file's own Q4_0, Q4_1 and Q8_0 blocks, their rows in transformers' order (the
    row permutation its loader applies, e.g. to Llama's q and k, is applied to the blocks' rows), laid out for our
    CUDA kernel where it runs them (``fit_kernels``). Tensors of other types keep their dequantized float weights.
    Returns how many layers of each type were taken."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)

    reader = GGUFReader(str(path))
    config = load_gguf_checkpoint(str(path))["config"]
    processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    linears = dict(layer_linears(model))
    taken: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in _GGUF_BLOCKS:
            continue
        rows = tensor.data.shape[0]
        # The row order transformers gives the weight: its processor applied to the row numbers.
        order = processor.process(weights=torch.arange(rows).view(rows, 1).numpy(), name=tensor.name,
                                  tensor_key_mapping=names, parsed_parameters={"tensors": {}, "config": config})
        if order.weights.shape != (rows, 1):  # a processor that reshapes a weight, not only reorders its rows
            raise ValueError(f"weights: transformers' GGUF loader reshapes {tensor.name} ({kind}); its blocks cannot "
                             "be taken as they are: use --weights float or int4")
        module_name = names.get(order.name, "").removesuffix(".weight")
        module = linears.get(module_name)
        if module is None or isinstance(module, QuantLinear):
            continue
        if (module.out_features, module.in_features) != (rows, int(tensor.shape[0])):
            raise ValueError(f"weights: GGUF tensor {tensor.name} of shape {tuple(tensor.shape)} does not fit "
                             f"{module_name} ({module.out_features} x {module.in_features})")
        perm = torch.from_numpy(order.weights.reshape(rows).copy()).long()
        codes, scale, minimum = (t[perm].to(module.weight.device) for t in gguf_blocks(tensor.data, kind))
        _replace(model, module_name, QuantLinear(codes, scale, minimum, module.bias, module.in_features))
        taken[kind] = taken.get(kind, 0) + 1
    if not taken:
        raise ConfigError("weights", "float for a GGUF file with no Q4_0, Q4_1 or Q8_0 layer weights", "gguf")
    fit_kernels(model)
    return taken
