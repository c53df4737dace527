"""RaaS: reasoning-aware attention sparsity (Hu et al., 2025, "Efficient Long-Decoding Inference with
Reasoning-Aware Attention Sparsity").

Long reasoning chains create *milestone* tokens: attended for a while, then never again. RaaS keeps a page only as
long as it is used. Every decode page of a (layer, sequence, KV head) carries a timestamp, the decode step it was
last refreshed at. At each step every page's attention is estimated with Quest's bound (the cache's per-page key
min/max) and the decode pages that score high are refreshed: those in the ``top_fraction`` of the step's pages
(prompt pages included in the ranking), or those whose estimated attention probability (softmax of the scaled
bounds over the row's pages) reaches ``alpha``. The page being written is refreshed every step. When the next
token needs a new page and the row already holds its budget, the decode page with the oldest timestamp is evicted
(ties: the older page) and its slot takes the new page, so the memory of the cache stops growing once the budget is
reached. Prompt (prefill) pages are never evicted: they hold the *phoenix* tokens that reasoning returns to late.

``prefill="keep"`` attends to every cached page (the cache is the budget). ``prefill="quest"`` is the hybrid for
long prompts: prompt pages are kept but only the best ones by Quest score are attended, within ``prefill_share`` of
the budget (and whatever share the decode pages do not use yet); decode pages follow RaaS within the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .base import Method, MethodConfig, is_real, require

PREFILL_MODES = ("keep", "quest")


@dataclass(frozen=True, kw_only=True)
class RaaSConfig(MethodConfig):
    """token_budget: KV tokens kept per (layer, KV head), a positive multiple of page_size; prompt pages beyond it
    are kept as well (``keep``: the cache holds the prompt plus one decode page at least).
    top_fraction / alpha: the refresh rule, exactly one of them set: refresh the pages whose estimated score is in
    the top ``top_fraction`` (0, 1] of the step's cached pages, or whose estimated attention probability is at least
    ``alpha`` (0, 1) (set ``top_fraction=None`` to use ``alpha``).
    prefill: "keep" (attend every cached page) or "quest" (attend the top prompt pages within ``prefill_share`` of
    the budget; decode pages get the rest)."""

    token_budget: int = 1024
    top_fraction: float | None = 0.5
    alpha: float | None = None
    prefill: str = "keep"
    prefill_share: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.token_budget, int) and not isinstance(self.token_budget, bool)
                and self.token_budget >= self.page_size and self.token_budget % self.page_size == 0,
                "token_budget", f"a positive multiple of page_size ({self.page_size})", self.token_budget)
        require((self.top_fraction is None) != (self.alpha is None), "top_fraction / alpha",
                "exactly one of the two set (top_fraction=None to use alpha)", (self.top_fraction, self.alpha))
        if self.top_fraction is not None:
            require(is_real(self.top_fraction) and 0 < self.top_fraction <= 1, "top_fraction", "in (0, 1]",
                    self.top_fraction)
        if self.alpha is not None:
            require(is_real(self.alpha) and 0 < self.alpha < 1, "alpha", "in (0, 1)", self.alpha)
        require(self.prefill in PREFILL_MODES, "prefill", f"one of {', '.join(PREFILL_MODES)}", self.prefill)
        require(is_real(self.prefill_share) and 0 < self.prefill_share < 1, "prefill_share", "in (0, 1)",
                self.prefill_share)
        if self.prefill == "quest":
            require(1 <= self.prefill_pages < self.budget_pages, "token_budget",
                    f"large enough that prefill_share ({self.prefill_share}) of it leaves at least one page "
                    f"({self.page_size} tokens) for the prompt and one for decoding", self.token_budget)

    @property
    def budget_pages(self) -> int:
        return self.token_budget // self.page_size

    @property
    def prefill_pages(self) -> int:
        """Pages of the budget reserved for prompt pages under ``prefill="quest"``."""
        return int(self.prefill_share * self.budget_pages)

    def method_class(self):
        return RaaS


STAMP = "raas_stamp"


class RaaS(Method):
    """Per layer: ``layer.slot_state["raas_stamp"]`` (B, Hkv, C + 1) int64, the row's length at the decode step
    each slot's decode page was last refreshed at (the paper's timestamp: it orders a row's steps; it moves with the
    slots when the cache grows or reorders), and ``layer.max_pages``, the largest row limit. Per prompt:
    ``prompt_pages`` and ``limit`` (B,), the prompt's pages and the pages a row may hold; ``decode_pages``, the most
    decode pages a row holds. A pool also keeps each row's limit on the host (``row_limit``): a row's pages lie in
    its first ``limit`` slots (it never holds more, and a new page takes the lowest free slot), so a step over rows
    whose limits are small reads only the first slots of a pool sized for long prompts (``slots``, from
    ``step_slots``)."""

    config: RaaSConfig
    prefix_reuse = True  # its limits apply from the first decode step, which may evict (no answer_reuse)
    accepts_chunks = False

    def __init__(self, config: RaaSConfig, num_layers: int):
        super().__init__(config, num_layers)
        self.prompt_pages: torch.Tensor | None = None
        self.limit: torch.Tensor | None = None
        self.decode_pages = 0
        self.row_limit: list[int] | None = None
        self.pool_slots = 0
        self.slots: int | None = None

    def _limits(self, prompt_lengths: list[int]) -> tuple[list[int], list[int]]:
        """Each row's prompt pages and the pages it may hold."""
        cfg = self.config
        prompt = [-(-n // cfg.page_size) for n in prompt_lengths]
        if cfg.prefill == "keep":
            return prompt, [max(cfg.budget_pages, p + 1) for p in prompt]
        return prompt, [p + cfg.budget_pages - cfg.prefill_pages for p in prompt]

    def pool_pages(self, max_context, max_new_tokens, max_prompt_tokens):
        # A row never holds more than the limit of its prompt (``_limits``), which grows with the prompt: the
        # longest prompt's, not the whole context's.
        full = super().pool_pages(max_context, max_new_tokens, max_prompt_tokens)[0]
        return [min(full, self._limits([max_prompt_tokens])[1][0])] * self.num_layers

    def planned_tokens(self, prompt_lengths, total):
        # The rows never hold more than their limit: a long decode allocates the budget, not the whole decode.
        return min(total, max(self._limits(prompt_lengths)[1]) * self.config.page_size)

    def prefill(self, layer_idx, q, layer, plan, scale):
        prompt, limit = self._limits(plan.new_len)
        device = layer.k.device
        self.prompt_pages = torch.tensor(prompt, device=device)
        self.limit = torch.tensor(limit, device=device)
        self.decode_pages = max(n - p for p, n in zip(prompt, limit))
        layer.max_pages = max(limit)
        layer.slot_state[STAMP] = torch.zeros(layer.shape[:3], dtype=torch.long, device=device)

    def start_pool(self, layers, max_context):
        b, _, _, _ = layers[0].shape
        device = layers[0].k.device
        self.prompt_pages = torch.zeros(b, dtype=torch.long, device=device)
        self.limit = torch.zeros(b, dtype=torch.long, device=device)
        self.decode_pages = self.config.budget_pages  # at least any row's decode pages, in either prefill mode
        self.row_limit = [0] * b
        self.pool_slots = min(layer.capacity for layer in layers)
        for layer in layers:
            layer.max_pages = layer.capacity
            layer.slot_state[STAMP] = torch.zeros(layer.shape[:3], dtype=torch.long, device=device)

    def copy_row(self, row, source, source_row, prompt_len):
        # Stamps (the row's lengths) move with the slots and the row's length.
        self.prompt_pages[row] = source.prompt_pages[source_row]
        self.limit[row] = source.limit[source_row]
        self.row_limit[row] = self._limits([prompt_len])[1][0]

    def step_slots(self, n):
        # A power of two, so that few steps are made; slot ``slots`` is then free in every row, as the scratch slot.
        most = max(self.row_limit[:n], default=1)
        return min(1 << (most - 1).bit_length(), self.pool_slots)

    def rows(self, n, decode_tokens):
        view = super().rows(n, decode_tokens)
        view.prompt_pages, view.limit = self.prompt_pages[:n], self.limit[:n]
        view.slots = self.step_slots(n)
        return view

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        # The first c slots and one more, free in every row, that stands for the scratch slot (all of them outside a
        # pool): (B, Hkv, c + 1) views.
        c = layer.capacity if self.slots is None else self.slots
        stamp, slot_page = layer.slot_state[STAMP][:, :, :c + 1], layer.slot_page[:, :, :c + 1]
        kmin, kmax = layer.kmin[:, :, :c + 1], layer.kmax[:, :, :c + 1]
        if self.config.prefill == "keep":
            scores = kernels.page_scores(q, kmin, kmax, slot_page)
            b, h, _ = slot_page.shape
            slots = layer.slot_ids[:c + 1].expand(b, h, c + 1)
        else:
            # Decode pages are always attended; free slots (page -1, "below" the prompt) keep their -inf score.
            scores, slots = kernels.raas_select(q, kmin, kmax, slot_page, layer.cur_slot, self.prompt_pages,
                                                self.config.budget_pages)
        out = layer.attend(q, slots, seq_len, scale, tally.rows(slots.shape[1]))

        cfg = self.config
        # Stamps and the eviction in one op: in place, as a captured step reads and writes them at the same address.
        # The freed slots are found again by the next page's append: the layer evicts (``max_pages``), so the cache
        # searches for free slots.
        kernels.raas_update(scores, slot_page, layer.cur_slot, stamp, seq_len, self.limit,
                            self.prompt_pages, layer.page_size, c, self.decode_pages, cfg.top_fraction,
                            cfg.alpha, scale)
        return out

    def reorder(self, index):
        if self.prompt_pages is not None:
            self.prompt_pages = self.prompt_pages.index_select(0, index.to(self.prompt_pages.device))
            self.limit = self.limit.index_select(0, index.to(self.limit.device))

