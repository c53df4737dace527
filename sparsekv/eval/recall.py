"""Attention recall: how much of the dense attention mass the tokens a method attends cover, per layer.

``RecallConfig(inner=config)`` builds the inner method wrapped in a probe. At every decode step of every layer the
probe records the slots the inner method's ``select`` returns (with the page each slot held at that moment), lets
the inner method decode as usual, and then computes, with the same query, the dense softmax attention over the
layer's whole key history and the share of it that falls on the selected tokens, averaged over query heads.

"Dense" is the attention this layer's query would give to every token of the sequence so far, including tokens
an evicting method (H2O, TOVA, StreamingLLM, SnapKV) has already dropped: the probe keeps a shadow copy of every
key it has seen in the layer, so evicted tokens count as missed mass. The query is the method's own, so the
number isolates the selection of this step from the drift of hidden states across earlier sparse steps. Tokens
no longer in the cache when the probe first sees the layer (evicted during the prompt's own pass) cannot be
recovered and are left out. Methods whose ``decode`` does not go through ``select`` are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PagedLayer
from ..methods.base import MethodConfig


@dataclass(frozen=True, kw_only=True)
class RecallConfig(MethodConfig):
    """``inner``: the method whose attention recall is measured; its page size is used."""

    inner: MethodConfig

    def __post_init__(self):
        if not isinstance(self.inner, MethodConfig):
            raise ValueError(f"inner must be a sparsekv method config, got {type(self.inner).__name__}")
        object.__setattr__(self, "page_size", self.inner.page_size)
        super().__post_init__()

    @property
    def name(self) -> str:
        return self.inner.name

    def build(self, num_layers: int) -> "RecallProbe":
        return RecallProbe(self, num_layers)


class RecallProbe:
    """The inner method plus the recall bookkeeping. Not a ``Method`` subclass on purpose: every hook other than
    ``prefill`` and ``decode`` (including ones added to ``Method`` later) reaches the inner method unchanged."""

    def __init__(self, config: RecallConfig, num_layers: int):
        self.config = config
        self.num_layers = num_layers
        self.inner = config.inner.build(num_layers)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, T, D) every key seen, by position
        self.seen: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, T) bool
        self.total = torch.zeros(num_layers, dtype=torch.float64)
        self.steps = torch.zeros(num_layers, dtype=torch.long)
        self._picked: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def prefill(self, layer_idx, q, layer, plan):
        self._remember(layer_idx, layer, int(max(plan.new_len)))
        self.inner.prefill(layer_idx, q, layer, plan)

    def decode(self, layer_idx, q, layer, seq_len, scale):
        self._remember(layer_idx, layer, int(seq_len.max()))
        self._picked = None
        select = self.inner.select

        def recording(*args):
            slots = select(*args)
            self._picked = (slots, layer.slot_page.clone())
            return slots

        own = self.inner.__dict__.get("select")  # an instance-level select (rare) is put back afterwards
        self.inner.select = recording  # the inner decode's own select call is the one recorded
        try:
            out, attended = self.inner.decode(layer_idx, q, layer, seq_len, scale)
        finally:
            if own is None:
                del self.inner.select
            else:
                self.inner.select = own
        if self._picked is None:
            raise ValueError(f"attention recall: method {self.inner.config.name!r} decodes without select(); "
                             f"its attended tokens cannot be observed")
        slots, slot_page = self._picked
        self.total[layer_idx] += float(self._coverage(layer_idx, q, slots, slot_page, layer.page_size, seq_len,
                                                      scale))
        self.steps[layer_idx] += 1
        return out, attended

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

    def _coverage(self, layer_idx, q, slots, slot_page, page_size, seq_len, scale) -> torch.Tensor:
        """Mean over sequences and query heads of the dense attention mass on the selected tokens.
        q: (B, H, D); slots: (B, Hs, K); slot_page: (B, Hkv, C + 1) at selection time."""
        keys, seen = self.keys[layer_idx], self.seen[layer_idx]
        b, hkv, t, d = keys.shape
        h, hs = q.shape[1], slots.shape[1]
        pos = torch.arange(t, device=q.device)
        valid = seen & (pos < seq_len.view(b, 1, 1))  # (B, Hkv, T)
        logits = torch.einsum("bngd,bntd->bngt", q.double().view(b, hkv, h // hkv, d), keys.double()) * scale
        weights = torch.softmax(logits.masked_fill(~valid.unsqueeze(2), float("-inf")), -1).nan_to_num(0.0)
        # Positions each selection row attends -> a (B, Hs, T) mask; the last column absorbs padding.
        kv_of_row = (torch.arange(hs, device=q.device) // (hs // hkv)).view(1, hs, 1)
        page = slot_page[torch.arange(b, device=q.device).view(b, 1, 1), kv_of_row, slots.clamp(min=0)]
        page = torch.where(slots >= 0, page, -1)
        tok = page.unsqueeze(-1) * page_size + torch.arange(page_size, device=q.device)  # (B, Hs, K, P)
        ok = (page.unsqueeze(-1) >= 0) & (tok < seq_len.view(b, 1, 1, 1)) & (tok < t)
        idx = torch.where(ok, tok, t).flatten(2)
        chosen = torch.zeros(b, hs, t + 1, dtype=torch.double, device=q.device).scatter_(2, idx, 1.0)[..., :t]
        chosen = chosen.view(b, hkv, h // hkv if hs == h else 1, t)
        return (weights * chosen).sum(-1).mean()
