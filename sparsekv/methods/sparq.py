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

from .. import kernels
from ..kernels import reference
from .base import require
from .quest import Quest, QuestConfig


@dataclass(frozen=True, kw_only=True)
class SparQConfig(QuestConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) with the same meaning; channels: the
    query channels each step reads of every key (None: 2 * head_dim / page_size, Quest's bytes); sink_pages: the
    first pages, always attended (>= 0, leaving the current page room in the budget); by_keys: the channels where
    the row's keys are largest instead of the query's (``kernels.reference.channel_scores``)."""

    channels: int | None = None
    sink_pages: int = 1
    by_keys: bool = False

    def __post_init__(self):
        super().__post_init__()
        require(self.channels is None or (isinstance(self.channels, int) and not isinstance(self.channels, bool)
                                          and self.channels >= 1), "channels",
                "None (2 * head_dim / page_size) or an int >= 1", self.channels)
        require(isinstance(self.by_keys, bool), "by_keys", "true or false", self.by_keys)
        require(isinstance(self.sink_pages, int) and not isinstance(self.sink_pages, bool) and self.sink_pages >= 0
                and (self.sink_pages + 1) * self.page_size <= self.token_budget, "sink_pages",
                f"an int >= 0 leaving the current page room in token_budget ({self.token_budget // self.page_size} "
                f"pages)", self.sink_pages)

    def channels_for(self, head_dim: int) -> int:
        return self.channels or max(1, 2 * head_dim // self.page_size)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head a step reads ``channels`` values of each of its keys."""
        return self.page_size * min(self.channels_for(head_dim), head_dim) * itemsize

    def method_class(self):
        return SparQ


class SparQ(Quest):
    config: SparQConfig

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """(B, Hs, C + 1): each page's estimated attention mass at the model's attention ``scale`` (None:
        head_dim ** -0.5), +inf for the sink pages, -inf for free slots."""
        cfg = self.config
        scores = reference.channel_scores(q, layer.k, layer.slot_page, seq_len, cfg.channels_for(q.shape[-1]),
                                          q.shape[-1] ** -0.5 if scale is None else scale, cfg.per_query_head,
                                          layer.table, cfg.by_keys)
        sinks = (layer.slot_page >= 0) & (layer.slot_page < cfg.sink_pages)
        return scores.masked_fill(sinks.repeat_interleave(scores.shape[1] // sinks.shape[1], dim=1), float("inf"))

    def select(self, layer_idx, q, layer, seq_len, scale=None):
        if layer_idx < self.config.dense_layers:
            return super().select(layer_idx, q, layer, seq_len)
        return kernels.select_pages(self.page_scores(layer_idx, q, layer, seq_len, scale), layer.cur_slot,
                                    self.config.token_budget // self.config.page_size)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        if layer_idx < self.config.dense_layers:
            return super().decode(layer_idx, q, layer, seq_len, scale, tally)
        slots = self.select(layer_idx, q, layer, seq_len, scale)
        return layer.attend(q, slots, seq_len, scale, tally.rows(slots.shape[1]))
