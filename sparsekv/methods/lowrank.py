"""Quest's page choice ranked by the attention mass that a low-rank sketch of the keys estimates (Loki: Singhania
et al., 2024, "Loki: Low-rank Keys for Efficient Sparse Attention", at page granularity).

Keys of a head lie near a subspace of few dimensions; Loki scores tokens by ``q . k`` in the ``rank`` principal
directions of the keys, where most of their variance is, and attends the top ones. Here each row's directions come
from its own stored keys (the top eigenvectors of their second moment, so no calibration data), each token's logit
is ``(q B) . (k B)`` and pages are ranked by the softmax mass of those logits over their tokens
(``kernels.reference.lowrank_scores``). A step reads ``rank`` values of every key: with ``rank = 2 * head_dim /
page_size`` (the default) that is Quest's metadata bytes per page, as sparq's channels. The first ``sink_pages``
pages are always attended. Everything else is Quest's: the budget, the current page, ``dense_layers``,
``per_query_head``, shared pages.

This is the reference: it computes the directions and the estimate from the keys in PyTorch at every step, for
measuring accuracy (``sparsekv.eval``, ``sparsekv.eval.selection``); a fast path would keep each key's projection
(``rank`` values) as the cache fills.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import reference
from .quest import Reranked, RerankedConfig


@dataclass(frozen=True, kw_only=True)
class LowRankConfig(RerankedConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) and sink_pages (``RerankedConfig``);
    rank: the principal directions of the keys each step scores in (None: 2 * head_dim / page_size, Quest's
    bytes; ``kernels.reference.lowrank_scores``)."""

    rank: int | None = None

    def __post_init__(self):
        super().__post_init__()
        self.check_width("rank", self.rank)

    def rank_for(self, head_dim: int) -> int:
        return self.values_per_key(self.rank, head_dim)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head a step reads ``rank`` values of each of its keys."""
        return self.key_values_bytes(self.rank, head_dim, itemsize)

    def method_class(self):
        return LowRank


class LowRank(Reranked):
    config: LowRankConfig

    def estimate(self, q, layer, seq_len, scale):
        """Each page's attention mass estimated in the principal directions of the row's keys."""
        cfg = self.config
        return reference.lowrank_scores(q, layer.k, layer.slot_page, seq_len, cfg.rank_for(q.shape[-1]), scale,
                                        cfg.per_query_head, layer.table)
