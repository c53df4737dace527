"""Oracle selection: the pages (or tokens) that the step's true attention weighs most, at a given budget.

A reference for measuring selections, not a method to deploy (as kvpress's oracle presses): at every decode step
it computes the layer's dense softmax attention over every stored token (float32, plain PyTorch ops), then attends
only the top ``token_budget / page_size`` pages by attention mass (current page always among them), or with
``granularity="token"`` the top ``token_budget`` tokens (current token always among them). Its accuracy is the
best any selection of that budget, page size and dense layers can reach, so every estimate (Quest's bound, ...)
is measured against it. Each step costs a dense attention plus the sparse one: it runs wherever the PyTorch ops
run (CPU, CUDA, a captured CUDA graph), only slower than dense.

GQA: per KV head, a page's mass is summed over the query heads of its group (their mean attention, times the
group size); ``per_query_head=True`` chooses per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels.reference import acc_dtype, mask_free, per_row
from .base import Method, attend_all, require
from .quest import QuestConfig

GRANULARITIES = ("page", "token")


@dataclass(frozen=True, kw_only=True)
class OracleConfig(QuestConfig):
    """Quest's fields (token_budget, page_size, dense_layers, per_query_head) with the same meaning; granularity:
    "page" (top pages by attention mass) or "token" (top tokens by attention weight, token_budget of them)."""

    granularity: str = "page"

    def __post_init__(self):
        super().__post_init__()
        require(self.granularity in GRANULARITIES, "granularity", f"one of {', '.join(GRANULARITIES)}",
                self.granularity)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Per page and KV head a step reads every key of the page (the dense attention it ranks by)."""
        return self.page_size * head_dim * itemsize

    def method_class(self):
        return Oracle


def true_attention(q: torch.Tensor, layer, seq_len: torch.Tensor, scale: float) -> torch.Tensor:
    """The dense softmax attention of one decode step over every slot of a layer. q: (B, H, D). Returns
    (B, H, C + 1, P) float32 (float64 for float64 inputs), zero for free slots and positions >= seq_len."""
    keys = per_row(layer.k, layer.table)
    b, hkv, c, p, d = keys.shape
    h = q.shape[1]
    acc = acc_dtype(q.dtype)
    logits = torch.einsum("bngd,bncpd->bngcp", q.to(acc).view(b, hkv, h // hkv, d), keys.to(acc)) * scale
    pos = layer.token_position()  # (B, Hkv, C + 1, P)
    valid = (pos >= 0) & (pos < seq_len.view(b, 1, 1, 1))
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    weights = torch.softmax(logits.flatten(3), dim=-1).nan_to_num(0.0)
    return weights.view(b, h, c, p)


def group_rows(x: torch.Tensor, kv_heads: int, per_query_head: bool) -> torch.Tensor:
    """(B, H, ...) per query head -> selection rows: (B, H, ...) as is, or (B, Hkv, ...) summed over each group."""
    if per_query_head:
        return x
    b, h = x.shape[:2]
    return x.view(b, kv_heads, h // kv_heads, *x.shape[2:]).sum(2)


class Oracle(Method):
    config: OracleConfig
    prefix_reuse = answer_reuse = True

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """The true attention mass of each slot, (B, Hs, C + 1) float32, -inf for free slots (what this method
        ranks; ``sparsekv.eval.selection`` compares the other methods' estimates with it)."""
        mass = group_rows(true_attention(q, layer, seq_len, scale).sum(-1), layer.k.shape[1],
                          self.config.per_query_head)
        return mask_free(mass, layer.slot_page)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        cfg = self.config
        if layer_idx < cfg.dense_layers:
            return attend_all(q, layer, seq_len, scale)
        if cfg.granularity == "page":
            slots = kernels.select_pages(self.page_scores(layer_idx, q, layer, seq_len, scale), layer.cur_slot,
                                         cfg.token_budget // cfg.page_size)
            return layer.attend(q, slots, seq_len, scale, tally.rows(slots.shape[1]))
        b, hkv, c, p, d = layer.k.shape
        weights = group_rows(true_attention(q, layer, seq_len, scale).flatten(2, 3), hkv, cfg.per_query_head)
        pos = layer.token_position().flatten(2)  # (B, Hkv, N)
        rows = weights.shape[1] // hkv
        pos = pos.repeat_interleave(rows, dim=1)
        current = pos == (seq_len - 1).view(b, 1, 1)
        scores = torch.where((pos >= 0) & (pos < seq_len.view(b, 1, 1)), weights, float("-inf"))
        scores = scores.masked_fill(current, float("inf"))
        top, tokens = scores.topk(min(cfg.token_budget, scores.shape[2]), dim=2)
        tokens = torch.where(top > float("-inf"), tokens, -1)
        tally.rows(tokens.shape[1]).add_((tokens >= 0).sum(-1))
        out, _ = kernels.sparse_decode_tokens(q, layer.k.flatten(2, 3), layer.v.flatten(2, 3), tokens, scale)
        return out.to(q.dtype)

