"""Serving under load: a load generator against continuous batching (``sparsekv.serve``), dense and each method in
one run, directly through the engine and through the HTTP server with a real client (``openai``).

    python -m sparsekv.bench.serve --methods dense quest --requests 64 --rate inf --prompt-len 32768 131072 \\
        --output-len 256 256 --max-batch 64 --static
    python -m sparsekv.bench.serve --methods dense quest raas --concurrency 8 --requests 32 \\
        --prompt-len 512 512 --output-len 8192 8192 --max-batch 64 --kv-memory-gib 20
    python -m sparsekv.bench.serve --capacity --methods dense omnikv:offload=true quest --requests 64 \\
        --prompt-len 131072 131072 --output-len 256 256 --max-batch 64
    python -m sparsekv.bench.serve --methods dense quest --requests 64 --prompt-len 32768 131072 --output-len 256 256 \
        --fill random --prefill-share 0.2 --fit --static --via engine
    python -m sparsekv.bench.serve --methods dense quest --requests 24 --prompt-len 16384 32768 \\
        --output-len 1024 1024 --max-batch 16 --via engine --peer vllm   # vLLM's dense on the same requests
    python -m sparsekv.bench.serve --methods dense raas --requests 96 --prompt-len 512 512 --output-len 8192 8192 \
        --max-batch 64 --kv-memory-gib 20 --via engine --peer vllm --peer-gpu 1   # vLLM beside ours, on GPU 1
    python -m sparsekv.bench.serve --model tiny:llama --device cpu --requests 6 --prompt-len 16 64 \\
        --output-len 4 16 --max-batch 4       # smoke test

Arrivals: Poisson at ``--rate`` requests/s (``inf``: all at once, a saturating load), or ``--concurrency N``
clients that each send their next request when the last one ends. Prompt lengths (random token ids) and output
lengths (the model's end-of-sequence tokens ignored, so each request makes exactly its tokens) are drawn uniformly
from the given ranges, the same workload for every method. Per run: output tokens/s and requests/s over the run,
time to first token (submit to the first token) and time per output token ((last - first token) / (tokens - 1)) at
p50/p90/p99, the decode step (median engine step without prefill work, engine runs) and the decode-phase output
tokens/s (the tokens of those steps over their time: what the decode side sustains, prefill aside), the running and
queued requests over time (the engine's metrics), the most requests running at once, the pool's device bytes
(``Runner.pool_bytes``), the steps' measured profile (``Runner.profile``), peak device memory (``device_memory``:
PyTorch's peak reserved plus what the process holds outside it) against ``--gpu-memory-utilization`` of the device,
peak host RSS and host KV (offload).
``--step-tokens N`` runs dense and Quest in mixed steps of N tokens (``ServingEngine``'s ``step_tokens``; the
peer's row gives vLLM's ``max_num_batched_tokens``). ``--static`` also times the static engine's step
(``sparsekv.engine.Engine``) at the run's median running batch, on prompts of the workload's lengths.
``--prefill-share S`` runs the engine with decode priority (``sparsekv.serve.PrefillPacer``). ``--fill random``
fills each prompt's KV with random keys and values (``bench.e2e.random_passes``) instead of running the model's
prefill, so that the decode side of a workload whose real prefill takes far longer than a run (64 prompts of
32K-128K: about 5M prompt tokens) can be measured; its time to first token and overall tokens/s are not those of
a real prefill (the tables say ``fill random``). ``--fill-chunk N`` writes the fill in passes of N tokens while
a step still runs about ``--prefill-chunk`` tokens through every layer, in fewer passes: fewer launches where a
pass's host time would exceed a short decode step (a real prefill is bound by its compute instead); with a pass's
append one kernel (``kernels.append_pages``), passes of 8192 and 32768 give the same saturating run on the H200.
Before each run a prompt as long as the workload's longest runs, and short requests step every batch size up to the
max batch (``--no-warmup``: not), so that the prompt pass is compiled and the CUDA graph of each size captured
before the measurement.

The engine holds a pool of ``--max-batch`` rows, each sized for the longest request (its method's share of it),
and admits a request when a row is free and its KV fits ``--kv-memory-gib`` (default: the pool). ``--fit`` lowers
each method's max batch to the largest pool the device holds (halving, then bisection; each candidate must also
run a prefill chunk and a decode step); ``--capacity`` fits, then stops each run once requests wait that cannot be
admitted and nothing is prefilling (or once every request is in): its ``max_running`` is the method's capacity.

``shape:<name>`` (the default, Llama-3-8B) is a random-weight model of that shape on the device, served with a
stand-in tokenizer (one word per token id). ``--weights int4`` quantizes its layers' linear weights to group-wise
int4 (``sparsekv.quant``) before the runs, which leaves their memory to the pool. Before it builds anything, a run
whose weights, largest pool and prefill the device's free memory (on a CPU, the host's available memory) cannot
hold is refused (``run_memory``). Writes ``<tag>.json``, ``<tag>.md`` and ``<tag>.png`` under ``--out`` (results
there from another device or other options are kept unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import importlib.util
import math
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from ..cache import storage_dtype
from ..cache.host_store import HostMemoryError
from ..engine import Engine, prefill_passes
from ..errors import ConfigError
from ..eval.base import EvalError
from ..eval.runner import method_runs
from ..methods import METHODS
from ..methods.base import DEVICE_MARGIN
from ..models import load_model, model_shape, resolve_device, resolve_dtype
from ..quant import quantize_model
from ..serve import Request, ServingEngine
from ..serve.scheduler import ADMISSIONS, PREEMPTIONS, check_swap_space, check_time_slice, swaps_when_preempted
from ..serve.runner import (POOL_FIELD, cache_bytes, own_request_bytes, own_rows, pool_row_bytes,
                            prefill_bytes, rows_share_pages, shared_page_bytes, shares_pages)
from ..spec import budget_arg
from .common import (ModelShape, claim_results, conditions, device_name, int_arg, markdown_table, memory_problems,
                     named_shape, out_of_memory_lines, pyplot, quantiles, refuse, run_args, run_setting, shape_config,
                     shape_model, shape_weights, start_pdl, pdl_arg, weights_arg, write_results)
from .e2e import fill_passes, random_fill
from .peer import PEERS, PeerError, keep_to_cpus, split_cpus
from .peer import load_rows_of as run_peer_load

GIB = 2**30
# Seconds between samples of the engine's metrics during an HTTP run (engine runs sample every step).
SAMPLE_EVERY = 0.05
# Steps in a row with requests waiting, none prefilling and none admitted that show memory is full (--capacity).
STALL_STEPS = 3
# Decode steps of the static engine's run (--static), of which the first two (eager, capture) are not timed.
STATIC_STEPS = 16


@dataclass
class Work:
    """One request of the workload: when it arrives (seconds from the start; None with a fixed concurrency), its
    prompt and how many tokens it makes."""

    at: float | None
    prompt: list[int]
    max_tokens: int


@dataclass
class Record:
    """What one request saw: submit time, each token's arrival (in pieces), its token count."""

    submitted: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    done: bool = False

    def tokens_in(self, at: float, count: int) -> None:
        if count:
            self.first = at if self.first is None else self.first
            self.last = at
            self.tokens += count


@dataclass
class Trace:
    """A run's records, (time, running, queued, prefilling, KV bytes in use, host KV bytes, RSS) samples, the times
    of the steps that ran no prefill and the tokens they made, the most requests running at once (the engine's own
    loop's count after every step, which a sample of an HTTP run can miss), and start/end."""

    records: list[Record] = field(default_factory=list)
    samples: list[tuple] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    step_tokens: int = 0
    peak_running: int = 0
    start: float = 0.0
    end: float = 0.0
    stopped_early: bool = False
    stopped_at: str | None = None  # "capacity" or "duration"

    def sample(self, metrics: dict) -> None:
        self.samples.append((time.perf_counter() - self.start, metrics["running"], metrics["queued"],
                             metrics["prefilling"], metrics["kv_bytes_in_use"], metrics["host_kv_bytes"], rss()))


def rss() -> int:
    """This process's resident memory in bytes (Linux: /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def workload(args, vocab: int) -> list[Work]:
    """The requests: arrival time (None: by concurrency), random token ids (every prompt beginning with the same
    ``--shared-prefix`` tokens) and output length."""
    rng = random.Random(args.seed)
    out, at = [], 0.0
    head = [rng.randrange(vocab) for _ in range(args.shared_prefix)]
    for _ in range(args.requests):
        if args.concurrency is None and math.isfinite(args.rate):
            at += rng.expovariate(args.rate)
        length = rng.randint(*args.prompt_len)
        prompt = head + [rng.randrange(vocab) for _ in range(length - len(head))]
        out.append(Work(None if args.concurrency else at, prompt, rng.randint(*args.output_len)))
    return out


class Saturated:
    """--capacity: whether memory keeps the queue waiting (``STALL_STEPS`` steps in a row with requests queued,
    none prefilling and the running count unchanged) or every request is in."""

    def __init__(self):
        self.still, self.running = 0, -1

    def __call__(self, m: dict, pending: int) -> bool:
        if not m["queued"] and not m["prefilling"] and not pending:
            return True
        blocked = m["queued"] and not m["prefilling"] and m["running"] == self.running
        self.still = self.still + 1 if blocked else 0
        self.running = m["running"]
        return self.still >= STALL_STEPS


def run_engine(engine: ServingEngine, work: list[Work], concurrency: int | None, capacity: bool,
               duration: float | None = None) -> Trace:
    """Submits the workload to ``engine`` at its arrival times (or ``concurrency`` at a time) and steps it in this
    thread until every request is done (``capacity``: until memory is full; ``duration``: at most that many
    seconds), recording every event."""
    trace = Trace(start=time.perf_counter())
    pending = list(work)
    live: dict[int, Record] = {}
    saturated = Saturated() if capacity else None
    while pending or engine.has_work():
        now = time.perf_counter() - trace.start
        while pending and (len(live) < concurrency if concurrency else pending[0].at <= now):
            w = pending.pop(0)
            rid = engine.submit(Request(prompt=w.prompt, max_tokens=w.max_tokens, stop_tokens=()))
            live[rid] = Record(time.perf_counter() - trace.start)
            trace.records.append(live[rid])
        if not engine.has_work():
            time.sleep(max(pending[0].at - now, 0))
            continue
        before = engine.metrics()
        began = time.perf_counter()
        events = engine.step()
        ended = time.perf_counter()
        metrics = engine.metrics()
        if metrics["prefill_work"] == before["prefill_work"] and before["running"]:
            trace.steps.append(ended - began)
            trace.step_tokens += sum(len(event.tokens) for event in events)
        for event in events:
            record = live[event.request_id]
            record.tokens_in(ended - trace.start, len(event.tokens))
            if event.finished:
                record.done = True
                del live[event.request_id]
        trace.sample(metrics)
        if saturated is not None and saturated(metrics, len(pending)):
            trace.stopped_early, trace.stopped_at = bool(live or pending), "capacity"
            break
        if duration is not None and ended - trace.start >= duration:
            trace.stopped_early, trace.stopped_at = bool(live or pending), "duration"
            break
    trace.end = time.perf_counter() - trace.start
    for rid in list(live):  # --capacity: what still runs or waits
        engine.cancel(rid)
    while engine.has_work():
        engine.step()
    return trace


def warm_up(engine: ServingEngine, max_batch: int, vocab: int, longest: int) -> None:
    """Builds the prompt passes' attention plans (``Runner.prepare``), runs one prompt of ``longest`` tokens (the
    workload's longest: the prompt pass's kernels compiled), then every batch size from 1 to ``max_batch`` twice or
    more, up and down (a size's decode step is captured on its second run), with short greedy requests, so that the
    measured run does not pay for the compilations and captures. Their prompts come from a generator of their own:
    they share no prefix with the workload's (``workload``, seeded by --seed), which a prefix cache would otherwise
    give it."""
    start = time.perf_counter()
    if built := engine.runner.prepare():
        print(f"built {built} prompt attention plans in {time.perf_counter() - start:.1f} s", flush=True)
    rng = random.Random("warm-up")
    engine.submit(Request(prompt=[rng.randrange(vocab) for _ in range(longest)], max_tokens=1))
    while engine.has_work():
        engine.step()
    submitted = steps = 0
    while submitted < max_batch or engine.has_work():
        if submitted < max_batch and steps % 2 == 0:
            # A call may run two decode steps (one collected, the next queued ahead), so a request that lives 2
            # steps per later submission is still running when the last is submitted.
            engine.submit(Request(prompt=[rng.randrange(vocab) for _ in range(16)],
                                  max_tokens=min(4 * max_batch + 4, engine.runner.max_new_tokens,
                                                 engine.runner.max_context - 16)))
            submitted += 1
        engine.step()
        steps += 1


def stand_in_tokenizer(vocab: int):
    """A tokenizer for a random-weight model: token id i is the word ``w<i>`` (so that every token has text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def run_http(engine: ServingEngine, tokenizer, work: list[Work], concurrency: int | None, capacity: bool) -> Trace:
    """The same workload through the HTTP server (in a thread of this process, on 127.0.0.1) with the ``openai``
    client: streamed completions of token-id prompts; tokens are counted from each stream's usage."""
    import httpx
    import openai

    from ..serve.server import create_app, running

    app = create_app(engine, tokenizer, "bench")
    loop = app.state.service.loop
    trace = Trace()
    with running(app) as url:
        async def main() -> None:
            http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                     timeout=httpx.Timeout(None))
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
            trace.start = time.perf_counter()
            saturated = Saturated() if capacity else None
            slots = asyncio.Semaphore(concurrency or len(work))
            tasks: list[asyncio.Task] = []

            async def one(w: Work) -> None:
                async with slots:
                    record = Record(time.perf_counter() - trace.start)
                    trace.records.append(record)
                    stream = await client.completions.create(
                        model="bench", prompt=w.prompt, max_tokens=w.max_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                    async for chunk in stream:
                        now = time.perf_counter() - trace.start
                        if chunk.usage is not None:
                            # pieces are text, not tokens: the first and last times are exact, the count is usage's
                            record.tokens = chunk.usage.completion_tokens
                            record.done = True
                        elif chunk.choices and chunk.choices[0].text:
                            record.first = now if record.first is None else record.first
                            record.last = now

            async def sample() -> None:
                while True:
                    trace.sample(loop.metrics)
                    waiting = len(work) - len(trace.records) + sum(r.first is None for r in trace.records)
                    if saturated is not None and saturated(loop.metrics, waiting):
                        trace.stopped_early, trace.stopped_at = True, "capacity"
                        for t in tasks:
                            t.cancel()
                        return
                    await asyncio.sleep(SAMPLE_EVERY)

            sampler = asyncio.create_task(sample())
            for w in work:
                if trace.stopped_early:
                    break
                if w.at is not None:
                    await asyncio.sleep(max(w.at - (time.perf_counter() - trace.start), 0))
                tasks.append(asyncio.create_task(one(w)))
            await asyncio.gather(*tasks, return_exceptions=capacity)
            trace.end = time.perf_counter() - trace.start
            sampler.cancel()
            trace.peak_running = loop.peak_running
            await http.aclose()

        asyncio.run(main())
    return trace


def summarize(trace: Trace) -> dict:
    done = [r for r in trace.records if r.done]
    tokens = sum(r.tokens for r in trace.records)
    ttft = quantiles([r.first - r.submitted for r in trace.records if r.first is not None])
    tpot = quantiles([(r.last - r.first) / (r.tokens - 1) for r in done if r.tokens > 1 and r.first is not None])
    # The running rows sampled while nothing prefills; a run too short for the sampler to catch such a moment
    # (a few tiny requests, a busy host) takes every sample with rows running, else the server loop's peak.
    decoding = ([s[1] for s in trace.samples if s[1] and not s[3]] or [s[1] for s in trace.samples if s[1]]
                or ([trace.peak_running] if trace.peak_running else []))
    return {"duration_s": trace.end, "requests_done": len(done), "output_tokens": tokens,
            "output_tokens_per_s": tokens / trace.end if trace.end else None,
            "requests_per_s": len(done) / trace.end if trace.end else None,
            **{f"ttft_{k}_ms": None if v is None else 1e3 * v for k, v in ttft.items()},
            **{f"tpot_{k}_ms": None if v is None else 1e3 * v for k, v in tpot.items()},
            "step_p50_ms": 1e3 * statistics.median(trace.steps) if trace.steps else None,
            "decode_tokens_per_s": trace.step_tokens / sum(trace.steps) if trace.steps else None,
            "max_running": max(trace.peak_running, max((s[1] for s in trace.samples), default=0)),
            "median_running": statistics.median(decoding) if decoding else None,
            "peak_kv_gib": max((s[4] for s in trace.samples), default=0) / GIB,
            "peak_host_kv_gib": max((s[5] for s in trace.samples), default=0) / GIB,
            "peak_rss_gib": max((s[6] for s in trace.samples), default=rss()) / GIB,
            "stopped_at_capacity": trace.stopped_at == "capacity",
            "stopped_at_duration": trace.stopped_at == "duration"}


def static_step_ms(model, config, work: list[Work], batch: int, args) -> float:
    """The static engine's median decode step at ``batch`` rows, prompts of the workload's first lengths (random
    keys and values instead of a prefill beyond ``--max-prefill`` tokens)."""
    rows = [w.prompt for w in work[:batch]]
    rows += [work[i % len(work)].prompt for i in range(len(rows), batch)]
    engine = Engine(model, config, max_batch=batch, max_context=max(map(len, rows)) + STATIC_STEPS,
                    prefill_chunk=args.prefill_chunk, compile=args.compile)
    real = args.fill == "prefill" and sum(map(len, rows)) <= args.max_prefill
    out = engine.generate(rows, STATIC_STEPS, stop_tokens=(), time_steps=True,
                          prefill=None if real else random_fill(model))
    return 1e3 * statistics.median(out.step_seconds[2:] or out.step_seconds)


def largest_batch(make, most: int) -> int:
    """The largest max batch up to ``most`` for which ``make(batch)`` (an engine run for one short request) does
    not run out of device memory, nor is refused by the engine for a pool the device's free memory cannot hold, nor
    for an offloaded store the host's free memory cannot hold: halving from ``most``, then bisection. 0 when not even
    one row fits."""
    def fits(batch: int) -> bool:
        try:
            make(batch)
            return True
        except (torch.OutOfMemoryError, HostMemoryError):
            return False
        except ConfigError as err:
            if err.field != POOL_FIELD:
                raise
            return False
        finally:
            if torch.cuda.is_initialized():  # give the candidate's memory back before the next one
                gc.collect()
                torch.cuda.empty_cache()

    high = most
    while high and not fits(high):
        high //= 2
    if high in (0, most):
        return high
    low, high = high, min(2 * high, most + 1)  # low fits, high does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def pool_parts(method, kv_heads: int, head_dim: int, layers: int, dtype: torch.dtype, max_context: int,
               max_new_tokens: int, max_prompt_tokens: int) -> dict[str, int]:
    """A pool row of ``method`` (a built method, one of its ``pool_configs``) for requests of up to ``max_context``
    tokens, at most ``max_new_tokens`` new and ``max_prompt_tokens`` in the prompt, in bytes by the runner's own
    accounting: ``row``, its own device part (``runner.pool_row_bytes`` of ``Method.pool_pages``: in shared pages its
    page table and per-slot state only); ``pages``, the shared pages a row holds at most (0 where the rows hold their
    own), ``page`` bytes each (``runner.shared_page_bytes``); ``request``, where the rows hold their own, the KV the
    longest request holds (``runner.own_request_bytes``: ``--kv-memory-gib`` admits that many rows at most);
    ``prefill``, one prompt's beside the pool (``runner.prefill_bytes``); and ``host_row``, its host store
    (``Method.pool_host_tokens``)."""
    token_bytes, page_bytes = cache_bytes(method.config, kv_heads, head_dim, dtype)
    itemsize = storage_dtype(method.config.kv_dtype, dtype).itemsize
    slots = method.pool_pages(max_context, max_new_tokens, max_prompt_tokens)
    page = shared_page_bytes(method, token_bytes, page_bytes, layers)
    longest = min(max_prompt_tokens + max_new_tokens, max_context)
    return {"row": pool_row_bytes(method, slots, token_bytes, page_bytes, kv_heads, head_dim, itemsize),
            "pages": slots[0] if page else 0, "page": page,
            "request": 0 if page else own_request_bytes(method, max_prompt_tokens, longest, token_bytes, page_bytes,
                                                        kv_heads, head_dim, itemsize),
            "prefill": prefill_bytes(method, max_context, token_bytes, kv_heads, head_dim, dtype),
            "host_row": method.pool_host_tokens(max_context) * token_bytes}


def run_memory(runs, config, dtype: torch.dtype, args, max_context: int, device: torch.device) -> dict[str, int]:
    """The memory beside the weights that the largest of ``runs``' pools takes on ``device`` (a model of
    ``config``), by part, as the runner sizes it (``pool_parts`` of the config it takes where it cannot see the
    device's free memory, the one that keeps the least there): max batch rows (``--fit`` on a GPU: one row, then
    the search), in shared pages with every row's pages on a CPU, ``--kv-memory-gib`` of them where given, on a GPU
    without it as many as the free memory leaves beside ``DEVICE_MARGIN`` (an estimate of the steps' profile, which
    the runner measures); one prompt's prefill; the rows' sampling
    state and the prefix cache (``Runner``'s ``others``); on a CPU the host store of offloaded layers too."""
    layers, kv_heads, head_dim = model_shape(config)
    vocab = config.vocab_size
    gpu = device.type == "cuda"
    worst: dict[str, int] = {}
    for run in runs:
        batch = 1 if gpu and (args.fit or args.capacity) else args.max_batch
        method = run.config.build(layers).pool_configs()[-1].build(layers)
        pool = pool_parts(method, kv_heads, head_dim, layers, dtype, max_context,
                          args.max_new_tokens or max_context, args.prompt_len[1])
        if pool["request"] and args.kv_memory_gib is not None:
            batch = own_rows(batch, int(args.kv_memory_gib * GIB), pool["request"])
        pages = batch * pool["pages"]
        if pool["page"] and args.kv_memory_gib is not None:
            pages = min(pages, int(args.kv_memory_gib * GIB) // pool["page"])
        fitted = gpu and pool["page"] and args.kv_memory_gib is None  # the runner takes what the device leaves
        parts = {"KV pool": batch * pool["row"] + (0 if fitted else pages * pool["page"]),
                 "one prompt's prefill": pool["prefill"],
                 "sampling state and prefix cache": batch * 9 * vocab + int(args.prefix_cache_gib * GIB),
                 "steps' margin": DEVICE_MARGIN if fitted else 0,
                 "host KV store": 0 if gpu else (batch + 1) * pool["host_row"]}
        if sum(parts.values()) > sum(worst.values()):
            worst = parts
    return worst


def device_memory(device: torch.device, utilization: float) -> dict:
    """This process's peak device memory in GiB (PyTorch's peak reserved memory plus what the process holds outside
    PyTorch's allocator now: the CUDA context, libraries' workspaces; the device's memory in use less PyTorch's
    reserved, other processes being counted there too) and the budget ``utilization`` gives it, and the peak's share
    of that budget; Nones off CUDA."""
    if device.type != "cuda":
        return {"peak_device_gib": None, "device_budget_gib": None, "peak_vs_budget": None}
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    peak = (torch.cuda.max_memory_reserved(device) + outside) / GIB
    budget = utilization * total / GIB
    return {"peak_device_gib": peak, "device_budget_gib": budget, "peak_vs_budget": peak / budget}


def _too_big(args, problem: str) -> int:
    return refuse("sparsekv.bench.serve", f"--model {args.model} with --max-batch {args.max_batch} and requests of "
                  f"up to {args.prompt_len[1]} + {args.output_len[1]} tokens {problem}; use a smaller --model (e.g. "
                  f"shape:tiny or tiny:llama), --max-batch, --prompt-len, --output-len or --max-context, or "
                  f"--kv-memory-gib")


def plan(config, shape: ModelShape, dtype: torch.dtype, max_context: int, max_new_tokens: int, device_bytes: int,
         host_bytes: int, max_prompt_tokens: int) -> dict:
    """The planner's rows (no device used) of a pool of ``config``'s method for requests of ``max_context`` tokens, at
    most ``max_new_tokens`` new and ``max_prompt_tokens`` in the prompt, by the runner's own accounting: a device row
    is ``runner.pool_row_bytes`` of ``Method.pool_pages`` (in shared pages, a request's pages of ``max_context``
    tokens and its row's page table, with ``DEVICE_MARGIN`` left free for the steps, an estimate of the profile the
    runner measures); the rows and one prompt's prefill (``runner.prefill_bytes``) must fit ``device_bytes`` less the
    weights (the runner's check before it allocates); a host row is ``Method.pool_host_tokens``, and the pool's host
    store plus one prompt's own store while it is prefilled must fit ``host_bytes``. Of the configs the method leaves
    open (``Method.pool_configs``: OmniKV's device layers) the one with the most rows, the first of equals; the
    runner takes it for that many rows (the first whose rows fit its device budget, ``runner.device_budget``). The
    method's other per-row state (OmniKV's fetch buffer: its budget times the offloaded layers' token bytes) and the
    activations are not counted."""
    _, kv_heads, head_dim = shape.attention
    weights = shape.parameters * dtype.itemsize
    best = None
    choices = config.build(shape.layers).pool_configs()
    for choice in choices:
        method = choice.build(shape.layers)
        pool = pool_parts(method, kv_heads, head_dim, shape.layers, dtype, max_context, max_new_tokens,
                          max_prompt_tokens)
        # A row, and in shared pages the pages of one request of max_context.
        row, prefill, host_row = pool["row"] + pool["pages"] * pool["page"], pool["prefill"], pool["host_row"]
        margin = DEVICE_MARGIN if shares_pages(method) or choice is not choices[-1] else 0
        by_device = max((device_bytes - weights - prefill - margin) // row, 0)
        by_host = max(host_bytes // host_row - 1, 0) if host_row else None
        rows = by_device if by_host is None else min(by_device, by_host)
        if best is None or rows > best["rows"]:
            best = {"method": config.name, "device_layers": getattr(choice, "device_layers", None),
                    "device_row_gib": row / GIB, "host_row_gib": host_row / GIB, "weights_gib": weights / GIB,
                    "prefill_gib": prefill / GIB, "rows_by_device": by_device, "rows_by_host": by_host,
                    "rows": rows, "binds": "device" if by_host is None or by_device <= by_host else "host"}
    return best


def plan_markdown(meta: dict, rows: list[dict]) -> list[str]:
    columns = [("method", "spec", "{}"), ("device layers", "device_layers", "{}"),
               ("device row GiB", "device_row_gib", "{:.2f}"),
               ("host row GiB", "host_row_gib", "{:.2f}"), ("prefill GiB", "prefill_gib", "{:.2f}"),
               ("rows by device", "rows_by_device", "{}"),
               ("rows by host", "rows_by_host", "{}"), ("rows", "rows", "{}"), ("binds", "binds", "{}"),
               ("vs dense", "vs_dense", "{:.2f}x"), ("host GiB for 2x dense", "host_gib_for_2x_dense", "{:.1f}")]
    lines = [f"# Capacity plan ({meta['model']}, {meta['dtype']}): the planner's numbers, not a run", "",
             f"Requests of {meta['max_context']} tokens, at most {meta['max_new_tokens']} new and "
             f"{meta['max_prompt_tokens']} in the prompt; {meta['device_gib']} "
             f"GiB of device memory less the weights ({rows[0]['weights_gib']:.2f} GiB) for the rows and one "
             f"prompt's prefill (`prefill GiB`: its own cache, or in shared pages one layer's keys and values "
             f"gathered for its attention); {meta['host_gib']} GiB of host memory for "
             f"the host store's rows and one prompt's own store. Activations and a method's per-row state beyond the "
             f"pages (OmniKV's fetch buffer) are not counted. Command: `{meta['command']}`", ""]
    return lines + markdown_table(columns, rows)


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    columns = [("method", "spec", "{}"), ("budget", "budget", "{}"), ("via", "via", "{}"), ("fill", "fill", "{}"),
               ("done", "requests_done", "{}"), ("out tok/s", "output_tokens_per_s", "{:.1f}"),
               ("decode tok/s", "decode_tokens_per_s", "{:.1f}"), ("req/s", "requests_per_s", "{:.3f}"),
               ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
               ("TTFT p90", "ttft_p90_ms", "{:.0f}"), ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
               ("until last TTFT", "until_last_ttft", "{:.0%}"),
               ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"), ("TPOT p90", "tpot_p90_ms", "{:.2f}"),
               ("TPOT p99", "tpot_p99_ms", "{:.2f}"), ("step p50 ms", "step_p50_ms", "{:.2f}"),
               ("static step ms", "static_step_ms", "{:.2f}"), ("TPOT / static", "tpot_vs_static", "{:.2f}x"),
               ("step / static", "step_vs_static", "{:.2f}x"),
               ("max batch", "max_batch", "{}"), ("step tokens", "step_tokens", "{}"),
               ("max running", "max_running", "{}"),
               ("median running", "median_running", "{:.0f}"),
               ("vs dense tok/s", "vs_dense", "{:.2f}x"), ("vs dense decode", "decode_vs_dense", "{:.2f}x"),
               *([(f"vs {meta['peer']['peer']} tok/s", "vs_peer", "{:.2f}x")] if meta.get("peer") else []),
               ("pool GiB", "pool_gib", "{:.2f}"), ("profile GiB", "profile_gib", "{:.2f}"),
               ("peak device GiB", "peak_device_gib", "{:.1f}"),
               ("device budget GiB", "device_budget_gib", "{:.1f}"), ("peak / budget", "peak_vs_budget", "{:.2f}"),
               ("KV capacity GiB", "kv_capacity_gib", "{:.2f}"), ("peak KV GiB", "peak_kv_gib", "{:.2f}"),
               ("host KV GiB", "peak_host_kv_gib", "{:.2f}"),
               ("peak RSS GiB", "peak_rss_gib", "{:.1f}"), ("host load at start", "host_load_1m", "{:.1f}"),
               ("GPU C at start", "gpu_temp_c", "{}"), ("SM MHz at start", "sm_clock_mhz", "{}")]
    if meta.get("prefix_cache_gib"):
        columns.append(("prefix tokens reused", "prefix_reused", "{}"))
    if meta.get("admission") == "grow":
        columns.append(("preempted", "preempted", "{}"))
    if meta.get("time_slice"):
        columns.append(("yielded", "yielded", "{}"))
    if meta.get("admission") == "grow" or meta.get("time_slice"):
        columns.append(("swap s", "swap_s", "{:.1f}"))
    kv = meta["kv_memory_bytes"]
    utilization = meta.get("gpu_memory_utilization")
    leaves = "the device leaves" if utilization is None else f"--gpu-memory-utilization {utilization} leaves"
    kv = (f"the pool's (dense and Quest: shared pages, as many as {leaves}, at most max batch rows of max context; "
          f"other methods: max batch rows of max context)" if kv is None else f"{kv / GIB:.3g} GiB")
    load = (f"{meta['concurrency']} clients at a time" if meta["concurrency"] else
            "all at once" if not math.isfinite(meta["rate"]) else f"Poisson arrivals at {meta['rate']} requests/s")
    share = meta["prefill_share"]
    window = "" if meta["duration"] is None else f"; engine runs stopped after {meta['duration']} s"
    prefill = "a chunk per step" if share is None else f"at most {share} of the decode time (decode priority)"
    if meta.get("step_tokens"):
        prefill = (f"in mixed steps of {meta['step_tokens']} tokens (decode tokens and the next prompt tokens in one "
                   f"forward; dense and Quest, the other methods {prefill})")
    fill = ("; fill random: each prompt's KV is random keys and values, no model prefill (TTFT and overall tokens/s "
            "are not those of a real prefill)" if meta["fill"] == "random" else "")
    if meta["fill"] == "random" and meta.get("fill_chunk"):
        fill += f", written in passes of {meta['fill_chunk']} tokens"
    weights = "" if meta.get("weights", "float") == "float" else f", {meta['weights']} weights"
    weights += ", programmatic dependent launch" if meta.get("pdl") else ""
    shared = (f"; every prompt begins with the same {meta['shared_prefix']} tokens" if meta.get("shared_prefix")
              else "")
    cached = f"; a prefix cache of {meta['prefix_cache_gib']:g} GiB" if meta.get("prefix_cache_gib") else ""
    back = ("its pages moved to host memory and back" if meta.get("preemption") == "swap" else
            "recomputed (dense) or its pages moved to host memory and back (Quest)")
    grow = (f", admission grow (dense and Quest take pages as they grow; where they run out the newest request is "
            f"preempted, {back})" if meta.get("admission") == "grow" else "")
    grow += (f"; time slicing: a running request {meta['time_slice']} tokens ahead of the queue's front yields its "
             f"row to it, through host memory (`--time-slice`)" if meta.get("time_slice") else "")
    grow += (f"; {meta['swap_space_gib']:g} GiB of page-locked host memory set aside at the start for rows that go "
             f"there (`--swap-space-gib`)" if meta.get("swap_space_gib") else "")
    lines = [f"# Serving under load ({meta['model']}{weights}, {meta['device_name']}, {meta['dtype']})", "",
             f"{meta['requests']} requests, {load}; prompts of {meta['prompt_len'][0]}-{meta['prompt_len'][1]} "
             f"tokens{shared}, {meta['output_len'][0]}-{meta['output_len'][1]} output tokens{cached}; max context "
             f"{meta['max_context']}, max prompt tokens {meta['prompt_len'][1]} (RaaS's rows hold the longest "
             f"prompt's pages and the budget's); max batch "
             f"{meta['max_batch']}{' (or the most the device holds)' if meta['fit'] else ''}, KV memory {kv}{grow}"
             f"{'; --capacity: runs stop once memory keeps requests waiting' if meta['capacity'] else ''}; "
             f"prefill {prefill}{fill}{window}. "
             f"via engine: the engine stepped in the bench's thread; via http: the server in this process, the "
             f"openai client streaming. until last TTFT: the share of the run before the last request's first token "
             f"(with every request given at once, the part that prefills prompts).{peer_note(meta)} "
             f"Command: `{meta['command']}`", ""]
    return lines + markdown_table(columns, rows) + out_of_memory_lines(meta["out_of_memory"])


def peer_note(meta: dict) -> str:
    """The sentence on the peer's row, or nothing without one."""
    peer = meta.get("peer")
    if not peer:
        return ""
    cpus = f", each process on {peer['cpus']} of the host's CPUs" if peer.get("cpus") else ""
    when = ("before ours" if peer.get("gpu") is None else
            f"at the same time as ours, on GPU {peer['gpu']} of the same machine (ours on GPU {peer['our_gpu']}{cpus})")
    return (f" {peer['peer']} {peer['version']} (dense, prefix caching off, in a process of its own {when}; "
            f"`python -m sparsekv.bench.peer load`): the same requests at once, at most the max batch running"
            f"{', in the same KV memory (kv_cache_memory_bytes)' if meta['kv_memory_bytes'] else ''}, its step "
            f"tokens its max_num_batched_tokens, TTFT from each request's arrival and TPOT from its first and last "
            f"token times in its engine.")


def plot(rows: list[dict]):
    """Running and queued requests over time, and throughput per run: a figure for ``write_results`` (None without
    matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), dpi=120)
    for r in rows:
        if "series" not in r:  # the peer's: its running and queued requests are not sampled
            continue
        t = [s[0] for s in r["series"]]
        line, = left.plot(t, [s[1] for s in r["series"]], label=f"{r['spec']} {r['via']} running")
        left.plot(t, [s[2] for s in r["series"]], linestyle="--", color=line.get_color(), alpha=0.6)
    left.set(xlabel="seconds", ylabel="requests", title="running (solid) and queued (dashed)")
    left.legend(fontsize=7)
    labels = [f"{r['spec']}\n{r['via']}" for r in rows]
    right.bar(range(len(rows)), [r["output_tokens_per_s"] or 0 for r in rows])
    right.set_xticks(range(len(rows)), labels, fontsize=7)
    right.set(ylabel="output tokens/s", title="throughput")
    fig.tight_layout()
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shape:llama3-8b",
                        help="shape:<name>, tiny:<arch>, a model directory or a GGUF file")
    parser.add_argument("--methods", nargs="+", default=["dense", "quest"],
                        help=f"NAME or NAME:FIELD=VALUE,... with NAME in {', '.join(METHODS)}")
    parser.add_argument("--budget", type=budget_arg, default=2048,
                        help="token budget of the methods that take one (OmniKV also a fraction such as 0.1)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=float("inf"),
                      help="Poisson arrivals, requests per second (inf, the default: all at once)")
    load.add_argument("--concurrency", type=int_arg(1), help="this many requests in flight at a time")
    parser.add_argument("--requests", type=int_arg(1), default=64)
    parser.add_argument("--prompt-len", type=int_arg(1), nargs=2, default=[32768, 131072], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int_arg(1), nargs=2, default=[256, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--shared-prefix", type=int_arg(0), default=0,
                        help="tokens every prompt begins with (the same document; below --prompt-len MIN)")
    parser.add_argument("--prefix-cache-gib", type=float, default=0.0,
                        help="ServingEngine(prefix_cache_bytes=...): finished prompts' KV kept for prompts that begin "
                             "like them (methods that keep the prompt's pages; default 0: none)")
    parser.add_argument("--via", nargs="+", choices=["engine", "http"], default=["engine", "http"],
                        help="drive the engine directly, through the HTTP server, or both (each method)")
    parser.add_argument("--max-batch", type=int_arg(1), default=64)
    parser.add_argument("--max-context", type=int_arg(2), default=None,
                        help="the engine's max_context (default: the longest prompt and output): a server's limit, "
                             "which sizes the rows of methods without shared pages")
    parser.add_argument("--prefill-chunk", type=int_arg(1), default=8192)
    parser.add_argument("--prefill-share", type=float, default=None,
                        help="decode priority: prefill takes at most about this share of the decode steps' time while "
                             "requests decode (default: a chunk per step)")
    parser.add_argument("--admission", choices=ADMISSIONS, default="reserve",
                        help="how admission counts a request's KV (sparsekv.serve.ServingEngine): reserve (its prompt "
                             "and max_tokens) or grow (dense, quest: pages as it grows, preempting the newest)")
    parser.add_argument("--preemption", choices=PREEMPTIONS, default=None,
                        help="with --admission grow, how a preempted request comes back: recompute (dense) or swap "
                             "(its pages to host memory and back); default: the method's (recompute for dense, swap "
                             "for quest)")
    parser.add_argument("--time-slice", type=int_arg(1), default=None,
                        help="time slicing (sparsekv.serve.ServingEngine): while the queue's front waits for a row, a "
                             "running request this many tokens ahead of it yields its row, through host memory")
    parser.add_argument("--swap-space-gib", type=float, default=0.0,
                        help="host memory set aside at the start for rows that go there (--time-slice, --preemption "
                             "swap), page-locked on a GPU; copies beyond it are allocated as rows go")
    parser.add_argument("--fill", choices=["prefill", "random"], default="prefill",
                        help="random: prompts' KV filled with random keys and values instead of the model's prefill")
    parser.add_argument("--fill-chunk", type=int_arg(1), default=None,
                        help="with --fill random: tokens per pass of the fill (default: --prefill-chunk); a step "
                             "still runs about --prefill-chunk tokens through every layer, in fewer passes")
    parser.add_argument("--kv-memory-gib", type=float, default=None,
                        help="KV memory admission may fill (default: the engine's pool)")
    parser.add_argument("--step-tokens", type=int_arg(2), default=None,
                        help="mixed steps (dense, quest): decode tokens and the next prompt tokens in one forward, "
                             "this many in all (sparsekv.serve.ServingEngine's step_tokens; default: none)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's total memory each engine may take, weights, pool and the steps' "
                             "profile included (sparsekv.serve.ServingEngine)")
    parser.add_argument("--fit", action="store_true",
                        help="lower each method's max batch to the largest pool the device holds (CUDA)")
    parser.add_argument("--capacity", action="store_true",
                        help="--fit, then stop each run once requests wait that cannot be admitted: max running is "
                             "the capacity")
    parser.add_argument("--duration", type=float, default=None,
                        help="engine runs stop after this many seconds (what runs is cancelled): throughput over a "
                             "window of a long workload")
    parser.add_argument("--static", action="store_true",
                        help="also time the static engine's step at each run's median running batch")
    parser.add_argument("--max-prefill", type=int, default=131072,
                        help="--static: prompt tokens up to which its prompts are really prefilled")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="before each run, step every batch size up to the max batch twice (CUDA graphs "
                             "captured before the measurement)")
    parser.add_argument("--compile", action="store_true", help="ServingEngine(compile=True)")
    parser.add_argument("--max-new-tokens", type=int_arg(1), default=None,
                        help="ServingEngine(max_new_tokens=...): at least the --output-len MAX; sizes the device rows "
                             "of OmniKV's offloaded layers (default: the max context)")
    parser.add_argument("--plan", action="store_true",
                        help="no run: the rows each method's pool holds for the longest request in --device-gib and "
                             "--host-gib, by the runner's accounting (a shape: model, no device used)")
    parser.add_argument("--device-gib", type=float, default=None, help="--plan: the device's memory")
    parser.add_argument("--host-gib", type=float, default=None, help="--plan: host memory free for offloaded KV")
    parser.add_argument("--peer", choices=PEERS, default=None,
                        help="also run the same requests through the peer's dense serving, at most --max-batch at "
                             "a time, in a process of its own before ours (python -m sparsekv.bench.peer; a shape: "
                             "model on CUDA, bf16, all at once, real prefill)")
    parser.add_argument("--peer-gpu", type=int_arg(0), default=None,
                        help="run the peer at the same time as ours, on this CUDA device of the machine (one that "
                             "--device does not name), instead of before ours: a load's two runs in the time of one")
    pdl_arg(parser)
    weights_arg(parser)
    run_args(parser, "serve")
    return parser


def peer_problem(args, device: torch.device) -> str | None:
    """Why ``--peer`` cannot run this load (None: it can): the peer builds the same published shape on one GPU in
    bf16, and takes every request at once with a real prefill, from the engine alone."""
    if not args.model.startswith("shape:"):
        return f"--peer needs a shape:<name> --model (the peer builds its random weights), got {args.model!r}"
    if device.type != "cuda":
        return "--peer runs on a CUDA device"
    if args.dtype not in (None, "bfloat16") or args.weights != "float":
        return "--peer compares bf16 weights: drop --dtype and --weights"
    if math.isfinite(args.rate) or args.concurrency or args.duration is not None:
        return "--peer gives every request at once: drop --rate, --concurrency and --duration"
    if args.fill != "prefill" or args.prefix_cache_gib:
        return "--peer prefills every prompt: --fill prefill, no --prefix-cache-gib"
    if args.peer_gpu is not None and not (args.peer_gpu < torch.cuda.device_count()
                                          and args.peer_gpu != our_gpu(device)):
        return (f"--peer-gpu must be a CUDA device of this machine other than ours ({our_gpu(device)}; it has "
                f"{torch.cuda.device_count()}), got {args.peer_gpu}")
    return None


def our_gpu(device: torch.device) -> int:
    """The index of the CUDA device our runs take ("cuda" alone: the first)."""
    return device.index or 0


def peer_line(peer: str, row: dict) -> str:
    """The line printed of the peer's row."""
    return (f"{peer:>32}: {row['output_tokens_per_s']:.1f} output tok/s, {row['requests_done']} done, TTFT p50 "
            f"{row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.2f} ms")


def peer_row(args, work: list[Work], device: torch.device, cpus: set[int] | None = None) -> tuple[dict, dict]:
    """The peer's version and its row of ``work`` (the same requests as ours, at most ``--max-batch`` running, in
    ``--kv-memory-gib`` of KV where given, on ``--peer-gpu`` and ``cpus`` where given), in ``summarize``'s names;
    its times come from its engine's per-request timestamps."""
    kv = None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB)
    result = run_peer_load(args.peer, args.model, [w.prompt for w in work], [w.max_tokens for w in work],
                           args.max_batch, args.seed, kv, gpu=args.peer_gpu, cpus=cpus)
    (row,) = result["rows"]
    return ({"peer": result["peer"], "version": result["version"], "gpu": args.peer_gpu,
             "our_gpu": None if args.peer_gpu is None else our_gpu(device),
             "cpus": None if cpus is None else len(cpus)},
            {**row, "spec": args.peer, "method": args.peer, "budget": None, "via": args.peer, "fill": "prefill"})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setting = run_setting("serve", args)
    try:
        runs = method_runs(args.methods, [args.budget])
        for run in runs:
            swaps_when_preempted(run.config, args.admission, args.preemption, "--preemption")
            check_time_slice(run.config, args.admission, args.preemption, args.time_slice, "--time-slice")
            check_swap_space(run.config, args.admission, args.preemption, args.time_slice, args.swap_space_gib,
                             "--swap-space-gib")
        if not args.rate > 0:
            raise ConfigError("--rate", "a number of requests per second > 0 (inf: all at once)", args.rate)
        if args.duration is not None and not (args.duration > 0 and args.via == ["engine"]):
            raise ConfigError("--duration", "seconds > 0, with --via engine", args.duration)
        if args.prefill_share is not None and not (math.isfinite(args.prefill_share) and args.prefill_share > 0):
            raise ConfigError("--prefill-share", "a number > 0", args.prefill_share)
        for name, (low, high) in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
            if low > high:
                raise ConfigError(name, "MIN <= MAX", f"{low} {high}")
        if args.shared_prefix >= args.prompt_len[0]:
            raise ConfigError("--shared-prefix", f"below the --prompt-len MIN ({args.prompt_len[0]})",
                              args.shared_prefix)
        if not (math.isfinite(args.prefix_cache_gib) and args.prefix_cache_gib >= 0):
            raise ConfigError("--prefix-cache-gib", "a number >= 0", args.prefix_cache_gib)
        longest = args.prompt_len[1] + args.output_len[1]
        if args.max_context is not None and args.max_context < longest:
            raise ConfigError("--max-context", f"at least the longest prompt and output ({longest})",
                              args.max_context)
        if args.fill_chunk is not None and args.fill != "random":
            raise ConfigError("--fill-chunk", "given with --fill random only", args.fill_chunk)
        if args.max_new_tokens is not None and args.max_new_tokens < args.output_len[1]:
            raise ConfigError("--max-new-tokens", f"at least the --output-len MAX ({args.output_len[1]})",
                              args.max_new_tokens)
        if args.plan and not (args.model.startswith("shape:") and args.device_gib and args.host_gib):
            raise ConfigError("--plan", "a shape: model with --device-gib and --host-gib > 0",
                              f"{args.model} {args.device_gib} {args.host_gib}")
        if args.peer_gpu is not None and not args.peer:
            raise ConfigError("--peer-gpu", "given with --peer", args.peer_gpu)
        if args.plan and args.weights != "float":
            raise ConfigError("--weights", "float with --plan (the planner counts 16-bit weights)", args.weights)
        if "http" in args.via and not args.plan:
            missing = [name for name in ("fastapi", "uvicorn", "openai", "httpx") if importlib.util.find_spec(name)
                       is None]
            if missing:
                raise ConfigError("--via", f"engine only, or http with {', '.join(missing)} installed "
                                           f"(pip install 'sparsekv[serve]' openai)", " ".join(args.via))
    except (ConfigError, EvalError) as err:
        print(f"sparsekv.bench.serve: error: {err}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" or args.plan else "float32"))
    max_context = args.max_context or args.prompt_len[1] + args.output_len[1]
    command = "python -m sparsekv.bench.serve " + " ".join(argv)
    if not args.plan:
        start_pdl(args, device, parser)
    claim_results(args.out / f"{args.tag}.json", None if args.plan else device_name(device), setting,
                  args.overwrite)
    problem = args.peer and not args.plan and peer_problem(args, device)
    if problem:
        parser.error(problem)
    if args.plan:
        return capacity_plan(args, runs, named_shape(args.model[len("shape:"):]), dtype, max_context, command,
                             setting)
    shape = args.model[len("shape:"):] if args.model.startswith("shape:") else None
    if shape:  # checked before it is built; a loaded model once it is there
        config = shape_config(shape, max_context + STATIC_STEPS)
    else:
        loaded = load_model(args.model, device, dtype)
        model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.model.config
    try:
        problem = memory_problems(device, shape_weights(args.model, dtype),
                                  run_memory(runs, config, dtype, args, max_context, device))
    except ConfigError as err:  # a method's options that the model's layers do not allow
        return refuse("sparsekv.bench.serve", str(err))
    if problem:
        return _too_big(args, problem)
    peer, rows, beside = None, [], None
    if args.peer and args.peer_gpu is None:  # first, in a process of its own: its engine takes most of the GPU
        try:
            peer, row = peer_row(args, workload(args, config.vocab_size), device)
        except PeerError as err:
            return refuse("sparsekv.bench.serve", str(err))
        rows.append(row)
        print(peer_line(args.peer, row), flush=True)
    elif args.peer:  # beside ours, on a GPU and half the CPUs of its own: its child process runs while ours runs
        halves = split_cpus()
        if halves is not None:
            keep_to_cpus(halves[0])
        beside = concurrent.futures.ThreadPoolExecutor(1).submit(peer_row, args, workload(args, config.vocab_size),
                                                                 device, halves and halves[1])
    if shape:
        model = shape_model(shape, device, dtype, max_context + STATIC_STEPS)
        tokenizer = stand_in_tokenizer(model.config.vocab_size)
    quantize_model(model, args.weights)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights the quantized layers replaced
    work = workload(args, model.config.vocab_size)
    refused = [run.label for run in runs
               if args.prefix_cache_gib and not run.config.build(model.config.num_hidden_layers).prefix_reuse]
    if refused:
        print(f"sparsekv.bench.serve: error: --prefix-cache-gib must be 0 with {', '.join(refused)} (methods that "
              f"evict, compress or offload the prompt)", file=sys.stderr)
        return 2
    kv_memory = None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB)
    meta = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "weights": args.weights, "pdl": args.pdl,
            "device_name": device_name(device), "torch": torch.__version__, "requests": args.requests,
            "rate": args.rate, "concurrency": args.concurrency, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "max_batch": args.max_batch, "max_context": max_context,
            "kv_memory_bytes": kv_memory, "admission": args.admission, "preemption": args.preemption,
            "time_slice": args.time_slice, "swap_space_gib": args.swap_space_gib,
            "gpu_memory_utilization": args.gpu_memory_utilization, "step_tokens": args.step_tokens,
            "fill": args.fill, "duration": args.duration,
            "prefill_share": args.prefill_share, "prefill_chunk": args.prefill_chunk, "fill_chunk": args.fill_chunk,
            "capacity": args.capacity, "fit": args.fit or args.capacity, "out_of_memory": [],
            "shared_prefix": args.shared_prefix, "prefix_cache_gib": args.prefix_cache_gib, "setting": setting,
            "peer": peer, "command": command}

    def save(final: bool = False) -> None:
        """Writes the runs so far (after every run, so that a cut-short bench keeps them; ``final``: with the
        plot)."""
        for key, ratio in (("output_tokens_per_s", "vs_dense"), ("decode_tokens_per_s", "decode_vs_dense")):
            dense = {r["via"]: r[key] for r in rows if r["method"] == "dense"}
            for r in rows:
                base = dense.get(r["via"])
                r[ratio] = r[key] / base if base and r[key] else None
        base = next((r["output_tokens_per_s"] for r in rows if r["via"] == args.peer), None)
        for r in rows:
            r["vs_peer"] = r["output_tokens_per_s"] / base if base and r["output_tokens_per_s"] else None
        for r in rows:  # with every request given at once: the share of the run that prefills prompts
            r["until_last_ttft"] = (r["ttft_max_ms"] / 1e3 / r["duration_s"]
                                    if r.get("ttft_max_ms") is not None and r.get("duration_s") else None)
        write_results(args.out, args.tag, meta, [{k: v for k, v in r.items() if k != "series"} for r in rows],
                      markdown(meta, rows), series={f"{r['spec']} {r['via']}": r["series"] for r in rows
                                                    if "series" in r},
                      series_columns=["seconds", "running", "queued", "prefilling", "kv_bytes", "host_kv_bytes",
                                      "rss_bytes"], figure=plot(rows) if final else None, overwrite=args.overwrite)

    def make(config, batch: int, swap_space_gib: float = 0.0) -> ServingEngine:
        return ServingEngine(model, config, tokenizer=tokenizer, max_batch=batch, max_context=max_context,
                             prefill_chunk=args.prefill_chunk, prefill_share=args.prefill_share,
                             max_queue=args.requests, compile=args.compile, kv_memory_bytes=kv_memory,
                             prefill=fill_passes(args.fill_chunk) if args.fill == "random" else prefill_passes,
                             max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.prompt_len[1],
                             prefix_cache_bytes=int(args.prefix_cache_gib * GIB),
                             admission=args.admission, gpu_memory_utilization=args.gpu_memory_utilization,
                             preemption=args.preemption, time_slice=args.time_slice,
                             swap_space_bytes=int(swap_space_gib * GIB),
                             step_tokens=args.step_tokens if rows_share_pages(config)
                             else None)  # the other methods keep the step-then-chunk schedule

    def probe(config, batch: int) -> None:
        """An engine of ``batch`` rows runs one request of a prefill chunk and two tokens."""
        engine = make(config, batch)
        prompt = work[0].prompt * (args.prefill_chunk // len(work[0].prompt) + 1)
        engine.submit(Request(prompt=prompt[:min(args.prefill_chunk, max_context - 2)], max_tokens=2))
        while engine.has_work():
            engine.step()

    for run in runs:
        batch = args.max_batch
        if (args.fit or args.capacity) and device.type == "cuda":
            batch = largest_batch(lambda b: probe(run.config, b), args.max_batch)
            print(f"{run.label:>32}: max batch {batch} fits the device", flush=True)
            if not batch:
                meta["out_of_memory"].append(f"{run.label} (not one row)")
                continue
        for via in args.via:
            label = f"{run.label} via {via}"
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                engine = make(run.config, batch, args.swap_space_gib)  # a probe sets none aside
                if args.warmup:
                    warm_up(engine, batch, model.config.vocab_size, max(len(w.prompt) for w in work))
                before = engine.metrics()  # the warm-up's counts
                started = conditions(device)
                print(f"{label:>32}: starts at {started}", flush=True)
                trace = (run_engine(engine, work, args.concurrency, args.capacity, args.duration)
                         if via == "engine" else run_http(engine, tokenizer, work, args.concurrency, args.capacity))
                # The pool's own choice where the config left it open (OmniKV's device layers).
                device_layers = getattr(engine.runner.config, "device_layers", None)
                capacity = engine.kv_memory_bytes / GIB
                after = engine.metrics()
                reused = after["prefix_tokens_reused"] - before["prefix_tokens_reused"]
                preempted = after["preempted"] - before["preempted"]
                yielded = after["yielded"] - before["yielded"]
                swap = after["swap_seconds"] - before["swap_seconds"]
                memory = device_memory(device, args.gpu_memory_utilization)
                step_tokens = engine.step_tokens
                profile = engine.runner.profile_bytes / GIB if device.type == "cuda" else None
                pool = engine.runner.pool_bytes / GIB
                del engine
                row = {"spec": run.label, "method": run.config.name, "budget": run.budget, "via": via,
                       "fill": args.fill, "max_batch": batch, "device_layers": device_layers, **summarize(trace),
                       "prefix_reused": reused, "preempted": preempted, "yielded": yielded, "swap_s": swap,
                       "kv_capacity_gib": capacity,
                       "step_tokens": step_tokens,
                       "pool_gib": pool, "profile_gib": profile, **memory, **started, "series": trace.samples}
            except torch.OutOfMemoryError:
                meta["out_of_memory"].append(label)
                print(f"{label:>32}: out of device memory", flush=True)
                continue
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if args.static and row["median_running"]:
                row["static_batch"] = max(round(row["median_running"]), 1)
                try:
                    row["static_step_ms"] = static_step_ms(model, run.config, work, row["static_batch"], args)
                    for key in ("tpot_p50_ms", "step_p50_ms"):
                        row[key.split("_")[0] + "_vs_static"] = (row[key] / row["static_step_ms"] if row[key]
                                                                 else None)
                except torch.OutOfMemoryError:
                    meta["out_of_memory"].append(f"{label}: the static engine at batch {row['static_batch']}")
                finally:
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            save()
            print(f"{label:>32}: {row['output_tokens_per_s']:.1f} output tok/s, {row['requests_done']} done, TTFT "
                  f"p50 {row['ttft_p50_ms'] or 0:.0f} ms, TPOT p50 {row['tpot_p50_ms'] or 0:.2f} ms, max running "
                  f"{row['max_running']}", flush=True)
    if beside is not None:
        try:
            meta["peer"], row = beside.result()
        except PeerError as err:  # our rows are written already
            return refuse("sparsekv.bench.serve", str(err))
        rows.insert(0, row)
        print(peer_line(args.peer, row), flush=True)
    save(final=True)
    print((args.out / f"{args.tag}.md").read_text())
    return 0


def capacity_plan(args, runs, shape: ModelShape, dtype: torch.dtype, max_context: int, command: str,
                  setting: dict) -> int:
    """--plan: ``plan`` for each method, written and printed like a run's results."""
    new = args.max_new_tokens or max_context
    rows = [{"spec": run.label, **plan(run.config, shape, dtype, max_context, new, int(args.device_gib * GIB),
                                       int(args.host_gib * GIB), args.prompt_len[1])} for run in runs]
    dense = next((r["rows"] for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["vs_dense"] = r["rows"] / dense if dense else None
        if dense and r["host_row_gib"]:
            r["host_gib_for_2x_dense"] = (2 * dense + 1) * r["host_row_gib"]
    meta = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "max_context": max_context,
            "max_new_tokens": new, "max_prompt_tokens": args.prompt_len[1], "device_gib": args.device_gib,
            "host_gib": args.host_gib, "plan": True,
            "setting": setting, "command": command}
    lines = plan_markdown(meta, rows)
    write_results(args.out, args.tag, meta, rows, lines, overwrite=args.overwrite)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
