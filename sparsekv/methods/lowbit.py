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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..cache.paged import gather
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
    key channel of the codes (1, 2 or 4)."""

    bits: int = 2

    def __post_init__(self):
        super().__post_init__()
        require(self.bits in (1, 2, 4), "bits", "1, 2 or 4", self.bits)

    def metadata_bytes(self, head_dim: int, itemsize: int) -> int:
        """Bytes of selection metadata a step reads per page and KV head: the min/max and the codes."""
        return 2 * head_dim * itemsize + self.page_size * head_dim * self.bits // 8

    def method_class(self):
        return LowBit


def _page_codes(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot: torch.Tensor,
                bits: int) -> torch.Tensor:
    """Codes (B, Hkv, P, D * bits / 8) of the page in slot (B, Hkv) of every row, on its current range."""
    idx = slot.view(*slot.shape, 1, 1)
    bounds = gather(kmin, 2, idx.expand(*slot.shape, 1, kmin.shape[3])).squeeze(2), \
        gather(kmax, 2, idx.expand(*slot.shape, 1, kmax.shape[3])).squeeze(2)
    keys = gather(k, 2, idx.unsqueeze(-1).expand(*slot.shape, 1, *k.shape[3:])).squeeze(2)
    return reference.key_codes(keys, *bounds, bits)


# dynamic=False: the width, an int argument, stays a constant of each compiled graph (one per width); left to
# torch.compile, a second width makes it a symbolic int, which ``key_codes`` cannot shift by.
page_codes = kernels.fused(_page_codes, dynamic=False)


class LowBit(Method):
    config: LowBitConfig
    accepts_chunks = False  # a multi-token pass after the prompt would complete pages without codes

    def prefill(self, layer_idx, q, layer, plan, scale):
        if layer_idx >= self.config.dense_layers:
            bits = self.config.bits
            reference.check_code_bits(bits, layer.k.shape[-1])
            layer.slot_state[codes_entry(bits)] = reference.key_codes(layer.k, layer.kmin, layer.kmax, bits)

    def page_scores(self, layer_idx, q, layer, seq_len, scale):
        """Each page's estimated log share of the attention, (B, Hs, C + 1), -inf for free slots, after coding
        the current page's keys (``kernels.coded_scores``)."""
        codes = layer.slot_state[codes_entry(self.config.bits)]
        slot = layer.cur_slot.clamp(min=0)
        new = page_codes(layer.k, layer.kmin, layer.kmax, slot, self.config.bits)
        codes.scatter_(2, slot.view(*slot.shape, 1, 1, 1).expand(*slot.shape, 1, *codes.shape[3:]), new.unsqueeze(2))
        return kernels.coded_scores(q, layer.kmin, layer.kmax, codes, layer.slot_page, seq_len, scale,
                                    self.config.bits, self.config.per_query_head)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        cfg = self.config
        if layer_idx < cfg.dense_layers:
            return attend_all(q, layer, seq_len, scale)
        slots = kernels.select_pages(self.page_scores(layer_idx, q, layer, seq_len, scale), layer.cur_slot,
                                     cfg.token_budget // cfg.page_size)
        return kernels.sparse_decode(q, layer.k, layer.v, layer.slot_page, slots, seq_len, scale,
                                     tally.rows(slots.shape[1]))

