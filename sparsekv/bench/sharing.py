"""What sharing a prompt's prefill saves in the serving engine (``ServingEngine``, a random-weight model of a
published shape, one method at one budget, the model's own chunked prefill), in one process.

``prefix-cache``: requests one at a time, with and without a prefix cache of ``--cache-gib`` (the same model):

- questions: ``--requests`` requests, each a document of ``--length`` random tokens and a 128-token question of
  its own;
- turns: a conversation of ``--requests`` turns, each prompt the last one, its answer and 128 more tokens, starting
  from the document.

Per request: time to first token (submit to first token, the engine stepped in this process), the prompt tokens
prefilled, the tokens the prefix cache gave, and whether its tokens equal those of the run without the cache.

``choices``: ``--prompts`` prompts of ``--length`` random tokens, ``--choices`` requests each (a client's ``n``),
all submitted at once into prompts x choices rows, against as many requests whose prompts all differ (the shared
run second): wall time to the last token, mean time to first token, prompt tokens prefilled.

Writes ``<tag>.json`` (meta, a row per request or run) and ``<tag>.md`` under ``--out``.

    python -m sparsekv.bench.sharing prefix-cache --method quest --requests 6 --length 32768 --new-tokens 32 \\
        --cache-gib 12 --out benchmarks/results/serve --tag prefix_cache_quest
    python -m sparsekv.bench.sharing choices --method quest --prompts 4 --choices 4 --length 16384 \\
        --new-tokens 128 --out benchmarks/results/serve --tag shared_prefill_quest
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from .common import (SHAPES, claim_results, device_name, int_arg, markdown_table, refuse, run_args, run_setting,
                     shape_model, write_results)

QUESTION = 128  # tokens of a question, and of what a turn adds after the answer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ask(engine, prompt: list[int], new: int, layers: int, device: torch.device) -> tuple[list[int], dict]:
    """One request alone through ``engine``: its tokens, and its time to first token, prompt tokens prefilled and
    prompt tokens the prefix cache gave."""
    from ..serve import Request

    began = time.perf_counter()
    work = engine.metrics()["prefill_work"]
    rid = engine.submit(Request(prompt=prompt, max_tokens=new))
    tokens, ttft, cached = [], None, 0
    while engine.has_work():
        for event in engine.step():
            if event.request_id == rid:
                tokens += event.tokens
                cached = event.cached_tokens
                if ttft is None and event.tokens:
                    _synchronize(device)
                    ttft = time.perf_counter() - began
    return tokens, {"prompt": len(prompt), "ttft_s": ttft, "cached": cached,
                    "prefilled": (engine.metrics()["prefill_work"] - work) // layers}


def prefix_cache(model, config, args, device: torch.device, draw) -> list[dict]:
    """The rows of ``prefix-cache``: each request of each workload, without the cache and then with it."""
    from ..serve import ServingEngine

    layers = model.config.num_hidden_layers
    context = args.length + args.requests * (QUESTION + args.new_tokens) + 64
    document = draw(args.length)
    questions = [draw(QUESTION) for _ in range(args.requests)]
    rows, tokens = [], {}
    for cache in ("without", "with"):
        engine = ServingEngine(model, config, max_batch=1, max_context=context, prefill_chunk=args.prefill_chunk,
                               max_new_tokens=args.new_tokens,
                               prefix_cache_bytes=int(args.cache_gib * 2**30) if cache == "with" else 0)
        ask(engine, draw(args.length), args.new_tokens, layers, device)  # warm-up: shares nothing with the rest
        prompt = document
        for workload in ("questions", "turns"):
            for i, q in enumerate(questions):
                text = document + q if workload == "questions" else prompt + q
                answer, row = ask(engine, text, args.new_tokens, layers, device)
                if workload == "turns":
                    prompt = text + answer
                tokens[cache, workload, i] = answer
                row.update(cache=cache, workload=workload, request=i)
                if cache == "with":
                    row["same_tokens"] = answer == tokens["without", workload, i]
                rows.append(row)
    return rows


def choices(model, config, args, device: torch.device, draw) -> list[dict]:
    """The rows of ``choices``: the run of distinct prompts, then the run of shared ones."""
    from ..serve import Request, ServingEngine

    layers = model.config.num_hidden_layers
    engine = ServingEngine(model, config, max_batch=args.prompts * args.choices, max_context=args.length
                           + args.new_tokens, prefill_chunk=args.prefill_chunk, max_new_tokens=args.new_tokens)

    def serve(texts: list[list[int]]) -> dict:
        began = time.perf_counter()
        ids = {engine.submit(Request(prompt=p, max_tokens=args.new_tokens)) for p in texts}
        first, work = {}, engine.metrics()["prefill_work"]
        while engine.has_work():
            for event in engine.step():
                if event.tokens and event.request_id not in first:
                    first[event.request_id] = time.perf_counter() - began
        _synchronize(device)
        return {"requests": len(ids), "wall_s": time.perf_counter() - began,
                "mean_ttft_s": sum(first.values()) / len(first),
                "prefilled_tokens": (engine.metrics()["prefill_work"] - work) // layers}

    serve([draw(args.length)])  # warm-up: kernels built, first steps captured
    n = args.prompts * args.choices
    distinct = {"run": "distinct", "prompts": n, **serve([draw(args.length) for _ in range(n)])}
    shared = [draw(args.length) for _ in range(args.prompts)]
    return [distinct, {"run": "shared", "prompts": args.prompts,
                       **serve([p for p in shared for _ in range(args.choices)])}]


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    title = {"prefix-cache": "The prefix cache: follow-up questions on one document, and a conversation",
             "choices": "One prefill for a prompt's choices"}[meta["mode"]]
    lines = [f"# {title} ({meta['device_name']}, shape:{meta['shape']}, {meta['dtype']}, {meta['method']})", "",
             f"Command: `{meta['command']}`", ""]
    if meta["mode"] == "choices":
        columns = [("run", "run", "{}"), ("prompts", "prompts", "{}"), ("requests", "requests", "{}"),
                   ("prompt tokens prefilled", "prefilled_tokens", "{}"), ("wall s", "wall_s", "{:.2f}"),
                   ("mean TTFT s", "mean_ttft_s", "{:.2f}")]
        return lines + markdown_table(columns, rows)
    table = []
    for workload in ("questions", "turns"):
        by = {c: [r for r in rows if r["workload"] == workload and r["cache"] == c] for c in ("without", "with")}
        table.append({"workload": workload, "without": _span([r["ttft_s"] for r in by["without"]]),
                      "first": f"{by['with'][0]['ttft_s']:.2f}", "rest": _span([r["ttft_s"] for r in by["with"][1:]]),
                      "prefilled_without": " ".join(str(r["prefilled"]) for r in by["without"]),
                      "prefilled_with": " ".join(str(r["prefilled"]) for r in by["with"]),
                      "same": sum(r["same_tokens"] for r in by["with"])})
    columns = [("workload", "workload", "{}"), ("TTFT without, s", "without", "{}"),
               ("TTFT with: first, s", "first", "{}"), ("then, s", "rest", "{}"),
               ("prefilled without", "prefilled_without", "{}"), ("prefilled with", "prefilled_with", "{}"),
               ("same tokens as without", "same", "{}")]
    return lines + markdown_table(columns, table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.sharing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["prefix-cache", "choices"])
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES), help="the random-weight model's shape")
    parser.add_argument("--method", default="quest", help="a method spec (NAME or NAME:FIELD=VALUE,...)")
    parser.add_argument("--budget", type=int_arg(), default=2048)
    parser.add_argument("--length", type=int_arg(), default=32768, help="tokens of a document (prompt)")
    parser.add_argument("--new-tokens", type=int_arg(), default=32, help="greedy tokens per request")
    parser.add_argument("--prefill-chunk", type=int_arg(), default=8192)
    parser.add_argument("--requests", type=int_arg(), default=6, help="prefix-cache: questions, and turns")
    parser.add_argument("--cache-gib", type=float, default=12.0, help="prefix-cache: the prefix cache's size")
    parser.add_argument("--prompts", type=int_arg(), default=4, help="choices: distinct prompts of the shared run")
    parser.add_argument("--choices", type=int_arg(), default=4, help="choices: requests per prompt (n)")
    run_args(parser, "sharing")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    setting = run_setting("sharing", args)

    from ..eval.base import EvalError
    from ..eval.runner import method_runs
    from ..models import resolve_device, resolve_dtype

    try:
        config = method_runs([args.method], [args.budget])[0].config
    except EvalError as err:
        return refuse("sparsekv.bench.sharing", str(err))
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    claim_results(Path(args.out) / f"{args.tag}.json", device_name(device), setting, args.overwrite)
    longest = args.length + args.requests * (QUESTION + args.new_tokens) + 64 if args.mode == "prefix-cache" \
        else args.length + args.new_tokens + 64
    torch.manual_seed(args.seed)
    model = shape_model(args.shape, device, dtype, longest)
    g = torch.Generator().manual_seed(args.seed)

    def draw(n: int) -> list[int]:
        return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()

    rows = (prefix_cache if args.mode == "prefix-cache" else choices)(model, config, args, device, draw)
    meta = {"mode": args.mode, "shape": args.shape, "method": args.method, "budget": args.budget,
            "length": args.length, "new_tokens": args.new_tokens, "prefill_chunk": args.prefill_chunk,
            "device_name": device_name(device), "dtype": str(dtype).removeprefix("torch."), "setting": setting,
            "command": "python -m sparsekv.bench.sharing " + shlex.join(argv)}
    meta.update({"requests": args.requests, "cache_gib": args.cache_gib} if args.mode == "prefix-cache"
                else {"prompts": args.prompts, "choices": args.choices})
    lines = markdown(meta, rows)
    write_results(Path(args.out), args.tag, meta, rows, lines, overwrite=args.overwrite)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
