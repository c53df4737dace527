"""StreamingLLM: attention sinks plus a window of the most recent tokens (Xiao et al., 2024).

Every (layer, KV head) keeps the first ``sink_tokens`` tokens of the sequence and the most recent ones: at a decode
step it attends ``sink_tokens`` sinks and the ``token_budget - sink_tokens`` latest tokens, the current one
included. A prompt longer than the budget is cut the same way right after its attention. The choice depends on
positions only, so every head keeps the same tokens and no attention weights are needed.

Difference from the paper: tokens keep their original positions (keys are cached after RoPE), where the paper
re-numbers positions inside the cache so that a model can run past its trained length. Within the trained length
(every benchmark here) the two differ only in the positions the kept keys were encoded at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .base import require
from .eviction import EvictionConfig, EvictionMethod, evict_lowest


@dataclass(frozen=True, kw_only=True)
class StreamingLLMConfig(EvictionConfig):
    """token_budget: KV tokens attended per (layer, KV head) and step, current token and sinks included; more than
    sink_tokens. sink_tokens: leading tokens always kept (>= 0). dense_layers: leading layers that keep all."""

    sink_tokens: int = 4

    def __post_init__(self):
        require(isinstance(self.sink_tokens, int) and self.sink_tokens >= 0,
                "sink_tokens", "an integer >= 0", self.sink_tokens)
        super().__post_init__()

    def min_budget(self) -> int:
        return self.sink_tokens + 1

    def method_class(self):
        return StreamingLLM


def recency(slot_page: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Keep-score of one-token pages slot_page (B, Hkv, C + 1): the position, the first ``sink_tokens`` first."""
    return slot_page.to(torch.float64).masked_fill(slot_page < sink_tokens, float("inf"))


def evict_oldest(slot_page: torch.Tensor, slot_ids: torch.Tensor, counted: torch.Tensor | None, keep: int,
                 sink_tokens: int) -> None:
    """StreamingLLM's eviction after a decode step (``EvictionMethod.step_eviction``)."""
    evict_lowest(slot_page, slot_ids, counted, recency(slot_page, sink_tokens), keep)


class StreamingLLM(EvictionMethod):
    config: StreamingLLMConfig
    needs_weights = False
    step_eviction = staticmethod(kernels.fused(evict_oldest))

    def prompt_score(self, layer_idx, q, layer, plan, scale):
        return recency(layer.slot_page, self.config.sink_tokens)

    def step_args(self, layer_idx, layer, weights, seq_len):
        return (self.config.sink_tokens,)
