"""The model's decode step written out layer by layer, with the weights' products fused.

One token per sequence goes through the decoder: the embedding and rotary embedding, then per layer the model's own
norms, rotary function, output projection and activation around the cache and the method (``sparsekv_attention``,
the same attention function as ``apply``'s), then the final norm and the head. What differs from the modules' own
forward is the products: a layer's q/k/v projections run as one product, and its gate/up projections as another.

At batch 1 a decode step is a stream of matrix-vector products whose time is the bytes of the weights they read;
a few large products run nearer to the memory bandwidth than many small ones (Llama-3-8B on the H200: q/k/v 16.2
against 26.6 us per layer, gate/up 57.2 against 61.2). So the weights of each group are re-laid in place into one
tensor whose row blocks are the projections' weights, and the modules' parameters become views of it: the model
computes what it did before (``model.generate`` included) and holds no second copy.

Weights that are not plain tensors (the DTensor shards of transformers' tensor parallelism) are left as they are
and multiplied through their modules, one product each, so that the modules' own communication runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .transformers import SparseKVCache, sparsekv_attention


@dataclass(frozen=True)
class Fused:
    """Row blocks of one product: weight (sum of outs, in), bias (sum of outs,) or None, and each block's rows."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (..., in). Returns each block's (..., out_i)."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fuse(linears: Sequence[nn.Module]) -> Fused | None:
    """One weight for ``linears`` (``nn.Linear`` of one input size, all with a bias or none), their weights and
    biases becoming views of its row blocks; None when a weight is not a plain tensor. A group laid out so already
    (by an earlier call) is taken as it is, so that no second copy is made."""
    if not all(type(m) is nn.Linear and type(m.weight) is nn.Parameter for m in linears):
        return None
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        return None
    sizes = tuple(m.out_features for m in linears)
    weight = _adjacent([m.weight for m in linears])
    if weight is None:
        weight = torch.cat([m.weight.detach() for m in linears])
        for m, part in zip(linears, weight.split(sizes)):
            m.weight.data = part
    bias = None
    if linears[0].bias is not None:
        bias = _adjacent([m.bias for m in linears])
        if bias is None:
            bias = torch.cat([m.bias.detach() for m in linears])
            for m, part in zip(linears, bias.split(sizes)):
                m.bias.data = part
    return Fused(weight, bias, sizes)


def _adjacent(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that ``params`` are consecutive contiguous row blocks of (one storage), or None."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    if not all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for p in params):
        return None
    whole = first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                             (rows, *first.shape[1:]))
    offset = 0
    for p in params:
        if p.data_ptr() != whole[offset].data_ptr():
            return None
        offset += p.shape[0]
    return whole


@torch.compiler.disable  # the cache's bookkeeping and the method run eagerly, between the compiled parts
def _attend(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cache: SparseKVCache) -> torch.Tensor:
    """Stores k, v (B, Hkv, 1, D) in the cache and returns the method's attention of q (B, H, 1, D): (B, 1, H, D)."""
    cache.update(k, v, attn.layer_idx)
    return sparsekv_attention(attn, q, k, v, None, scaling=attn.scaling, sparsekv_cache=cache)[0]


class DecodeModel:
    """The decode step of ``model`` (a model ``apply`` supports) with fused products. ``layer``: how a layer runs,
    ``decode_layer`` or a compiled version of it (one compilation serves every layer). Made for each generation, so
    that weights moved since (``model.to``) are fused again."""

    def __init__(self, model, layer=None):
        decoder = model.get_decoder()
        self.embed, self.rotary, self.norm, self.head = decoder.embed_tokens, decoder.rotary_emb, decoder.norm, \
            model.lm_head
        self.layers = decoder.layers
        self.qkv = [fuse((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
                    for layer in self.layers]
        self.gate_up = [fuse((layer.mlp.gate_proj, layer.mlp.up_proj)) for layer in self.layers]
        self.rotate = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.layer = layer or decode_layer

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache: SparseKVCache) -> torch.Tensor:
        """token, position: (B, 1). Returns the next token's logits (B, V)."""
        hidden = self.embed(token)
        rotary = self.rotary(hidden, position)
        for layer, qkv, gate_up in zip(self.layers, self.qkv, self.gate_up):
            hidden = self.layer(layer, qkv, gate_up, self.rotate, hidden, rotary, cache)
        return self.head(self.norm(hidden))[:, -1]


def decode_layer(layer: nn.Module, qkv: Fused | None, gate_up: Fused | None, rotate, hidden: torch.Tensor,
                 rotary: tuple[torch.Tensor, torch.Tensor], cache: SparseKVCache) -> torch.Tensor:
    """One decoder layer for hidden (B, 1, hidden); qkv, gate_up: the layer's fused products (None: through the
    modules); rotate: the model's ``apply_rotary_pos_emb``; rotary: the (cos, sin) of the step's positions. Returns
    the layer's output (B, 1, hidden)."""
    attn, mlp = layer.self_attn, layer.mlp
    x = layer.input_layernorm(hidden)
    if qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = qkv(x)
    heads = (*x.shape[:-1], -1, attn.head_dim)
    q, k, v = q.view(heads), k.view(heads), v.view(heads)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's query and key
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), *rotary)
    out = _attend(attn, q, k, v.transpose(1, 2), cache)
    hidden = hidden + attn.o_proj(out.reshape(*x.shape[:-1], -1))
    x = layer.post_attention_layernorm(hidden)
    if gate_up is None:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    else:
        gate, up = gate_up(x)
    return hidden + mlp.down_proj(mlp.act_fn(gate) * up)
