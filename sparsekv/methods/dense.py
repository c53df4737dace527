"""Dense attention through the same paged cache and integration as every sparse method: the baseline that all
comparisons run against, so differences come from selection alone."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, MethodConfig, all_slots, attend_all


@dataclass(frozen=True, kw_only=True)
class DenseConfig(MethodConfig):
    """Attend to every cached token at every step."""

    def method_class(self):
        return Dense


class Dense(Method):
    prefix_reuse = answer_reuse = shared_pages = decodes_as_prompt = True

    def select(self, layer_idx, q, layer, seq_len):
        return all_slots(layer)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        return attend_all(q, layer, seq_len, scale)
