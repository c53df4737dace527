"""SnapKV: observation-window voting (Li et al., 2024).

Right after the prompt's attention each (layer, KV head) keeps ``token_budget`` prompt tokens: the last ``window``
tokens (the observation window) and the ``token_budget - window`` earlier tokens that the window's queries attend
to most. The votes are the window queries' attention weights summed over those queries, zero over the window
itself, smoothed along the sequence by 1D pooling (``kernel`` wide, stride 1, ``pooling`` max or average) so that
a kept token brings its neighbours. Every decode token is then kept: the budget bounds the prompt, and a decode
step attends ``token_budget`` (or the prompt length, if shorter) plus the tokens generated so far.

GQA: the votes of a KV head are summed over the query heads of its group before pooling (the mean ranks the
same); each KV head keeps its own tokens. The paper selects per query head on MHA models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from .base import require
from .eviction import EvictionConfig, EvictionMethod, per_kv_head, prompt_attention

POOLING = ("max", "avg")


@dataclass(frozen=True, kw_only=True)
class SnapKVConfig(EvictionConfig):
    """token_budget: prompt tokens kept per (layer, KV head), window included (>= window). window: last prompt
    tokens whose queries vote (>= 1). kernel: pooling width, odd (>= 1). pooling: "max" or "avg".
    dense_layers: leading layers that keep all."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        require(isinstance(self.window, int) and self.window >= 1, "window", "an integer >= 1", self.window)
        require(isinstance(self.kernel, int) and self.kernel >= 1 and self.kernel % 2 == 1,
                "kernel", "an odd integer >= 1", self.kernel)
        require(self.pooling in POOLING, "pooling", f"one of {', '.join(POOLING)}", self.pooling)
        super().__post_init__()

    def min_budget(self) -> int:
        return self.window

    def method_class(self):
        return SnapKV


class SnapKV(EvictionMethod):
    config: SnapKVConfig
    evicts_in_decode = False
    needs_weights = False

    def min_prompt_chunk(self):
        return self.config.window

    def prompt_score(self, layer_idx, q, layer, plan, scale):
        cfg = self.config
        votes = per_kv_head(prompt_attention(q, layer, plan, scale, last=cfg.window), layer.k.shape[1])
        pos = layer.slot_page  # slot j holds position j right after the prompt
        window = pos >= (plan.seq_len - cfg.window).view(-1, 1, 1)
        votes = votes.masked_fill(window, 0.0)
        b, h, c = votes.shape
        pool = F.max_pool1d if cfg.pooling == "max" else F.avg_pool1d
        pooled = pool(votes.view(b * h, 1, c), cfg.kernel, stride=1, padding=cfg.kernel // 2).view(b, h, c)
        return pooled.masked_fill(window, float("inf"))
