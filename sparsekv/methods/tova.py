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

from .. import kernels, parallel
from .eviction import EvictionConfig, EvictionMethod, evict_lowest, prompt_attention


@dataclass(frozen=True, kw_only=True)
class TOVAConfig(EvictionConfig):
    """token_budget: KV tokens attended per (layer, KV head) and step, current token included (>= 1).
    dense_layers: leading layers that keep all."""

    def method_class(self):
        return TOVA


def head_mean(slot_page: torch.Tensor, weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Keep-score (B, Hkv, C + 1) of slot_page's rows: the attention weights (B, H', C + 1) summed over their
    heads, divided by the layer's ``heads`` query heads, for every KV head (H' = 1: a sum already taken over the
    heads of every process). Summed in float64, where the sum of a few dozen weights is (almost always) exact: the
    mean then does not depend on how the heads are split over processes, and neither do the near ties among evicted
    tokens. Slot ``j`` holds the same token in every head, because every head has dropped the same tokens."""
    return (weights.sum(dim=1, keepdim=True, dtype=torch.float64) / heads).expand(-1, slot_page.shape[1], -1)


def evict_least_attended(slot_page: torch.Tensor, slot_ids: torch.Tensor, counted: torch.Tensor | None, keep: int,
                         weights: torch.Tensor, heads: int) -> None:
    """TOVA's eviction after a decode step (``EvictionMethod.step_eviction``)."""
    evict_lowest(slot_page, slot_ids, counted, head_mean(slot_page, weights, heads), keep)


class TOVA(EvictionMethod):
    config: TOVAConfig
    step_eviction = staticmethod(kernels.fused(evict_least_attended))

    def head_weights(self, weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``head_mean``'s arguments after slot_page for this process's weights (B, H, C + 1): those weights, or
        under tensor parallelism their float64 sum over the heads of every process; and the layer's heads."""
        if self.tp_group is None:
            return weights, weights.shape[1]
        total = parallel.all_reduce_sum(weights.sum(dim=1, keepdim=True, dtype=torch.float64), self.tp_group)
        return total, weights.shape[1] * parallel.size(self.tp_group)

    def prompt_score(self, layer_idx, q, layer, plan, scale):
        return head_mean(layer.slot_page, *self.head_weights(prompt_attention(q, layer, plan, scale, last=1)))

    def step_args(self, layer_idx, layer, weights, seq_len):
        return self.head_weights(weights)
