"""Quest: query-aware page selection (Tang et al., 2024).

Each page keeps the channel-wise min and max of its post-RoPE keys (maintained by the cache). At a decode step a
page's score is the upper bound ``sum_i max(q_i * max_i, q_i * min_i)`` of ``q . k`` over its tokens; the layer
attends to the top ``token_budget / page_size`` pages, the current page always among them. The first
``dense_layers`` layers attend densely, as in the paper. While a sequence's context fits in the budget every page
is selected, so decoding is dense until the context outgrows the budget.

GQA: by default pages are chosen per KV head with the max score over the query heads of its group, so each page
is read once; ``per_query_head=True`` chooses per query head, as the official evaluation (MHA models) does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import kernels
from .base import Method, MethodConfig, all_slots, attend_all, require


@dataclass(frozen=True, kw_only=True)
class QuestConfig(MethodConfig):
    """token_budget: KV tokens attended per (layer, KV head) and step, current page included; a positive multiple
    of page_size. dense_layers: leading layers that attend densely."""

    token_budget: int = 1024
    dense_layers: int = 2
    per_query_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.token_budget, int) and self.token_budget >= self.page_size
                and self.token_budget % self.page_size == 0,
                "token_budget", f"a positive multiple of page_size ({self.page_size})", self.token_budget)
        require(isinstance(self.dense_layers, int) and self.dense_layers >= 0,
                "dense_layers", "an integer >= 0", self.dense_layers)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Bytes of selection metadata a decode step reads per page and KV head: the page's min and max."""
        return 2 * head_dim * itemsize

    def check_model(self, num_layers: int) -> None:
        require(self.dense_layers <= num_layers, "dense_layers",
                f"at most the model's {num_layers} layers", self.dense_layers)

    def method_class(self):
        return Quest


class Quest(Method):
    config: QuestConfig
    prefix_reuse = answer_reuse = shared_pages = True

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """The bounds this method ranks pages by, (B, Hs, C + 1), -inf for free slots (see ``kernels.page_scores``);
        for ``sparsekv.eval.selection``."""
        return kernels.page_scores(q, layer.kmin, layer.kmax, layer.slot_page, self.config.per_query_head,
                                   layer.table)

    def select(self, layer_idx, q, layer, seq_len):
        if layer_idx < self.config.dense_layers:
            return all_slots(layer)
        return kernels.quest_select(q, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot,
                                    self.config.token_budget // self.config.page_size, self.config.per_query_head,
                                    in_order=not layer.may_have_holes, table=layer.table)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        if layer_idx < self.config.dense_layers:
            return attend_all(q, layer, seq_len, scale)
        return super().decode(layer_idx, q, layer, seq_len, scale, tally)
