"""Attention recall: how much of the dense attention mass the tokens a method attends cover, per layer.

``RecallConfig(inner=config)`` builds the inner method wrapped in a probe. In every decode step of every layer the
probe lets the inner method decode unchanged while it observes (``kernels.observe``) the attention ops the method
calls (``kernels.sparse_decode``, ``kernels.attend_with_weights``): the slots each call attends, read with the page
table as it is at that call, are the tokens the method attends. It then computes, with the same query, the dense
softmax attention over the layer's whole key history and the share of it that falls on those tokens, averaged
over query heads. Ops over a packed token store that return their log-sum-exp (``kernels.sparse_decode_tokens``,
OmniKV's) contribute ``exp(lse - dense lse)``, their exact share of the dense mass.

"Dense" is the attention this layer's query would give to every token of the sequence so far, including tokens
an evicting method (H2O, TOVA, StreamingLLM, SnapKV, RaaS) has already dropped: the probe keeps a shadow copy of
every key it has seen in the layer, so evicted tokens count as missed mass. The query is the method's own, so the
number isolates the selection of this step from the drift of hidden states across earlier sparse steps. Keys are
copied before the method's prefill hook, so a prompt compressed after its attention is seen whole; only tokens a
cache cap drops while they are stored would be missing. A decode step that attends through any other ``kernels``
op is refused, not approximated. The probe syncs with the host and runs a float64 attention per layer and step: a
diagnostic only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from ..cache import PagedLayer
from ..errors import ConfigError
from ..methods.base import Method, MethodConfig


@dataclass(frozen=True, kw_only=True)
class RecallConfig(MethodConfig):
    """``inner``: the method whose attention recall is measured; its page size is used."""

    inner: MethodConfig
    syncs_host: ClassVar[bool] = True  # reads every step on the host: never captured in a CUDA graph

    def __post_init__(self):
        if not isinstance(self.inner, MethodConfig):
            raise ValueError(f"inner must be a sparsekv method config, got {type(self.inner).__name__}")
        object.__setattr__(self, "page_size", self.inner.page_size)
        super().__post_init__()

    @property
    def name(self) -> str:
        return self.inner.name

    def check_model(self, num_layers: int) -> None:
        self.inner.check_model(num_layers)

    def method_class(self):
        return RecallProbe


class RecallProbe(Method):
    """The inner method plus the recall bookkeeping. Every hook of ``Method`` is handed to the inner method,
    ``prefill`` and ``decode`` with the bookkeeping around them (a test checks that none is left out)."""

    def __init__(self, config: RecallConfig, num_layers: int):
        super().__init__(config, num_layers)
        self.inner = config.inner.build(num_layers)
        self.max_pages = self.inner.max_pages
        self.accepts_chunks = self.inner.accepts_chunks
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, T, D) every key seen, by position
        self.seen: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, T) bool
        self.total = torch.zeros(num_layers, dtype=torch.float64)
        self.steps = torch.zeros(num_layers, dtype=torch.long)

    def reorder(self, index):
        self.inner.reorder(index)

    def resident_bytes(self):
        return self.inner.resident_bytes()

    def offloaded_bytes(self):
        return self.inner.offloaded_bytes()

    def release(self):
        self.inner.release()

    def select(self, layer_idx, q, layer, seq_len):
        return self.inner.select(layer_idx, q, layer, seq_len)

    def prefill_chunk(self, layer_idx, q, layer, plan, scale, lse=None):
        self.inner.prefill_chunk(layer_idx, q, layer, plan, scale, lse)

    def min_prompt_chunk(self):
        return self.inner.min_prompt_chunk()

    def planned_tokens(self, prompt_lengths, total):
        return self.inner.planned_tokens(prompt_lengths, total)

    def held_tokens(self, prompt_len, total):
        return self.inner.held_tokens(prompt_len, total)

    def host_tokens(self, prompt_len):
        return self.inner.host_tokens(prompt_len)

    # The probe keeps every key of one generation by position: it measures a generation through the engine or
    # ``apply``, and a serving pool (rows joining and leaving) is refused when it is made.
    def pool_pages(self, max_context, max_new_tokens, max_prompt_tokens):
        raise ConfigError("method", "a method to serve, not the attention-recall probe (it measures one generation "
                                    "through Engine or apply)", self.config.name)

    def pool_host_tokens(self, max_context):
        return self.pool_pages(max_context, None, None)

    def prefill_device_tokens(self, max_context):
        return self.pool_pages(max_context, None, None)

    def slot_state_bytes(self, head_dim, itemsize):
        return self.pool_pages(None, None, None)

    def pool_configs(self):
        return self.pool_pages(None, None, None)

    def step_slots(self, n):
        return self.pool_pages(None, None, None)

    def start_pool(self, layers, max_context):
        self.pool_pages(max_context, None, None)

    def request_config(self):
        return self.pool_pages(None, None, None)

    def copy_row(self, row, source, source_row, prompt_len):
        self.pool_pages(None, None, None)

    def rows(self, n, decode_tokens):
        return self.pool_pages(None, None, None)

    def prefill(self, layer_idx, q, layer, plan, scale):
        self._remember(layer_idx, layer, int(max(plan.new_len)))  # before a compressing method drops any
        self.inner.prefill(layer_idx, q, layer, plan, scale)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        self._remember(layer_idx, layer, int(seq_len.max()))
        calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        with _observing_attention(calls):
            out = self.inner.decode(layer_idx, q, layer, seq_len, scale, tally)
        if not calls:
            raise ValueError(f"attention recall: method {self.inner.config.name!r} decoded layer {layer_idx} without "
                             f"any of kernels.{', kernels.'.join(OBSERVED)}; its attended tokens cannot be observed")
        self.total[layer_idx] += float(self._coverage(layer_idx, q, calls, layer.page_size, seq_len, scale))
        self.steps[layer_idx] += 1
        return out

    def recall(self) -> list[float | None]:
        """Mean recall per layer over the decode steps seen (None for a layer with none)."""
        return [float(t / n) if n else None for t, n in zip(self.total, self.steps)]

    def _remember(self, layer_idx: int, layer: PagedLayer, length: int) -> None:
        """Copies every key the layer holds now into the shadow history."""
        b, h, _, d = layer.shape
        keys, seen = self.keys.get(layer_idx), self.seen.get(layer_idx)
        if keys is None or keys.shape[2] - 1 < length:
            grown = max(length, 2 * (0 if keys is None else keys.shape[2] - 1))
            new_keys = layer.k.new_zeros(b, h, grown + 1, d)  # the extra column absorbs free slots
            new_seen = torch.zeros(b, h, grown + 1, dtype=torch.bool, device=layer.k.device)
            if keys is not None:
                new_keys[:, :, :keys.shape[2] - 1] = keys[:, :, :-1]
                new_seen[:, :, :seen.shape[2] - 1] = seen[:, :, :-1]
            keys, seen = new_keys, new_seen
        dump = keys.shape[2] - 1
        pos = layer.token_position().flatten(2)  # (B, Hkv, N)
        idx = torch.where((pos >= 0) & (pos < dump), pos, dump)
        keys.scatter_(2, idx.unsqueeze(-1).expand(-1, -1, -1, d), layer.k.flatten(2, 3))
        seen.scatter_(2, idx, torch.ones_like(idx, dtype=torch.bool))
        seen[:, :, dump] = False
        self.keys[layer_idx], self.seen[layer_idx] = keys, seen

    def _coverage(self, layer_idx, q, calls, page_size, seq_len, scale) -> torch.Tensor:
        """Mean over sequences and query heads of the dense attention mass on the attended tokens.
        q: (B, H, D); calls: what each observed op attended (see ``_observing_attention``)."""
        keys, seen = self.keys[layer_idx], self.seen[layer_idx]
        b, hkv, t, d = keys.shape
        h = q.shape[1]
        valid = seen & (torch.arange(t, device=q.device) < seq_len.view(b, 1, 1))  # (B, Hkv, T)
        logits = torch.einsum("bngd,bntd->bngt", q.double().view(b, hkv, h // hkv, d), keys.double()) * scale
        logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
        chosen = torch.zeros(b, h, t + 1, dtype=torch.bool, device=q.device)  # the last column absorbs padding
        mass = torch.zeros(b, h, dtype=torch.double, device=q.device)
        dense_lse = logits.logsumexp(-1).view(b, h)
        bi = torch.arange(b, device=q.device).view(b, 1, 1)
        for kind, *args in calls:
            if kind == "lse":  # a token op's own log-sum-exp: its share is exp(lse - dense lse)
                mass += (args[0].double() - dense_lse).exp().nan_to_num(0.0)
                continue
            slot_page, slots, limit = args
            hs = slots.shape[1]
            page = slot_page[bi, (torch.arange(hs, device=q.device) // (hs // hkv)).view(1, hs, 1), slots.clamp(min=0)]
            page = torch.where(slots >= 0, page, -1)
            tok = page.unsqueeze(-1) * page_size + torch.arange(page_size, device=q.device)  # (B, Hs, K, P)
            ok = (page.unsqueeze(-1) >= 0) & (tok < limit.view(b, 1, 1, 1)) & (tok < t)
            rows = torch.zeros(b, hs, t + 1, dtype=torch.bool, device=q.device)
            rows.scatter_(2, torch.where(ok, tok, t).flatten(2), True)
            chosen |= rows.repeat_interleave(h // hs, dim=1)
        weights = torch.softmax(logits, -1).nan_to_num(0.0)
        mass += (weights * chosen[..., :t].view(b, hkv, h // hkv, t)).sum(-1).view(b, h)
        return mass.mean()


# Attention ops a decode step may use. Slot ops: how to read (slot_page, slots, limit) from their arguments, a
# token counting where its position is below the limit; their tokens are united. Token ops attend a packed token
# store and return (out, lse): their mass is read from the log-sum-exp, as parts disjoint from everything else
# attended in the step (what ``merge_attention`` assumes of them).
SLOT_OPS = {
    "sparse_decode": lambda a: (a["slot_page"], a["slots"], a["seq_len"]),
    "attend_with_weights": lambda a: (a["slot_page"], a["slots"], a["q_pos"][:, -1] + 1),
}
TOKEN_OPS = ("sparse_decode_tokens",)
OBSERVED = (*SLOT_OPS, *TOKEN_OPS)
# Ops of ``kernels`` that attend nothing (scores, selection, bookkeeping, the merge of a prompt pass's attention
# parts); any other op met in a decode step is an attention the probe cannot read, and is refused rather than left
# out of the recall.
NOT_ATTENTION = {"page_scores", "select_pages", "quest_select", "raas_select", "coded_scores", "lowbit_select",
                 "code_page", "window_token_maxima", "attention_mass", "append_token", "append_pages", "page_bounds",
                 "page_codes", "raas_update", "linear", "linear_quantized", "landmark_means", "landmark_page_scores",
                 "landmark_select", "page_means", "spread_stats", "spread_page_scores", "spread_select", "page_stats",
                 "merge_lse"}


def _observing_attention(calls: list):
    """A context in which every call of a ``kernels`` attention op appends what it attended to ``calls``:
    ("slots", slot_page, slots, limit) for slot ops, ("lse", lse (B, H)) for token ops."""

    def record(name, arguments, result):
        if name in TOKEN_OPS:
            calls.append(("lse", result[1].clone()))
        elif name in SLOT_OPS:
            calls.append(("slots", *(t.clone() for t in SLOT_OPS[name](arguments))))
        elif name not in NOT_ATTENTION:
            raise ValueError(f"attention recall cannot observe kernels.{name}; it reads {', '.join(OBSERVED)} only")

    return kernels.observe(record)
