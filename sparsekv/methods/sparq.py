"""Quest's page choice ranked by the attention mass that the query's largest channels estimate (SparQ: Ribar et
al., 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference", at page granularity).

Quest's bound adds every channel's worst case; SparQ instead estimates each token's logit from the few channels
where the query is largest, ``q_r . k_r``, rescaled by the share of |q| they keep, and ranks pages by the softmax
mass of those logits over their tokens (``kernels.reference.channel_scores``). A step reads ``channels`` values of
every key: with ``channels = 2 * head_dim / page_size`` (the default) that is Quest's metadata bytes per page (its
min and max vectors), so the two compare at equal reads. The first ``sink_pages`` pages are always attended (the
attention sink). Everything else is Quest's: the budget, the current page, ``dense_layers``, ``per_query_head``,
shared pages. ``by_keys`` takes the channels where the row's keys are largest, whatever the query: channels fixed
step after step, which a store of those channels of every key (contiguous, unlike a few channels of each key in
token-major pages) could serve.

This is the reference: it computes the estimate from the keys in PyTorch at every step, for measuring accuracy
(``sparsekv.eval``, ``sparsekv.eval.selection``); a fast path would read the chosen channels of each page's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import reference
from .base import require
from .quest import Reranked, RerankedConfig


@dataclass(frozen=True, kw_only=True)
class SparQConfig(RerankedConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) and sink_pages (``RerankedConfig``);
    channels: the query channels each step reads of every key (None: 2 * head_dim / page_size, Quest's bytes);
    by_keys: the channels where the row's keys are largest instead of the query's
    (``kernels.reference.channel_scores``)."""

    channels: int | None = None
    by_keys: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check_width("channels", self.channels)
        require(isinstance(self.by_keys, bool), "by_keys", "true or false", self.by_keys)

    def channels_for(self, head_dim: int) -> int:
        return self.values_per_key(self.channels, head_dim)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head a step reads ``channels`` values of each of its keys."""
        return self.key_values_bytes(self.channels, head_dim, itemsize)

    def method_class(self):
        return SparQ


class SparQ(Reranked):
    config: SparQConfig

    def estimate(self, q, layer, seq_len, scale):
        """Each page's attention mass estimated from the query's largest channels."""
        cfg = self.config
        return reference.channel_scores(q, layer.k, layer.slot_page, seq_len, cfg.channels_for(q.shape[-1]), scale,
                                        cfg.per_query_head, layer.table, cfg.by_keys)
