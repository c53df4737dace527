"""Who runs next: requests, their queue, admission by memory, and the scheduler's loop (``ServingEngine``).

A request, as data::

    submit -> validate (RequestError) -> queue (QueueFull when max_queue wait) -> admitted when its KV fits
           -> prefill (in passes: about one chunk per step, or what the PrefillPacer allows while rows decode; one
              prefill for the requests of one prompt admitted while it runs, such as a client's n choices)
           -> first token (each request its own) -> a running row
           -> one token per step -> stop token, max_tokens or cancel: its row is freed at the step boundary
           (a failure inside a step: "error", see ``ServingEngine.step``)
           (admission "grow": a row takes its pages as it grows; where the store cannot give the running rows their
            next pages, the newest admitted request is preempted: its pages go back and it waits at the front of
            the queue, then its prompt and the tokens it has drawn are prefilled again (dense), or its row, copied
            to host memory when it was preempted, is copied back (Quest), and it goes on)

``submit`` and ``cancel`` may come from any thread; ``step`` runs in one thread (the server's loop), which alone
touches the runner and the model.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from ..engine import SAMPLING_FORM, Sampling, _is_count, check_seed, prefill_passes, token_id_list
from ..errors import ConfigError
from ..methods.base import MethodConfig, is_real, require
from .runner import TOP_LOGPROBS, Logprobs, Prefill, Runner, rows_share_pages, rows_swap

log = logging.getLogger("sparsekv.serve")

# How admission counts a request's KV (``ServingEngine``).
ADMISSIONS = ("reserve", "grow")
# How a running request preempted under admission "grow" comes back (``ServingEngine``): its prompt and drawn tokens
# prefilled again, or its row copied to host memory and back.
PREEMPTIONS = ("recompute", "swap")
# The finish reasons a caller may end a request with (``ServingEngine.cancel``): "stop" where the caller found its
# end itself (a server's stop string).
CANCEL_REASONS = ("cancelled", "stop")


def swaps_when_preempted(config, admission: str, preemption: str | None, field: str = "preemption") -> bool:
    """Whether a running request of ``config``'s method preempted under ``admission`` goes to host memory (True)
    or is prefilled again (False), by ``preemption`` (``ServingEngine``'s); ConfigError naming ``field`` (a
    command's option) where it cannot apply."""
    recomputes = isinstance(config, MethodConfig) and config.method_class().decodes_as_prompt
    if preemption is not None:
        require(preemption in PREEMPTIONS, field, " or ".join(map(repr, PREEMPTIONS)), preemption)
        require(admission == "grow", field, 'given only with admission "grow" (the only one that preempts)',
                preemption)
        require(preemption == "swap" or recomputes, field,
                f"'swap' for {config.name} (or not given): a prompt pass cannot redo its decode steps, which attended "
                f"the pages it chose", preemption)
    return preemption == "swap" or not recomputes


def check_time_slice(config, admission: str, preemption: str | None, time_slice: int | None,
                     field: str = "time_slice") -> None:
    """ConfigError naming ``field`` (a command's option) where ``time_slice`` (``ServingEngine``'s) cannot apply to
    ``config``'s method: its rows must go to host memory and back unchanged (``runner.rows_swap``), and come back that
    way when preempted (``swaps_when_preempted``)."""
    if time_slice is None:
        return
    require(_is_count(time_slice, 1), field, "None (no time slicing) or an int >= 1", time_slice)
    require(rows_swap(config), field, f"None for {config.name}: its rows cannot go to host memory and back unchanged",
            time_slice)
    require(swaps_when_preempted(config, admission, preemption), field,
            f'None for {config.name} unless preemption is "swap": a row that yields goes to host memory', time_slice)


def check_swap_space(config, admission: str, preemption: str | None, time_slice: int | None, swap_space,
                     field: str = "swap_space_bytes") -> None:
    """ConfigError naming ``field`` (a command's option) where ``swap_space`` (host memory set aside for rows that
    go there, ``ServingEngine``'s) is not a number >= 0, or is set where no row goes to host memory: without time
    slicing, only rows in shared pages preempted under admission "grow" with swap do."""
    require(is_real(swap_space) and swap_space >= 0, field, "a number >= 0", swap_space)
    moves = time_slice is not None or (admission == "grow" and rows_share_pages(config)
                                       and swaps_when_preempted(config, admission, preemption))
    require(not swap_space or moves, field,
            f'0 for {config.name} here: no row goes to host memory (time slicing does, and so does preemption "swap" '
            f'under admission "grow" for dense and quest)', swap_space)


class RequestError(ConfigError):
    """A request field that is not allowed, or a request that can never fit: ``field`` must be ``allowed``."""


class ContextTooLong(RequestError):
    """A request whose prompt, or prompt and new tokens, exceed ``max_context``, or whose prompt exceeds
    ``max_prompt_tokens``."""


class QueueFull(RuntimeError):
    """``max_queue`` requests already wait; the client should retry later."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What one client asks for: ``prompt`` token ids, at most ``max_tokens`` new tokens, drawn by ``sampling``
    (greedy by default); ``stop_tokens`` end it (the stop token is its last token; ``()``: none, a server passes
    ``ServingEngine.stop_tokens_default`` for a client that names none); ``seed`` makes a sampled request
    reproducible (None: a random one), whatever other requests share its batch; ``logprobs``: each new token's
    log-probability and those of the ``logprobs`` likeliest tokens (``runner.Logprobs``; None: none)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_tokens: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt", token_id_list(self.prompt, "prompt", least=1, error=RequestError))
        if not _is_count(self.max_tokens, 1):
            raise RequestError("max_tokens", "an int >= 1", self.max_tokens)
        if not isinstance(self.sampling, Sampling):
            raise RequestError("sampling", SAMPLING_FORM, self.sampling)
        object.__setattr__(self, "stop_tokens", tuple(token_id_list(self.stop_tokens, "stop_tokens",
                                                                    error=RequestError)))
        check_seed(self.seed, RequestError)
        if self.logprobs is not None and not (_is_count(self.logprobs, 0) and self.logprobs <= TOP_LOGPROBS):
            raise RequestError("logprobs", f"None or an int from 0 to {TOP_LOGPROBS}", self.logprobs)


@dataclass
class Event:
    """What happened to one request in one step: its ``tokens`` new since its last event (may be empty at the
    finish), whether it ``finished`` and why ("stop", "length", "cancelled", or "error": a failure inside a step,
    which ``error`` describes), its usage counts, and for a request that asked for them the ``logprobs`` of its new
    tokens (one each; else None)."""

    request_id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[Logprobs] | None = None
    cached_tokens: int = 0  # prompt tokens whose prefill a kept prompt gave (the prefix cache)
    error: str | None = None  # for finish reason "error": what failed


class PrefillPacer:
    """Decode priority: while requests decode, the prefill passes run between decode steps take at most about
    ``share`` times the decode steps' time, so that a running request's time per output token stays near
    (1 + share) x the decode step. A credit in seconds: each decode step adds ``share`` x its measured time (a
    positive credit is capped at one step's worth, so that no burst follows an idle prefill queue); each prefill run
    while rows decode spends its measured time. The prefill runs while the credit is positive, at most the
    token-layers the credit pays for at the last measured seconds per token-layer, and at least one pass (a pass is
    one chunk through one layer): a pass longer than a step's credit is paid back over the next steps.

    The price is the time to first token of a request that arrives while others decode: its prefill gets
    share / (1 + share) of the time instead of about all of it, so it takes about (1 + share) / share times as
    long as alone (share 0.25: 5x); with no row decoding the prefill runs at full speed."""

    def __init__(self, share: float):
        require(is_real(share) and share > 0, "prefill_share", "None (a chunk per step) or a number > 0", share)
        self.share = float(share)
        self.credit = 0.0  # seconds of prefill the decode steps have paid for
        self.per_work: float | None = None  # seconds per token-layer of the last prefill run

    def budget(self) -> int:
        """Token-layers of prefill allowed now (0: none; the runner runs at least one pass for any other)."""
        if self.credit <= 0:
            return 0
        if self.per_work is None:
            return 1
        return max(int(self.credit / self.per_work), 1)

    def decoded(self, seconds: float) -> None:
        """A decode step took ``seconds``."""
        self.credit = min(self.credit + self.share * seconds, self.share * seconds)

    def prefilled(self, seconds: float, work: int, decoding: bool) -> None:
        """A prefill run of ``work`` token-layers took ``seconds``; ``decoding``: rows were running meanwhile."""
        self.per_work = seconds / work
        if decoding:
            self.credit -= seconds


@dataclass
class _Live:
    """A request inside the engine: its id, what it asked, its seed, its prefill while it runs, the tokens it has
    generated (with their log-probabilities where it asked for them), how many of them its events have
    delivered, the prompt tokens the prefix cache gave, the KV bytes admission counts it for (``held``), when it
    was admitted (``admitted``: a count, the newest highest) and, while it waits preempted, its row in host memory
    (``swapped``, ``Runner.swap_out``)."""

    id: int
    request: Request
    seed: int
    prefill: Prefill | None = None
    cached: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    shown: int = 0
    held: int = 0
    admitted: int = 0
    swapped: Prefill | None = None

    @property
    def context(self) -> int:
        """The tokens its KV holds when it joins the rows: the prompt's, and for a request preempted after drawing
        tokens, those tokens' but the last, which is its next input."""
        return len(self.request.prompt) + max(len(self.tokens) - 1, 0)


class ServingEngine:
    """Continuous batching of ``config``'s method on ``model``: requests join and leave the running rows at step
    boundaries; a new request's prompt is prefilled in passes interleaved with the decode steps.

    max_batch: rows decoded together; max_context: tokens per request (prompt plus new ones; default the model's limit);
    max_new_tokens: new tokens per request (default max_context; a smaller one shrinks the rows of layers that hold only
    the decode tokens on the device, OmniKV's offloaded layers); max_prompt_tokens: tokens per prompt (default
    max_context - 1; a smaller one shrinks the rows of methods that hold a prompt and a bounded part of the decode,
    RaaS's, to the longest prompt's, and bounds every row by it plus max_new_tokens); prefill_chunk: prompt tokens per
    pass, and about the prefill work done per step (one chunk through every layer); prefill_share: None, or decode
    priority (``PrefillPacer``): while requests decode, prefill takes at most about this share of the decode steps'
    time; max_queue: requests that may wait; cuda_graph, compile: as in ``Engine``; kv_memory_bytes: the KV memory
    requests may hold at once (default: what the runner's pool holds for ``max_batch`` rows; for methods whose rows keep
    their keys and values in shared pages, the size of those pages, by default what the device leaves; for the others,
    given, it also bounds the rows to as many as it admits of the longest request);
    gpu_memory_utilization: on a CUDA device, the share of its total memory the process may take (weights, pool and the
    steps' measured profile, ``Runner.profile``), as vLLM's option of that name. tokenizer: gives the default stop
    tokens. prefill: a prompt's prefill, ``engine.prefill_passes``'s signature (benchmarks give
    ``bench.e2e.random_passes``: random keys and values). prefix_cache_bytes: device memory for finished prompts'
    caches, which start the prompts that begin with the same tokens (``runner.PrefixCache``; 0: none). admission:
    "reserve" counts each request's KV of its prompt and max_tokens from its admission; "grow" (methods in shared pages:
    dense, quest) counts its prompt's and then each page it takes as it grows, and preempts the newest admitted request
    where the store cannot give the running rows their next pages (later its prompt and tokens so far are prefilled
    again, or for methods whose decode step a prompt pass cannot redo (Quest) its row comes back from host memory, and
    it goes on with the same tokens); other methods' rows are bounded and counted whole either way. step_tokens: None,
    or mixed steps (methods in shared pages: dense, quest): each step carries the running rows' decode tokens and the
    next prompt tokens of the oldest prefills, at most ``step_tokens`` tokens in all (as vLLM's
    ``max_num_batched_tokens``), through the model together (``Runner.launch_mixed``); steps with no prompt tokens stay
    captured. preemption: under "grow", how a preempted running request comes back: "recompute" (its prompt and
    drawn tokens prefilled again, as vLLM does; only for a method whose decode step a prompt pass redoes:
    dense), "swap" (its row copied to host memory and back: PCIe time instead of compute), or None, the method's
    (recompute for dense, swap for Quest). time_slice: None, or time slicing: while the request at the front of the
    queue cannot be admitted, a running request that has drawn ``time_slice`` tokens more than it has yields its row
    (copied to host memory, ``Runner.swap_out``) and waits at the back of the queue, the one that has drawn the most
    first, so that requests of equal lengths advance together and a full batch runs to the end of a load (without it,
    requests run in the order they came, and the last of them run at a smaller batch). For rows that go to host
    memory and back unchanged (``runner.rows_swap``) and come back that way (dense with preemption "swap").
    swap_space_bytes: host memory set aside at the start for rows that go there (time slicing, preemption "swap"),
    page-locked on a CUDA device, as vLLM's ``swap_space``: row copies beyond it are allocated as rows go, and every
    copy is kept for the next row once its row is back (page-locking memory takes longer than the copy through it:
    ``Runner.swap_out``)."""

    def __init__(self, model, config, *, tokenizer=None, max_batch: int = 8, max_context: int | None = None,
                 prefill_chunk: int = 4096, prefill_share: float | None = None, max_queue: int = 256,
                 cuda_graph: bool | None = None, compile: bool = False, kv_memory_bytes: int | None = None,
                 prefill: Callable = prefill_passes, max_new_tokens: int | None = None, prefix_cache_bytes: int = 0,
                 admission: str = "reserve", gpu_memory_utilization: float = 0.9, step_tokens: int | None = None,
                 max_prompt_tokens: int | None = None, preemption: str | None = None,
                 time_slice: int | None = None, swap_space_bytes: int = 0):
        if not _is_count(max_queue, 1):
            raise ConfigError("max_queue", "an int >= 1", max_queue)
        require(admission in ADMISSIONS, "admission", " or ".join(map(repr, ADMISSIONS)), admission)
        require(callable(prefill), "prefill", "a callable of engine.prefill_passes's signature", prefill)
        swaps = swaps_when_preempted(config, admission, preemption)
        check_time_slice(config, admission, preemption, time_slice)
        check_swap_space(config, admission, preemption, time_slice, swap_space_bytes)
        self.pacer = None if prefill_share is None else PrefillPacer(prefill_share)
        self.runner = Runner(model, config, max_batch=max_batch, max_context=max_context,
                             prefill_chunk=prefill_chunk, cuda_graph=cuda_graph, compile=compile, passes=prefill,
                             max_new_tokens=max_new_tokens, prefix_cache_bytes=prefix_cache_bytes,
                             kv_memory_bytes=kv_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                             grow=admission == "grow", step_tokens=step_tokens, max_prompt_tokens=max_prompt_tokens,
                             swap_space_bytes=swap_space_bytes)
        self.tokenizer, self.max_queue, self.kv_memory_bytes = tokenizer, max_queue, self.runner.kv_memory_bytes
        if step_tokens is not None:
            require(_is_count(step_tokens, max_batch + 1), "step_tokens",
                    f"None (no mixed steps) or an int > max_batch ({max_batch}), room for a prompt token beside every "
                    f"row's", step_tokens)
            require(self.runner.shared is not None, "step_tokens",
                    f"None for {self.runner.config.name}: mixed steps serve the methods in shared pages (dense, quest)",
                    step_tokens)
            require(prefill_share is None, "prefill_share", "None with step_tokens (mixed steps schedule the prefill)",
                    prefill_share)
        self.step_tokens = step_tokens
        self._swaps = swaps
        self.time_slice = time_slice
        self._lock = threading.Lock()
        self._next_id = 0
        self._queue: deque[_Live] = deque()
        self._cancel: dict[int, str] = {}  # request id -> the finish reason it ends with
        self._prefilling: list[_Live] = []
        self._running: dict[int, _Live] = {}  # id -> request
        self._in_use = 0  # KV bytes of the admitted requests
        self._generated = 0
        self._finished: dict[str, int] = {}  # requests finished since the start, by finish reason
        self._prefill_work = 0  # token-layers of prefill run
        self._admissions = 0  # requests admitted since the start (``_Live.admitted``)
        self._preempted = 0  # preemptions since the start
        self._yielded = 0  # rows yielded to the queue by time slicing since the start
        self._swap_seconds = 0.0  # host time in moving rows to host memory and back since the start
        self._carried: list[Event] = []  # events of a step that raised, returned by the next
        # Rows whose requests ended while a step over them was in flight (its tokens for them are dropped): released
        # once it is collected, with the tokens their prefix cache may keep.
        self._ended_rows: list[tuple[int, list[int] | None]] = []
        self._ended: Exception | None = None  # a failure whose requests ended already, raised to ``step``

    @property
    def stop_tokens_default(self) -> tuple[int, ...]:
        """The model's EOS ids (for requests that give none)."""
        eos = getattr(self.runner.model.generation_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    def submit(self, request: Request) -> int:
        """Queues ``request`` and returns its id. Raises RequestError when it can never run here (its tokens
        outside the vocabulary, longer than max_context or its prompt than max_prompt_tokens, more new tokens than
        max_new_tokens, or more KV than kv_memory_bytes), QueueFull when max_queue requests wait already.
        Thread-safe."""
        if not isinstance(request, Request):
            raise TypeError(f"submit takes a sparsekv.serve.Request, got {type(request).__name__}")
        runner = self.runner
        vocab = runner.vocab_size
        if max(request.prompt) >= vocab:
            raise RequestError("prompt", f"token ids below the vocabulary size ({vocab})", request.prompt)
        if request.stop_tokens and max(request.stop_tokens) >= vocab:
            raise RequestError("stop_tokens", f"token ids below the vocabulary size ({vocab})", request.stop_tokens)
        request.sampling.check_vocab(vocab)
        if request.max_tokens > runner.max_new_tokens:
            raise RequestError("max_tokens", f"at most max_new_tokens ({runner.max_new_tokens})", request.max_tokens)
        if len(request.prompt) >= runner.max_context:
            raise ContextTooLong("prompt", f"at most {runner.max_context - 1} tokens (max_context, "
                               f"{runner.max_context}, less one new token)", len(request.prompt))
        if len(request.prompt) > runner.max_prompt_tokens:
            raise ContextTooLong("prompt", f"at most {runner.max_prompt_tokens} tokens (max_prompt_tokens)",
                                 len(request.prompt))
        total = len(request.prompt) + request.max_tokens
        if total > runner.max_context:
            raise ContextTooLong("max_tokens", f"at most max_context ({runner.max_context}) less the prompt's "
                               f"{len(request.prompt)} tokens", request.max_tokens)
        need = runner.kv_bytes(len(request.prompt), total)
        if need > self.kv_memory_bytes:
            raise RequestError("prompt and max_tokens", f"at most kv_memory_bytes ({self.kv_memory_bytes}) of KV "
                               f"for {self.runner.config.name}", f"{need} bytes")
        with self._lock:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already (max_queue)")
            rid = self._next_id
            self._next_id += 1
            seed = request.seed if request.seed is not None else random.getrandbits(62)
            self._queue.append(_Live(rid, request, seed))
        return rid

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """Ends the request at the next step boundary, with a final event of finish reason ``reason``: "cancelled",
        or "stop" for a caller that found the request's end itself (a server's stop string). Unknown or finished ids:
        nothing happens; a request cancelled twice ends with the first reason. Thread-safe."""
        if not _is_count(request_id, 0):
            raise ConfigError("request_id", "an id that submit returned (an int >= 0)", request_id)
        if reason not in CANCEL_REASONS:
            raise ConfigError("reason", " or ".join(map(repr, CANCEL_REASONS)), reason)
        with self._lock:
            self._cancel.setdefault(request_id, reason)

    def has_work(self) -> bool:
        """Whether anything is queued, prefilling or running, a row whose request ended waits for the step queued over
        it, or a step that raised left events to return."""
        with self._lock:
            return bool(self._queue or self._prefilling or self._running or self._carried or self._ended_rows)

    def metrics(self) -> dict:
        """Rows, queue and memory now (``free_rows``: rows neither running nor taken by a prefill), and totals since
        the start (``finished_requests``: by finish reason, "stop", "length", "cancelled" or "error"; ``preempted``:
        preemptions under admission "grow"; ``yielded``: rows yielded by time slicing; ``swap_seconds``: the host's
        time in moving rows to host memory (``Runner.swap_out``, which waits for its copies) and in bringing them back;
        ``prefix_hits``: prompts started from a kept prompt's cache, ``prefix_tokens_reused``: the prompt tokens it
        gave them)."""
        with self._lock:
            queued, running, prefilling = len(self._queue), len(self._running), len(self._prefilling)
        return {"running": running, "queued": queued, "prefilling": prefilling,
                "free_rows": self.runner.max_batch - running - prefilling, "kv_bytes_in_use": self._in_use,
                "kv_bytes_capacity": self.kv_memory_bytes, "host_kv_bytes": self.runner.host_bytes(),
                "generated_tokens": self._generated, "finished_requests": dict(self._finished),
                "prefill_work": self._prefill_work, "preempted": self._preempted, "yielded": self._yielded,
                "swap_seconds": self._swap_seconds,
                **self._prefix_metrics()}

    def _prefix_metrics(self) -> dict:
        cache = self.runner.prefixes
        if cache is None:
            return {"prefix_cache_bytes": 0, "prefix_hits": 0, "prefix_tokens_reused": 0}
        return {"prefix_cache_bytes": cache.bytes, "prefix_hits": cache.hits,
                "prefix_tokens_reused": cache.reused_tokens}

    def step(self, raise_errors: bool = True) -> list[Event]:
        """One iteration: cancellations, admission, one decode step over the running rows with the prefill (about
        one chunk, or what the pacer allows while rows decode) queued behind it, or with a pacer before it, so that
        its time is its own. Where only decoding comes before the next step, that step is queued before this one's
        tokens are read, and stays in flight until the next call (``_pages_ahead``). Returns the events of this
        step. Call from one thread only.

        A failure (an ``Exception``) inside a step ends the requests it belongs to, with finish reason "error" (the
        event's ``error`` says what failed), and the step stops there: a prefill's, its first token's or its join
        into a row ends the requests of that prefill, an admission's its request, and the running requests keep
        the tokens of the step launched before it. A failure no request can be blamed for (the decode step over the
        rows, freeing a row) ends every admitted request, running or prefilling, with "error" and clears the rows,
        whose state is not known; the queue waits on. Either way the engine takes requests as before. Then
        ``raise_errors``: True raises the failure (a benchmark's probe for memory catches it), the events the step
        made coming with the next step's; False (a server) logs it to ``sparsekv.serve`` and returns the events.
        Where clearing the rows fails too, or on a ``BaseException`` (KeyboardInterrupt), ``step`` raises whatever
        ``raise_errors`` says, the events carried the same way."""
        events, self._carried = self._carried, []
        try:
            try:
                self._step(events)
            except Exception as error:
                if error is self._ended:  # its requests have ended; the steps in flight hold the running ones' tokens
                    self._collect_all(events)
                else:
                    self._fail_all(error, events)
                self._ended = None
                if raise_errors:
                    raise
                log.error("a serving step failed; the requests it ran or prefilled ended with \"error\"",
                          exc_info=error)
        except BaseException:
            self._collect_all(events)  # the steps in flight hold the running requests' tokens
            self._carried = events
            raise
        return events

    def _fail_all(self, error: Exception, events: list[Event]) -> None:
        """Ends every admitted request with "error" and clears the runner's rows and their prefills."""
        with self._lock:
            lives = [*self._prefilling, *self._running.values()]
            self._prefilling, self._running = [], {}
        self.runner.clear({id(live.prefill): live.prefill for live in lives if live.prefill is not None}.values())
        self._ended_rows = []
        for live in lives:
            live.prefill = None
            self._finish(live, "error", events, error=error)

    def _step(self, events: list[Event]) -> None:
        if self.runner.in_flight:  # the rows' step the last call queued ahead
            step = self.runner.in_flight[0]
            if (growing := self._pages_ahead()) is not None:
                self._run_ahead(growing)
                self._collect(step, events)
                return
            self._collect_all(events)
        self._cancelled(events)
        self._yield_rows(events)
        self._admit(events)
        self._grow(events)
        if self.step_tokens is not None:
            self._mixed_step(events)
            return
        pacer = self.pacer
        launched = None
        if pacer is None:
            # The running rows' step is queued first, so that the host queues the prefill's passes (and joins)
            # while the device runs it; the rows that join start at the next step.
            launched = self.runner.launch() if self._running else None
            self._prefill(events, self.runner.prefill_budget)
        elif self._prefilling and (not self._running or pacer.budget()):
            decoding = bool(self._running)
            began = time.perf_counter()
            work = self._prefill(events, pacer.budget() if decoding else self.runner.prefill_budget)
            self.runner.synchronize()
            pacer.prefilled(time.perf_counter() - began, work, decoding)
        if launched is None and self._running:
            began = time.perf_counter()
            self._collect(self.runner.launch(), events)  # reads the tokens back: the step's work is done
            if pacer is not None:
                pacer.decoded(time.perf_counter() - began)
        elif launched is not None:
            if (growing := self._pages_ahead()) is not None:
                self._run_ahead(growing)
            self._collect(launched, events)

    def _mixed_step(self, events: list[Event]) -> None:
        """One step of the running rows' decode tokens and, while prefills wait, the next prompt tokens of the
        oldest (and of the next ones where it ends first), ``step_tokens`` in all; a prefill that ends there gives
        its requests their first tokens and rows."""
        jobs = list({id(live.prefill): live.prefill for live in self._prefilling}.values())  # arrival order, once
        # A prefill may have ended in a step where an earlier one's joining failed: it joins now, running no more.
        waiting = [job for job in jobs if job.logits is None]
        if waiting:
            before = sum(job.ran for job in waiting)
            launched = self.runner.launch_mixed(waiting, self.step_tokens - len(self._running))
            self._prefill_work += (sum(job.ran for job in waiting) - before) * self.runner.num_layers
            self._collect(launched, events)
        elif self._running:
            launched = self.runner.launch()
            if (growing := self._pages_ahead()) is not None:
                self._run_ahead(growing)
            self._collect(launched, events)
        for job in jobs:
            if job.logits is not None:
                self._prefilled(job, [live for live in self._prefilling if live.prefill is job], events)

    def _collect(self, launched, events: list[Event]) -> None:
        """Emits the tokens of the oldest step the runner launched, but those of rows whose requests ended since."""
        for rid, (token, logprobs) in self.runner.collect(launched).items():
            live = self._running.get(rid)
            if live is not None:
                self._emit(live, token, logprobs, events)

    def _collect_all(self, events: list[Event]) -> None:
        """Collects every step in flight, oldest first, then releases the rows whose requests ended meanwhile."""
        while self.runner.in_flight:
            self._collect(self.runner.in_flight[0], events)
        for key, tokens in self._ended_rows:
            self.runner.release(key, tokens)
        self._ended_rows = []

    def _pages_ahead(self) -> list | None:
        """Where the rows' next step may be queued before the host reads the one in flight (so that the device
        decodes while the host reads its tokens and emits their events), the keys of the rows whose next token
        starts a page (``Runner.growth``); else None. It may where nothing but decoding comes before the next step
        (no cancellation, no prompt work, no request that the queue could admit, no ended row to release, no decode
        priority pacing the prefill), every row has that token still to draw (``max_tokens``: a row that ends on a
        stop token meanwhile decodes once more, its token dropped), and the store gives every row its next page
        without a preemption."""
        if self.pacer is not None or self._prefilling or self._ended_rows or not self._running:
            return None
        with self._lock:
            if self._cancel or (self._queue and (self._admits(self._queue[0]) or self._yielder() is not None)):
                return None
        ahead = len(self.runner.in_flight)
        if any(len(live.tokens) + ahead + 1 > live.request.max_tokens for live in self._running.values()):
            return None
        growing = self.runner.growth()
        return growing if self._in_use + len(growing) * self.runner.page_store_bytes <= self.kv_memory_bytes else None

    def _run_ahead(self, growing: list) -> None:
        """Queues the rows' next step behind the one in flight, the rows of ``growing`` (``_pages_ahead``) given
        their next pages first."""
        self._take_pages(growing)
        self.runner.launch()

    def _yielder(self) -> _Live | None:
        """Under time slicing, the running request that yields its row to the front of the queue now (``time_slice``):
        of those that have drawn the most tokens, the first admitted; None where the front can be admitted or
        none has drawn ``time_slice`` tokens more than it. Called under the lock, with a request queued."""
        head = self._queue[0]
        if self.time_slice is None or not self._running or self._admits(head):
            return None
        live = max(self._running.values(), key=lambda live: (len(live.tokens), -live.admitted))
        return live if len(live.tokens) - len(head.tokens) >= self.time_slice else None

    def _yield_rows(self, events: list[Event]) -> None:
        """Time slicing: running requests yield their rows (``_yielder``) until the front of the queue can be
        admitted or none is due."""
        while True:
            with self._lock:
                live = self._yielder() if self._queue else None
            if live is None:
                return
            self._preempt(live, events, yielded=True)

    def _cancelled(self, events: list[Event]) -> None:
        with self._lock:
            cancel, self._cancel = self._cancel, {}
            queued = [live for live in self._queue if live.id in cancel]
            for live in queued:
                self._queue.remove(live)
        for live in queued:
            self._finish(live, cancel[live.id], events)
        for live in [*self._prefilling, *self._running.values()]:
            if live.id in cancel:
                self._finish(live, cancel[live.id], events)

    def _admit(self, events: list[Event]) -> None:
        """Takes waiting requests in order while a row is free and their KV fits (the first that does not fit
        waits, and so does everything behind it: no request is passed over for ever). A request whose prompt is
        being prefilled already shares that prefill: it takes a row of its own when the prefill ends. A request
        whose prefill cannot start ends with "error"."""
        while True:
            failed = None
            with self._lock:
                if not self._queue:
                    return
                live = self._queue[0]
                if not self._admits(live):
                    return
                need = self._need(live)
                self._queue.popleft()
                self._in_use += need
                live.held = need
                live.admitted = self._admissions = self._admissions + 1
                if not live.tokens:  # a preempted request prefills tokens of its own
                    live.prefill = next((other.prefill for other in self._prefilling
                                         if not other.tokens and other.request.prompt == live.request.prompt), None)
                try:
                    if live.swapped is not None:  # its row comes back from host memory
                        request, swapped, live.swapped = live.request, live.swapped, None
                        start = time.perf_counter()
                        self.runner.join(live.id, swapped, live.tokens[-1], request.sampling, live.seed,
                                         request.max_tokens, request.logprobs, earlier=live.tokens[:-1])
                        self._running[live.id] = live
                        self.runner.discard(swapped)
                        self._swap_seconds += time.perf_counter() - start
                        continue
                    if live.prefill is None:
                        live.prefill = self.runner.start(live.request.prompt, live.tokens[:-1])
                    self._prefilling.append(live)
                except Exception as error:
                    failed = error
            if failed is not None:
                self._finish(live, "error", events, error=failed)
                self._ended = failed
                failed.add_note(f"while starting the prefill of request {live.id}, or bringing its row back, which "
                                f"ends with \"error\"")
                raise failed

    def _admits(self, live: _Live) -> bool:
        """Whether a row is free and ``live``'s KV fits now (under "grow" with a page of headroom for each running
        row, so that an admission does not preempt at the next step)."""
        headroom = len(self._running) * self.runner.page_store_bytes * self.runner.grows
        rows_taken = len(self._prefilling) + len(self._running)
        return (rows_taken < self.runner.max_batch
                and self._in_use + self._need(live) + headroom <= self.kv_memory_bytes)

    def _need(self, live: _Live) -> int:
        """The KV bytes admission counts ``live`` for: its context's and its max_tokens' (a request preempted after
        drawing tokens: the same total), or under "grow" its context's and its next token's."""
        context = live.context
        total = len(live.request.prompt) + live.request.max_tokens
        # A row back from host memory holds what it held: a row of its own is sized by its prompt, not its context.
        prompt = len(live.request.prompt) if live.swapped is not None else context
        return self.runner.kv_bytes(prompt, context + 1 if self.runner.grows else total)

    def _grow(self, events: list[Event]) -> None:
        """Under "grow", gives the running rows the pages of their next tokens, preempting the newest admitted
        requests (running or prefilling) while the store cannot."""
        page = self.runner.page_store_bytes
        while True:
            keys = self.runner.growth()
            if not keys or self._in_use + len(keys) * page <= self.kv_memory_bytes:
                break
            self._preempt(max([*self._prefilling, *self._running.values()], key=lambda live: live.admitted), events)
        self._take_pages(keys)

    def _take_pages(self, keys: list) -> None:
        """Gives the running rows of ``keys`` the store pages of their next tokens, counted as theirs."""
        page = self.runner.page_store_bytes
        self.runner.grow(keys)
        for key in keys:
            self._running[key].held += page
        self._in_use += len(keys) * page

    def _preempt(self, live: _Live, events: list[Event], yielded: bool = False) -> None:
        """Gives back what ``live`` holds (its row or its share of a prefill) and puts it at the front of the queue
        (``yielded``, a row that time slicing takes: at the back), to be prefilled again with the tokens it has drawn
        (``_Live.context``), or for a running request whose rows swap (``swaps_when_preempted``: preemption "swap",
        or a method whose decode step a prompt pass cannot redo, Quest), with its row copied to host memory first
        (``Runner.swap_out``). A failed copy ends that request with "error"."""
        if live.id in self._running and self._swaps:
            start = time.perf_counter()
            try:
                live.swapped = self.runner.swap_out(live.id, live.request.prompt)
                self._swap_seconds += time.perf_counter() - start
            except Exception as error:
                self._finish(live, "error", events, error=error)
                self._ended = error
                error.add_note(f"while moving request {live.id}'s row to host memory, which ends with \"error\"")
                raise
        self._in_use -= live.held
        live.held = 0
        if live.id in self._running:
            self.runner.release(live.id)
            with self._lock:
                del self._running[live.id]
        else:
            job, live.prefill = live.prefill, None
            with self._lock:
                self._prefilling.remove(live)
            if not any(other.prefill is job for other in self._prefilling):
                self.runner.discard(job)
        with self._lock:
            if yielded:
                self._queue.append(live)
                self._yielded += 1
            else:
                self._queue.appendleft(live)
                self._preempted += 1

    def _prefill(self, events: list[Event], budget: int) -> int:
        """Runs about ``budget`` token-layers of prompt work (at least one pass), oldest request first; when a
        prefill ends, each of its requests (in arrival order) draws its first token and joins the running rows.
        Returns the token-layers run."""
        start = budget
        while self._prefilling and budget > 0:
            job = self._prefilling[0].prefill
            pending = [live for live in self._prefilling if live.prefill is job]
            with self._blamed(job, pending, events):
                work = self.runner.prefill(job, budget)
            budget -= work
            self._prefill_work += work
            if job.logits is not None:
                self._prefilled(job, pending, events)
        return start - budget

    def _prefilled(self, job: Prefill, pending: list[_Live], events: list[Event]) -> None:
        """The requests ``pending`` of a prefill whose passes have all run each draw their first token (in arrival
        order) and join the running rows; a preempted one goes on from its last token, drawn already."""
        with self._blamed(job, pending, events):
            with self._lock:
                for live in pending:
                    self._prefilling.remove(live)
            for live in list(pending):
                live.prefill = None
                request = live.request
                if live.tokens:
                    self.runner.join(live.id, job, live.tokens[-1], request.sampling, live.seed, request.max_tokens,
                                     request.logprobs, earlier=live.tokens[:-1])
                    with self._lock:
                        self._running[live.id] = live
                else:
                    live.cached = job.reused  # a request that comes back keeps the count of its first prefill
                    first, logprobs = self.runner.first_token(job, request.sampling, live.seed, request.logprobs)
                    if not self._emit(live, first, logprobs, events):
                        self.runner.join(live.id, job, first, request.sampling, live.seed, request.max_tokens,
                                         request.logprobs)
                        with self._lock:
                            self._running[live.id] = live
                pending.remove(live)
        self.runner.discard(job, keep=True)

    @contextmanager
    def _blamed(self, job: Prefill, pending: list[_Live], events: list[Event]):
        """A failure inside it is the prefill ``job``'s: its requests not yet running (``pending``) end with
        "error", what they held freed, and the error goes on to ``step``; the running requests and the queue are
        as they were."""
        try:
            yield
        except Exception as error:
            with self._lock:
                self._prefilling = [live for live in self._prefilling if live.prefill is not job]
            for live in pending:
                live.prefill = None
                self._finish(live, "error", events, error=error)
            self.runner.discard(job)
            self._ended = error
            error.add_note(f"while prefilling request(s) {[live.id for live in pending]}, which end with \"error\"")
            raise

    def _emit(self, live: _Live, token: int, logprobs: Logprobs | None, events: list[Event]) -> bool:
        """Records the request's new token (and its log-probabilities); ends it on a stop token or at max_tokens.
        Returns whether it ended."""
        live.tokens.append(token)
        if logprobs is not None:
            live.logprobs.append(logprobs)
        self._generated += 1
        request = live.request
        reason = "stop" if token in request.stop_tokens else "length" if len(live.tokens) >= request.max_tokens \
            else None
        if reason is None:
            events.append(self._event(live, False, None))
            return False
        self._finish(live, reason, events)
        return True

    def _event(self, live: _Live, finished: bool, reason: str | None, error: Exception | None = None) -> Event:
        new = live.tokens[live.shown:]
        logprobs = None if live.request.logprobs is None else live.logprobs[live.shown:]
        live.shown = len(live.tokens)
        return Event(request_id=live.id, tokens=new, finished=finished, finish_reason=reason,
                     prompt_tokens=len(live.request.prompt), completion_tokens=len(live.tokens), logprobs=logprobs,
                     cached_tokens=live.cached, error=None if error is None else f"{type(error).__name__}: {error}")

    def _finish(self, live: _Live, reason: str, events: list[Event], error: Exception | None = None) -> None:
        """Frees what the request holds (its prefill or its row, none while it waits) and emits its last event
        (``error``: the failure that ended it, for reason "error")."""
        self._in_use -= live.held
        live.held = 0
        if live.id in self._running:
            # An answer that ended is kept with its prompt where the prefix cache takes it (the row holds the KV
            # of every token but the last).
            tokens = live.request.prompt + live.tokens[:-1] if reason in ("stop", "length") else None
            if self.runner.in_flight:  # a step over its row is queued: the row goes once that step is collected
                self._ended_rows.append((live.id, tokens))
            else:
                self.runner.release(live.id, tokens)
            with self._lock:
                del self._running[live.id]
        elif live.prefill is not None:  # its prefill goes once no other request of its prompt waits for it
            job, live.prefill = live.prefill, None
            with self._lock:
                self._prefilling.remove(live)
            if not any(other.prefill is job for other in self._prefilling):
                self.runner.discard(job)
        elif live.swapped is not None:  # its row's copy in host memory
            job, live.swapped = live.swapped, None
            self.runner.discard(job)
        self._finished[reason] = self._finished.get(reason, 0) + 1
        events.append(self._event(live, True, reason, error))
