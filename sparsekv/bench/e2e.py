"""End-to-end decoding through the engine (``sparsekv.engine``: chunked prefill, CUDA-graph decode step) with each
method, against dense through the same engine and against transformers' own decode loops, in one run.

    python -m sparsekv.bench.e2e --contexts 32768 131072 524288 --batches 1 4 --methods dense quest omnikv raas
    python -m sparsekv.bench.e2e --model tiny:llama --contexts 512 --device cpu --new-tokens 8   # smoke test

``shape:<name>`` (the default, Llama-3-8B) builds a random-weight model of that published shape on the device: speed
does not depend on the weights. Per row: prefill tokens/s and the time to first token (after an untimed prefill of
the same prompts, which compiles the kernels the prefill launches and builds cuDNN's attention plans for its shapes:
a server builds each once), decode ms per step (CUDA events around each replay,
median over the steps after the eager warm-up and the capture; for lowbit with ``reuse`` r, the median of the mean
of each run of r steps, one of which chooses pages), tokens/s (batch / step time), peak device memory,
KV bytes on the device and in host memory, the bandwidth floor of the method's step ((weights + KV and page
metadata the step reads) / the copy bandwidth measured in the same run) and the ratio to it, and the speedup over
dense through the engine and over transformers' eager loop (``DynamicCache``) and, with ``--compiled``, its
``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` loop. Where batch x context exceeds ``--max-prefill``
the cache is filled with random keys and values instead of a real prefill (column ``fill``); the transformers loops
run at batch 1 from a random cache. Writes ``<tag>.json``, ``<tag>.md`` and ``<tag>.png`` under ``--out`` (results
there from another device or other options are kept unless ``--overwrite``).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 -m sparsekv.bench.e2e --contexts 131072 524288 --methods dense quest

Started by torchrun, every process loads the model with transformers' tensor parallelism (a ``shape:`` model is
saved by the first process for all to load) and holds 1/N of every layer's heads and KV on its GPU; the decode
step, collectives included, is captured on each. Memory columns are one GPU's; the floor divides the step's bytes
by N GPUs' bandwidth. The transformers loops run in one process only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from typing import Callable, Generator

import torch
import torch.distributed as dist

from .. import parallel
from ..cache import KV_DTYPE_HELP, storage_dtype
from ..engine import Engine, prompt_passes, run_passes
from ..errors import ConfigError
from ..eval.base import EvalError
from ..eval.runner import method_runs
from ..integrations.transformers import cache_argument, prompt_attention
from ..methods import METHODS, selection_bytes
from ..methods.omnikv import OmniKVConfig
from ..models import check_context, load_model, model_shape, resolve_device, resolve_dtype
from ..quant import QuantLinear, quantize_model
from ..spec import budget_arg
from .peer import PEERS, PeerError
from .peer import peer_rows as run_peer
from .common import (SHAPES, Timer, all_reduce_arg, claim_results, conditions, copy_bandwidth, device_name, int_arg,
                     kernel_table, load_sharded, markdown_table, memory_problems, out_of_memory_lines, pdl_arg, pyplot,
                     refuse, run_args, run_setting, shape_model, shape_weights, shared_folder, start_all_reduce,
                     start_pdl, weights_arg, write_results)

FILL_CHUNK = 16384  # tokens of random keys and values written per pass


def bench_model(spec: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    """``shape:<name>`` (random weights of a published shape, built on the device) or any ``load_model`` spec.
    Under torchrun (process group started) the model is loaded with tensor parallelism; a ``shape:`` model is
    built by the first process and saved for all of them to load."""
    if not spec.startswith("shape:"):
        return load_model(spec, device, dtype).model
    if not parallel.launched():
        return shape_model(spec[len("shape:"):], device, dtype, max_positions)
    with shared_folder(lambda folder: shape_model(spec[len("shape:"):], device, dtype,
                                                  max_positions).save_pretrained(folder)) as folder:
        return load_sharded(folder, dtype)


class Noise:
    """Standard normal values for the random fill without drawing them at every pass: views of one pool of noise
    (drawn once per device and dtype, from torch's seeded generator) at offsets drawn from a seeded generator of
    its own. A view (B, H, S, D) reads D consecutive values per token, its tokens one after another, each head
    ``HEAD_SHIFT`` tokens after the one before and each sequence ``ROW_SHIFT`` after (heads and rows overlap,
    shifted): a pass's keys, values and queries are then slices of the pool, and filling a long prompt costs
    its copies only (drawing them took most of the fill's device time, 4 of 7.7 ms per 8192 tokens of
    Llama-3-8B on the H200)."""

    HEAD_SHIFT, ROW_SHIFT = 17, 263
    LEAST = 1 << 24  # values in a pool: 32 MiB of bf16

    def __init__(self):
        self.pools: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.offsets = torch.Generator().manual_seed(0)

    def __call__(self, b: int, h: int, s: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(B, H, S, D) noise as a view of the pool of ``device`` and ``dtype``."""
        span = ((b - 1) * self.ROW_SHIFT + (h - 1) * self.HEAD_SHIFT + s) * d
        pool = self.pools.get((device, dtype))
        if pool is None or pool.numel() < 2 * span:
            pool = torch.randn(max(self.LEAST, 2 * span), dtype=dtype, device=device)
            self.pools[(device, dtype)] = pool
        offset = int(torch.randint(pool.numel() - span + 1, (1,), generator=self.offsets))
        return pool.as_strided((b, h, s, d), (self.ROW_SHIFT * d, self.HEAD_SHIFT * d, d, 1), offset)


noise = Noise()


def random_passes(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, chunk: int, start: int = 0,
                  layers=None) -> Generator[int, None, torch.Tensor]:
    """``engine.prefill_passes`` with random keys and values (``noise``) instead of the model: the same appends and
    method hooks as a real chunked prefill (random queries stand for the prompt's), without its compute, pass by
    pass (layer major), yielding the tokens of each pass; returns zero logits (B, V). The prompt's attention runs
    only for a method that reads its log-sum-exps (``Method.reads_prompt_lse``: H2O's prompt scores), which a
    real pass hands it, so that its fill costs what a real one does there. Layer by layer, so a method
    that moves a layer's prompt to host memory at the layer's last chunk (OmniKV's offload) holds one offloaded
    layer on the device at a time. ``start``: as in ``prefill_passes`` (the cache's keys continue; the random ones
    have no positions); ``layers``: not used (nothing runs through the model)."""
    heads, kv_heads = parallel.local_heads(model)
    head_dim = model.get_decoder().layers[0].self_attn.head_dim
    dtype = next(model.parameters()).dtype
    b, scale, pages = ids.shape[0], head_dim ** -0.5, cache.pages
    for layer, begin, end in prompt_passes(cache, ids.shape[1], mask, chunk, model.config.num_hidden_layers):
        k, v = (noise(b, kv_heads, end - begin, head_dim, dtype, ids.device) for _ in range(2))
        cache.update(k, v, layer)
        q = noise(b, heads, end - begin, head_dim, dtype, ids.device)
        lse = prompt_attention(q, pages.layers[layer], pages.plan, scale)[1] if cache.method.reads_prompt_lse else None
        cache.method.prefill_chunk(layer, q, pages.layers[layer], pages.plan, scale, lse)
        if pages.plan.prompt_end:
            cache.method.prefill(layer, q, pages.layers[layer], pages.plan, scale)
        yield (end - begin) * b
    return torch.zeros(b, model.config.vocab_size, device=ids.device)


def fill_passes(chunk: int | None) -> Callable:
    """``random_passes`` (for the serving runner's ``passes``) writing passes of ``chunk`` tokens whatever chunk the
    runner asks for (None: the runner's). The runner still runs about its own chunk's token-layers per step, so the
    same keys and values come in fewer, longer passes, with fewer launches on the host."""
    if chunk is None:
        return random_passes
    return lambda model, cache, ids, mask, _, start=0, layers=None: random_passes(model, cache, ids, mask, chunk,
                                                                                 start)


def random_fill(model):
    """An engine ``prefill`` (``Engine.generate(prefill=...)``) that runs ``random_passes`` to the end."""
    return lambda cache, ids, mask: run_passes(random_passes(model, cache, ids, mask, FILL_CHUNK))


def kv_itemsize(model, config) -> int:
    """Bytes per stored key or value element of ``config``'s cache (``kv_dtype``) for ``model``."""
    return storage_dtype(config.kv_dtype, next(model.parameters()).dtype).itemsize


def metadata_bytes(model, config, context: int, batch: int) -> int:
    """``methods.selection_bytes`` of ``model``'s shape and cache, over all processes of tensor parallelism."""
    return selection_bytes(config, *model_shape(model.config), kv_itemsize(model, config), context, batch)


def step_bytes(model, config, stats: dict, context: int, batch: int) -> int:
    """Bytes a decode step must read, over all processes of tensor parallelism: the weights (less the embedding
    table, of which it reads B rows), the KV tokens it attends (the statistics' mean per layer and KV head), the
    page metadata (``metadata_bytes``), and OmniKV's filter-layer keys, read again to score the prompt."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    weights += sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, QuantLinear)
                   for t in (m.codes, m.scale, m.minimum))
    itemsize = kv_itemsize(model, config)
    layers, kv_heads, head_dim = model_shape(model.config)
    token = kv_heads * head_dim * itemsize  # one token's key (or value) in one layer
    kv = stats["attended_per_head"] * layers * batch * 2 * token
    rescored = len(config.layers_for(layers)) * batch * context * token if isinstance(config, OmniKVConfig) else 0
    return int(weights + kv + metadata_bytes(model, config, context, batch) + rescored)


def step_time(seconds: list[float], period: int) -> float:
    """The median over ``seconds``' runs of ``period`` consecutive steps of their mean: the step time of a method
    whose steps repeat every ``period`` (lowbit's ``reuse``: one step in each run chooses pages, the others reuse
    them); the median step for a period of 1."""
    runs = [seconds[i:i + period] for i in range(0, len(seconds) - period + 1, period)] or [seconds]
    return statistics.median(statistics.fmean(run) for run in runs)


def engine_row(model, config, label: str, context: int, batch: int, args, device, bandwidth: float | None) -> dict:
    """One row: ``config``'s method through the engine; ``bandwidth`` (bytes/s, None on the CPU) gives the floor."""
    rows = torch.randint(0, model.config.vocab_size, (batch, context),
                         generator=torch.Generator().manual_seed(args.seed)).tolist()
    real = batch * context <= args.max_prefill
    engine = Engine(model, config, max_batch=batch, max_context=context + args.new_tokens,
                    prefill_chunk=args.prefill_chunk, compile=args.compile)
    profiler = StepProfiler(args.profile) if args.profile and device.type == "cuda" else None
    if real:  # the prompts' own shapes, in a cache of the measured run's size (cuDNN keys its plans by the
        # strides of the keys it reads, which follow that size): the kernels compiled, the plans built
        engine.generate(rows, args.new_tokens, stop_tokens=())
    started = conditions(device)
    out = engine.generate(rows, args.new_tokens, stop_tokens=(), time_steps=True,
                          prefill=None if real else random_fill(model), stream=profiler)
    ms = 1e3 * step_time(out.step_seconds[2:] or out.step_seconds, getattr(config, "reuse", 1))
    # Under tensor parallelism each GPU reads its share of the step's bytes.
    gpus = dist.get_world_size() if parallel.launched() else 1
    floor_ms = None if bandwidth is None else 1e3 * step_bytes(model, config, out.stats, context, batch) / (
        gpus * bandwidth)
    return {"spec": label, "method": config.name, "budget": getattr(config, "token_budget", None),
            "context": context, "batch": batch, "gpus": gpus, "fill": "prefill" if real else "random",
            "prefill_tokens_per_s": batch * context / out.prefill_seconds if real else None,
            "ttft_s": out.prefill_seconds if real else None,
            "decode_ms": ms, "tokens_per_s": 1e3 * batch / ms, "floor_ms": floor_ms,
            "x_floor": None if floor_ms is None else ms / floor_ms,
            "metadata_mib": metadata_bytes(model, config, context, batch) / 2**20,
            "captured": out.captured, "attended_per_head": out.stats["attended_per_head"],
            "kv_device_gib": out.kv_device_bytes / 2**30, "kv_host_gib": out.kv_host_bytes / 2**30,
            "peak_device_gib": None if out.peak_device_bytes is None else out.peak_device_bytes / 2**30,
            **started, **({"profile": profiler.table} if profiler is not None else {})}


class StepProfiler:
    """An engine ``stream`` callback that runs torch.profiler over ``steps`` decode steps once the step is captured
    and warm (from the 8th), and keeps their ``kernel_table``."""

    START = 8

    def __init__(self, steps: int):
        self.steps, self.calls, self.table, self.prof = steps, 0, None, None

    def __call__(self, new_tokens) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.calls += 1
        if self.calls == self.START:
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.start()
        elif self.calls == self.START + self.steps:
            torch.cuda.synchronize()
            self.prof.stop()
            self.table = kernel_table(self.prof, self.steps)
            self.prof = None


def transformers_row(model, context: int, batch: int, args, device, compiled: bool) -> dict:
    """transformers' own decode loop from a random cache of ``context`` tokens: eager with a ``DynamicCache``, or a
    ``StaticCache`` with the forward compiled in "reduce-overhead" mode (CUDA graphs)."""
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    steps = args.new_tokens
    if compiled:
        cache = StaticCache(config=cfg, max_cache_len=context + steps + 8)
    else:
        cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, cfg.num_key_value_heads, context, head_dim, dtype=dtype, device=device)
        cache.update(k, torch.randn_like(k), layer, {"cache_position": torch.arange(context, device=device)})
    cache_arg = cache_argument(model)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    position = torch.full((batch, 1), context, dtype=torch.long, device=device)

    def step():
        logits = forward(input_ids=token, position_ids=position, cache_position=position[0],
                         use_cache=True, **{cache_arg: cache}).logits
        token.copy_(logits[:, -1:].argmax(-1))
        position.add_(1)

    with torch.no_grad():
        ms = Timer(device, reps=max(steps - 4, 1), warmup=4).eager(step)
    return {"spec": "transformers-compiled" if compiled else "transformers-eager", "method": "dense",
            "budget": None, "context": context, "batch": batch, "fill": "random", "prefill_tokens_per_s": None,
            "decode_ms": ms, "tokens_per_s": 1e3 * batch / ms, "floor_ms": None, "x_floor": None,
            "captured": compiled, "attended_per_head": None, "kv_device_gib": None, "kv_host_gib": None,
            "peak_device_gib": None}


def add_ratios(rows: list[dict]) -> None:
    """Speedups over dense through the engine and over transformers' loops, at the same context and batch, and at
    batch 1 the time to first token over the peer's."""
    def ref(spec, r, key="decode_ms"):
        return next((x[key] for x in rows if x["spec"] == spec and x["context"] == r["context"]
                     and x["batch"] == r["batch"]), None)

    for r in rows:
        for key, spec in (("vs_dense", "dense"), ("vs_transformers", "transformers-eager"),
                          ("vs_compiled", "transformers-compiled"), ("vs_peer", "vllm")):
            base = ref(spec, r)
            r[key] = base / r["decode_ms"] if base else None
        peer = ref("vllm", r, "ttft_s")
        r["ttft_vs_peer"] = r["ttft_s"] / peer if peer and r.get("ttft_s") and r["batch"] == 1 else None


def fmt(x, spec="{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    """The table of ``rows``; the bandwidth floor's columns on a GPU only (None: the CPU, timed by the host clock)."""
    gpu = meta["bandwidth_tbs"] is not None
    how = (f"Engine: chunked prefill, CUDA-graph decode step; {meta['new_tokens']} greedy tokens, median step (CUDA "
           f"events) after the warm-up and capture (lowbit with reuse r: median of the mean of each run of r steps). "
           f"Floor: bytes the step reads / {meta['bandwidth_tbs']:.2f} TB/s "
           f"(device copy measured in the run)." if gpu else
           f"Engine: chunked prefill, eager decode step on the CPU; {meta['new_tokens']} greedy tokens, median step "
           f"(host clock) after the warm-up.")
    columns = [("method", "spec", "{}"), ("budget", "budget", "{}"), ("context", "context", "{}"),
               ("batch", "batch", "{}"), ("fill", "fill", "{}"), ("prefill tok/s", "prefill_tokens_per_s", "{:.0f}"),
               ("TTFT s", "ttft_s", "{:.2f}"),
               *([(f"TTFT / {meta['peer']['peer']}", "ttft_vs_peer", "{:.2f}x")] if meta.get("peer") else []),
               ("decode ms/step", "decode_ms", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
               *([("floor ms", "floor_ms", "{:.2f}"), ("x floor", "x_floor", "{:.2f}")] if gpu else []),
               ("vs dense", "vs_dense", "{:.2f}x"), ("vs transformers eager", "vs_transformers", "{:.2f}x"),
               ("vs compiled", "vs_compiled", "{:.2f}x"),
               *([(f"vs {meta['peer']['peer']}", "vs_peer", "{:.2f}x")] if meta.get("peer") else []),
               ("metadata MiB/step", "metadata_mib", "{:.1f}"), ("peak GiB", "peak_device_gib", "{:.1f}"),
               ("KV device GiB", "kv_device_gib", "{:.2f}"), ("KV host GiB", "kv_host_gib", "{:.2f}")]
    if meta.get("peer"):
        how += (f" {meta['peer']['peer']} {meta['peer']['version']} (dense, in a process of its own before ours; "
                f"`python -m sparsekv.bench.peer`): real prefill, prefill tok/s = context / time to first token, "
                f"decode ms per token from its engine's first and last token times.")
    weights = "" if meta.get("weights", "float") == "float" else f", {meta['weights']} weights"
    weights += "" if meta.get("kv_dtype", "auto") == "auto" else f", {meta['kv_dtype']} KV"
    weights += ", programmatic dependent launch" if meta.get("pdl") else ""
    weights += f", {meta['all_reduce']} all-reduce" if meta.get("all_reduce", "nccl") != "nccl" else ""
    lines = [f"# End-to-end decode ({meta['model']}{weights}, {meta['device_name']}, {meta['dtype']})", "",
             f"{how} fill = random: the cache was filled with random keys and values instead of a real prefill. "
             f"Command: `{meta['command']}`", "", *markdown_table(columns, rows)]
    return lines + out_of_memory_lines(meta["out_of_memory"])


def plot(rows: list[dict]):
    """Decode step time against context, per batch: a figure for ``write_results`` (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False, dpi=120)
    for ax, batch in zip(axes[0], batches):
        for spec in dict.fromkeys(r["spec"] for r in rows):
            pts = sorted((r["context"], r["decode_ms"]) for r in rows if r["spec"] == spec and r["batch"] == batch)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=spec)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode ms per step",
               title=f"batch {batch}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def kv_bytes(args, layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of keys and values of the largest row: batch x (context plus the new tokens). Methods that hold less
    or offload still get the dense row's room (the runs and the transformers loops at batch 1 fit within it, but
    for one layer's copy as a ``DynamicCache`` grows)."""
    return max(args.batches) * (max(args.contexts) + args.new_tokens) * 2 * layers * kv_heads * head_dim * itemsize


def _too_big(args, problem: str) -> int:
    return refuse("sparsekv.bench.e2e", f"--model {args.model} at --contexts {max(args.contexts)} and --batches "
                 f"{max(args.batches)} {problem}; use smaller --contexts or --batches, or a smaller --model (e.g. "
                 f"shape:tiny or tiny:llama)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shape:llama3-8b",
                        help="shape:<name>, tiny:<arch>, a model directory or a GGUF file")
    parser.add_argument("--contexts", type=int_arg(), nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int_arg(), nargs="+", default=[1])
    parser.add_argument("--methods", nargs="+", default=["dense", "quest", "omnikv", "raas"],
                        help=f"NAME or NAME:FIELD=VALUE,... (as sparsekv eval takes them) with NAME in "
                             f"{', '.join(METHODS)}")
    parser.add_argument("--budget", type=budget_arg, default=2048,
                        help="token budget of the methods that take one (OmniKV also a fraction such as 0.1)")
    parser.add_argument("--new-tokens", type=int_arg(2), default=64,
                        help="tokens to generate: the first comes from the prefill, the rest are timed steps")
    parser.add_argument("--prefill-chunk", type=int_arg(), default=8192)
    parser.add_argument("--max-prefill", type=int_arg(0), default=131072,
                        help="batch x context up to which the prompt is really prefilled (else random keys/values)")
    parser.add_argument("--compile", action="store_true",
                        help="Engine(compile=True): the model's layer code fused by torch.compile around the method")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' eager loop")
    parser.add_argument("--compiled", type=int_arg(), nargs="*", default=[],
                        help="contexts at which to time transformers' StaticCache + torch.compile loop too")
    parser.add_argument("--profile", type=int_arg(0), default=0, metavar="STEPS",
                        help="list the kernels of this many captured decode steps of each row (torch.profiler, CUDA)")
    pdl_arg(parser)
    all_reduce_arg(parser)
    weights_arg(parser)
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"], help=KV_DTYPE_HELP)
    parser.add_argument("--peer", choices=PEERS, default=None,
                        help="also time the peer's dense decode at batch 1, in a process of its own before ours "
                             "(python -m sparsekv.bench.peer; a shape: model on CUDA, bf16 weights and KV)")
    parser.add_argument("--peer-contexts", type=int_arg(), nargs="+", default=None,
                        help="the contexts the peer runs at (default: --contexts)")
    run_args(parser, "e2e")
    return parser


def peer_problem(args, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``--peer`` cannot run beside these options (None: it can): the peer builds the same published shape on
    the GPU, one process, bf16 weights and KV, at batch 1."""
    if not args.model.startswith("shape:"):
        return f"--peer needs a shape:<name> --model (the peer builds its random weights), got {args.model!r}"
    if device.type != "cuda" or parallel.launched():
        return "--peer runs on one CUDA device, without torchrun"
    if dtype != torch.bfloat16 or args.weights != "float" or args.kv_dtype != "auto":
        return "--peer compares bf16 weights and KV: drop --dtype, --weights and --kv-dtype"
    if 1 not in args.batches:
        return "--peer times batch 1: give --batches 1"
    return None


def peer_rows(args) -> tuple[dict, list[dict]]:
    """The peer's version and its rows, shaped as ``engine_row``'s (spec: the peer's name; its decode time from its
    engine's token timestamps, not CUDA events; prefill tokens/s: context / time to first token)."""
    contexts = args.peer_contexts or args.contexts
    result = run_peer(args.peer, "decode", ["--model", args.model, "--contexts", *map(str, contexts),
                                            "--new-tokens", str(args.new_tokens), "--seed", str(args.seed)])
    rows = [{"spec": args.peer, "method": "dense", "budget": None, "context": r["context"], "batch": 1,
             "fill": "prefill", "prefill_tokens_per_s": r["prefill_tok_s"], "ttft_s": r["ttft_s"],
             "decode_ms": r["decode_ms"], "tokens_per_s": r["tokens_per_s"], "floor_ms": None, "x_floor": None,
             "captured": True, "attended_per_head": None, "kv_device_gib": None, "kv_host_gib": None,
             "peak_device_gib": None} for r in result["rows"]]
    return {"peer": result["peer"], "version": result["version"]}, rows


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setting = run_setting("e2e", args)
    try:
        runs = method_runs(args.methods, [args.budget], args.kv_dtype)
    except (ConfigError, EvalError) as err:
        print(f"sparsekv.bench.e2e: error: {err}", file=sys.stderr)
        return 2
    if parallel.launched() and (args.transformers or args.compiled):
        parser.error("--transformers and --compiled time transformers' loops in one process: run them without "
                     "torchrun")
    # Under torchrun the process group is started here (transformers would start it while loading), to share a
    # shape: model's folder; each process drives its GPU and the first one prints and writes the results.
    try:
        device = parallel.start() if parallel.launched() else resolve_device(args.device)
        dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        weights = shape_weights(args.model, dtype)
    except ValueError as err:
        parser.error(str(err))
    start_pdl(args, device, parser)
    start_all_reduce(args, device, parser)
    longest = max(args.contexts) + args.new_tokens
    gpus = dist.get_world_size() if parallel.launched() else 1
    where = device_name(device) + (f" x {gpus} (tensor parallel)" if gpus > 1 else "")
    claim_results(args.out / f"{args.tag}.json", where, setting, args.overwrite)
    problem = args.peer and peer_problem(args, device, dtype)
    if problem:
        parser.error(problem)
    if weights:  # a shape: model is checked before it is built; a loaded model once it is there
        shape = SHAPES[args.model.removeprefix("shape:")]
        problem = memory_problems(device, weights, {"KV cache": kv_bytes(
            args, shape.layers, shape.kv_heads, shape.head_dim, storage_dtype(args.kv_dtype, dtype).itemsize)}, gpus)
        if problem:
            return _too_big(args, problem)
    peer, peer_results = None, []
    if args.peer:  # first, in a process of its own: its engine takes most of the GPU until it exits
        try:
            peer, peer_results = peer_rows(args)
        except PeerError as err:
            return refuse("sparsekv.bench.e2e", str(err))
    try:
        model = bench_model(args.model, device, dtype, longest)
    except (FileNotFoundError, ImportError) as err:  # ImportError: a missing optional extra (gguf)
        parser.error(str(err))
    quantize_model(model, args.weights)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not weights:
        try:
            check_context(model, longest, "use smaller --contexts or --new-tokens")
        except ValueError as err:
            parser.error(f"--contexts {max(args.contexts)} with --new-tokens {args.new_tokens}: {err}")
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = kv_bytes(args, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                      storage_dtype(args.kv_dtype, dtype).itemsize)
        problem = memory_problems(device, None, {"KV cache": kv}, gpus)
        if problem:
            return _too_big(args, problem)
    # The floor is a GPU's: bytes a step reads over its bandwidth. The CPU's steps are timed, not floored.
    bandwidth = copy_bandwidth(device, Timer(device, reps=30)) if device.type == "cuda" else None
    rows, out_of_memory = list(peer_results), []
    meta = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "weights": args.weights,
            "kv_dtype": args.kv_dtype, "pdl": args.pdl, "all_reduce": args.all_reduce,
            "new_tokens": args.new_tokens,
            "device_name": where, "torch": torch.__version__,
            "bandwidth_tbs": None if bandwidth is None else bandwidth / 1e12,
            "out_of_memory": out_of_memory, "setting": setting, "peer": peer,
            "command": (f"torchrun --nproc-per-node {gpus}" if gpus > 1 else "python") + " -m sparsekv.bench.e2e "
                       + " ".join(argv)}

    def say(line: str) -> None:
        if parallel.is_first():
            print(line, flush=True)

    def save(final: bool = False) -> None:
        """Writes the rows so far (after every row, so that a run cut short keeps them; ``final``: with the plot)."""
        if parallel.is_first():
            add_ratios(rows)
            write_results(args.out, args.tag, meta, rows, markdown(meta, rows), figure=plot(rows) if final else None,
                          overwrite=args.overwrite)

    def done(row: dict) -> None:
        rows.append(row)
        save()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        floor = "" if bandwidth is None else f"x floor {fmt(row['x_floor'])}, "
        say(f"{row['spec']:>24} ctx {row['context']:>7} b {row['batch']}: {row['decode_ms']:.2f} ms/step "
            f"({row['tokens_per_s']:.1f} tok/s, {floor}fill {row['fill']}), "
            f"metadata {fmt(row.get('metadata_mib'), '{:.1f}')} MiB/step, "
            f"peak {fmt(row['peak_device_gib'], '{:.1f}')} GiB")

    # transformers' loops first, at batch 1: their caches grow by copying, which needs twice the KV memory.
    for context in args.contexts:
        modes = ([False] if args.transformers else []) + ([True] if context in args.compiled else [])
        for compiled in modes:
            done(transformers_row(model, context, 1, args, device, compiled))
    for context in args.contexts:
        for batch in args.batches:
            for run in runs:
                try:
                    done(engine_row(model, run.config, run.label, context, batch, args, device, bandwidth))
                except torch.OutOfMemoryError:
                    out_of_memory.append(f"{run.label} at context {context}, batch {batch}")
                    say(f"{run.label:>24} ctx {context:>7} b {batch}: out of device memory")
                    gc.collect()
                    torch.cuda.empty_cache()
    if not parallel.is_first():
        parallel.finish()
        return 0
    save(final=True)
    print((args.out / f"{args.tag}.md").read_text())
    parallel.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
