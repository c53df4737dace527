"""sparsekv inside vLLM against vLLM's own attention, in the same device call: each engine in a process of its own
(``bench.peer``), one after the other on the same GPU.

    python -m sparsekv.bench.vllm_backend decode --contexts 32768 131072 --spec quest:token_budget=2048
    python -m sparsekv.bench.vllm_backend load --requests 24 --prompt-len 16384 32768 --output-len 1024
    python -m sparsekv.bench.vllm_backend agree --layers 4 --context 8192 --new-tokens 64

``decode``: batch-1 decode per context (vLLM's engine timestamps; ``bench.peer decode``), vLLM dense and vLLM with
sparsekv's backend, an engine per ``--spec`` given (several may follow it). ``load``: the requests given at once
(``bench.peer load``): output tokens/s, time to first token and per output token. Both on the published shape with
random weights (vLLM's ``dummy`` load).

``agree``: whether sparsekv inside vLLM scores what it should. A random-weight checkpoint of the shape's first
``--layers`` layers (transformers' initialisation, so that attention moves the logits) is saved and loaded by every
run. vLLM's own attention decodes ``--new-tokens`` greedy tokens after each random prompt (the control); then these
tokens are fed through the decode steps (``bench.vllm_forced``, which puts vLLM on its V1 model runner) of sparsekv
in vLLM at a budget covering the context and at ``--spec``'s, and of sparsekv's own engine (dense and ``--spec``),
each giving the tokens' mean negative log-likelihood. sparsekv in vLLM at the covering budget also decodes greedily
on vLLM's default runner (V2, full CUDA graphs for decode batches): how many of its tokens equal the control's
before the first that differs (bf16 near-ties may part them) and their NLL. Passes when sparsekv in vLLM at the
covering budget is within the tolerance of vLLM's own attention, and at ``--spec``'s budget within it of sparsekv's
own engine at that budget (forced NLLs); the tolerance is twice the difference between the two dense runs (vLLM's
and sparsekv's engine: arithmetic that differs in bf16), at least ``NLL_FLOOR``. Exits 1 when it fails.

Results go to ``benchmarks/results/vllm/`` (JSON and markdown, ``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from .common import (claim_results, device_name, int_arg, markdown_table, overwrite_arg, refuse, run_setting,
                     write_files)
from .peer import PeerError, missing_vllm, peer_rows

RESULTS = Path("benchmarks/results/vllm")
NLL_FLOOR = 0.02  # nats per token, as bench.tp's low-precision comparison


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsekv.bench.vllm_backend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    decode = sub.add_parser("decode", help="batch-1 decode per context")
    decode.add_argument("--contexts", type=int_arg(), nargs="+", default=[32768, 131072])
    decode.add_argument("--new-tokens", type=int_arg(2), default=64)
    load = sub.add_parser("load", help="requests given at once")
    load.add_argument("--requests", type=int_arg(), default=24)
    load.add_argument("--prompt-len", type=int_arg(), nargs=2, default=[16384, 32768], metavar=("MIN", "MAX"))
    load.add_argument("--output-len", type=int_arg(), default=1024)
    load.add_argument("--max-num-seqs", type=int_arg(), default=None, help="vLLM's cap on running requests")
    agree = sub.add_parser("agree", help="forced NLL of vLLM's greedy tokens: sparsekv in vLLM vs its controls")
    agree.add_argument("--layers", type=int_arg(), default=4, help="the shape's first layers in the checkpoint")
    agree.add_argument("--context", type=int_arg(), default=8192)
    agree.add_argument("--new-tokens", type=int_arg(), default=64)
    agree.add_argument("--prompts", type=int_arg(), default=2)
    for s in (decode, load):
        s.add_argument("--spec", nargs="+", default=["quest:token_budget=2048"],
                       help="the methods sparsekv's backend runs, each in an engine of its own")
    agree.add_argument("--spec", default="quest:token_budget=2048", help="the method sparsekv's backend runs")
    for s in (decode, load, agree):
        s.add_argument("--model", default="shape:llama3-8b", help="shape:<name>: a published shape")
        s.add_argument("--kv-cache-memory-bytes", type=int_arg(), default=None,
                       help="vLLM's KV cache size, the same for every run (default: what 0.9 of the device leaves)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--tensor-parallel-size", type=int_arg(), default=1,
                       help="vLLM's tensor parallelism: every engine over this many GPUs (sparsekv's own engine in "
                            "agree stays on one)")
        s.add_argument("--out", type=Path, default=None,
                       help="results JSON (default: benchmarks/results/vllm/KIND.json)")
        overwrite_arg(s)
    return p


def peer_options(args) -> list[str]:
    kv = [] if args.kv_cache_memory_bytes is None else ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    return ["--model", args.model, "--seed", str(args.seed), "--tensor-parallel-size", str(args.tensor_parallel_size),
            *kv]


def decode_runs(args) -> list[dict]:
    common = [*peer_options(args), "--contexts", *map(str, args.contexts), "--new-tokens", str(args.new_tokens)]
    dense = peer_rows("vllm", "decode", common)["rows"]
    sparse = [row for spec in args.spec for row in peer_rows("vllm", "decode", [*common, "--sparsekv", spec])["rows"]]
    for row in sparse:
        base = next(d for d in dense if d["context"] == row["context"])
        row["vs_dense"] = base["decode_ms"] / row["decode_ms"]
    return dense + sparse


def load_runs(args) -> list[dict]:
    rng = random.Random(args.seed)
    lo, hi = args.prompt_len
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="sparsekv-vllm-") as folder:
        path = Path(folder) / "workload.json"
        path.write_text(json.dumps({"prompts": prompts, "output_lens": [args.output_len] * args.requests}))
        common = [*peer_options(args), "--workload", str(path)]
        if args.max_num_seqs:
            common += ["--max-num-seqs", str(args.max_num_seqs)]
        (dense,) = peer_rows("vllm", "load", common, timeout_s=1800)["rows"]
        sparse = [row for spec in args.spec
                  for row in peer_rows("vllm", "load", [*common, "--sparsekv", spec], timeout_s=1800)["rows"]]
    for row in sparse:
        row["vs_dense"] = row["output_tokens_per_s"] / dense["output_tokens_per_s"]
    return [dense, *sparse]


def covering_spec(spec: str, tokens: int) -> str:
    """``spec`` at a token budget covering ``tokens`` (pages of 16), the rest of its fields kept."""
    name, _, fields = spec.partition(":")
    kept = [f for f in fields.split(",") if f and not f.startswith("token_budget=")]
    return f"{name}:" + ",".join([f"token_budget={-(-tokens // 16) * 16}", *kept])


def own_engine_nll(folder: Path, specs: list[str], prompts: list[list[int]],
                   forced: list[list[int]]) -> dict[str, list[float]]:
    """sparsekv's own engine over the checkpoint, loaded once: per spec, the forced tokens' mean NLL per prompt
    through its decode steps."""
    from transformers import AutoModelForCausalLM

    from ..engine import Engine
    from ..spec import build_config

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    n = len(forced[0])
    nll = {}
    for spec in specs:
        engine = Engine(model, build_config(spec), max_batch=len(prompts), max_context=len(prompts[0]) + n)
        nll[spec] = [x / n for x in engine.generate(prompts, 0, stop_tokens=(), forced=forced).forced_nll]
        del engine
    del model
    torch.cuda.empty_cache()
    return nll


def agree_runs(args) -> tuple[list[dict], dict]:
    from .common import shape_model

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 128000, (args.context,), generator=gen).tolist() for _ in range(args.prompts)]
    total = args.context + args.new_tokens
    with tempfile.TemporaryDirectory(prefix="sparsekv-vllm-") as folder:
        torch.manual_seed(args.seed)
        model = shape_model(args.model.removeprefix("shape:"), torch.device("cuda"), torch.bfloat16, total,
                            args.layers)
        model.config.torch_dtype = "bfloat16"
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
        work = Path(folder) / "workload.json"
        common = ["--weights", folder, *peer_options(args), "--workload", str(work)]
        lens = [args.new_tokens] * args.prompts
        work.write_text(json.dumps({"prompts": prompts, "output_lens": lens}))
        control = peer_rows("vllm", "score", common)["rows"]
        full = covering_spec(args.spec, total)
        greedy = peer_rows("vllm", "score", [*common, "--sparsekv", full])["rows"]
        forced = [r["tokens"] for r in control]
        work.write_text(json.dumps({"prompts": prompts, "output_lens": lens, "forced": forced}))
        runs = {"vllm dense": [r["nll"] for r in control],
                f"vllm sparsekv {full}": [r["nll"] for r in peer_rows("vllm", "score", [*common, "--sparsekv",
                                                                                         full])["rows"]],
                f"vllm sparsekv {args.spec}": [r["nll"] for r in peer_rows("vllm", "score", [*common, "--sparsekv",
                                                                                              args.spec])["rows"]],
                **{f"sparsekv {spec}": nll for spec, nll in
                   own_engine_nll(Path(folder), ["dense", args.spec], prompts, forced).items()}}

    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(runs[a], runs[b]))

    tol = max(2 * gap("vllm dense", "sparsekv dense"), NLL_FLOOR)
    checks = {f"vllm sparsekv {full} vs vllm dense": gap(f"vllm sparsekv {full}", "vllm dense"),
              f"vllm sparsekv {args.spec} vs sparsekv {args.spec}": gap(f"vllm sparsekv {args.spec}",
                                                                        f"sparsekv {args.spec}")}
    rows = [{"run": name, "nll": nll} for name, nll in runs.items()]
    same = [next((i for i, (a, b) in enumerate(zip(r["tokens"], c)) if a != b), len(c))
            for r, c in zip(greedy, forced)]
    rows.append({"run": f"vllm sparsekv {full}, greedy", "nll": [r["nll"] for r in greedy], "same_tokens": same})
    return rows, {"tolerance": tol, "checks": checks, "passed": all(v <= tol for v in checks.values())}


def markdown(meta: dict, rows: list[dict], verdict: dict | None) -> list[str]:
    head = [f"# sparsekv inside vLLM {meta['vllm']} ({meta['model']}, {meta['device_name']}, bf16): {meta['kind']}",
            "", f"Command: `{meta['command']}`", ""]
    if meta["kind"] == "decode":
        cols = [("method", "method", "{}"), ("context", "context", "{}"), ("TTFT s", "ttft_s", "{:.3f}"),
                ("decode ms/token", "decode_ms", "{:.2f}"), ("vs vLLM dense", "vs_dense", "{:.2f}x")]
    elif meta["kind"] == "load":
        cols = [("method", "method", "{}"), ("output tok/s", "output_tokens_per_s", "{:.1f}"),
                ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"),
                ("running cap (max_num_seqs)", "max_batch", "{}"), ("KV GiB", "kv_capacity_gib", "{:.1f}"),
                ("vs vLLM dense", "vs_dense", "{:.2f}x")]
    else:
        cols = [("run", "run", "{}"),
                ("NLL/token per prompt", lambda r: ", ".join(f"{x:.4f}" for x in r["nll"]), "{}"),
                ("greedy tokens equal to vLLM dense's before the first that differs",
                 lambda r: None if "same_tokens" not in r else ", ".join(map(str, r["same_tokens"])), "{}")]
    lines = head + markdown_table(cols, rows)
    if verdict:
        lines += ["", f"Tolerance {verdict['tolerance']:.4f} nats/token; "
                  + "; ".join(f"{k}: {v:.4f}" for k, v in verdict["checks"].items())
                  + (" — passed" if verdict["passed"] else " — FAILED")]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    args = p.parse_args(argv)
    prog = "sparsekv.bench.vllm_backend"
    problem = missing_vllm()
    if problem:
        return refuse(prog, problem)
    if torch.cuda.device_count() < args.tensor_parallel_size:
        return refuse(prog, f"--tensor-parallel-size {args.tensor_parallel_size} needs as many CUDA devices, this "
                            f"machine has {torch.cuda.device_count()}")
    tp = args.tensor_parallel_size
    out = args.out or RESULTS / (f"{args.kind}.json" if tp == 1 else f"{args.kind}_tp{tp}.json")
    setting = run_setting("vllm_backend", args)
    device = device_name(torch.device("cuda")) + (f" x {tp} (tensor parallel)" if tp > 1 else "")
    claim_results(out, device, setting, args.overwrite)
    try:
        rows, verdict = (agree_runs(args) if args.kind == "agree"
                         else ({"decode": decode_runs, "load": load_runs}[args.kind](args), None))
    except PeerError as err:
        return refuse(prog, str(err))
    import vllm

    meta = {"kind": args.kind, "model": args.model, "spec": args.spec, "vllm": vllm.__version__,
            "device_name": device, "setting": setting,
            "command": "python -m sparsekv.bench.vllm_backend " + shlex.join(argv)}
    lines = markdown(meta, rows, verdict)
    print("\n".join(lines))
    write_files(out, {"meta": meta, "rows": rows, "verdict": verdict}, lines, overwrite=args.overwrite)
    return 1 if verdict and not verdict["passed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
