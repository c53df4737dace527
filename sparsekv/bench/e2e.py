"""End-to-end decoding through transformers with each method: prefill time, decode ms per token, tokens/s, KV
tokens attended, KV cache and peak device memory, compared with dense in the same run.

    python -m sparsekv.bench.e2e --model shape:llama3-8b --contexts 8192 32768 --methods dense quest --budget 2048
    python -m sparsekv.bench.e2e --model PATH --contexts 4096                   # a local model directory
    python -m sparsekv.bench.e2e --model tiny:llama --contexts 512 --device cpu  # smoke test

``shape:<name>`` builds a random-weight model of that published shape directly on the device (speed does not depend
on the weights). The decode loop is transformers' eager forward, one token per step, timed with CUDA events (host
clock on CPU) after a warm-up; the median over steps is reported. Writes ``e2e.json`` and ``e2e.md`` under
``--out`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

from .. import apply
from ..errors import ConfigError
from ..eval.base import EvalError
from ..eval.runner import method_runs
from ..methods import METHODS
from ..models import load_model, resolve_device, resolve_dtype
from ..spec import budget_arg
from .common import Timer, device_name, markdown_table, shape_model, write_results

def run_one(model, config, context: int, new_tokens: int, device: torch.device, seed: int) -> dict:
    """Prefill ``context`` random tokens, then decode ``new_tokens`` greedily one at a time."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    timer = Timer(device)
    with apply(model, config) as session, torch.no_grad():
        with timer.region() as prefill:
            out = model(ids, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            with timer.region() as step:
                out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            steps.append(step.seconds)
    warm = steps[2:] or steps  # the first steps pay one-time compilation and allocation
    median = statistics.median(warm)
    return {"method": config.name, "budget": getattr(config, "token_budget", None), "context": context,
            "prefill_s": prefill.seconds, "decode_ms_per_token": 1e3 * median, "tokens_per_s": 1 / median,
            **session.stats.summary(), "kv_device_mib": session.cache.resident_bytes() / 2**20,
            "kv_offloaded_mib": session.cache.offloaded_bytes() / 2**20,
            "peak_device_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    dense = {r["context"]: r["decode_ms_per_token"] for r in rows if r["spec"] == "dense"}
    cols = [("method", "spec", "{}"), ("budget", "budget", "{}"), ("context", "context", "{}"),
            ("prefill s", "prefill_s", "{:.2f}"), ("decode ms/token", "decode_ms_per_token", "{:.1f}"),
            ("tokens/s", "tokens_per_s", "{:.1f}"),
            ("vs dense", lambda r: dense.get(r["context"], float("nan")) / r["decode_ms_per_token"], "{:.2f}x"),
            ("attended/step", "attended_per_head", "{:.0f}"), ("KV device MiB", "kv_device_mib", "{:.0f}"),
            ("KV host MiB", "kv_offloaded_mib", "{:.0f}"), ("peak device MiB", "peak_device_mib", "{:.0f}")]
    return [f"# End-to-end decode ({meta['model']}, {meta['device_name']}, {meta['dtype']})", "",
            f"transformers eager forward, batch 1, {meta['new_tokens']} greedy tokens, median over steps after "
            "warm-up. Command: `" + meta["command"] + "`", "", *markdown_table(cols, rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shape:llama3-8b", help="shape:<name>, tiny:<arch> or a model directory")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--methods", nargs="+", default=["dense", "quest"],
                        help=f"NAME or NAME:FIELD=VALUE,... (as sparsekv eval takes them) with NAME in "
                             f"{', '.join(METHODS)}")
    parser.add_argument("--budget", type=budget_arg, default=2048,
                        help="token budget of the methods that take one (OmniKV also a fraction such as 0.1)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="e2e")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    try:
        runs = method_runs(args.methods, [args.budget])
    except (ConfigError, EvalError) as err:
        print(f"sparsekv.bench.e2e: error: {err}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.model.startswith("shape:"):
        model = shape_model(args.model[len("shape:"):], device, dtype, max(args.contexts) + args.new_tokens)
    else:
        model = load_model(args.model, device, dtype).model
    rows = []
    for context in args.contexts:
        for run in runs:
            rows.append(run_one(model, run.config, context, args.new_tokens, device, args.seed))
            rows[-1]["spec"] = spec = run.label
            r = rows[-1]
            print(f"{spec:>20} ctx {context:>7}: prefill {r['prefill_s']:.2f} s, decode {r['decode_ms_per_token']:.1f} "
                  f"ms/token, attended {r['attended_per_head']:.0f}/step, KV {r['kv_device_mib']:.0f} MiB", flush=True)
    meta = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "new_tokens": args.new_tokens,
            "device_name": device_name(device), "torch": torch.__version__,
            "command": "python -m sparsekv.bench.e2e " + " ".join(argv)}
    write_results(args.out, args.tag, meta, rows, markdown(meta, rows))
    print((args.out / f"{args.tag}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
