"""The model's decode step written out layer by layer, with the weights' products fused.

One token per sequence goes through the decoder: the embedding and rotary embedding, then per layer the model's own
norms, rotary function and activation around the cache and the method (``sparsekv_attention``, the same attention
function as ``apply``'s), then the final norm and the head. What differs from the modules' own forward is the
weights' products, the head's included: they run through ``kernels.linear`` (a matrix-vector kernel for one row on
CUDA, ``F.linear`` otherwise; ``kernels.linear_quantized`` for quantized layers), a layer's q/k/v projections as
one product and its gate/up projections as another.

At batch 1 a decode step is a stream of matrix-vector products whose time is the bytes of the weights they read;
a few large products run nearer to the memory bandwidth than many small ones (Llama-3-8B on the H200: q/k/v 16.2
against 26.6 us per layer, gate/up 57.2 against 61.2). So the weights of each group are re-laid in place into one
tensor whose row blocks are the projections' weights, and the modules' parameters become views of it: the model
computes what it did before (``model.generate`` included) and holds no second copy.

A prompt pass runs through the same functions (``DecodeModel.prompt_pass``: a chunk of tokens per row through one
layer, its attention the prompt's dense one), compiled with dynamic shapes where the engine compiles.

Under transformers' tensor parallelism the weights are DTensor shards. The projections whose outputs are split
(q/k/v, gate/up) fuse their local rows as above, each process computing its own heads and channels; those whose
inputs are split (o and down) multiply their local columns and sum the partial outputs over the processes
(``parallel.sum_partials``), the one collective of each. Other such weights (the embedding, the head) are
multiplied through their modules.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels, parallel
from ..kernels.reference import tiled
from ..quant import QuantLinear
from .transformers import SparseKVCache, sparsekv_attention


@dataclass(frozen=True)
class Fused:
    """Row blocks of one product: weight (sum of outs, in), bias (sum of outs,) or None, and each block's rows. For
    quantized layers (``QuantLinear``) weight holds the codes and scale, minimum the groups' (rows are
    independent, so the blocks of codes, scales and minima stack as the weights do). ``group``: under tensor
    parallelism, the processes over which the product's inputs are split (``parallel.row_split``): weight is this
    process's columns, and the partial outputs are summed over the group (through ``one_shot`` where set:
    ``parallel.set_all_reduce``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    group: dist.ProcessGroup | None = None
    one_shot: parallel.OneShot | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (..., in). Returns each block's (..., out_i)."""
        if self.scale is None:
            out = kernels.linear(x, self.weight, self.bias)
        else:
            out = kernels.linear_quantized(x, self.weight, self.scale, self.minimum, self.bias)
        if self.group is not None:
            out = parallel.sum_partials(out, self.group, self.one_shot)
        return out.split(self.sizes, dim=-1)


@dataclass(frozen=True)
class Products:
    """A layer's weight products: q/k/v, o, gate/up, down, each None where its weights are not plain tensors (then
    the modules multiply)."""

    qkv: Fused | None
    o: Fused | None
    gate_up: Fused | None
    down: Fused | None

    @classmethod
    def of(cls, layer: nn.Module) -> "Products":
        attn, mlp = layer.self_attn, layer.mlp
        return cls(fuse((attn.q_proj, attn.k_proj, attn.v_proj), local=True), fuse((attn.o_proj,)),
                   fuse((mlp.gate_proj, mlp.up_proj), local=True), fuse((mlp.down_proj,)))


def fuse(linears: Sequence[nn.Module], local: bool = False) -> Fused | None:
    """One weight for ``linears`` (``nn.Linear`` of one input size, all with a bias or none; or ``QuantLinear`` of
    one input size, code width and layout), their weights and biases (codes, scales and minima) becoming views of
    its row blocks (blocks of tiles for tiled codes). Under tensor parallelism, with ``local`` (outputs that the
    products after them take split: a layer's heads and MLP channels; not the head's logits, which are gathered),
    projections without a bias whose outputs are split (``parallel.column_split``): their local rows the same way,
    each process computing its own outputs; one projection without a bias whose inputs are split
    (``parallel.row_split``): its local columns, summed over the group. None for any other weight that is not a
    plain tensor. A group laid out so already (by an earlier call) is taken as it is, so that no second copy is made."""
    if len(linears) == 1 and linears[0].bias is None and (group := parallel.row_split(linears[0])) is not None:
        weight = linears[0].weight.to_local()
        return Fused(weight, None, (linears[0].out_features,), group=group,
                     one_shot=parallel.one_shot(group, weight.dtype, weight.device))
    shards = [parallel.column_split(m) for m in linears] if local else [None]
    if all(shard is not None for shard in shards) and len({m.in_features for m in linears}) == 1:
        return Fused(_one_tensor(shards, 0), None, tuple(shard.shape[0] for shard in shards))
    rows = 0  # the dim of the outputs' rows: 1 for tiled codes (chunks of tiles)
    if all(type(m) is QuantLinear for m in linears):
        names = ("codes", "scale", "minimum")
        if len({(m.bits, tiled(m.codes)) for m in linears}) != 1:
            return None
        rows = int(tiled(linears[0].codes))
    elif all(type(m) is nn.Linear and type(m.weight) is nn.Parameter for m in linears):
        names = ("weight",)
    else:
        return None
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        return None
    sizes = tuple(m.out_features for m in linears)
    bias = None if linears[0].bias is None else _one_tensor([m.bias for m in linears], 0)
    tensors = [_one_tensor([getattr(m, name) for m in linears], rows) for name in names]
    return Fused(tensors[0], bias, sizes, *tensors[1:])


def _one_tensor(params: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The tensor whose consecutive blocks along ``dim`` are ``params`` (parameters or buffers): the one they are
    views of already, else their concatenation, which they then become views of (``.data``: the same tensor
    objects)."""
    whole = _adjacent(params, dim)
    if whole is None:
        whole = torch.cat([p.detach() for p in params], dim=dim)
        for p, part in zip(params, whole.split([p.shape[dim] for p in params], dim=dim)):
            p.data = part
    return whole


def _adjacent(params: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
    """The contiguous tensor (one storage) whose consecutive blocks along ``dim`` ``params`` are, or None."""
    first = params[0]
    shape = (*first.shape[:dim], sum(p.shape[dim] for p in params), *first.shape[dim + 1:])
    storage = first.untyped_storage()
    if (first.storage_offset() + math.prod(shape)) * first.element_size() > storage.nbytes() or not all(
            p.stride() == first.stride() and p.untyped_storage().data_ptr() == storage.data_ptr() for p in params):
        return None
    whole = first.detach().new_empty(0).set_(storage, first.storage_offset(), shape)
    offset = 0
    for p in params:
        part = whole.narrow(dim, offset, p.shape[dim])
        if p.data_ptr() != part.data_ptr() or p.stride() != part.stride():
            return None
        offset += p.shape[dim]
    return whole


@torch.compiler.disable  # the cache's bookkeeping and the method run eagerly, between the compiled parts
def _attend(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cache: SparseKVCache) -> torch.Tensor:
    """Stores k, v (B, Hkv, S, D) in the cache and returns the method's attention of q (B, H, S, D): (B, S, H, D)."""
    cache.update(k, v, attn.layer_idx)
    return sparsekv_attention(attn, q, k, v, None, scaling=attn.scaling, sparsekv_cache=cache)[0]


@dataclass(frozen=True)
class PromptChunk:
    """The next tokens of a prompt in a mixed step (``DecodeModel.mixed``): ids (1, S) at positions ``start ..``,
    the prompt's cache (set for the pass: ``prompt_end``), and whether the step returns its last column's logits
    (the prompt's last chunk)."""

    ids: torch.Tensor
    start: int
    cache: SparseKVCache
    logits: bool


@dataclass(frozen=True)
class Parts:
    """The code of a decode step between two attentions, each part a function of tensors and modules: ``first``
    (embedding, rotary embedding, layer 0's attention inputs), ``between`` (a layer's output and the next layer's
    attention inputs, so that the residual add and the next norm fuse) and ``last`` (the last layer's output, the
    final norm and the head); and those of a prompt pass through one layer, ``prompt_inputs``
    (``attention_inputs``) and ``prompt_output`` (``layer_output``). ``compiled``: each part compiled by
    torch.compile once, whatever the layer."""

    first: Callable
    between: Callable
    last: Callable
    prompt_inputs: Callable
    prompt_output: Callable

    @classmethod
    def make(cls, compiled: bool) -> "Parts":
        parts = (first_part, between_part, last_part)
        if not compiled:
            return cls(*parts, attention_inputs, layer_output)
        # Combo kernels: Inductor launches independent kernels as one, here the rotation of q and that of k
        # (H200, Llama-3-8B: -30 to -40 us per step).
        return cls(*(torch.compile(f, options={"combo_kernels": True}) for f in parts),
                   *(_by_tokens(f) for f in (attention_inputs, layer_output)))


def _by_tokens(f: Callable) -> Callable:
    """``f`` (a prompt pass's part, its tensors (B, S, ...)) compiled with the token dim S dynamic and every other
    dim static: a graph for every length would compile anew for each prompt's chunk, and with every dim dynamic
    (``dynamic=True``) Inductor's kernels index by symbolic sizes (H200, Llama-3-8B, a layer over 16384 tokens:
    attention inputs 1.20 against 1.46 ms, output and MLP 9.07 against 10.07)."""
    compiled = torch.compile(f)

    def run(*args):
        for arg in args:
            for t in arg if isinstance(arg, tuple) else (arg,):
                if isinstance(t, torch.Tensor) and t.shape[1] > 1:  # one token: a graph of its own, as dynamo's
                    torch._dynamo.mark_dynamic(t, 1)
        return compiled(*args)

    return run


class DecodeModel:
    """The decode step of ``model`` (a model ``apply`` supports) with fused products, run by ``parts``. Made for each
    generation, so that weights moved since (``model.to``) are fused again."""

    def __init__(self, model, parts: Parts):
        self.model, self.parts = model, parts
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        self.products = [Products.of(layer) for layer in self.layers]
        self.head = fuse((model.lm_head,))
        self.rotate = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache: SparseKVCache) -> torch.Tensor:
        """token, position: (B, 1). Returns the next token's logits (B, V)."""
        layers, products = self.layers, self.products
        hidden, rotary, q, k, v = self.parts.first(self.decoder, layers[0], products[0], self.rotate,
                                                   token, position)
        for i in range(len(layers) - 1):
            out = _attend(layers[i].self_attn, q, k, v, cache)
            hidden, q, k, v = self.parts.between(layers[i], products[i], layers[i + 1], products[i + 1], self.rotate,
                                                 hidden, out, rotary)
        out = _attend(layers[-1].self_attn, q, k, v, cache)
        return self.parts.last(self.model, self.head, layers[-1], products[-1], hidden, out)

    def mixed(self, token: torch.Tensor, position: torch.Tensor, cache: SparseKVCache,
              chunks: list[PromptChunk]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One forward of a mixed step: the decode tokens of B rows, token and position (B, 1), with ``cache``,
        and the next tokens of one or more prompts (``chunks``, each with its own cache), through every layer
        together. Each weight product runs once over all the tokens (the rows' tokens, then each chunk's, as
        columns of one sequence), the attention apart: the decode tokens through the method, each chunk's densely
        (its prompt pass). Returns the rows' next-token logits (B, V) and, for each chunk, its last column's (1, V)
        where it asked for them (else None). B may be 0: prompt passes through every layer at once."""
        b = token.shape[0]
        sizes = [chunk.ids.shape[1] for chunk in chunks]
        decoder = self.decoder
        device = token.device
        hidden = decoder.embed_tokens(torch.cat([token.view(1, b), *(chunk.ids for chunk in chunks)], dim=1))
        positions = torch.cat([position.view(1, b), *(torch.arange(chunk.start, chunk.start + s, device=device)
                                                       .view(1, s) for chunk, s in zip(chunks, sizes))], 1)
        rotary = decoder.rotary_emb(hidden, positions)
        bounds = list(itertools.accumulate(sizes, initial=b))  # chunk j's columns: bounds[j] .. bounds[j + 1] - 1
        for layer, products in zip(self.layers, self.products):
            q, k, v = self.parts.prompt_inputs(layer, products, self.rotate, hidden, rotary)
            outs = []
            if b:  # (1, H, B, D) -> (B, H, 1, D): a row's token is its own sequence
                rows = [t[:, :, :b].transpose(0, 2).contiguous() for t in (q, k, v)]
                outs.append(_attend(layer.self_attn, *rows, cache).transpose(0, 1))
            for chunk, first, end in zip(chunks, bounds, bounds[1:]):
                outs.append(_attend(layer.self_attn, q[:, :, first:end], k[:, :, first:end], v[:, :, first:end],
                                    chunk.cache))
            hidden = self.parts.prompt_output(layer, products, hidden, torch.cat(outs, dim=1))
        wanted = decoder.norm(torch.cat([hidden[0, :b], *(hidden[0, end - 1:end]
                                                          for chunk, end in zip(chunks, bounds[1:]) if chunk.logits)]))
        logits = self.model.lm_head(wanted) if self.head is None else self.head(wanted)[0]
        found = iter(logits[b:].split(1))
        return logits[:b], [next(found) if chunk.logits else None for chunk in chunks]

    def prompt_pass(self, index: int, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                    cache: SparseKVCache) -> torch.Tensor:
        """Layer ``index`` over a prompt pass's hidden states (B, S, hidden) at the positions whose (cos, sin)
        are ``rotary`` (the cache set for the pass: ``engine.prompt_passes``). Returns its output (B, S, hidden)."""
        layer, products = self.layers[index], self.products[index]
        q, k, v = self.parts.prompt_inputs(layer, products, self.rotate, hidden, rotary)
        return self.parts.prompt_output(layer, products, hidden, _attend(layer.self_attn, q, k, v, cache))


def first_part(decoder: nn.Module, layer: nn.Module, products: Products, rotate, token: torch.Tensor,
               position: torch.Tensor):
    """token, position: (B, 1). Returns the embedded tokens (B, 1, hidden), the (cos, sin) of the positions and
    the first layer's attention inputs (``attention_inputs``)."""
    hidden = decoder.embed_tokens(token)
    rotary = decoder.rotary_emb(hidden, position)
    return hidden, rotary, *attention_inputs(layer, products, rotate, hidden, rotary)


def between_part(layer: nn.Module, products: Products, next_layer: nn.Module, next_products: Products, rotate,
                 hidden: torch.Tensor, out: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
    """``layer_output`` of ``layer``, and ``attention_inputs`` of the next layer for it."""
    hidden = layer_output(layer, products, hidden, out)
    return hidden, *attention_inputs(next_layer, next_products, rotate, hidden, rotary)


def last_part(model: nn.Module, head: Fused | None, layer: nn.Module, products: Products, hidden: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """The last layer's output through the final norm and the head (``head``: its product, None for the module's
    own): the logits (B, V)."""
    hidden = model.get_decoder().norm(layer_output(layer, products, hidden, out))
    return (model.lm_head(hidden) if head is None else head(hidden)[0])[:, -1]


def attention_inputs(layer: nn.Module, products: Products, rotate, hidden: torch.Tensor,
                     rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The layer's query, key and value for hidden (B, S, hidden): (B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, D),
    rotated by ``rotate`` (the model's ``apply_rotary_pos_emb``) with rotary, the (cos, sin) of the positions."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    if products.qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = products.qkv(x)
    heads = (*x.shape[:-1], -1, attn.head_dim)
    q, k, v = q.view(heads), k.view(heads), v.view(heads)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's query and key
        q, k = attn.q_norm(q), attn.k_norm(k)
    # Rotated in the products' (B, S, heads, D) layout, then viewed as (B, heads, S, D): Inductor's kernel reading
    # and writing one layout ran 2.3x faster than rotating the transposed views (H200, Llama-3-8B, a prompt pass
    # of 16000 tokens: 0.34 against 0.79 ms a layer for q and k).
    q, k = rotate(q, k, *rotary, unsqueeze_dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def layer_output(layer: nn.Module, products: Products, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The layer's output (B, S, hidden) from its input hidden (B, S, hidden) and its attention's out (B, S, H, D):
    output projection, residual, norm, MLP, residual."""
    attn, mlp = layer.self_attn, layer.mlp
    out = out.reshape(*hidden.shape[:-1], -1)
    hidden = hidden + (attn.o_proj(out) if products.o is None else products.o(out)[0])
    x = layer.post_attention_layernorm(hidden)
    if products.gate_up is None:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    else:
        gate, up = products.gate_up(x)
    x = mlp.act_fn(gate) * up
    return hidden + (mlp.down_proj(x) if products.down is None else products.down(x)[0])
