"""Quest's page choice ranked by the attention mass that each page's landmarks estimate: the mean keys of runs of
its tokens (as ShadowKV's landmarks, one per chunk of keys, at page granularity).

A page's ``landmarks`` runs of ``page_size / landmarks`` tokens each keep their keys' mean; a step takes every
token's logit as its run's ``q . mean`` and ranks pages by the softmax mass of those logits
(``kernels.reference.landmark_scores``). Two landmarks are Quest's metadata bytes (two vectors per page and KV head,
like its min and max), kept contiguous as a page fills. The first ``sink_pages`` pages are always attended (the
attention sink). Everything else is Quest's: the budget, the current page, ``dense_layers``, ``per_query_head``,
shared pages.

This is the reference: it computes the means from the keys at every step, for measuring accuracy
(``sparsekv.eval``, ``sparsekv.eval.selection``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import reference
from .base import require
from .quest import Reranked, RerankedConfig


@dataclass(frozen=True, kw_only=True)
class LandmarkConfig(RerankedConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) and sink_pages (``RerankedConfig``);
    landmarks: mean keys per page, a divisor of page_size (2: Quest's bytes)."""

    landmarks: int = 2

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.landmarks, int) and not isinstance(self.landmarks, bool) and self.landmarks >= 1
                and self.page_size % self.landmarks == 0, "landmarks",
                f"a divisor of page_size ({self.page_size})", self.landmarks)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head a step reads its landmarks."""
        return self.landmarks * head_dim * itemsize

    def method_class(self):
        return Landmark


class Landmark(Reranked):
    config: LandmarkConfig

    def estimate(self, q, layer, seq_len, scale):
        """Each page's attention mass estimated from its landmarks."""
        cfg = self.config
        return reference.landmark_scores(q, layer.k, layer.slot_page, seq_len, cfg.landmarks, scale,
                                         cfg.per_query_head, layer.table)
