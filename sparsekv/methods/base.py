"""What every method shares: a validated config that builds a policy, and the policy's interface.

A policy never touches the model. At each decode step the integration asks it, per layer, which page slots of the
paged cache to attend (``select``); methods that evict free slots there as well.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from ..cache import AppendPlan, PagedLayer, check_kv_dtype, check_page_size
from ..errors import ConfigError

# Bytes of device memory left free for the steps' activations and buffers where KV is placed by an estimate, not a
# measured profile: the engine's OmniKV placing its layers, the serving benchmarks' planner and pre-checks.
DEVICE_MARGIN = 4 << 30


class Tally:
    """Where one layer's decode steps count the KV tokens they attend, for the decode statistics.

    ``rows(hs)`` is the layer's running total per selection row, (B, hs) int64 on ``device``: the attention op adds
    each row's tokens into it (``kernels.sparse_decode(..., attended=tally.rows(hs))``, no kernel of its own), or a
    method adds a count it has. A step of a layer that attends the whole context (``attend_all``) leaves it unused:
    the statistics count the context instead. ``used`` says whether the current step asked for it."""

    def __init__(self, batch: int, device: torch.device):
        self.batch, self.device = batch, device
        self.total: torch.Tensor | None = None
        self.used = False

    def rows(self, hs: int) -> torch.Tensor:
        self.used = True
        if self.total is None or self.total.shape[1] != hs:
            if self.total is not None:
                raise RuntimeError(f"a layer's selection rows changed from {self.total.shape[1]} to {hs}")
            self.total = torch.zeros(self.batch, hs, dtype=torch.long, device=self.device)
        return self.total


MAX_INT = 2**31  # bound on the integers of a config (tokens, layers, pages)


def is_real(x) -> bool:
    """Whether ``x`` is a finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def require(ok: bool, field: str, allowed: str, value) -> None:
    """Raises ``ConfigError`` unless ``ok``: the field, what is allowed, and what was given."""
    if not ok:
        raise ConfigError(field, allowed, value)


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """Fields every method has. ``page_size``: tokens per KV page, a power of two from 1 to 256. ``kv_dtype``: the
    storage of keys, values and page bounds, "auto" (the model's dtype) or "fp8" (float8_e4m3fn, see
    ``sparsekv.cache.paged``)."""

    page_size: int = 16
    kv_dtype: str = "auto"

    def __post_init__(self):
        # Counts and indices go to kernels as int32 or int64: a larger one would overflow there, far from its field.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for x in value if isinstance(value, tuple) else (value,):
                require(not isinstance(x, int) or abs(x) < MAX_INT, f.name, "a number of magnitude below 2**31",
                        value)
        check_page_size(self.page_size)
        check_kv_dtype(self.kv_dtype)

    @property
    def name(self) -> str:
        return type(self).__name__.removesuffix("Config").lower()

    def method_class(self) -> type["Method"]:
        """The policy this config builds."""
        raise NotImplementedError(f"{type(self).__name__} does not define method_class()")

    def check_model(self, num_layers: int) -> None:
        """Refuses fields that do not fit a model of ``num_layers`` layers (e.g. more dense layers than it has)."""

    def build(self, num_layers: int) -> "Method":
        """The policy for a model of ``num_layers`` layers: the one way every config becomes its method."""
        self.check_model(num_layers)
        return self.method_class()(self, num_layers)


def most_tokens(max_context: int, max_new_tokens: int, max_prompt_tokens: int) -> int:
    """The most tokens a request of up to ``max_context`` tokens holds, at most ``max_new_tokens`` of them new and
    ``max_prompt_tokens`` in its prompt."""
    return min(max_context, max_prompt_tokens + max_new_tokens)


class Method:
    """A sparse-attention policy over a paged cache.

    ``max_pages``: cap on page slots per (sequence, KV head) the cache may hold (None: grows with the context).
    ``accepts_chunks``: False for methods whose state follows every token after the prompt, so that a multi-token
    pass after it is refused rather than attended without them.
    ``tp_group``: the process group over which tensor parallelism splits every layer's heads (``apply`` sets it from
    the model, see ``sparsekv.parallel``), None when they are not split. The tensors a method sees hold this
    process's heads only; a decision over all heads of a layer reduces over ``tp_group``.
    ``prefix_reuse``: after a prompt, every layer holds each of its pages as the prompt's passes wrote them
    (nothing evicted, offloaded or compressed), and the passes carry no state from one chunk to the next but the
    pages: so the first pages of one prompt's cache start any prompt that begins with the same tokens
    (``PagedKVCache.seed``, a server's prefix cache). ``answer_reuse``: the same holds after the decode steps,
    which append to every layer without evicting: a finished request's prompt and answer start the prompts that
    begin with them (a conversation's next turn).
    ``shared_pages``: the method reads and writes keys and values only through ``PagedLayer.attend`` and the
    cache's append, and holds every page of a row to its end, so that a serving pool keeps its rows' keys and
    values in shared pages, each row holding its own request's (``cache.SharedPages``).
    ``decodes_as_prompt``: its decode step attends what a prompt pass over the same tokens attends (every earlier
    token), so that the keys and values of a preempted request's drawn tokens come back from one prompt pass over
    its prompt and them (``serve.Runner.start``) rather than a decode step per token.
    ``reads_prompt_lse``: ``prefill_chunk`` reads the log-sum-exps of the prompt's attention, so that a fill that
    does not run the model's attention (``bench.e2e.random_passes``) computes them for this method.
    ``row_moves``: a pool's row whose pages (``PagedLayer.copy_row``) and per-row state (``start_pool`` of a pool of
    one row, then ``copy_row``) are copied out and back goes on as it would have (``serve.Runner.swap_out``).
    """

    max_pages: int | None = None
    shared_pages: bool = False
    decodes_as_prompt: bool = False
    row_moves: bool = True
    prefix_reuse: bool = False
    answer_reuse: bool = False
    accepts_chunks: bool = True
    reads_prompt_lse: bool = False
    sized_by_decode_tokens: bool = False
    tp_group = None

    def __init__(self, config: MethodConfig, num_layers: int):
        self.config = config
        self.num_layers = num_layers

    def prefill_chunk(self, layer_idx: int, q: torch.Tensor, layer: PagedLayer, plan: AppendPlan, scale: float,
                      lse: torch.Tensor | None = None) -> None:
        """Called after the attention of every pass of the prompt (the whole prompt, or each of its chunks), with
        that pass's queries q: (B, H, S, D) (post-RoPE) and, where the attention computed it, each query's
        log-sum-exp lse: (B, H, S) in the accumulation dtype (natural log; anything at padding). Methods that score
        every prompt query accumulate here."""

    def prefill(self, layer_idx: int, q: torch.Tensor, layer: PagedLayer, plan: AppendPlan, scale: float) -> None:
        """Called after a layer's last prompt pass (after ``prefill_chunk``), with that pass's queries
        q: (B, H, S, D) (post-RoPE), its plan (``new_len``: the prompt lengths) and the model's attention scale.
        Methods that score or compress the prompt do it here; methods that read the prompt's last queries find them
        in q (a chunked prompt's last chunk holds at least as many as they need: ``min_prompt_chunk``)."""

    def min_prompt_chunk(self) -> int:
        """The fewest columns the prompt's last chunk may have: the prompt queries ``prefill`` reads."""
        return 1

    def planned_tokens(self, prompt_lengths: list[int], total: int) -> int:
        """Tokens per row the cache allocates for up front, given each row's prompt length and ``total`` (the
        longest prompt plus the tokens to decode): all of them, unless the method caps what a row holds."""
        return total

    # A pool of rows for serving (``sparsekv.serve``): this method object holds the state of every row of a cache
    # whose rows serve different requests. Each request's prompt runs through a method of its own (built from
    # ``request_config``) in a cache of one row; ``copy_row`` then moves it into a row of the pool, and the decode
    # steps run on ``rows(n)``, the method of the pool's first n rows.

    def pool_pages(self, max_context: int, max_new_tokens: int, max_prompt_tokens: int) -> list[int]:
        """Page slots per row each layer of a pool needs for any request of up to ``max_context`` tokens, at most
        ``max_new_tokens`` of them new and ``max_prompt_tokens`` in its prompt."""
        return [-(-most_tokens(max_context, max_new_tokens, max_prompt_tokens) // self.config.page_size)] * \
            self.num_layers

    def slot_state_bytes(self, head_dim: int, itemsize: int) -> list[int]:
        """Per layer, the bytes per page slot and KV head of the method's per-slot state in a pool
        (``PagedLayer.slot_state``) for a cache of ``itemsize`` bytes an element: 8 (a counter or a score) unless
        the method keeps more."""
        return [8] * self.num_layers

    def prefill_device_tokens(self, max_context: int) -> int:
        """KV tokens summed over layers that a prompt of up to ``max_context`` tokens holds on the device at most while
        it is prefilled in a cache of its own, before it joins a pool of this method: every layer's."""
        return max_context * self.num_layers

    def pool_host_tokens(self, max_context: int) -> int:
        """KV tokens summed over layers that a pool's host store keeps per row for requests of up to
        ``max_context`` tokens (a prompt of that many tokens keeps as many in its own store while it is
        prefilled)."""
        return 0

    def pool_configs(self) -> list[MethodConfig]:
        """The configs a pool of this method may run, the one that keeps the most on the device first; a pool takes
        the first whose rows fit (``serve.runner.Runner``, ``bench.serve.plan``). One unless the config leaves the
        split of device and host memory open."""
        return [self.config]

    def start_pool(self, layers: list[PagedLayer], max_context: int) -> None:
        """Makes this method the state of a pool whose layers (B rows, ``pool_pages`` slots) are ``layers``: per-row
        state for B rows, and limits fixed for any request (a decode step captured once serves them all)."""

    def request_config(self) -> MethodConfig:
        """The config of the method each request's prompt runs through, so that its state fits the pool's."""
        return self.config

    def copy_row(self, row: int, source: "Method", source_row: int, prompt_len: int) -> None:
        """Makes ``row`` of the pool hold the per-row state of row ``source_row`` of ``source`` (a request's method
        after its prompt of ``prompt_len`` tokens, or this pool); the pages move with ``PagedLayer.copy_row``."""

    def rows(self, n: int, decode_tokens: int) -> "Method":
        """The method of the pool's rows [0, n), none of which holds more than ``decode_tokens`` tokens after its
        prompt: its per-row state is views of this one's. A method whose step depends on ``decode_tokens`` sets
        ``sized_by_decode_tokens``."""
        return copy.copy(self)

    def step_slots(self, n: int) -> int | None:
        """Page slots per row that a decode step over the pool's rows [0, n) needs to read (every page of those rows
        lies in slots [0, that)), for a method whose step costs less over fewer slots; None: all of them. The runner
        keeps a step per value, and ``rows(n, ...)`` reads it."""
        return None

    def held_tokens(self, prompt_len: int, total: int) -> int:
        """KV tokens summed over layers that a row of a ``prompt_len``-token prompt and ``total`` tokens in all holds
        on the device at most after its prompt."""
        return self.planned_tokens([prompt_len], total) * self.num_layers

    def host_tokens(self, prompt_len: int) -> int:
        """KV tokens summed over layers that such a row keeps in host memory."""
        return 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps the sequences ``index`` of any per-sequence state (beam search, batch selection)."""

    def resident_bytes(self) -> int:
        """Bytes of per-sequence state the method holds on the cache's device, beyond the pages."""
        return 0

    def offloaded_bytes(self) -> int:
        """Bytes of KV the method keeps off the device (in host memory)."""
        return 0

    def release(self) -> None:
        """Frees what the method holds for one generation outside the cache's pages (host memory), once the
        generation is over: a result that keeps the method for inspection must not keep its stores."""

    def select(self, layer_idx: int, q: torch.Tensor, layer: PagedLayer, seq_len: torch.Tensor) -> torch.Tensor:
        """Slots to attend in one decode step. q: (B, H, D); seq_len: (B,). Returns (B, Hs, K) int64, -1 = none,
        with Hs = Hkv (per KV head) or H (per query head)."""
        raise NotImplementedError

    def decode(self, layer_idx: int, q: torch.Tensor, layer: PagedLayer, seq_len: torch.Tensor, scale: float,
               tally: Tally) -> torch.Tensor:
        """One decode step of one layer. q: (B, H, D). Returns the attention output (B, H, D), having counted the
        tokens attended per selection row in ``tally`` (unless the layer attends the whole context: ``attend_all``).
        The default attends to the slots ``select`` picks."""
        slots = self.select(layer_idx, q, layer, seq_len)
        return layer.attend(q, slots, seq_len, scale, tally.rows(slots.shape[1]))


def all_slots(layer: PagedLayer) -> torch.Tensor:
    """Every slot of every row, (B, Hkv, C + 1) (a view, no kernel): dense attention over whatever the cache
    holds."""
    b, h, c, _ = layer.shape
    return layer.slot_ids.expand(b, h, c)


def attend_all(q: torch.Tensor, layer: PagedLayer, seq_len: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense attention (B, H, D) of a layer that holds the whole context (nothing evicted or offloaded); nothing
    is tallied, the statistics counting the context instead. Without holes (slot j holds page j) each row is read
    up to its length only, not over every slot of the layer."""
    return layer.attend(q, all_slots(layer), seq_len, scale, in_order=not layer.may_have_holes)
