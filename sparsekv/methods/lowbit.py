"""Quest's pages, chosen by the attention estimated from low-bit key codes instead of Quest's bound.

Quest scores a page by the upper bound ``q . centre + sum_i |q_i| halfwidth_i`` of ``q . k`` over its tokens.
Its width term adds every channel's worst case with the same sign, so on a page of varied keys (noise text, large
low-frequency RoPE channels) it dwarfs the true logits, and a page whose keys are alike (the needle) ranks low
however well it matches (``sparsekv.eval.selection`` shows the heads where this happens).

Here every key also keeps a ``bits``-bit code per channel on its page's min/max range (the min/max Quest stores:
a quantized key cache whose groups are the pages, as in KIVI's per-channel quantization). A step dequantizes the
keys of every page, ``min + code * (max - min) / (2^bits - 1)``, takes their estimated logits and scores the page
by its estimated share of the attention (the log-sum-exp of its tokens' logits less the head's total, summed over
the query heads of a KV head's group): the per-channel errors of a dequantized key are of both signs and mostly
cancel in ``q . k``, where the bound adds them all up. The top ``token_budget / page_size`` pages are attended in
full precision, the current page always among them; the first ``dense_layers`` layers attend densely.

Metadata read per step, per page and KV head: Quest's min and max (2 * D values in the cache's dtype) plus
``page_size * D * bits / 8`` bytes of codes (``metadata_bytes``); at 2 bits, 16 tokens per page and a 16-bit
cache that is twice Quest's (4 * D + 4 * D bytes), at 1 bit 1.5 times. The codes of a page are written when its
tokens arrive: all pages after the prompt, then the current page at every decode step (its range may still widen;
once the page is full its codes are final). A pass of several tokens after the prompt is refused, so that no page
is left without codes.

``reuse`` > 1 lets a choice serve several decode steps, as LServe's reusable page selector does: a row chooses its
pages at its first decode step and at every position that is a multiple of ``reuse``, and attends the pages it
chose in between (the current page among them: ``reuse`` divides the page size, so a new page always starts a new
choice). The scoring and selection kernels skip the rows that keep their choice, so a step costs a ``1 / reuse``
share of the estimate on average; the codes are still written at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import reference
from .base import Method, attend_all, require
from .quest import QuestConfig


def codes_entry(bits: int) -> str:
    """The ``slot_state`` entry that holds a layer's codes of ``bits`` bits (one per width, so that methods of
    different widths can score one cache side by side, as ``sparsekv.eval.selection`` does)."""
    return f"key_codes_{bits}"


@dataclass(frozen=True, kw_only=True)
class LowBitConfig(QuestConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) with the same meaning; bits: bits per
    key channel of the codes (1, 2 or 4); reuse: decode steps a choice of pages serves, a power of two dividing
    page_size (1: every step chooses, the default)."""

    bits: int = 2
    reuse: int = 1

    def __post_init__(self):
        super().__post_init__()
        require(self.bits in (1, 2, 4), "bits", "1, 2 or 4", self.bits)
        require(isinstance(self.reuse, int) and 1 <= self.reuse <= self.page_size
                and self.page_size % self.reuse == 0, "reuse",
                f"a power of two from 1 to page_size ({self.page_size})", self.reuse)

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of key codes per page and KV head."""
        return self.page_size * head_dim * self.bits // 8

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Bytes of selection metadata a step reads per page and KV head: the min/max and the codes, on a step that
        chooses; on average over steps, a ``1 / reuse`` share of that (rounded up)."""
        return -(-(2 * head_dim * itemsize + self.code_bytes(head_dim)) // self.reuse)

    def method_class(self):
        return LowBit


class LowBit(Method):
    """State beyond the cache: ``first`` (B,) int64, each row's first decode position, and with ``reuse`` > 1
    ``chosen``, per layer the pages each row attends, (B, Hs, min(budget pages, C + 1)) int64 slots (-1: none), kept
    from the step that chose them (``kernels.lowbit_select``). The method of a pool's first rows (``rows``) uses
    views of the pool's. With shared pages (``layer.table``: vLLM's blocks) the codes are per store page."""

    config: LowBitConfig
    prefix_reuse = answer_reuse = True  # the prompt's codes are made from its keys at its end (``prefill``)
    accepts_chunks = False  # a multi-token pass after the prompt would complete pages without codes
    row_moves = False  # a row that joins a pool chooses its pages anew (``copy_row``), before its reuse runs out

    def __init__(self, config: LowBitConfig, num_layers: int):
        super().__init__(config, num_layers)
        self.first: torch.Tensor | None = None
        self.chosen: list[torch.Tensor | None] = [None] * num_layers
        self.owner = self  # the method that holds ``chosen`` for all rows

    def prefill(self, layer_idx, q, layer, plan, scale):
        if layer_idx >= self.config.dense_layers:
            bits = self.config.bits
            reference.check_code_bits(bits, layer.k.shape[-1])
            layer.slot_state[codes_entry(bits)] = reference.key_codes(layer.k, layer.kmin, layer.kmax, bits)
        if layer_idx == 0:
            self.first = torch.tensor(plan.new_len, device=layer.k.device)
            self.chosen = [None] * self.num_layers

    def slot_state_bytes(self, head_dim, itemsize):
        cfg = self.config
        return [8 if i < cfg.dense_layers else cfg.code_bytes(head_dim) for i in range(self.num_layers)]

    def start_pool(self, layers, max_context):
        self.first = torch.zeros(layers[0].shape[0], dtype=torch.long, device=layers[0].k.device)
        # The codes of every row, allocated with the pool (and counted in its size), not at the first join.
        bits = self.config.bits
        for layer in layers[self.config.dense_layers:]:
            layer.slot_state[codes_entry(bits)] = torch.zeros((*layer.slot_page.shape, self.config.page_size,
                                                               layer.k.shape[-1] * bits // 8), dtype=torch.uint8,
                                                              device=layer.k.device)

    def copy_row(self, row, source, source_row, prompt_len):
        self.first[row] = source.first[source_row]
        # A row that joins chooses anew at its first step; one that moves within the pool keeps its choice, which
        # its steps until its next choice attend.
        if source.owner is self.owner:
            for chosen in self.owner.chosen:
                if chosen is not None:
                    chosen[row] = chosen[source_row]

    def rows(self, n, decode_tokens):
        view = super().rows(n, decode_tokens)
        view.first = self.first[:n]
        return view

    def reorder(self, index):
        if self.first is not None:
            self.first = self.first.index_select(0, index.to(self.first.device))
            self.chosen = [None if t is None else t.index_select(0, index.to(t.device)) for t in self.chosen]

    def _chosen(self, layer_idx: int, rows: int, slots: int) -> torch.Tensor:
        """This method's rows of the layer's chosen pages for ``rows`` selection rows per sequence and ``slots``
        page slots (scratch included), made at the layer's first step (eager, before a step is captured). A cache
        grown since (a new page: a step where its row chooses anew) keeps the other rows' choices, the new columns
        none."""
        owner = self.owner
        shape = (owner.first.shape[0], rows, min(self.config.token_budget // self.config.page_size, slots))
        old = owner.chosen[layer_idx]
        if old is None or old.shape != shape:
            new = torch.full(shape, -1, dtype=torch.long, device=owner.first.device)
            if old is not None and old.shape[:2] == shape[:2]:
                k = min(old.shape[2], shape[2])
                new[:, :, :k] = old[:, :, :k]
            owner.chosen[layer_idx] = old = new
        return old[:self.first.shape[0]]

    def _codes(self, layer) -> torch.Tensor:
        """The layer's codes, after coding the current page's keys on its current range."""
        codes = layer.slot_state[codes_entry(self.config.bits)]
        kernels.code_page(layer.k, layer.kmin, layer.kmax, codes, layer.cur_slot, self.config.bits, layer.table)
        return codes

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """Each page's estimated log share of the attention, (B, Hs, C + 1), -inf for free slots, after coding
        the current page's keys (``kernels.coded_scores``)."""
        return kernels.coded_scores(q, layer.kmin, layer.kmax, self._codes(layer), layer.slot_page, seq_len, scale,
                                    self.config.bits, self.config.per_query_head, layer.table)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        cfg = self.config
        if layer_idx < cfg.dense_layers:
            return attend_all(q, layer, seq_len, scale)
        _, hkv, c, _ = layer.shape
        rows = q.shape[1] if cfg.per_query_head else hkv
        if cfg.reuse > 1:
            chosen, first = self._chosen(layer_idx, rows, c), self.first
        else:  # every step chooses: nothing is kept between steps (so rows need no state of ours: vLLM's)
            chosen = torch.empty(q.shape[0], rows, min(cfg.token_budget // cfg.page_size, c), dtype=torch.long,
                                 device=q.device)
            first = seq_len
        kernels.lowbit_select(q, layer.k, layer.kmin, layer.kmax, layer.slot_state[codes_entry(cfg.bits)],
                              layer.slot_page, layer.cur_slot, seq_len, first, chosen, scale, cfg.bits,
                              cfg.token_budget // cfg.page_size, cfg.reuse, cfg.per_query_head, layer.table,
                              not layer.may_have_holes)
        return layer.attend(q, chosen, seq_len, scale, tally.rows(chosen.shape[1]))

