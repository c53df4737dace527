"""Contexts beyond GPU memory and long decodes, through the engine.

    python -m sparsekv.bench.capacity ladder --contexts 262144 524288 1048576 --methods dense omnikv:offload=True
    python -m sparsekv.bench.capacity long-decode --prompt 512 --decode 16384 --methods dense quest raas

``ladder``: for each method, contexts in increasing order at batch 1 until one fails (out of device memory, or refused
for lack of host memory): decode tokens/s (median CUDA-event step), peak device memory, KV on the device and pinned
in host memory. The cache is filled with random keys and values (a real prefill of a million tokens takes longer
than a run may), except at ``--prefill CONTEXT``, which runs the real chunked prefill and reports its time.

``long-decode``: a short prompt, then ``--decode`` tokens: step time and the KV the cache holds against the tokens
decoded (RaaS's memory figure). Step times are medians over windows of ``--window`` steps; the KV held by dense and
Quest grows with every token, RaaS's stops at its budget (measured at the end of the run, and drawn from the rule
before).

Both write ``<tag>.json``, ``<tag>.md`` (and long-decode ``<tag>.png``) under ``--out`` after every row, so that a
run stopped part way keeps what it measured (results there from another device or other options are kept unless
``--overwrite``); ``--model`` as in ``bench.e2e``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch

from ..cache import KV_DTYPE_HELP
from ..engine import Engine
from ..eval.base import EvalError
from ..eval.runner import method_runs
from ..models import check_context, resolve_device
from .common import (claim_results, device_name, int_arg, markdown_table, memory_problems, output_args, pyplot,
                     refuse, run_setting, shape_weights, write_results)
from .e2e import bench_model, kv_itemsize, random_fill


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ladder(model, runs, args, device, rows: list[dict], save) -> None:
    for run in runs:
        for context in sorted(args.contexts):
            row = {"spec": run.label, "context": context}
            real = context == args.prefill
            try:
                engine = Engine(model, run.config, max_context=context + args.new_tokens,
                                prefill_chunk=args.prefill_chunk, compile=args.compile)
                ids = [torch.randint(0, model.config.vocab_size, (context,)).tolist()]
                out = engine.generate(ids, args.new_tokens, stop_tokens=(), time_steps=True,
                                      prefill=None if real else random_fill(model))
                ms = 1e3 * statistics.median(out.step_seconds[2:] or out.step_seconds)
                row.update(status="ok", fill="prefill" if real else "random", decode_ms=ms, tokens_per_s=1e3 / ms,
                           prefill_s=out.prefill_seconds if real else None,
                           peak_device_gib=(out.peak_device_bytes or 0) / 2**30,
                           kv_device_gib=out.kv_device_bytes / 2**30, kv_host_gib=out.kv_host_bytes / 2**30)
            except torch.OutOfMemoryError:
                row.update(status="out of device memory")
            except ValueError as err:
                row.update(status=f"refused: {err}")
            rows.append(row)
            _free(device)
            print(row, flush=True)
            save()
            if row["status"] != "ok":
                break


def long_decode(model, runs, args, device, rows: list[dict], save) -> None:
    for run in runs:
        per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
            (model.config.hidden_size // model.config.num_attention_heads) * kv_itemsize(model, run.config)
        engine = Engine(model, run.config, max_context=args.prompt + args.decode + 1, compile=args.compile,
                        check_every=1024)
        ids = [torch.randint(0, model.config.vocab_size, (args.prompt,)).tolist()]
        out = engine.generate(ids, args.decode, stop_tokens=(), time_steps=True)
        steps = out.step_seconds[2:]
        windows = [1e3 * statistics.median(steps[i:i + args.window]) for i in range(0, len(steps), args.window)]
        cap = getattr(run.config, "token_budget", None) if run.config.name == "raas" else None
        held = [(args.prompt + t) * per_token if cap is None else min(args.prompt + t, max(cap, args.prompt))
                * per_token for t in range(0, args.decode + 1, args.window)]
        rows.append({"spec": run.label, "window_ms": windows, "held_gib": [h / 2**30 for h in held],
                     "held_gib_measured_end": out.kv_held_bytes / 2**30, "kv_device_gib": out.kv_device_bytes / 2**30,
                     "median_ms": 1e3 * statistics.median(steps), "decode_steps": out.decode_steps})
        _free(device)
        print({k: v for k, v in rows[-1].items() if k not in ("window_ms", "held_gib")}, flush=True)
        save()


LADDER_COLUMNS = [("method", "spec", "{}"), ("context", "context", "{}"), ("status", "status", "{}"),
                  ("fill", "fill", "{}"), ("prefill s", "prefill_s", "{:.1f}"),
                  ("decode ms/step", "decode_ms", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
                  ("peak device GiB", "peak_device_gib", "{:.1f}"), ("KV device GiB", "kv_device_gib", "{:.1f}"),
                  ("KV host GiB", "kv_host_gib", "{:.1f}")]
DECODE_COLUMNS = [("method", "spec", "{}"), ("median ms/step", "median_ms", "{:.2f}"),
                  ("vs Quest", "vs_quest", "{:.2f}x"),
                  ("first window ms", lambda r: r["window_ms"][0], "{:.2f}"),
                  ("last window ms", lambda r: r["window_ms"][-1], "{:.2f}"),
                  ("KV held at the end GiB", "held_gib_measured_end", "{:.3f}"),
                  ("KV allocated GiB", "kv_device_gib", "{:.3f}")]


def write(args, rows, device, final: bool) -> None:
    """Writes the rows so far (after every row, so that a run cut short keeps them); ``final`` also prints them."""
    if args.mode == "long-decode":
        quest = next((r["median_ms"] for r in rows if r["spec"].startswith("quest")), None)
        for r in rows:
            r["vs_quest"] = r["median_ms"] / quest if quest else None
    meta = {"model": args.model, "device_name": device_name(device), "setting": args.setting,
            "command": "python -m sparsekv.bench.capacity " + " ".join(args.argv)}
    lines = [f"# {args.mode} ({args.model}, {meta['device_name']})", "", f"Command: `{meta['command']}`", ""]
    if args.mode == "ladder":
        lines += markdown_table(LADDER_COLUMNS, rows)
    else:
        lines += [f"Prompt {args.prompt} tokens, {args.decode} decoded; step time = median over windows of "
                  f"{args.window} steps.", "", *markdown_table(DECODE_COLUMNS, rows)]
    write_results(args.out, args.tag, meta, rows, lines, overwrite=args.overwrite,
                  figure=_plot(args, rows) if args.mode == "long-decode" else None)
    if final:
        print("\n".join(lines))


def _plot(args, rows):
    """KV held and step time against the tokens decoded: a figure for ``write_results`` (None without
    matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for r in rows:
        marks = [i * args.window for i in range(len(r["held_gib"]))]
        mem.plot(marks, r["held_gib"], label=r["spec"])
        speed.plot([i * args.window for i in range(len(r["window_ms"]))], r["window_ms"], label=r["spec"])
    mem.set(xlabel="decoded tokens", ylabel="KV held (GiB)", title="KV memory")
    speed.set(xlabel="decoded tokens", ylabel="ms per step", title="decode step time")
    mem.legend()
    speed.legend()
    fig.tight_layout()
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.capacity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["ladder", "long-decode"])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--methods", nargs="+", default=["dense", "omnikv:offload=True"])
    parser.add_argument("--budget", type=int_arg(), default=2048)
    parser.add_argument("--contexts", type=int_arg(), nargs="+", default=[262144, 524288, 1048576])
    parser.add_argument("--prefill", type=int_arg(), default=None, help="the ladder context that runs a real prefill")
    parser.add_argument("--prefill-chunk", type=int_arg(), default=8192)
    parser.add_argument("--new-tokens", type=int_arg(2), default=24)
    parser.add_argument("--prompt", type=int_arg(), default=512)
    parser.add_argument("--decode", type=int_arg(4), default=16384,
                        help="tokens decoded; the steps after the first two are timed")
    parser.add_argument("--window", type=int_arg(), default=1024)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"], help=KV_DTYPE_HELP)
    parser.add_argument("--device", default="auto")
    output_args(parser, None, "file stem of the results (default: the mode)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.setting = run_setting("capacity", args)
    args.argv, args.tag = argv, args.tag or args.mode
    try:
        runs = method_runs(args.methods, [args.budget], args.kv_dtype)
    except EvalError as err:
        return refuse("sparsekv.bench.capacity", str(err))
    try:
        device = resolve_device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        problem = memory_problems(device, shape_weights(args.model, dtype))
    except ValueError as err:
        parser.error(str(err))
    claim_results(args.out / f"{args.tag}.json", device_name(device), args.setting, args.overwrite)
    if problem:
        return refuse("sparsekv.bench.capacity", f"--model {args.model} {problem}; use a smaller --model (e.g. "
                     f"shape:tiny or tiny:llama)")
    ladder_mode = args.mode == "ladder"
    longest = max(args.contexts) + args.new_tokens + 1 if ladder_mode else args.prompt + args.decode + 1
    try:
        model = bench_model(args.model, device, dtype, longest)
        check_context(model, longest, "use smaller --contexts or --new-tokens" if ladder_mode else
                      "use a smaller --prompt or --decode")
    except (FileNotFoundError, ImportError, ValueError) as err:  # ImportError: a missing optional extra (gguf)
        parser.error(str(err))
    rows: list[dict] = []
    (ladder if ladder_mode else long_decode)(model, runs, args, device, rows,
                                                        lambda: write(args, rows, device, final=False))
    write(args, rows, device, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
