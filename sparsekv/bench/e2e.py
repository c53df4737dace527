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
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import apply
from ..methods import METHODS
from ..eval.base import EvalError
from ..eval.runner import method_runs
from ..models import load_model, resolve_device, resolve_dtype

# Published shapes: hidden, layers, query heads, KV heads, MLP, vocab, RoPE theta.
SHAPES = {"llama3-8b": (4096, 32, 32, 8, 14336, 128256, 500000.0),
          "llama2-7b": (4096, 32, 32, 32, 11008, 32000, 10000.0)}


def shape_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in SHAPES:
        raise ValueError(f"--model shape:<name>: name must be one of {', '.join(SHAPES)}, got {name!r}")
    hidden, layers, heads, kv, mlp, vocab, theta = SHAPES[name]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=mlp, vocab_size=vocab,
                         max_position_embeddings=max_positions, rope_theta=theta)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


class Timer:
    """Elapsed seconds of a region: CUDA events on the GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def run_one(model, config, context: int, new_tokens: int, device: torch.device, seed: int) -> dict:
    """Prefill ``context`` random tokens, then decode ``new_tokens`` greedily one at a time."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    with apply(model, config) as session, torch.no_grad():
        with Timer(device) as prefill:
            out = model(ids, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            with Timer(device) as step:
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


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [f"# End-to-end decode ({meta['model']}, {meta['device_name']}, {meta['dtype']})", "",
             f"transformers eager forward, batch 1, {meta['new_tokens']} greedy tokens, median over steps after "
             "warm-up. Command: `" + meta["command"] + "`", "",
             "| method | budget | context | prefill s | decode ms/token | tokens/s | vs dense | attended/step | "
             "KV device MiB | KV host MiB | peak device MiB |", "|" + " --- |" * 11]
    dense = {r["context"]: r["decode_ms_per_token"] for r in rows if r["spec"] == "dense"}
    for r in rows:
        speedup = dense[r["context"]] / r["decode_ms_per_token"] if r["context"] in dense else float("nan")
        peak = "-" if r["peak_device_mib"] is None else f"{r['peak_device_mib']:.0f}"
        lines.append(f"| {r['spec']} | {r['budget'] or '-'} | {r['context']} | {r['prefill_s']:.2f} | "
                     f"{r['decode_ms_per_token']:.1f} | {r['tokens_per_s']:.1f} | {speedup:.2f}x | "
                     f"{r['attended_per_head']:.0f} | {r['kv_device_mib']:.0f} | {r['kv_offloaded_mib']:.0f} | "
                     f"{peak} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shape:llama3-8b",
                        help="shape:<name>, tiny:<arch>, a model directory or a GGUF file")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--methods", nargs="+", default=["dense", "quest"],
                        help=f"NAME or NAME:FIELD=VALUE,... (as sparsekv eval takes them) with NAME in "
                             f"{', '.join(METHODS)}")
    parser.add_argument("--budget", type=int, default=2048)
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
    except EvalError as err:
        print(f"sparsekv.bench.e2e: error: {err}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.model.startswith("shape:"):
        model = shape_model(args.model[len("shape:"):], device, dtype, max(args.contexts) + args.new_tokens)
    else:
        model, _ = load_model(args.model, device, dtype)
    rows = []
    for context in args.contexts:
        for run in runs:
            rows.append(run_one(model, run.config, context, args.new_tokens, device, args.seed))
            rows[-1]["spec"] = spec = run.label
            r = rows[-1]
            print(f"{spec:>20} ctx {context:>7}: prefill {r['prefill_s']:.2f} s, decode {r['decode_ms_per_token']:.1f} "
                  f"ms/token, attended {r['attended_per_head']:.0f}/step, KV {r['kv_device_mib']:.0f} MiB", flush=True)
    meta = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "new_tokens": args.new_tokens,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "command": "python -m sparsekv.bench.e2e " + " ".join(argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_markdown(args.out / f"{args.tag}.md", meta, rows)
    print((args.out / f"{args.tag}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
