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

import torch

from .. import kernels
from ..kernels import reference
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


@dataclass(frozen=True, kw_only=True)
class RerankedConfig(QuestConfig):
    """Quest's fields with the same meaning, for Quest's choice ranked by another page estimate; sink_pages: the
    first pages, always attended (>= 0, leaving the current page room in the budget)."""

    sink_pages: int = 1

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.sink_pages, int) and not isinstance(self.sink_pages, bool) and self.sink_pages >= 0
                and (self.sink_pages + 1) * self.page_size <= self.token_budget, "sink_pages",
                f"an int >= 0 leaving the current page room in token_budget ({self.token_budget // self.page_size} "
                f"pages)", self.sink_pages)

    def check_width(self, name: str, width: int | None) -> None:
        """Refuses a ``width`` field (the values an estimate reads of every key: sparq's channels, lowrank's
        directions) that is neither None nor an int >= 1."""
        require(width is None or (isinstance(width, int) and not isinstance(width, bool) and width >= 1), name,
                "None (2 * head_dim / page_size) or an int >= 1", width)

    def values_per_key(self, width: int | None, head_dim: int) -> int:
        """The values a step reads of every key for a ``width`` field: at most head_dim; None: 2 * head_dim /
        page_size, so that a page costs Quest's metadata bytes (its min and max)."""
        return min(width or max(1, 2 * head_dim // self.page_size), head_dim)

    def key_values_bytes(self, width: int | None, head_dim: int, itemsize: int) -> int:
        """Metadata a step reads per page and KV head: ``values_per_key`` values of each of its keys."""
        return self.page_size * self.values_per_key(width, head_dim) * itemsize


class Reranked(Quest):
    """Quest's choice (the budget, the current page, ``dense_layers``, shared pages) ranked by ``estimate``, the
    first ``sink_pages`` pages always in: the attention sink at a sequence's start has keys unlike the rest, which
    an estimate of typical logits ranks low."""

    config: RerankedConfig

    def estimate(self, q, layer, seq_len, scale: float) -> torch.Tensor:
        """(B, Hs, C + 1) the pages' scores, -inf for free slots. q: (B, H, D); seq_len: (B,)."""
        raise NotImplementedError

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """(B, Hs, C + 1): ``estimate`` at the model's attention ``scale`` (None: head_dim ** -0.5), +inf for the
        sink pages."""
        scores = self.estimate(q, layer, seq_len, q.shape[-1] ** -0.5 if scale is None else scale)
        return reference.with_sinks(scores, layer.slot_page, self.config.sink_pages)

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


class Summarized(Reranked):
    """Quest's choice ranked by an estimate from what each page keeps of its keys beside their bounds:
    ``summary_rows`` vectors per page slot in the cache's dtype (landmark's mean keys of its runs, spread's mean and
    deviation), in ``layer.slot_state[summary_entry]`` (B, Hkv, C + 1, summary_rows, D) of each layer from
    ``dense_layers`` on. They are made from the keys of every page after the prompt (``prefill``), then at every
    decode step for the current page, whose tokens arrive one at a time (within the step's choice, ``select``; once
    the page is full they are final), so a pass of several tokens after the prompt is refused, leaving no page
    without them. Over pages that something else keeps (vLLM's blocks) they are per store page, kept with the page
    (``PagedLayer.over``'s ``page_state``), and read through the page table."""

    prefix_reuse = answer_reuse = True  # made from the prompt's keys at its end (``prefill``)
    accepts_chunks = False  # a multi-token pass after the prompt would complete pages without them
    # A pool's rows keep their own pages: the summaries are per row and slot, which shared pages would need per
    # store page, as their bounds are.
    shared_pages = False

    @property
    def summary_entry(self) -> str:
        """The ``slot_state`` entry of the summaries."""
        raise NotImplementedError

    @property
    def summary_rows(self) -> int:
        """Vectors per page."""
        raise NotImplementedError

    def summarize(self, k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, C, summary_rows, D) in float32 (float64 for float64 keys) from the keys k (B, Hkv, C, P, D)
        stored (``reference.stored_tokens``)."""
        raise NotImplementedError

    def prefill(self, layer_idx, q, layer, plan, scale):
        if layer_idx >= self.config.dense_layers:
            kept = self.summarize(layer.k, layer.slot_page, plan.seq_len)
            layer.slot_state[self.summary_entry] = reference.to_cache(kept, layer.k.dtype)

    def slot_state_bytes(self, head_dim, itemsize):
        cfg = self.config
        return [8 if i < cfg.dense_layers else self.summary_rows * head_dim * itemsize
                for i in range(self.num_layers)]

    def start_pool(self, layers, max_context):
        # Every row's summaries, allocated with the pool (and counted in its size), not at the first join.
        for layer in layers[self.config.dense_layers:]:
            layer.slot_state[self.summary_entry] = torch.zeros(
                (*layer.slot_page.shape, self.summary_rows, layer.k.shape[-1]), dtype=layer.k.dtype,
                device=layer.k.device)
