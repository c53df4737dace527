"""Quest's page choice ranked by the mean and spread of each page's keys instead of their min/max bound.

Quest's bound ``sum_i max(q_i * max_i, q_i * min_i)`` adds every channel's worst case; on pages whose keys vary
(noise, prose) it dwarfs the true logits, and a page of alike keys (a needle) ranks near the bottom
(``benchmarks/results/accuracy/selection``: on SmolLM2, layer 18, KV head 2, the most attended page ranks 38th of
65). Here a page is scored by a Gaussian picture of its keys (``kernels.reference.spread_scores``): with mu and
sigma its channel-wise mean and standard deviation, ``q . mu + spread * sqrt(sum_i q_i^2 sigma_i^2)``, the mean
of its logits plus ``spread`` of their standard deviations (the largest of P such logits lies about
sqrt(2 ln P) deviations up: the default). The first ``sink_pages`` pages are always attended: the attention sink
at the sequence's start has keys unlike the rest, which a mean ranks low and a bound ranks high. Everything else
is Quest's: the budget, the current page, ``dense_layers``, ``per_query_head``.

The means and deviations are kept per page slot in the cache (``quest.Summarized``), (B, Hkv, C + 1, 2, D) in the
cache's dtype: Quest's metadata bytes (two vectors per page and KV head, where Quest keeps its min and max), which
is all a step reads to score a page. A step chooses in one op, ``kernels.spread_select``: on CUDA Quest's two
launches, its page-score kernel reading the means and deviations (and writing the current page's first) where it
reads the bounds. ``kernels.reference.spread_scores`` computes the same scores from every key (unrounded), for the
tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import kernels
from ..kernels import reference
from .base import is_real, require
from .quest import RerankedConfig, Summarized


@dataclass(frozen=True, kw_only=True)
class SpreadConfig(RerankedConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) and sink_pages (``RerankedConfig``);
    spread: the weight of a page's spread, a number from 0 to 100 (None: sqrt(2 ln page_size))."""

    spread: float | None = None

    def __post_init__(self):
        super().__post_init__()
        require(self.spread is None or (is_real(self.spread) and 0 <= self.spread <= 100), "spread",
                "None (sqrt(2 ln page_size)) or a number from 0 to 100", self.spread)

    @property
    def spread_weight(self) -> float:
        return math.sqrt(2 * math.log(self.page_size)) if self.spread is None else float(self.spread)

    def method_class(self):
        return Spread


STATS = "spread"  # the ``slot_state`` entry of the pages' means and deviations


class Spread(Summarized):
    """Its state is the cache's: ``layer.slot_state[STATS]`` (B, Hkv, C + 1, 2, D), each page's mean and deviation,
    in each layer from ``dense_layers`` on (``Summarized``)."""

    config: SpreadConfig
    summary_entry = STATS
    summary_rows = 2

    def summarize(self, k, slot_page, seq_len):
        return reference.page_spreads(k, slot_page, seq_len)

    def estimate(self, q, layer, seq_len, scale):
        """Each page's mean-and-spread score, after the current page's mean and deviation (the step's choice,
        ``select``, does both in one op)."""
        cfg = self.config
        stats = layer.slot_state[STATS]
        kernels.spread_stats(layer.k, stats, layer.slot_page, layer.cur_slot, seq_len, layer.table)
        return kernels.spread_page_scores(q, stats, layer.slot_page, cfg.spread_weight, cfg.per_query_head,
                                          layer.table)

    def select(self, layer_idx, q, layer, seq_len, scale=None):
        cfg = self.config
        if layer_idx < cfg.dense_layers:
            return super().select(layer_idx, q, layer, seq_len)
        return kernels.spread_select(q, layer.k, layer.slot_state[STATS], layer.slot_page, layer.cur_slot, seq_len,
                                     cfg.spread_weight, cfg.token_budget // cfg.page_size, cfg.sink_pages,
                                     cfg.per_query_head, not layer.may_have_holes, layer.table)
