"""The model's side of serving: a request's prefill in passes, and one decode step over the running rows.

A pool, as data::

    a cache of max_batch rows (every layer allocated once, each row sized for any request of max_context tokens,
    at most max_new_tokens of them new: ``Method.pool_pages``; for methods that allow it, ``Method.shared_pages``,
    the rows' pages (keys, values, bounds) in one store, ``cache.SharedPages``, a request taking the pages of its
    prompt when its prefill starts and those of its max_tokens when it joins, and giving them back when it ends,
    so that the store, sized by
    kv_memory_bytes or what gpu_memory_utilization leaves, holds as many requests as their own lengths allow)
    + the method's state for those rows + per-row next token, sampling, seed, token index, and the penalties'
    state (each row's count of every token drawn, its logit bias and its prompt's tokens: ``engine.penalize``)
    running rows packed low: rows [0, n) run, n = the running requests; a request that ends gives its row to the
    last running one (its pages, bounds and state copied over; shared pages move by the page table, not copied),
    so a step runs over rows [0, n) only

    prompt -> a cache of one row with a method of its own (``engine.prefill_passes``, a few passes per call, so
           that the scheduler interleaves it with the decode steps; in shared pages its pages are store pages taken
           at its first pass, through a table of its own: ``SharedPages.beside``) -> copied into row n
           (``PagedLayer.copy_row``, ``Method.copy_row``; into several rows for requests of one prompt; in shared
           pages the first request's row takes the prompt's pages, nothing copied, and the others copy them)
           -> decoded with the others

A decode step over rows [0, n) runs on views of the pool (``PagedKVCache.rows``, ``Method.rows``) and draws each
row's token under its own sampling and seed (``engine.draw``, ``engine.counter_noise``), so a request's tokens do
not depend on which requests share its step. Each batch size n (and whether any row samples) has its step, run
eagerly once, then captured as a CUDA graph and replayed (``engine.CapturedStep``); the host reads the step's new
tokens once per step. Under tensor parallelism every process would hold the same pool over its heads and run the
same calls in the same order; one process serves HTTP and broadcasts the scheduler's decisions (not done here).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generator

import torch

from .. import parallel
from ..cache import PagedKVCache, PagedLayer, SharedPages, device_tensor, storage_dtype
from ..cache.host_store import require_host_bytes
from ..engine import (CapturedStep, Engine, Sampling, _is_count, argmax, counter_noise, draw, penalize,
                      prefill_passes, run_passes, token_logprobs, token_set)
from ..integrations import apply
from ..integrations.decode import DecodeModel, PromptChunk
from ..integrations.transformers import DecodeStats, SparseKVCache, _sliding_window, build_prompt_plans
from ..methods.base import Method, is_real, require

log = logging.getLogger("sparsekv.serve")

# The field a pool that the device budget cannot hold is refused under (benchmarks search the largest pool).
POOL_FIELD = "max_batch and max_context"
# How many of the likeliest tokens a request may have listed with each new token (OpenAI's limit for chat).
TOP_LOGPROBS = 20
# Decode steps queued at once (``Runner.launch``): the next step goes to the device before the host reads the last
# one's tokens, so that the host's work between two steps (the tokens' events, the next step's pages) runs while the
# device decodes.
MAX_IN_FLIGHT = 2


def cache_bytes(config, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one token's keys and values in one layer, and of one page's key bounds (0 for pages of one token,
    whose bounds are the key), in ``config``'s cache dtype (``kv_dtype``) for a model computing in ``dtype``."""
    token = 2 * kv_heads * head_dim * storage_dtype(config.kv_dtype, dtype).itemsize
    return token, token if config.page_size > 1 else 0


def row_bytes(slots: list[int], page_size: int, token_bytes: int, page_bytes: int, kv_heads: int,
              state_bytes: list[int]) -> int:
    """Device bytes of one row of a pool whose layers have ``slots`` page slots each (``Method.pool_pages``), plus
    each layer's scratch slot: per slot, keys and values, key bounds, and per KV head the page table's 8 bytes and
    the method's per-slot state (``state_bytes`` per layer, ``Method.slot_state_bytes``)."""
    return sum((s + 1) * (page_size * token_bytes + page_bytes + (8 + state) * kv_heads)
               for s, state in zip(slots, state_bytes))


def shares_pages(method) -> bool:
    """Whether a pool of ``method`` keeps its rows' pages in shared pages (``rows_share_pages``)."""
    return rows_share_pages(method.config)


def rows_share_pages(config) -> bool:
    """Whether a pool of ``config``'s method keeps its rows' pages in shared pages (``SharedPages``): the method
    allows it (``Method.shared_pages``, a class attribute) and its pages hold more than one token."""
    return config.method_class().shared_pages and config.page_size > 1


def rows_swap(config) -> bool:
    """Whether a running row of a pool of ``config``'s method can go to host memory and back unchanged
    (``Runner.swap_out``): rows in shared pages (dense, Quest), or rows of their own of a method whose per-row state
    moves with them (``Method.row_moves``)."""
    return rows_share_pages(config) or config.method_class().row_moves


def pool_row_bytes(method, slots: list[int], token_bytes: int, page_bytes: int, kv_heads: int, head_dim: int,
                   itemsize: int) -> int:
    """Device bytes of one row of a pool of ``method`` whose layers have ``slots`` page slots each, in a cache of
    ``itemsize`` bytes an element: ``row_bytes``, or in shared pages the row's page table and per-slot tensors
    without the pages (``shared_page_bytes`` each)."""
    shared = shares_pages(method)
    return 8 * (slots[0] + 1) * shared + row_bytes(
        slots, method.config.page_size, 0 if shared else token_bytes, 0 if shared else page_bytes, kv_heads,
        method.slot_state_bytes(head_dim, itemsize))


def own_request_bytes(method, prompt_len: int, total: int, token_bytes: int, page_bytes: int, kv_heads: int,
                      head_dim: int, itemsize: int) -> int:
    """KV bytes (device and host) a request of ``prompt_len`` prompt tokens and ``total`` tokens in all holds at most
    in a row of its own of a pool of ``method``: its keys and values, the key bounds of its pages and the method's
    per-slot state beyond the 8 bytes a slot and KV head that the page table takes (lowbit's key codes), which is
    left uncounted so that a request of max_context never needs more than its row."""
    device = method.held_tokens(prompt_len, total)
    pages = -(-device // method.config.page_size) + method.num_layers
    extra = sum(max(b - 8, 0) for b in method.slot_state_bytes(head_dim, itemsize)) * kv_heads
    # a request's pages lie evenly over the layers that hold them
    return device * token_bytes + pages * page_bytes + pages * extra // method.num_layers + \
        method.host_tokens(prompt_len) * token_bytes


def own_rows(max_batch: int, kv_memory_bytes: int, longest_bytes: int) -> int:
    """Rows of a pool whose rows hold their own pages: ``max_batch``, at most as many as ``kv_memory_bytes`` admits
    of the longest request (``longest_bytes``, ``own_request_bytes``), at least one."""
    return min(max_batch, max(kv_memory_bytes // longest_bytes, 1))


def shared_page_bytes(method, token_bytes: int, page_bytes: int, layers: int) -> int:
    """Bytes of one shared page of a pool of ``method``: its keys, values and bounds in every layer (0 where the
    rows hold their own pages)."""
    return (method.config.page_size * token_bytes + page_bytes) * layers if shares_pages(method) else 0


def prefill_bytes(method, max_context: int, token_bytes: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, hidden_size: int = 0) -> int:
    """Device bytes one prompt of up to ``max_context`` tokens takes beside a pool of ``method`` while it is
    prefilled: its cache of one row (``Method.prefill_device_tokens``: every layer's keys and values before any
    eviction, OmniKV's offloaded layers one at a time), or in shared pages, whose store pages it writes, one layer's
    keys and values read for its attention (``prompt_attention``: gathered or copied), and their copy in ``dtype``
    where the cache holds another (fp8). ``hidden_size``: where the prompt runs layer by layer
    (``engine.prefill_passes``, not mixed steps), the model's hidden size: its hidden states between two layers,
    (1, S, hidden) in ``dtype``, are held beside (0: not counted)."""
    between = max_context * hidden_size * dtype.itemsize
    if shares_pages(method):  # in a cache dtype other than the model's, the gathered tokens and their conversion
        converted = 2 * kv_heads * head_dim * dtype.itemsize
        return between + max_context * (token_bytes + (converted if converted != token_bytes else 0))
    return between + method.prefill_device_tokens(max_context) * token_bytes


def device_budget(device: torch.device, utilization: float, profile: int) -> int | None:
    """On a CUDA device, the bytes this process may still allocate for its pool: ``utilization`` of the device's
    total memory, less what is in use on it now (the weights, the CUDA context, other processes) and ``profile``
    (the steps' memory beyond the pool: ``Runner.profile``); None elsewhere (host memory is not checked)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(utilization * total) - (total - free) - profile


def peak_bytes(device: torch.device, run: Callable[[], int]) -> int:
    """Device memory ``run`` takes at its peak beyond what was reserved before it (PyTorch's reserved memory, which
    counts the allocator's rounding), less the bytes it returns (what it made that the pool holds instead)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    kept = run()
    torch.cuda.synchronize(device)
    used = torch.cuda.max_memory_reserved(device) - before - kept
    torch.cuda.empty_cache()
    return max(used, 0)


@dataclass(frozen=True)
class Logprobs:
    """A drawn token's log-probability under the model (``engine.token_logprobs``: the log-softmax of its logits,
    before penalties, temperature and top-p), and ``top``: the likeliest tokens and theirs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Launched:
    """A decode step queued on the device (``Runner.launch``): the keys of its rows, in row order, the top
    log-probabilities each asked for (None: no row asked), and its results on their way to the host: its tokens
    (B,) and, where asked, their log-probabilities (B,), (B, top), (B, top), copied in the stream right after the
    step, so that a step queued behind it does not overwrite them (``done``: the copy's CUDA event, None on the
    CPU, where the copy has run)."""
    keys: list
    logprobs: list[int | None] | None
    found: tuple[torch.Tensor, ...]
    done: torch.cuda.Event | None


@dataclass
class Prefill:
    """A request's prompt on its way in: its cache of one row, the passes still to run, the prompt's token ids, the
    tokens its passes run (``passed``: the prompt, or a preempted dense request's prompt and drawn tokens), how many
    of them a kept prompt's cache gave (``PrefixCache``, looked up at the first pass: they do not run through the
    model) and how many mixed steps ran (``ran``, ``Runner.launch_mixed``), the last column's logits (1, V) once the
    passes have all run, and in shared pages its table of one row (``SharedPages.beside``) and the key of the
    request whose row took its pages (``Runner.join``; None: it holds them). A row moved to host memory
    (``Runner.swap_out``) is one too, its passes None: its cache holds the row's pages in host memory."""

    cache: SparseKVCache
    passes: Generator | None
    prompt: list[int]
    passed: list[int]
    reused: int = 0
    ran: int = 0
    begun: bool = False
    logits: torch.Tensor | None = None
    table: SharedPages | None = None
    holder: object = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


class PrefixCache:
    """Finished prompts' caches of one row (``PagedKVCache``; also ended requests' prompt and answer,
    ``Runner.release``), kept within ``budget`` device bytes, the least recently used dropped first, for prompts
    that begin with the same tokens: such a prompt starts from a copy of the shared whole pages
    (``PagedKVCache.seed``) and runs only the rest through the model (a conversation's next turn, another question
    on the same document). ``hits`` and ``reused_tokens`` count since the start."""

    def __init__(self, budget: int, page_size: int):
        self.budget, self.page_size = budget, page_size
        self.entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, PagedKVCache, int]] = OrderedDict()
        self.bytes = self.hits = self.reused_tokens = 0

    def find(self, prompt: list[int], most: int) -> tuple[int, PagedKVCache | None]:
        """The kept prompt sharing the most whole pages with the start of ``prompt``, at most ``most`` tokens: the
        tokens shared and its cache (0, None: none)."""
        ids = torch.tensor(prompt)
        best, found = 0, None
        for key, (tokens, _, _) in self.entries.items():
            n = min(len(tokens), len(ids), most)
            differ = (tokens[:n] != ids[:n]).nonzero()
            same = int(differ[0]) if len(differ) else n
            if same // self.page_size * self.page_size > best:
                best, found = same // self.page_size * self.page_size, key
        if found is None:
            return 0, None
        self.entries.move_to_end(found)
        self.hits += 1
        self.reused_tokens += best
        return best, self.entries[found][1]

    def keep(self, prompt: list[int], pages: PagedKVCache) -> bool:
        """Keeps the cache of a finished ``prompt`` unless it does not fit (False)."""
        size = pages.resident_bytes()
        if not self.room(prompt, size):
            return False
        self.entries[tuple(prompt)] = (torch.tensor(prompt), pages, size)
        self.bytes += size
        return True

    def room(self, prompt: list[int], size: int) -> bool:
        """Makes room for a cache of ``size`` bytes of ``prompt``, which serves the kept prompts it begins with (they
        go), then the least recently used as needed; returns whether it fits, False too where a kept prompt begins
        with ``prompt`` (it serves it already)."""
        key = tuple(prompt)
        if size > self.budget or any(len(k) >= len(key) and k[:len(key)] == key for k in self.entries):
            return False
        for other in [k for k in self.entries if len(k) <= len(key) and key[:len(k)] == k]:
            self._drop(other)
        while self.bytes + size > self.budget:
            self._drop(next(iter(self.entries)))
        return True

    def _drop(self, key: tuple[int, ...]) -> None:
        _, pages, size = self.entries.pop(key)
        pages.layers = []
        self.bytes -= size


class Runner:
    """Runs ``config``'s method on ``model`` for up to ``max_batch`` requests at once (see ``Engine`` for the arguments,
    validated the same way). ``max_new_tokens``: the most new tokens of any request (None: max_context), which sizes the
    rows of layers that hold only a request's decode tokens on the device (OmniKV's offloaded layers).
    ``max_prompt_tokens``: the most tokens of any prompt (None: max_context - 1), which sizes the rows of methods that
    hold a prompt and a bounded part of the decode (RaaS: the longest prompt's limit, not max_context) and bounds every
    row by it plus max_new_tokens. Requests are known by a key the caller gives (``join``). ``passes``: a prompt's
    prefill, ``engine.prefill_passes``'s signature (benchmarks give random keys and values instead).
    ``prefix_cache_bytes``: device memory for finished prompts' caches kept for prompts that begin like them
    (``PrefixCache``; 0: none), for methods whose prompt pages can start another prompt (``Method.prefix_reuse``).
    ``kv_memory_bytes``: the KV memory requests may hold at once (``ServingEngine``), which sizes the shared pages where
    the rows keep theirs there (None: what ``gpu_memory_utilization`` leaves, ``device_budget``, after the rows and one
    prompt's prefill); where rows keep their own pages, a given one makes the rows at most as many as it admits of the
    longest request (``max_batch`` then reads that count). ``gpu_memory_utilization``: on a CUDA device, the share of
    its total memory the process may take, the weights, the pool and the steps' memory (``profile``, measured before the
    pool is made) included; a pool that does not fit it is refused. ``grow``: in shared pages a row takes the pages of
    its new tokens as it reaches them (``growth``, ``grow``), not all of its max_tokens' when it joins. ``step_tokens``:
    the tokens of a mixed step (``launch_mixed``), which the profile's prompt pass takes where it exceeds
    prefill_chunk."""

    def __init__(self, model, config, *, max_batch: int, max_context: int | None, prefill_chunk: int,
                 cuda_graph: bool | None, compile: bool, passes: Callable = prefill_passes,
                 max_new_tokens: int | None = None, prefix_cache_bytes: int = 0, kv_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, grow: bool = False, step_tokens: int | None = None,
                 max_prompt_tokens: int | None = None, swap_space_bytes: int = 0):
        self.engine = Engine(model, config, max_batch=max_batch, max_context=max_context,
                             prefill_chunk=prefill_chunk, cuda_graph=cuda_graph, compile=compile)
        self.max_batch, self.max_context, self.compile = max_batch, self.engine.max_context, compile
        self.device = self.engine.device
        self.num_layers = model.config.num_hidden_layers
        attn = model.get_decoder().layers[0].self_attn
        self.tp_group = parallel.head_group(model)
        kv_heads = model.config.num_key_value_heads // parallel.size(self.tp_group)
        dtype = next(model.parameters()).dtype
        self.token_bytes, self.page_bytes = cache_bytes(config, kv_heads, attn.head_dim, dtype)
        itemsize = storage_dtype(config.kv_dtype, dtype).itemsize
        max_context = self.max_context
        self.max_new_tokens = max_context if max_new_tokens is None else max_new_tokens
        require(_is_count(self.max_new_tokens, 1) and self.max_new_tokens <= max_context, "max_new_tokens",
                f"None (max_context) or an int from 1 to max_context ({max_context})", max_new_tokens)
        self.max_prompt_tokens = max_context - 1 if max_prompt_tokens is None else max_prompt_tokens
        require(_is_count(self.max_prompt_tokens, 1) and self.max_prompt_tokens < max_context, "max_prompt_tokens",
                f"None (max_context - 1) or an int from 1 to max_context - 1 ({max_context - 1})", max_prompt_tokens)
        self.vocab_size = model.config.vocab_size
        require(_is_count(prefix_cache_bytes, 0), "prefix_cache_bytes", "an int >= 0 (0: no prefix cache)",
                prefix_cache_bytes)
        # Device memory beside the pool: one prompt's prefill (``prefill_bytes``), each row's penalty state (its count
        # of every token drawn and its logit bias, float32, and its prompt's tokens, bool: ``penalize``), and the
        # prefix cache.
        others = max_batch * 9 * self.vocab_size + prefix_cache_bytes
        require(is_real(gpu_memory_utilization) and 0 < gpu_memory_utilization <= 1, "gpu_memory_utilization",
                "a number in (0, 1]", gpu_memory_utilization)
        self.model, self.passes = model, passes
        self.window = _sliding_window(model.config)
        self.decoder = DecodeModel(model, self.engine.parts)
        self.most_tokens = max(prefill_chunk, step_tokens or 0)  # the most prompt tokens a forward carries
        self.profile_bytes = self.profile(config, self.most_tokens, max_batch) if self.device.type == "cuda" else 0
        budget = device_budget(self.device, gpu_memory_utilization, self.profile_bytes)

        def pool_bytes(method) -> int:
            return max_batch * pool_row_bytes(method, method.pool_pages(max_context, self.max_new_tokens,
                                                                        self.max_prompt_tokens),
                                              self.token_bytes, self.page_bytes, kv_heads, attn.head_dim, itemsize)

        # Of the configs the method leaves open (OmniKV's device layers), the first whose rows fit; with the device's
        # memory unknown, the last, which keeps the least there.
        choices = [c.build(self.num_layers) for c in config.build(self.num_layers).pool_configs()]

        def beside_bytes(method) -> int:
            return prefill_bytes(method, max_context, self.token_bytes, kv_heads, attn.head_dim, dtype,
                                 0 if step_tokens else model.config.hidden_size) + others

        self.method = choices[-1] if budget is None else next(
            (m for m in choices if pool_bytes(m) + beside_bytes(m) <= budget), choices[-1])
        self.config = self.method.config
        beside = beside_bytes(self.method)
        need = pool_bytes(self.method)
        self.kv_shape = (kv_heads, attn.head_dim, itemsize)  # what ``own_request_bytes`` reads of the cache
        slots = self.method.pool_pages(self.max_context, self.max_new_tokens, self.max_prompt_tokens)
        self.page_store_bytes = shared_page_bytes(self.method, self.token_bytes, self.page_bytes, self.num_layers)
        least = self.kv_bytes(1, 2)  # a request of one prompt token and one new one
        require(kv_memory_bytes is None or _is_count(kv_memory_bytes, least), "kv_memory_bytes",
                f"None (the pool's size) or an int >= {least} (the KV of the smallest request)", kv_memory_bytes)
        if not self.page_store_bytes and kv_memory_bytes is not None:
            # Rows that hold their own pages: as many as kv_memory_bytes admits of the longest request (a prompt of
            # max_prompt_tokens, then max_new_tokens), so that no row is allocated for admission to leave empty.
            longest = self.kv_bytes(self.max_prompt_tokens,
                                    min(self.max_prompt_tokens + self.max_new_tokens, max_context))
            max_batch = self.max_batch = own_rows(max_batch, kv_memory_bytes, longest)
            need = pool_bytes(self.method)
        store_pages = 0
        if self.page_store_bytes:
            # The shared pages: as many as kv_memory_bytes holds, else as the device budget leaves beside the rows
            # (on a CPU, every row's pages), at most every row's.
            most = max_batch * slots[0]
            room = kv_memory_bytes if kv_memory_bytes is not None else \
                most * self.page_store_bytes if budget is None else budget - need - beside
            store_pages = min(most, max(room // self.page_store_bytes, 0))
            require(store_pages >= 1, POOL_FIELD,
                    f"small enough that the rows ({need / 2**30:.2f} GiB) and one prompt's prefill, the rows' "
                    f"sampling state and the prefix cache ({beside / 2**30:.2f} GiB) leave room for a page of KV "
                    f"({self.page_store_bytes / 2**20:.1f} MiB) {_in_budget(budget, gpu_memory_utilization)}",
                    (max_batch, max_context))
            need += store_pages * self.page_store_bytes
        self.pool_bytes = need  # the device bytes the pool allocates, by the sums above
        require(budget is None or need + beside <= budget, POOL_FIELD,
                f"small enough that the pool of rows ({need / 2**30:.2f} GiB), and one prompt's prefill, the "
                f"rows' sampling state and the prefix cache ({beside / 2**30:.2f} GiB) fit "
                f"{_in_budget(budget, gpu_memory_utilization)}", (max_batch, max_context))
        # The pool's host store, and one prompt's own store while it is prefilled, must fit before any is taken.
        require_host_bytes((max_batch + 1) * self.method.pool_host_tokens(max_context) * self.token_bytes,
                           f"max_batch: the host store of {max_batch} rows and one prompt's own store need",
                           "use a smaller max_batch or max_context")
        # About one chunk of the prompt through every layer per call of ``prefill``.
        self.prefill_budget = prefill_chunk * self.num_layers
        self.method.tp_group = self.tp_group
        self.pool = SparseKVCache(self.method, DecodeStats(tp_group=self.tp_group), self.window)
        pages = self.pool.pages
        page = config.page_size
        kv_dtype = storage_dtype(config.kv_dtype, dtype)
        self.shared = SharedPages(max_batch, slots[0], store_pages, self.device) if store_pages else None
        self.grows = grow and self.shared is not None
        pages.layers = [PagedLayer(max_batch, kv_heads, attn.head_dim, page, n, kv_dtype, self.device, self.shared)
                        for n in slots]
        self.method.start_pool(pages.layers, self.max_context)
        # The KV memory requests may hold at once: the shared pages, or what is asked (default: the rows' size, with
        # the method's per-slot state, which ``kv_bytes`` counts).
        self.kv_memory_bytes = self.capacity_bytes() if self.shared is not None or kv_memory_bytes is None \
            else kv_memory_bytes
        pages.lengths = [0] * max_batch
        pages.seq_len = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        pages.in_prompt = False
        self.request_config = self.method.request_config()
        require(_is_count(swap_space_bytes, 0), "swap_space_bytes",
                "an int >= 0 (0: host copies of rows allocated as rows go to host memory)", swap_space_bytes)
        # Host copies of rows back from host memory (``swap_out``, ``discard``), kept for the next rows that go: on
        # a CUDA device, page-locking memory takes far longer than a copy through it. Each is (the device event
        # after the last copy that reads it, or None; its layers). As many as ``swap_space_bytes`` holds (at least
        # one) are made now, each of a row's every slot.
        self._spare: list[tuple[torch.cuda.Event | None, list[PagedLayer]]] = []
        if swap_space_bytes and rows_swap(self.config):
            copies = [self._host_layers(None)]
            per_copy = sum(layer.resident_bytes() for layer in copies[0])
            copies += [self._host_layers(None) for _ in range(swap_space_bytes // per_copy - 1)]  # at least one
            self._spare = [(None, layers) for layers in copies]
        self.prefixes = None
        if prefix_cache_bytes:
            require(self.method.prefix_reuse, "prefix_cache_bytes",
                    f"0 for {config.name}: its prompt's pages, once the prompt has run, cannot start another prompt "
                    f"(evicted, compressed or offloaded); a prefix cache serves dense, quest, lowbit, oracle, raas "
                    f"and omnikv without offload", prefix_cache_bytes)
            self.prefixes = PrefixCache(prefix_cache_bytes, config.page_size)

        def per_row(fill, dtype):
            return torch.full((max_batch,), fill, dtype=dtype, device=self.device)

        self.token = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)  # each row's next input
        self.temperature, self.top_p = per_row(0.0, torch.float32), per_row(1.0, torch.float32)
        self.top_k, self.seed, self.index = per_row(0, torch.long), per_row(0, torch.long), per_row(0, torch.long)
        self.min_p = per_row(0.0, torch.float32)
        # ``penalize``'s per-row state, read by the steps of rows whose sampling adjusts the logits.
        self.repetition, self.presence, self.frequency = (per_row(v, torch.float32) for v in (1.0, 0.0, 0.0))
        self.counts = torch.zeros(max_batch, self.vocab_size, dtype=torch.float32, device=self.device)
        self.bias = torch.zeros_like(self.counts)
        self.prompt_tokens = torch.zeros(max_batch, self.vocab_size, dtype=torch.bool, device=self.device)
        # A step's log-probabilities (``token_logprobs``), written by the steps of rows that asked for them.
        top = min(TOP_LOGPROBS, self.vocab_size)
        self.logprob = per_row(0.0, torch.float32)
        self.top_logprob = torch.zeros(max_batch, top, dtype=torch.float32, device=self.device)
        self.top_ids = torch.zeros(max_batch, top, dtype=torch.long, device=self.device)
        self.keys: list = []  # the request running in each row, rows [0, n)
        self.sampled: list[bool] = []
        self.adjusted: list[bool] = []  # whether the row's sampling adjusts the logits (``Sampling.adjusts``)
        self.logprobs: list[int | None] = []  # the top log-probabilities each row asked for (None: none)
        self.prompt_lens: list[int] = []
        self.max_tokens: list[int] = []
        self.steps: dict[tuple[int, bool, bool, bool, int, int | None],
                         tuple[SparseKVCache, CapturedStep, Callable[[torch.Tensor], None]]] = {}
        self.in_flight: list[Launched] = []  # the steps ``launch`` queued, oldest first, until ``collect``

    def profile(self, config, chunk: int, rows: int) -> int:
        """Device bytes the steps take beside the pool, measured (``peak_bytes``): the activations of prompt passes of
        ``chunk`` random tokens through every layer of ``config``'s method, a second one where the context allows
        (its attention over the keys before it, ``prompt_attention``'s second part, included; its cache of one row
        not counted: the pool holds a prompt's keys and values), plus a decode step's logits, sampling, penalties
        and log-probabilities over ``rows`` rows, apart because captured steps keep theirs in the graphs' memory
        pool (``engine.GraphCapture``)."""
        device, vocab = self.device, self.vocab_size

        def prompt_pass() -> int:
            method = config.build(self.num_layers)
            method.tp_group = self.tp_group
            cache = SparseKVCache(method, DecodeStats(tp_group=self.tp_group), self.window)
            tokens = min(2 * chunk, self.max_context)
            cache.pages.planned_tokens = method.planned_tokens([tokens], tokens)
            ids = torch.randint(vocab, (1, tokens), device=device)
            with apply(self.model, method.config), torch.no_grad():
                run_passes(prefill_passes(self.model, cache, ids, None, chunk, layers=self.decoder))
            return cache.pages.resident_bytes()

        def decode_tail() -> int:
            logits = torch.randn(rows, vocab, device=device)
            row = torch.ones(rows, device=device)
            zeros = torch.zeros_like(logits)
            chosen = penalize(logits, zeros, zeros.bool(), row, row * 0.5, row * 0.5, zeros)
            index = torch.arange(rows, device=device)
            token = draw(chosen, row, index, row * 0.9, row * 0.1, counter_noise(index, index, vocab))
            token_logprobs(logits, token, TOP_LOGPROBS)
            return 0

        return peak_bytes(device, prompt_pass) + peak_bytes(device, decode_tail)

    def prepare(self) -> int:
        """With ``compile`` (start-up time spent for speed), builds what the prompt passes would otherwise build
        mid-run: cuDNN's execution plans for every shape of their attention (``build_prompt_plans``; ~60 ms each, some
        100 shapes for a 32K context and 500 for 128K). PyTorch keeps them per thread: call this from the thread that
        runs the steps. Returns the count of shapes built."""
        if not self.compile:
            return 0
        attn = self.model.get_decoder().layers[0].self_attn
        return build_prompt_plans(*parallel.local_heads(self.model), attn.head_dim, next(self.model.parameters()).dtype,
                                  self.device, attn.scaling, self.most_tokens, self.max_context)

    @property
    def free_rows(self) -> int:
        return self.max_batch - len(self.keys)

    def growth(self) -> list:
        """Under ``grow``, the keys of the running rows whose next token starts a page they do not hold yet."""
        if not self.grows:
            return []
        lengths, held = self.pool.pages.lengths, self.shared.held
        return [key for row, key in enumerate(self.keys) if self._pages(lengths[row] + 1) > len(held[row])]

    def grow(self, keys: list) -> None:
        """Gives each row of ``keys`` (``growth``) the store page of its next token."""
        for key in keys:
            row = self.keys.index(key)
            self.shared.assign(row, len(self.shared.held[row]) + 1)

    def kv_bytes(self, prompt_len: int, total: int) -> int:
        """KV bytes (device and host) a request of ``prompt_len`` prompt tokens and ``total`` tokens in all holds at
        most: in shared pages, the pages it takes; else ``own_request_bytes``."""
        if self.page_store_bytes:
            return self._pages(total) * self.page_store_bytes
        return own_request_bytes(self.method, prompt_len, total, self.token_bytes, self.page_bytes, *self.kv_shape)

    def capacity_bytes(self) -> int:
        """Bytes of the pool's keys, values and key bounds on the device, and of its host store; in shared pages,
        of the pages (what requests take from)."""
        if self.shared is not None:
            return self.shared.pages * self.page_store_bytes
        return self.pool.pages.resident_bytes() + self.method.offloaded_bytes()

    def host_bytes(self) -> int:
        """Bytes of KV in host memory: the pool's host store."""
        return self.method.offloaded_bytes()

    def start(self, prompt: list[int], drawn: list[int] = ()) -> Prefill:
        """A prefill of ``prompt`` into a cache of one row, with a method of its own; ``drawn``: a preempted
        request's tokens but its last, run in the prompt's passes, which only a method whose decode step attends as
        a prompt pass allows (``Method.decodes_as_prompt``: dense; a sparse method's steps attended other keys and
        values than a prompt pass would, so its rows go to host memory instead: ``swap_out``). With a prefix cache,
        from the
        kept prompt that shares the most whole pages with its start (leaving at least the last pass's queries that
        the method reads, ``min_prompt_chunk``), looked up and copied at the first pass: prefills run one after
        another, so the prompts that end before it have been kept by then (requests on one document, arriving
        together, prefill it once). In shared pages the prompt's passes write its store pages, taken at the first
        pass (admission has counted them)."""
        method = self.request_config.build(self.num_layers)
        if drawn and not method.decodes_as_prompt:
            raise ValueError(f"start: {method.config.name} cannot prefill a request's drawn tokens (swap_out its row)")
        method.tp_group = self.tp_group
        cache = SparseKVCache(method, DecodeStats(tp_group=self.tp_group), self.window)
        # Only the prompt (and the drawn tokens): the request decodes in its row of the pool.
        passed = prompt + list(drawn)
        cache.pages.planned_tokens = method.planned_tokens([len(passed)], len(passed))
        job = Prefill(cache, None, prompt, passed)

        def passes() -> Generator[int, None, torch.Tensor]:
            self._begin(job)
            ids = device_tensor(passed[job.reused:], self.device).view(1, -1)
            return (yield from self.passes(self.model, cache, ids, None, self.engine.prefill_chunk, start=job.reused,
                                           layers=self.decoder))

        job.passes = passes()
        return job

    def swap_out(self, key, prompt: list[int]) -> Prefill:
        """A copy in host memory of the running row of ``key`` (a request of ``prompt``): its pages (keys, values,
        bounds; the partial last page too), their per-slot state, its lengths, and for a row of its own the method's
        per-row state (a pool of one row on the host), as a ``Prefill`` of no passes that ``join`` brings back into a
        row, the tokens it gives unchanged (``rows_swap``). The row itself stays until it is released."""
        if not rows_swap(self.config):
            raise RuntimeError(f"swap_out: a row of {self.config.name} cannot go to host memory and back unchanged")
        row, pages = self.keys.index(key), self.pool.pages
        used = self._pages(pages.lengths[row])
        method = self.request_config.build(self.num_layers)
        cache = SparseKVCache(method, DecodeStats(tp_group=self.tp_group), self.window)
        copy = cache.pages
        copy.layers = self._host_layers(used)
        with torch.no_grad():
            if self.shared is None:
                method.start_pool(copy.layers, self.max_context)
                method.copy_row(0, self.method, row, len(prompt))
            for kept, layer in zip(copy.layers, pages.layers):
                kept.copy_row(0, layer, row, used)
        copy.lengths = [pages.lengths[row]]
        copy.seq_len = pages.seq_len[row:row + 1].to("cpu", copy=True)  # on a CPU pool .to gives a view
        copy.in_prompt = False
        self.synchronize()  # the copies into page-locked memory ran asynchronously: the host may read them now
        return Prefill(cache, None, prompt, prompt, begun=True)

    def _host_layers(self, used: int | None) -> list[PagedLayer]:
        """Host layers for a copy of a row of ``used`` pages (None: as many as a row holds); in shared pages the
        row's pages go to its first slots, a row of its own keeps its slots' layout. The smallest spare copy
        (``discard``) that holds them; else new ones, page-locked on a CUDA device, in shared pages of the next power
        of two of ``used`` slots (so that copies fit later rows), and the smallest spare, which holds none of this
        size, is dropped (so that the copies kept are no more than the rows out at once)."""
        layers = self.pool.pages.layers
        capacity = [layer.capacity if used is None or self.shared is None
                    else min(layer.capacity, 1 << (used - 1).bit_length()) for layer in layers]
        def size(i: int) -> int:  # a copy's layers are sized alike
            return self._spare[i][1][0].capacity

        fits = [i for i in range(len(self._spare)) if size(i) >= capacity[0]]
        if fits:
            event, kept = self._spare.pop(min(fits, key=size))
            if event is not None:  # its last copy back to the device has run: the host may write it again
                event.synchronize()
            return kept
        if self._spare:
            self._spare.pop(min(range(len(self._spare)), key=size))
        return [PagedLayer(1, layer.shape[1], layer.shape[3], self.config.page_size, n, layer.k.dtype,
                           torch.device("cpu"), host_copy=True)
                for layer, n in zip(layers, capacity)]

    def _begin(self, job: Prefill) -> None:
        """A prefill's first pass: in shared pages, its store pages; with a prefix cache, the kept prompt's pages it
        starts from."""
        job.begun = True
        cache = job.cache
        if self.shared is not None:
            job.table = self.shared.beside(1)
            job.table.assign(0, self._pages(len(job.passed)))
            cache.pages.layers = [layer.beside(job.table) for layer in self.pool.pages.layers]
        if self.prefixes is not None:
            job.reused, source = self.prefixes.find(job.passed, len(job.passed) - cache.method.min_prompt_chunk())
            if source is not None:
                cache.pages.seed(source, job.reused)
                cache.columns = job.reused

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

    def synchronize(self) -> None:
        """Waits for the device's queued work (so that a host clock times it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def first_token(self, job: Prefill, sampling: Sampling, seed: int,
                    logprobs: int | None = None) -> tuple[int, Logprobs | None]:
        """The request's first new token, drawn from its prompt's logits (token index 0), and with ``logprobs`` (the
        likeliest tokens to list, up to ``TOP_LOGPROBS``) its log-probabilities."""
        one = torch.ones(1, dtype=torch.long, device=self.device)
        logits = job.logits
        if sampling.adjusts:  # nothing drawn yet: the prompt's repetition and the bias
            logits = penalize(logits, torch.zeros_like(logits, dtype=torch.float32), self._prompt_set(job),
                              *sampling.penalties(1, logits.shape[1], self.device))
        token = sampling(logits, one * seed, one * 0)
        if logprobs is None:
            return int(token[0]), None
        found = token_logprobs(job.logits, token, TOP_LOGPROBS)
        return int(token[0]), _logprobs(*(t.tolist()[0] for t in found), logprobs)

    def join(self, key, job: Prefill, first: int, sampling: Sampling, seed: int, max_tokens: int,
             logprobs: int | None = None, earlier: list[int] = ()) -> None:
        """Makes the prefilled request ``key`` (of at most ``max_tokens`` new tokens) a running row whose next input
        is ``first``; ``logprobs``: as in ``first_token``, for each of its tokens; ``earlier``: the tokens it drew
        before ``first`` (a request preempted and prefilled again with them, or brought back from host memory,
        ``swap_out``: its draws and penalties go on where they were). Requests of the same prompt join from one
        prefill, which the caller then ``discard``s: the prefill is copied into each row, except in shared pages,
        where the first request's row takes its pages and the others copy them from that row (and a row in host
        memory is copied into pages of its own). In shared pages the row takes the pages of its max_tokens, or
        (``grow``) of its next token only."""
        if not self.free_rows:
            raise RuntimeError("join: every row runs a request")
        row = len(self.keys)
        pages = self.pool.pages
        source, method, source_row = self._prefilled(job)
        takes = self.shared is not None and job.holder is None and job.table is not None
        if takes:
            self.shared.move(row, 0, job.table)
        try:
            if self.shared is not None:  # the pages of its new tokens
                held = source.lengths[source_row] + 1 if self.grows else job.prompt_len + max_tokens
                self.shared.assign(row, self._pages(held))
            with torch.no_grad():
                for layer, from_layer in zip(pages.layers, source.layers):
                    layer.copy_row(row, from_layer, source_row, self._pages(source.lengths[source_row]), moved=takes)
                pages.lengths[row] = source.lengths[source_row]
                pages.seq_len[row] = source.seq_len[source_row]
                self.method.copy_row(row, method, source_row, job.prompt_len)
            self._set_sampling(row, job, first, sampling, seed, earlier)
        except BaseException:  # the row runs nothing: its pages go back (its prefill's pages too, where it took them)
            if self.shared is not None:
                self.shared.release(row)
            pages.lengths[row] = 0
            raise
        if takes:
            job.holder = key
        self.keys.append(key)
        self.sampled.append(not sampling.greedy)
        self.adjusted.append(sampling.adjusts)
        self.logprobs.append(logprobs)
        self.prompt_lens.append(job.prompt_len)
        self.max_tokens.append(max_tokens)

    def _set_sampling(self, row: int, job: Prefill, first: int, sampling: Sampling, seed: int,
                      earlier: list[int]) -> None:
        """Sets ``row``'s next token, sampling, seed, token index and penalties' state (``earlier``: as in
        ``join``)."""
        # Each value is filled in by a kernel, not copied from the host: such a copy would wait for the step in
        # flight.
        for t, value in ((self.token[row], first), (self.temperature[row], sampling.temperature),
                         (self.top_k[row], sampling.top_k), (self.top_p[row], sampling.top_p), (self.seed[row], seed),
                         (self.index[row], 1 + len(earlier)), (self.min_p[row], sampling.min_p)):
            t.fill_(value)
        # Written for every request: a row that does not adjust may run in a step that does.
        for t, value in zip((self.repetition, self.presence, self.frequency, self.bias),
                            sampling.penalties(1, self.vocab_size, self.device)):
            t[row] = value[0]
        self.counts[row].zero_()
        self.counts[row, first].fill_(1)
        if earlier:  # a copy from the host, once for a request that comes back
            drawn = device_tensor(list(earlier), self.device)
            self.counts[row].index_add_(0, drawn, torch.ones_like(drawn, dtype=torch.float32))
        # Only a row whose sampling adjusts reads its prompt's tokens (a repetition penalty of 1 changes nothing).
        if sampling.adjusts:
            self.prompt_tokens[row] = self._prompt_set(job)[0]
        else:
            self.prompt_tokens[row].zero_()

    def discard(self, job: Prefill, keep: bool = False) -> None:
        """Drops a prefill: what its cache and method hold (a cancelled request's, or one that joined rows).
        ``keep``: a finished prefill's pages go to the prefix cache instead, if there is one and they fit; in shared
        pages a copy of its whole pages, from the row that took them if one did. A row's copy in host memory
        (``swap_out``) is kept for the next row that goes there."""
        job.cache.method.release()
        if job.passes is None:
            event = None
            if self.device.type == "cuda":  # the copies back to the device may still be queued
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            self._spare.append((event, job.cache.pages.layers))
            job.cache.pages.layers = []
            return
        job.passes.close()
        keep = keep and self.prefixes is not None and job.logits is not None
        if job.table is not None:
            try:
                if keep:
                    source, _, row = self._prefilled(job)
                    self._offer(job.prompt, source, row)
            finally:  # the pages no row took go back whatever happens
                job.table.release(0)
                job.cache.pages.layers = []
        elif not (keep and self.prefixes.keep(job.prompt, job.cache.pages)):
            job.cache.pages.layers = []

    def release(self, key, tokens: list[int] | None = None) -> None:
        """Frees the row of ``key``: the last running row moves into it. ``tokens``: the prompt and answer of a
        request that ended (stop or length), whose row's whole pages go to the prefix cache first where the method
        keeps its decode pages (``Method.answer_reuse``) and they fit."""
        if self.in_flight:
            raise RuntimeError("release: a decode step over the rows is in flight (collect it first)")
        row, last = self.keys.index(key), len(self.keys) - 1
        if tokens is not None and self.prefixes is not None and self.method.answer_reuse:
            self._offer(tokens, self.pool.pages, row)
        if self.shared is not None:
            self.shared.release(row)
        if row != last:
            pages = self.pool.pages
            if self.shared is not None:
                self.shared.move(row, last)  # its pages stay where they are
            with torch.no_grad():
                for layer in pages.layers:
                    layer.copy_row(row, layer, last, self._pages(pages.lengths[last]), moved=self.shared is not None)
                pages.lengths[row] = pages.lengths[last]
                pages.seq_len[row] = pages.seq_len[last]
                self.method.copy_row(row, self.method, last, self.prompt_lens[last])
                for t in (self.token, self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.index,
                          self.repetition, self.presence, self.frequency, self.bias, self.counts, self.prompt_tokens):
                    t[row] = t[last]
            for rows in self._host_rows:
                rows[row] = rows[last]
        for rows in self._host_rows:
            rows.pop()
        self.pool.pages.lengths[last] = 0

    def clear(self, jobs=()) -> None:
        """Drops every row, nothing copied, and the prefills ``jobs``: after a failure that leaves the rows' state
        unknown (the next requests join from row 0, their rows set anew). Pages the rows hold come back."""
        self.in_flight = []
        for job in jobs:
            self.discard(job)
        if self.shared is not None:
            for row in range(self.max_batch):
                self.shared.release(row)
        for rows in self._host_rows:
            rows.clear()
        self.pool.pages.lengths[:] = [0] * self.max_batch

    @property
    def _host_rows(self) -> tuple[list, ...]:
        """What the host keeps per running row."""
        return self.keys, self.sampled, self.adjusted, self.logprobs, self.prompt_lens, self.max_tokens

    def _prefilled(self, job: Prefill) -> tuple[PagedKVCache, Method, int]:
        """Where a finished prefill's prompt is: its own cache and method, row 0, or in shared pages, once a
        request's row took its pages (``join``), the pool's cache and method at that row."""
        if job.holder is None:
            return job.cache.pages, job.cache.method, 0
        return self.pool.pages, self.method, self.keys.index(job.holder)

    def _offer(self, tokens: list[int], pages: PagedKVCache, row: int) -> None:
        """``_keep``, whose failure (no memory for the copy) is logged, not raised: the request the pages come from
        has ended well, and the prefix cache only saves prefill work."""
        try:
            self._keep(tokens, pages, row)
        except Exception:
            log.warning("a prompt's pages could not be kept in the prefix cache", exc_info=True)

    def _keep(self, tokens: list[int], pages: PagedKVCache, row: int) -> None:
        """Copies the whole pages of ``row`` of ``pages`` (the pool's, or a prefill's), which holds the KV of
        ``tokens``' first tokens, into the prefix cache, once room is made for them (nothing is allocated beyond its
        budget)."""
        held = min(len(tokens), pages.lengths[row]) // self.config.page_size * self.config.page_size
        if not held or not self.prefixes.room(tokens[:held], (held // self.config.page_size + 1) * pages.slot_bytes()):
            return
        kept = PagedKVCache(self.num_layers, self.config.page_size, None, self.config.kv_dtype)
        kept.planned_tokens = held
        with torch.no_grad():
            kept.seed(pages, held, row)
        self.prefixes.keep(tokens[:held], kept)

    def _prompt_set(self, job: Prefill) -> torch.Tensor:
        """(1, V) bool: the prompt's tokens."""
        ids = torch.tensor([job.prompt], device=self.device)
        return token_set(ids, torch.ones_like(ids), self.vocab_size)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.config.page_size)

    def decode(self) -> dict:
        """One decode step over the running rows; returns each request's new token and, for a request that asked
        for them, its ``Logprobs`` (else None), by key."""
        return self.collect(self.launch())

    def launch(self) -> "Launched":
        """Queues one decode step over the running rows on the device and returns at once, so that the host can
        queue other work (a prefill's passes, a join, the next step) behind it; ``collect`` reads its tokens. Rows
        that join in between are not in it; no row may be released before it is collected. At most
        ``MAX_IN_FLIGHT`` steps are queued: the next step may be queued before the last is collected, and each row's
        next input is the token the step before it drew, on the device."""
        if len(self.in_flight) >= MAX_IN_FLIGHT:
            raise RuntimeError(f"launch: {MAX_IN_FLIGHT} steps are in flight (collect the oldest first)")
        cache, run, _ = self._rows_step()
        with torch.no_grad():
            run()
        return self._launched(cache)

    def launch_mixed(self, jobs: list[Prefill], tokens: int) -> "Launched":
        """``launch``, the step carrying the next prompt tokens of ``jobs`` (the oldest first, each up to its
        prompt's end, ``tokens`` in all) beside the running rows' decode tokens, through the model together
        (``DecodeModel.mixed``: each weight read once for all), run eagerly; after a prompt's last, its
        ``job.logits``. With no row running, prompt passes through every layer. A prefill is run by mixed steps
        only, from its first: a layer-major pass (``prefill``) would leave its layers at different columns. Only in
        shared pages (``ServingEngine``'s ``step_tokens``), where a prompt pass reads the prompt's earlier pages in
        the store, chunks in any order."""
        if self.in_flight:
            raise RuntimeError("launch_mixed: the step launched before is not collected")
        chunks = []
        for job in jobs:
            if tokens <= 0:
                break
            if not job.begun:
                self._begin(job)
            begin = job.reused + job.ran
            end = min(begin + tokens, len(job.passed))
            ends = end == len(job.passed)
            job.cache.prompt_end, job.cache.pending_mask = ends, None
            chunks.append(PromptChunk(device_tensor(job.passed[begin:end], self.device).view(1, -1), begin,
                                      job.cache, ends))
            tokens -= end - begin
        n = len(self.keys)
        cache, _, sample = self._rows_step() if n else (None, None, None)
        with apply(self.model, self.config), torch.no_grad():
            logits, found = self.decoder.mixed(self.token[:n], self.pool.pages.seq_len[:n].view(n, 1), cache, chunks)
            if n:
                sample(logits)
        for job, chunk, job_logits in zip(jobs, chunks, found):
            job.ran += chunk.ids.shape[1]
            job.logits = job_logits
        return self._launched(cache)

    def _rows_step(self) -> tuple[SparseKVCache, CapturedStep, Callable[[torch.Tensor], None]]:
        """The running rows' step (``_step``), its cache set to the pool's lengths."""
        n = len(self.keys)
        room = self.max_context
        if self.method.sized_by_decode_tokens:  # a step per power of two of the rows' longest decode
            room = min(room, 1 << (max(self.max_tokens) - 1).bit_length())
        scored = any(k is not None for k in self.logprobs)
        found = self._step(n, any(self.sampled), scored, any(self.adjusted), room, self.method.step_slots(n))
        pages, cache = self.pool.pages, found[0]
        cache.pages.lengths = pages.lengths[:n]
        for layer, view in zip(pages.layers, cache.pages.layers):
            view.dropped = layer.dropped[:n]
        return found

    def _launched(self, cache: SparseKVCache | None) -> "Launched":
        """The step just queued over the running rows (``cache``: their view, None for no row), in flight."""
        n = len(self.keys)
        if cache is not None:
            self.pool.pages.lengths[:n] = cache.pages.lengths
        scored = any(k is not None for k in self.logprobs)
        results = (self.token[:n, 0], *((self.logprob[:n], self.top_logprob[:n], self.top_ids[:n]) if scored else ()))
        cuda = self.device.type == "cuda"
        found = tuple(t.to("cpu", non_blocking=True) if cuda else t.clone() for t in results)
        done = torch.cuda.Event() if cuda else None
        if done is not None:  # on the stream of the pool's device, which need not be the current device
            done.record(torch.cuda.current_stream(self.device))
        step = Launched(list(self.keys), list(self.logprobs) if scored else None, found, done)
        self.in_flight.append(step)
        return step

    def collect(self, step: "Launched") -> dict:
        """``decode``'s result for the oldest step in flight (waits for the device to finish that step alone)."""
        if not self.in_flight or step is not self.in_flight[0]:
            raise RuntimeError("collect: not the oldest step in flight (each launched step is collected once, in "
                               "order)")
        self.in_flight.pop(0)
        if step.done is not None:
            step.done.synchronize()
        tokens, *scores = (t.tolist() for t in step.found)
        found = [None] * len(step.keys)
        if step.logprobs is not None:
            found = [None if k is None else _logprobs(*row, k) for *row, k in zip(*scores, step.logprobs)]
        return dict(zip(step.keys, zip(tokens, found)))

    def _step(self, n: int, sampled: bool, scored: bool, adjusted: bool, room: int,
              slots: int | None) -> tuple[SparseKVCache, CapturedStep, Callable[[torch.Tensor], None]]:
        """The decode step over rows [0, n) (``sampled``: some row samples; ``scored``: some row asked for
        log-probabilities; ``adjusted``: some row's sampling adjusts the logits; ``room``: no row holds more tokens
        after its prompt; ``slots``: ``Method.step_slots``), made at its first use: a cache and method that are views
        of the pool's first n rows, the step (captured at its second run where the engine captures) and its drawing
        of the rows' tokens from their logits (B, V), which a mixed step runs too. A row whose sampling does not
        adjust runs in an adjusting step unchanged: its penalties and bias are zero."""
        key = (n, sampled, scored, adjusted, room, slots)
        if key in self.steps:
            return self.steps[key]
        cache = SparseKVCache(self.method.rows(n, room), DecodeStats(tp_group=self.tp_group), self.window)
        cache.pages = self.pool.pages.rows(n)
        token, seq_len = self.token[:n], self.pool.pages.seq_len[:n]
        temperature, top_k, top_p, min_p = self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n]
        seed, index = self.seed[:n], self.index[:n]
        logprob, top_logprob, top_ids = self.logprob[:n], self.top_logprob[:n], self.top_ids[:n]
        counts, prompt = self.counts[:n], self.prompt_tokens[:n]
        penalties = (self.repetition[:n], self.presence[:n], self.frequency[:n], self.bias[:n])

        def sample(logits: torch.Tensor) -> None:
            chosen = penalize(logits, counts, prompt, *penalties) if adjusted else logits
            if sampled:
                nxt = draw(chosen, temperature, top_k, top_p, min_p, counter_noise(seed, index, logits.shape[1]))
            else:
                nxt = argmax(chosen)
            token.copy_(nxt.view(n, 1))
            index.add_(1)
            if adjusted:
                counts.scatter_add_(1, token, torch.ones_like(token, dtype=torch.float32))
            if scored:
                for out, value in zip((logprob, top_logprob, top_ids), token_logprobs(logits, nxt, TOP_LOGPROBS)):
                    out.copy_(value)

        def step() -> None:
            sample(self.decoder(token, seq_len.view(n, 1), cache))

        self.steps[key] = cache, CapturedStep(step, cache, self.engine.capture), sample
        return self.steps[key]


def _in_budget(budget: int | None, utilization: float) -> str:
    """Where a pool must fit: the device budget (``device_budget``) of ``budget`` bytes."""
    return (f"in the {(budget or 0) / 2**30:.2f} GiB that gpu_memory_utilization ({utilization}) leaves of the device "
            f"after what is in use on it and the steps' profile")


def _logprobs(logprob: float, top: list[float], ids: list[int], k: int) -> Logprobs:
    """``Logprobs`` from a row of ``token_logprobs``' results (host values), its ``k`` likeliest tokens."""
    return Logprobs(logprob, tuple(zip(ids[:k], top[:k])))
