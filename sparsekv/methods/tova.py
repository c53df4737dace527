"""TOVA: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

At every decode step, once a (layer, KV head) holds ``token_budget`` tokens (the current one included), the token
with the lowest attention weight of this step is dropped, the current token being a candidate too. The weight is
averaged over all query heads of the layer, as in the paper, so every KV head of a layer drops the same token and
the heads keep identical sets. A prompt longer than the budget keeps its ``token_budget - 1`` tokens with the
highest attention from the prompt's last query (averaged the same way), which is how TOVA enters decoding after
a prompt it did not evict token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import parallel
from .eviction import EvictionConfig, EvictionMethod, prompt_attention


@dataclass(frozen=True, kw_only=True)
class TOVAConfig(EvictionConfig):
    """token_budget: KV tokens attended per (layer, KV head) and step, current token included (>= 1).
    dense_layers: leading layers that keep all."""

    def method_class(self):
        return TOVA


class TOVA(EvictionMethod):
    config: TOVAConfig

    def head_mean(self, weights, kv_heads: int):
        """(B, H, C + 1) weights -> (B, Hkv, C + 1), their mean over all heads of the layer (those of every process
        under tensor parallelism) for every KV head. Slot ``j`` holds the same token in every head, because every
        head has dropped the same tokens."""
        # Summed in float64, where the sum of a few dozen weights is (almost always) exact: the mean then does not
        # depend on how the heads are split over processes, and neither do the near ties among evicted tokens.
        total = parallel.all_reduce_sum(weights.sum(dim=1, keepdim=True, dtype=torch.float64), self.tp_group)
        return (total / (weights.shape[1] * parallel.size(self.tp_group))).expand(-1, kv_heads, -1)

    def prompt_score(self, layer_idx, q, layer, plan, scale):
        return self.head_mean(prompt_attention(q, layer, plan, scale, last=1), layer.k.shape[1])

    def step_score(self, layer_idx, layer, weights, seq_len):
        return self.head_mean(weights, layer.k.shape[1])
