"""Command line: ``sparsekv generate``, ``sparsekv demo``, ``sparsekv eval``."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import apply
from .eval import cli as eval_cli
from .methods import METHODS, MethodConfig
from .models import (default_model, load_model, make_config, parse_options, resolve_device, resolve_dtype,
                     synchronize)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    seconds: float
    stats: dict
    kv_bytes: int
    offloaded_bytes: int

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def generate(model, tokenizer, config: MethodConfig, prompt: str, max_new_tokens: int, sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> GenerationResult:
    """Generates from ``prompt`` with ``config``'s method; times the whole ``generate`` call (prefill included)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    enc = tokenizer(prompt, return_tensors="pt").to(device)
    extra = dict(do_sample=True, temperature=temperature, top_p=top_p) if sample else dict(do_sample=False)
    torch.manual_seed(seed)
    with apply(model, config) as session, torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **extra)
        synchronize(device)
        seconds = time.perf_counter() - start
    new = out[0, enc.input_ids.shape[1]:]
    return GenerationResult(text=tokenizer.decode(new, skip_special_tokens=True), tokens=new.tolist(),
                            seconds=seconds, stats=session.stats.summary(),
                            kv_bytes=session.cache.resident_bytes(), offloaded_bytes=session.cache.offloaded_bytes())


def _describe(name: str, result: GenerationResult) -> str:
    s = result.stats
    return (f"[{name}] {result.new_tokens} tokens in {result.seconds:.2f} s ({result.tokens_per_second:.1f} tokens/s, "
            f"prefill included); KV tokens attended per layer-head per decode step: "
            f"{s['attended_per_head']:.1f} of {s['context_per_head']:.1f} ({100 * s['fraction']:.1f}%); "
            f"KV cache on the device: {result.kv_bytes / 2**20:.1f} MiB, offloaded to host memory: "
            f"{result.offloaded_bytes / 2**20:.1f} MiB")


def _method_args(parser: argparse.ArgumentParser, default_method: str, extra_choices: tuple[str, ...] = ()) -> None:
    parser.add_argument("--method", default=default_method, choices=[*sorted(METHODS), *extra_choices],
                        help="sparsity method")
    parser.add_argument("--budget", type=_budget, default=None,
                        help="token budget: KV tokens attended (or kept) per layer and KV head per decode step "
                             "(OmniKV also takes a fraction of the prompt, e.g. 0.1); default: the method's own")
    parser.add_argument("--opt", action="append", default=[], metavar="FIELD=VALUE",
                        help="any other field of the method's config, e.g. --opt page_size=32 (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default=None, help="float32, float16, bfloat16 (default: bfloat16 on CUDA, "
                                                      "float32 on CPU)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def _budget(text: str) -> int | float:
    """Budgets are token counts; a value with a decimal point is a fraction (OmniKV)."""
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a number of tokens (or a fraction), got {text!r}")


def _setup(args, default_budget: int | None = None) -> tuple[torch.device, torch.dtype, MethodConfig]:
    """Device, dtype and method config from the options; ``default_budget`` applies to methods with a budget when
    neither --budget nor --opt token_budget is given."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    options = parse_options(args.opt)
    budget = args.budget
    if budget is None and "token_budget" not in options and args.method != "dense":
        budget = default_budget
    return device, dtype, make_config(args.method, budget, **options)


def cmd_generate(args) -> int:
    device, dtype, config = _setup(args)
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file: no file at {str(path)!r}")
        prompt = path.read_text()
    else:
        prompt = args.prompt
    model, tokenizer = load_model(args.model, device, dtype)
    result = generate(model, tokenizer, config, prompt, args.max_new_tokens, args.sample, args.temperature,
                      args.top_p, args.seed)
    print(result.text)
    print(_describe(config.name, result), file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .eval import TaskOptions, get_task

    names = [n for n in METHODS if n != "dense"] if args.method == "all" else [args.method]
    configs = []
    for name in names:
        args.method = name
        device, dtype, config = _setup(args, default_budget=256)
        configs.append(config)
    model, tokenizer = load_model(args.model or default_model(), device, dtype)
    sample = get_task("passkey", TaskOptions()).samples(tokenizer, args.prompt_tokens, 0.5, args.seed, 1)[0]
    prompt = sample.context + sample.question
    print(f"sparsekv demo: model {args.model or 'sparsekv-llama-16m (the project-trained default)'}; a pass key "
          f"hidden mid-way in {len(tokenizer(prompt).input_ids)} prompt tokens (the answer is {sample.answer}); "
          f"up to {args.max_new_tokens} new tokens; {device}, {dtype}. Each method decodes the same prompt: its "
          f"answer, speed, KV tokens attended per step and cache memory against dense.\n")
    generate(model, tokenizer, make_config("dense"), "Warm up.", 2)  # so that timings compare fairly
    dense = generate(model, tokenizer, make_config("dense"), prompt, args.max_new_tokens, seed=args.seed)
    print("| method | budget | answer | tokens/s | KV tokens attended per layer-head per step | of dense "
          "| KV on device (MiB) | same tokens as dense |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for config in [make_config("dense"), *configs]:
        result = dense if config.name == "dense" else generate(
            model, tokenizer, config, prompt, args.max_new_tokens, args.sample, args.temperature, args.top_p,
            args.seed)
        agree = next((i for i, (a, b) in enumerate(zip(dense.tokens, result.tokens)) if a != b), len(dense.tokens))
        s = result.stats
        answer = " ".join(result.text.split())[:24]
        print(f"| {config.name} | {getattr(config, 'token_budget', '-')} | {answer} | "
              f"{result.tokens_per_second:.1f} | {s['attended_per_head']:.0f} | {100 * s['fraction']:.0f}% | "
              f"{result.kv_bytes / 2**20:.1f} | first {agree} of {len(dense.tokens)} |")
    print("\nOther fields are each method's defaults (see README, Methods); --method X --opt FIELD=VALUE sets them.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt with a sparsity method")
    gen.add_argument("--model", required=True, help="local model directory, GGUF file or folder holding one (or a "
                     "hub id where there is network)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    _method_args(gen, "quest")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="the README's main job: dense vs every method (or --method X) on the default "
                                       "model, budget 256 unless --budget")
    _method_args(demo, "all", ("all",))
    demo.add_argument("--prompt-tokens", type=int, default=4000)
    demo.add_argument("--model", help="model folder, GGUF file or tiny:<arch> (default: the project's trained model)")
    demo.set_defaults(func=cmd_demo, opt=[], max_new_tokens=48)

    eval_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as err:  # ImportError: a missing optional extra
        print(f"sparsekv {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
