"""Quest's page choice ranked by the mean and spread of each page's keys instead of their min/max bound.

Quest's bound ``sum_i max(q_i * max_i, q_i * min_i)`` adds every channel's worst case; on pages whose keys vary
(noise, prose) it dwarfs the true logits, and a page of alike keys (a needle) ranks near the bottom
(``benchmarks/results/accuracy/selection``: on SmolLM2, layer 18, KV head 2, the most attended page ranks 38th of
65). Here a page is scored by a Gaussian picture of its keys (``kernels.reference.spread_scores``): with mu and
sigma its channel-wise mean and standard deviation, ``q . mu + spread * sqrt(sum_i q_i^2 sigma_i^2)``, the mean
of its logits plus ``spread`` of their standard deviations (the largest of P such logits lies about
sqrt(2 ln P) deviations up: the default). The first ``sink_pages`` pages are always attended: the attention sink
at the sequence's start has keys unlike the rest, which a mean ranks low and a bound ranks high. Everything else
is Quest's: the budget, the current page, ``dense_layers``, ``per_query_head``, shared pages.

This is the reference: it computes the means and spreads from the keys at every step, reading every key (as the
oracle does), for measuring accuracy (``sparsekv.eval``, ``sparsekv.eval.selection``); a page's mean and spread
take Quest's metadata bytes, two vectors, and a fast path would keep them as each page fills.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import kernels
from ..kernels import reference
from .base import is_real, require
from .quest import Quest, QuestConfig


@dataclass(frozen=True, kw_only=True)
class SpreadConfig(QuestConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) with the same meaning; spread: the
    weight of a page's spread, a number from 0 to 100 (None: sqrt(2 ln page_size)); sink_pages: the first pages,
    always attended (>= 0, leaving the current page room in the budget)."""

    spread: float | None = None
    sink_pages: int = 1

    def __post_init__(self):
        super().__post_init__()
        require(self.spread is None or (is_real(self.spread) and 0 <= self.spread <= 100), "spread",
                "None (sqrt(2 ln page_size)) or a number from 0 to 100", self.spread)
        require(isinstance(self.sink_pages, int) and not isinstance(self.sink_pages, bool) and self.sink_pages >= 0
                and (self.sink_pages + 1) * self.page_size <= self.token_budget, "sink_pages",
                f"an int >= 0 leaving the current page room in token_budget ({self.token_budget // self.page_size} "
                f"pages)", self.sink_pages)

    @property
    def spread_weight(self) -> float:
        return math.sqrt(2 * math.log(self.page_size)) if self.spread is None else float(self.spread)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head the reference reads every key of the page."""
        return self.page_size * head_dim * itemsize

    def method_class(self):
        return Spread


class Spread(Quest):
    config: SpreadConfig

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """(B, Hs, C + 1): each page's mean-and-spread score, +inf for the sink pages, -inf for free slots."""
        cfg = self.config
        scores = reference.spread_scores(q, layer.k, layer.slot_page, seq_len, cfg.spread_weight,
                                         cfg.per_query_head, layer.table)
        sinks = (layer.slot_page >= 0) & (layer.slot_page < cfg.sink_pages)
        return scores.masked_fill(sinks.repeat_interleave(scores.shape[1] // sinks.shape[1], dim=1), float("inf"))

    def select(self, layer_idx, q, layer, seq_len):
        if layer_idx < self.config.dense_layers:
            return super().select(layer_idx, q, layer, seq_len)
        return kernels.select_pages(self.page_scores(layer_idx, q, layer, seq_len, None), layer.cur_slot,
                                    self.config.token_budget // self.config.page_size)
