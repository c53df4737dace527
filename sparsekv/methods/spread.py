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

from ..kernels import reference
from .base import is_real, require
from .quest import Reranked, RerankedConfig


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

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head the reference reads every key of the page."""
        return self.page_size * head_dim * itemsize

    def method_class(self):
        return Spread


class Spread(Reranked):
    config: SpreadConfig

    def estimate(self, q, layer, seq_len, scale):
        """Each page's mean-and-spread score (``kernels.reference.spread_scores``)."""
        cfg = self.config
        return reference.spread_scores(q, layer.k, layer.slot_page, seq_len, cfg.spread_weight, cfg.per_query_head,
                                       layer.table)
