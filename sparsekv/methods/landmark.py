"""Quest's page choice ranked by the attention mass that each page's landmarks estimate: the mean keys of runs of
its tokens (as ShadowKV's landmarks, one per chunk of keys, at page granularity).

A page's ``landmarks`` runs of ``page_size / landmarks`` tokens each keep their stored keys' mean; a step takes
every token's logit as its run's ``q . mean`` and ranks pages by the log of the softmax mass of those logits
(``kernels.landmark_page_scores``). The first ``sink_pages`` pages are always attended (the attention sink).
Everything else is Quest's: the budget, the current page, ``dense_layers``, ``per_query_head``.

The means are kept per page slot in the cache (``quest.Summarized``), (B, Hkv, C + 1, landmarks, D) in the cache's
dtype: two landmarks are Quest's metadata bytes (two vectors per page and KV head, like its min and max), which is
all a step reads to score a page; the current page's are written within ``kernels.landmark_select``, the step's
choice in one op. ``kernels.reference.landmark_scores`` computes the same scores from every key (the means
unrounded), for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import kernels
from ..kernels import reference
from .base import require
from .quest import RerankedConfig, Summarized


def means_entry(landmarks: int) -> str:
    """The ``slot_state`` entry that holds a layer's means of ``landmarks`` runs per page (one per count, so that
    methods of different counts can score one cache side by side, as ``sparsekv.eval.selection`` does)."""
    return f"landmarks_{landmarks}"


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


class Landmark(Summarized):
    """Its state is the cache's: the means, ``layer.slot_state[means_entry(landmarks)]`` in each layer from
    ``dense_layers`` on (``Summarized``)."""

    config: LandmarkConfig

    @property
    def summary_entry(self):
        return means_entry(self.config.landmarks)

    @property
    def summary_rows(self):
        return self.config.landmarks

    def summarize(self, k, slot_page, seq_len):
        return reference.page_landmarks(k, slot_page, seq_len, self.config.landmarks)

    def estimate(self, q, layer, seq_len, scale):
        """Each page's estimated attention mass (its log), after the current page's landmarks (the step's choice,
        ``select``, does both in one op)."""
        cfg = self.config
        means = layer.slot_state[self.summary_entry]
        kernels.landmark_means(layer.k, means, layer.slot_page, layer.cur_slot, seq_len, layer.table)
        return kernels.landmark_page_scores(q, means, layer.slot_page, seq_len, cfg.page_size, scale,
                                            cfg.per_query_head, layer.table)

    def select(self, layer_idx, q, layer, seq_len, scale=None):
        cfg = self.config
        if layer_idx < cfg.dense_layers:
            return super().select(layer_idx, q, layer, seq_len)
        return kernels.landmark_select(q, layer.k, layer.slot_state[self.summary_entry], layer.slot_page,
                                       layer.cur_slot, seq_len, q.shape[-1] ** -0.5 if scale is None else scale,
                                       cfg.token_budget // cfg.page_size, cfg.sink_pages, cfg.per_query_head,
                                       not layer.may_have_holes, layer.table)
