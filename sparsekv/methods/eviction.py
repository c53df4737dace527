"""What the token-eviction baselines (StreamingLLM, H2O, TOVA, SnapKV) share.

They run the paged cache with one token per page (``page_size`` 1): a slot is a token, and dropping a token frees
its slot for the next one. Each method scores the tokens a row holds; the row keeps the highest scored and the
rest are gone for good. A method file only says how it scores (``prompt_score`` after the prompt; after each decode
step ``step_eviction`` with ``step_args``); the keeping, the memory bookkeeping and the attention are here.

Budget: in a layer that evicts every decode step, a (layer, KV head) attends exactly ``token_budget`` tokens, the
current one included (all of them while the context is shorter), and then drops to ``token_budget - 1`` so that
the next token fits. That equals the papers' "cache of size k, the new token attends cache + itself, then evict"
with k = ``token_budget - 1``. The layer's slots are capped at ``token_budget``, so memory stops growing there;
a long prompt is stored whole, compressed right after its attention, and the layer is compacted to what it holds.

The first ``dense_layers`` layers attend and keep everything. Attention at decode is ``kernels.sparse_decode`` over
every held slot, or ``kernels.attend_with_weights`` (same op, plus its weights) for methods that score by attention.
A step's eviction after it (the method's scores, then ``evict_lowest``) is one function of tensors per method
(``step_eviction``), which torch.compile makes one to three kernels on CUDA, where its torch ops are a dozen
launches a layer, more than StreamingLLM's attention costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import kernels
from ..cache import AppendPlan, PagedLayer, free_slots
from .base import Method, MethodConfig, all_slots, attend_all, most_tokens, require


@dataclass(frozen=True, kw_only=True)
class EvictionConfig(MethodConfig):
    """token_budget: KV tokens per (layer, KV head), see the subclass. dense_layers: leading layers that keep and
    attend every token. page_size: must be 1 (tokens are evicted one by one)."""

    token_budget: int = 1024
    dense_layers: int = 0
    page_size: int = 1

    def __post_init__(self):
        super().__post_init__()
        require(self.page_size == 1, "page_size", f"1 ({self.name} keeps and evicts single tokens)", self.page_size)
        low = self.min_budget()
        require(isinstance(self.token_budget, int) and self.token_budget >= low,
                "token_budget", f"an integer >= {low}", self.token_budget)
        require(isinstance(self.dense_layers, int) and self.dense_layers >= 0,
                "dense_layers", "an integer >= 0", self.dense_layers)

    def min_budget(self) -> int:
        return 1

    def check_model(self, num_layers: int) -> None:
        require(self.dense_layers <= num_layers, "dense_layers",
                f"at most the model's {num_layers} layers", self.dense_layers)


class EvictionMethod(Method):
    """Token eviction over the paged cache. Subclasses set ``evicts_in_decode`` and ``needs_weights`` and define
    the scores; a higher score keeps a token (free slots are never kept, whatever their score)."""

    config: EvictionConfig
    evicts_in_decode = True  # False: the prompt is compressed once, then every decode token is kept (SnapKV)
    needs_weights = True  # the keep-score after a decode step reads the step's attention weights (methods that evict)

    def prompt_score(self, layer_idx: int, q: torch.Tensor, layer: PagedLayer, plan: AppendPlan,
                     scale: float) -> torch.Tensor:
        """Keep-score (B, Hkv, C + 1) of the prompt's tokens; slot ``j`` holds position ``j`` here."""
        raise NotImplementedError

    # ``kernels.fused(f)`` of the method's own f(slot_page, slot_ids, counted, keep, *step_args), its keep-score after
    # a decode step then ``evict_lowest``; None for a method that does not evict in decode. A function per method:
    # torch.compile counts its recompilations per function, and fails past its limit under fullgraph.
    step_eviction: Callable | None = None

    def step_args(self, layer_idx: int, layer: PagedLayer, weights: torch.Tensor | None,
                  seq_len: torch.Tensor) -> tuple:
        """The arguments after ``slot_page`` of the method's keep-score after a decode step. weights: (B, H, C + 1)
        of that step, or None."""
        raise NotImplementedError

    def dense(self, layer_idx: int) -> bool:
        return layer_idx < self.config.dense_layers

    def prefill(self, layer_idx, q, layer, plan, scale):
        if self.dense(layer_idx):
            return
        budget = self.config.token_budget
        keep = budget - 1 if self.evicts_in_decode else budget
        keep_top(layer, self.prompt_score(layer_idx, q, layer, plan, scale), keep)
        held = [min(n, keep) for n in plan.new_len]
        layer.dropped = [n - h for n, h in zip(plan.new_len, held)]
        if self.evicts_in_decode:
            layer.max_pages = budget
        if max(held) + 1 < layer.capacity:
            layer.compact(max(held) + 1)  # room for the next token without growing again

    def pool_pages(self, max_context, max_new_tokens, max_prompt_tokens):
        # A row holds its budget where every step evicts; else (SnapKV) the compressed prompt, at most the budget,
        # and every decode token.
        budget = self.config.token_budget
        full = most_tokens(max_context, max_new_tokens, max_prompt_tokens)
        sparse = budget if self.evicts_in_decode else min(budget + max_new_tokens, full)
        return [full if self.dense(i) else sparse for i in range(self.num_layers)]

    def start_pool(self, layers, max_context):
        for i, layer in enumerate(layers):
            if not self.dense(i):
                if self.evicts_in_decode:
                    layer.max_pages = self.config.token_budget
                else:
                    layer.has_holes = True  # a row's prompt is compressed before it joins

    def held_tokens(self, prompt_len, total):
        budget = self.config.token_budget
        sparse = min(total, budget) if self.evicts_in_decode else min(prompt_len, budget) + total - prompt_len
        return sum(total if self.dense(i) else sparse for i in range(self.num_layers))

    def select(self, layer_idx, q, layer, seq_len):
        return all_slots(layer)  # dense layers only: the others run decode below

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        if self.dense(layer_idx):
            return attend_all(q, layer, seq_len, scale)
        slots = all_slots(layer)
        rows = tally.rows(slots.shape[1])
        if not self.needs_weights:
            out = layer.attend(q, slots, seq_len, scale, rows)
            weights, counted = None, None
        else:
            out, weights = kernels.attend_with_weights(q.unsqueeze(2), layer.k, layer.v, layer.slot_page, slots,
                                                       (seq_len - 1).unsqueeze(1), scale)
            out, weights, counted = out.squeeze(2), weights.squeeze(2), rows
        if self.evicts_in_decode:
            self.step_eviction(layer.slot_page, layer.slot_ids, counted, self.config.token_budget - 1,
                               *self.step_args(layer_idx, layer, weights, seq_len))
            layer.has_holes = True
        return out


def keep_top(layer: PagedLayer, score: torch.Tensor, keep: int) -> None:
    """Frees every held slot of each (sequence, KV head) row except the ``keep`` with the highest ``score``
    (B, Hkv, C + 1). Rows holding ``keep`` or fewer tokens are left as they are. Ties (SnapKV's max pooling makes
    many) go to the lower slot, after a prompt the earlier position, so a sequence keeps the same tokens alone or
    in a batch."""
    held = layer.slot_page >= 0
    if keep >= held.shape[2]:
        return
    order = score.masked_fill(~held, float("-inf")).sort(dim=2, descending=True, stable=True).indices
    top = order[:, :, :keep]
    layer.free(all_slots(layer), held.scatter(2, top, False))


def drop_lowest(slot_page: torch.Tensor, slot_ids: torch.Tensor, score: torch.Tensor, keep: int) -> None:
    """``keep_top`` where each row holds at most ``keep`` + 1 tokens, as after a decode step (one token appended
    since the last eviction): frees, in ``slot_page`` (B, Hkv, C + 1) in place, the lowest scored held slot of each
    (sequence, KV head) row holding more than ``keep`` (ties: the higher slot, the one ``keep_top`` drops). Two
    reductions in place of a sort of every slot. slot_ids: (C + 1,) 0, 1, ..., C; score: (B, Hkv, C + 1)."""
    held = slot_page >= 0
    masked = score.masked_fill(~held, float("inf"))
    lowest = held & (masked == masked.amin(dim=2, keepdim=True))
    victim = torch.where(lowest, slot_ids, -1).amax(dim=2, keepdim=True)
    free_slots(slot_page, victim, held.sum(dim=2, keepdim=True) > keep)


def evict_lowest(slot_page: torch.Tensor, slot_ids: torch.Tensor, counted: torch.Tensor | None,
                 score: torch.Tensor, keep: int) -> None:
    """A decode step's eviction: adds each row's held tokens (those the step attended) into ``counted`` (B, Hkv)
    int64 if it is not None, then ``drop_lowest`` by ``score`` (B, Hkv, C + 1), in place."""
    if counted is not None:
        counted.add_((slot_page >= 0).sum(dim=2))
    drop_lowest(slot_page, slot_ids, score, keep)


def per_kv_head(weights: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sums attention weights (B, H, N) over each KV head's group of query heads: (B, Hkv, N)."""
    b, h, n = weights.shape
    return weights.view(b, kv_heads, h // kv_heads, n).sum(2)


def prompt_attention(q: torch.Tensor, layer: PagedLayer, plan: AppendPlan, scale: float,
                     last: int | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights over the stored tokens, summed over each row's last ``last`` real queries of a prompt
    pass (all of them when None), causal as in the prompt's own attention.

    q: (B, H, S, D) the pass's queries (padding anywhere; a chunked prompt's pass sees the tokens of the chunks
    before it too); lse: None, or (B, H, S) the pass's log-sum-exps from its attention (``Method.prefill_chunk``),
    which spare the kernel its first pass. Returns (B, H, C + 1) per query head, indexed by slot
    (``kernels.attention_mass``).
    """
    b, h, s, d = q.shape
    n = s if last is None else min(last, s)
    cols = torch.arange(s, device=q.device)
    # Column of each row's r-th real token of the pass: real tokens sorted by position come first.
    order = torch.where(plan.valid, plan.position, s + cols).argsort(dim=1)
    counts = plan.valid.sum(dim=1, keepdim=True)
    rank = counts - n + torch.arange(n, device=q.device)  # (B, n) ranks of the queries taken, < 0: none
    col = order.gather(1, rank.clamp(min=0))
    q_taken = q.gather(2, col.view(b, 1, n, 1).expand(b, h, n, d))
    q_pos = torch.where(rank >= 0, plan.prev_seq_len.unsqueeze(1) + rank, -1)
    lse_taken = None if lse is None else lse.gather(2, col.view(b, 1, n).expand(b, h, n))
    return kernels.attention_mass(q_taken, layer.k, layer.slot_page, all_slots(layer), q_pos, scale,
                                  not layer.may_have_holes, lse_taken)
