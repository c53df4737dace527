"""H2O: Heavy-Hitter Oracle (Zhang et al., 2023).

Every held token accumulates the attention it receives: from all the prompt's queries, then from each decode step.
A (layer, KV head) attends ``token_budget`` tokens per step, the current one included: the ``recent`` most recent
tokens (``recent = max(1, round(recent_fraction * token_budget))``, the current one among them) and the
``token_budget - recent`` heavy hitters, the older tokens with the highest accumulated attention. After the step
the lowest scoring token outside the ``recent - 1`` most recent is dropped for good, so the next token fits; a
prompt longer than the budget is cut to ``token_budget - 1`` tokens by the same rule right after its attention.

GQA: a KV head's score is the attention summed over the query heads of its group (the mean ranks the same), and
each KV head keeps its own tokens. Accumulated scores live in the layer's per-slot state, so they follow their
tokens when the layer grows, is compacted, or the batch is reordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import require
from .eviction import EvictionConfig, EvictionMethod, per_kv_head, prompt_attention

STATE = "h2o_score"


@dataclass(frozen=True, kw_only=True)
class H2OConfig(EvictionConfig):
    """token_budget: KV tokens attended per (layer, KV head) and step, current token included (>= 1).
    recent_fraction: share of the budget given to the most recent tokens, from 0 to 1 (at least the current
    token). dense_layers: leading layers that keep all."""

    recent_fraction: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.recent_fraction, (int, float)) and 0.0 <= self.recent_fraction <= 1.0,
                "recent_fraction", "a number from 0 to 1", self.recent_fraction)

    @property
    def recent(self) -> int:
        """Most recent tokens attended per step, the current one included."""
        return max(1, round(self.recent_fraction * self.token_budget))

    def method_class(self):
        return H2O


class H2O(EvictionMethod):
    config: H2OConfig

    def keep_score(self, layer, seq_len: torch.Tensor) -> torch.Tensor:
        """Accumulated attention, with the ``recent - 1`` latest tokens (those that stay recent for the next
        step) protected. seq_len: (B,) tokens per sequence so far. Returns (B, Hkv, C + 1)."""
        pos = layer.slot_page
        recent = pos > (seq_len - self.config.recent).view(-1, 1, 1)
        return layer.slot_state[STATE].masked_fill(recent, float("inf"))

    def prefill_chunk(self, layer_idx, q, layer, plan, scale):
        # Every prompt query adds its attention, chunk by chunk (slot j holds position j during the prompt).
        if self.dense(layer_idx):
            return
        score = per_kv_head(prompt_attention(q, layer, plan, scale), layer.k.shape[1])
        if STATE in layer.slot_state:
            layer.slot_state[STATE].add_(score)
        else:
            layer.slot_state[STATE] = score

    def prompt_score(self, layer_idx, q, layer, plan, scale):
        return self.keep_score(layer, plan.seq_len)

    def step_score(self, layer_idx, layer, weights, seq_len):
        # The current token's slot may have held a dropped token: its score starts from zero. In place: the state
        # is read and written at the same address by every replay of a captured step.
        score = layer.slot_state[STATE]
        score.scatter_(2, layer.cur_slot.unsqueeze(-1), 0.0)
        score.add_(per_kv_head(weights, layer.k.shape[1]))
        return self.keep_score(layer, seq_len)
