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

from .. import kernels
from .base import require
from .eviction import EvictionConfig, EvictionMethod, evict_lowest, per_kv_head, prompt_attention

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


def keep_score(slot_page: torch.Tensor, score: torch.Tensor, seq_len: torch.Tensor, recent: int) -> torch.Tensor:
    """The accumulated attention ``score`` (B, Hkv, C + 1) with the ``recent - 1`` latest tokens (those that stay
    recent for the next step) protected; seq_len: (B,) tokens per sequence so far."""
    return score.masked_fill(slot_page > (seq_len - recent).view(-1, 1, 1), float("inf"))


def step_score(slot_page: torch.Tensor, score: torch.Tensor, cur_slot: torch.Tensor, weights: torch.Tensor,
               seq_len: torch.Tensor, recent: int) -> torch.Tensor:
    """Adds a decode step's weights (B, H, C + 1) into the accumulated ``score`` in place (the current token's
    slot, which may have held a dropped token, starting from zero; cur_slot: (B, Hkv)), then ``keep_score``. In
    place: a captured step reads and writes the same state at every replay."""
    score.scatter_(2, cur_slot.unsqueeze(-1), 0.0)
    score.add_(per_kv_head(weights, score.shape[1]))
    return keep_score(slot_page, score, seq_len, recent)


def evict_lightest(slot_page: torch.Tensor, slot_ids: torch.Tensor, counted: torch.Tensor | None, keep: int,
                   score: torch.Tensor, cur_slot: torch.Tensor, weights: torch.Tensor, seq_len: torch.Tensor,
                   recent: int) -> None:
    """H2O's eviction after a decode step (``EvictionMethod.step_eviction``), the step's weights added first."""
    evict_lowest(slot_page, slot_ids, counted, step_score(slot_page, score, cur_slot, weights, seq_len, recent), keep)


class H2O(EvictionMethod):
    config: H2OConfig
    step_eviction = staticmethod(kernels.fused(evict_lightest))
    reads_prompt_lse = True

    def prefill_chunk(self, layer_idx, q, layer, plan, scale, lse=None):
        # Every prompt query adds its attention, chunk by chunk (slot j holds position j during the prompt).
        if self.dense(layer_idx):
            return
        score = per_kv_head(prompt_attention(q, layer, plan, scale, lse=lse), layer.k.shape[1])
        if STATE in layer.slot_state:
            layer.slot_state[STATE].add_(score)
        else:
            layer.slot_state[STATE] = score

    def prompt_score(self, layer_idx, q, layer, plan, scale):
        return keep_score(layer.slot_page, layer.slot_state[STATE], plan.seq_len, self.config.recent)

    def step_args(self, layer_idx, layer, weights, seq_len):
        return layer.slot_state[STATE], layer.cur_slot, weights, seq_len, self.config.recent
