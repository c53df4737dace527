"""A vLLM logits processor that feeds each request the tokens its ``SamplingParams.extra_args["forced"]`` lists,
one a decode step, so that vLLM scores given tokens through its decode path (the log-probabilities it reports are
computed before any logits processor: the model's own). Imported by vLLM's engine process by name; needs vLLM."""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class ForcedTokens(LogitsProcessor):
    KEY = "forced"

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch index -> (the forced tokens, the request's output tokens so far: a list vLLM keeps growing)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output in batch_update.added:
            forced = (params.extra_args or {}).get(self.KEY)
            if forced:
                self.rows[index] = (forced, output)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output) in self.rows.items():
            token = forced[min(len(output), len(forced) - 1)]
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits
