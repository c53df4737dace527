"""The model's side of serving: a request's prefill in passes, and one decode step over the running rows.

Each request's prompt runs through ``engine.prefill_passes`` into a cache of its own (batch 1, with its own method
state), a few passes per call, so that the scheduler interleaves it with the decode steps. Once the prompt is in,
the request takes a row; a decode step runs every running row and draws each row's token under its own sampling
and seed (``engine.draw``, ``engine.counter_noise``), so that a request's tokens do not depend on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch

from .. import parallel
from ..engine import Engine, Sampling, counter_noise, draw, prefill_passes
from ..integrations import apply
from ..integrations.decode import DecodeModel
from ..integrations.transformers import DecodeStats, SparseKVCache, _sliding_window


@dataclass
class Prefill:
    """A request's prompt on its way in: its cache, the passes still to run, and the last column's logits (1, V)
    once they have all run."""

    cache: SparseKVCache
    passes: Generator
    prompt_len: int
    logits: torch.Tensor | None = None


@dataclass
class _Row:
    """A running request: its cache, its next input token (1, 1), its sampling and seed, and its tokens so far."""

    cache: SparseKVCache
    token: torch.Tensor
    sampling: Sampling
    seed: int
    count: int


class Runner:
    """Runs ``config``'s method on ``model`` for up to ``max_batch`` requests at once (see ``Engine`` for the
    arguments, validated the same way)."""

    def __init__(self, model, config, *, max_batch: int, max_context: int | None, prefill_chunk: int,
                 cuda_graph: bool | None, compile: bool):
        self.engine = Engine(model, config, max_batch=max_batch, max_context=max_context,
                             prefill_chunk=prefill_chunk, cuda_graph=cuda_graph, compile=compile)
        self.model, self.config = model, config
        self.max_batch, self.max_context = max_batch, self.engine.max_context
        self.device = self.engine.device
        self.num_layers = model.config.num_hidden_layers
        self.vocab_size = model.config.vocab_size
        # About one chunk of the prompt through every layer per call of ``prefill``.
        self.prefill_budget = prefill_chunk * self.num_layers
        self.window = _sliding_window(model.config)
        self.rows: dict[int, _Row] = {}
        self.decoder = DecodeModel(model, self.engine.parts)
        layer = model.get_decoder().layers[0].self_attn
        kv_heads = model.config.num_key_value_heads // parallel.size(parallel.head_group(model))
        self.token_bytes = 2 * kv_heads * layer.head_dim * next(model.parameters()).element_size() * self.num_layers

    @property
    def free_rows(self) -> int:
        return self.max_batch - len(self.rows)

    def kv_bytes(self, prompt_len: int, total: int) -> int:
        """KV bytes a request of ``prompt_len`` prompt tokens and ``total`` tokens in all holds at most."""
        method = self.config.build(self.num_layers)
        return method.planned_tokens([prompt_len], total) * self.token_bytes

    def capacity_bytes(self) -> int:
        """KV bytes of ``max_batch`` rows of ``max_context`` tokens."""
        return self.max_batch * self.kv_bytes(self.max_context, self.max_context)

    def host_bytes(self) -> int:
        return sum(row.cache.offloaded_bytes() for row in self.rows.values())

    def start(self, prompt: list[int]) -> Prefill:
        """A prefill of ``prompt`` into a cache of its own."""
        method = self.config.build(self.num_layers)
        method.tp_group = parallel.head_group(self.model)
        cache = SparseKVCache(method, DecodeStats(tp_group=method.tp_group), self.window)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        cache.pages.planned_tokens = method.planned_tokens([len(prompt)], self.max_context)
        passes = prefill_passes(self.model, cache, ids, torch.ones_like(ids), self.engine.prefill_chunk)
        return Prefill(cache, passes, len(prompt))

    def prefill(self, job: Prefill, budget: int) -> int:
        """Runs passes of ``job`` until about ``budget`` tokens times layers have run (at least one pass); sets
        ``job.logits`` after the last. Returns the tokens times layers run."""
        used = 0
        with apply(self.model, self.config), torch.no_grad():
            while used < budget:
                try:
                    used += next(job.passes)
                except StopIteration as done:
                    job.logits = done.value
                    break
        return max(used, 1)

    def first_token(self, job: Prefill, sampling: Sampling, seed: int) -> int:
        """The request's first new token, drawn from its prompt's logits."""
        return self._draw(job.logits, [sampling], [seed], [0])[0]

    def join(self, job: Prefill, first: int, sampling: Sampling, seed: int) -> int:
        """Makes the prefilled request a running row whose next input is ``first``; returns the row."""
        row = min(set(range(self.max_batch)) - set(self.rows))
        token = torch.tensor([[first]], dtype=torch.long, device=self.device)
        self.rows[row] = _Row(job.cache, token, sampling, seed, 1)
        return row

    def discard(self, job: Prefill) -> None:
        """Drops a prefill (its request was cancelled or ended at its first token)."""
        job.cache.method.release()
        job.passes.close()

    def release(self, row: int) -> None:
        """Frees ``row``."""
        self.rows.pop(row).cache.method.release()

    def decode(self) -> dict[int, int]:
        """One decode step over the running rows; returns each row's new token."""
        order = sorted(self.rows)
        with torch.no_grad():
            logits = []
            for r in order:
                row = self.rows[r]
                logits.append(self.decoder(row.token, row.cache.pages.seq_len.view(1, 1), row.cache))
            rows = [self.rows[r] for r in order]
            tokens = self._draw(torch.cat(logits), [row.sampling for row in rows], [row.seed for row in rows],
                                [row.count for row in rows])
        for row, token in zip(rows, tokens):
            row.token.fill_(token)
            row.count += 1
        return dict(zip(order, tokens))

    def _draw(self, logits: torch.Tensor, samplings: list[Sampling], seeds: list[int],
              index: list[int]) -> list[int]:
        """Each row's token from logits (B, V) under its sampling, seed and token index."""
        device = logits.device

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        noise = counter_noise(column(seeds, torch.long), column(index, torch.long), logits.shape[1])
        return draw(logits, column([s.temperature for s in samplings], torch.float32),
                    column([s.top_k for s in samplings], torch.long),
                    column([s.top_p for s in samplings], torch.float32), noise).tolist()
