"""Command line: ``sparsekv generate``, ``sparsekv demo``, ``sparsekv prompt``, ``sparsekv eval``,
``sparsekv serve``."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

import torch

from . import parallel
from .cache import KV_DTYPE_HELP
from .engine import Engine, Sampling
from .errors import ConfigError
from .eval import cli as eval_cli
from .eval.base import EvalError
from .methods import METHODS, MethodConfig
from .models import chat_prompt, check_context, default_model, load_model, resolve_device, resolve_dtype
from .serve.scheduler import ADMISSIONS, PREEMPTIONS, check_swap_space, check_time_slice, swaps_when_preempted
from .spec import budget_arg, build_config, parse_spec, takes_budget


@dataclass
class GenerationResult:
    """One generation. ``prefill_seconds``: the prompt's pass up to the first new token; ``decode_seconds``: the
    steps after it. ``kv_held_bytes``: keys and values of the tokens the cache holds; ``kv_allocated_bytes``: what
    the cache has allocated on the device (growth room, page metadata and the method's state included).
    ``step_seconds``: each decode step's time, where they were timed."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: dict
    kv_held_bytes: int
    kv_allocated_bytes: int
    offloaded_bytes: int
    step_seconds: list[float] | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the decode steps (the first new token comes out of the prefill); with each step
        timed, one over the median step, which a step slowed by other work on the machine does not move."""
        if self.step_seconds:
            return 1.0 / statistics.median(self.step_seconds)
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds else 0.0


class _Progress:
    """Progress on stderr: the prefill, then a bar of decoded tokens fed by the engine's ``stream`` callback."""

    def __init__(self, label: str, prompt_tokens: int, max_new_tokens: int):
        self.label, self.prompt_tokens, self.max_new_tokens = label, prompt_tokens, max_new_tokens
        self.bar = None
        print(f"[{label}] prefill of {prompt_tokens} tokens ...", file=sys.stderr, flush=True)

    def __call__(self, new: list[list[int]]) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.max_new_tokens, desc=f"[{self.label}] decode", unit="token", file=sys.stderr,
                            dynamic_ncols=True, leave=False)
        self.bar.update(len(new[0]))

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()


def generate(model, tokenizer, config: MethodConfig, prompt: str, max_new_tokens: int, sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, progress: bool = False,
             chat: bool = False, stop_tokens: list[int] | None = None, time_steps: bool = False) -> GenerationResult:
    """Generates from ``prompt`` with ``config``'s method through the engine (``sparsekv.engine``: chunked prefill,
    and on CUDA a decode step captured as a CUDA graph); times the prefill and the decode steps apart.
    ``progress``: show both on stderr. ``chat``: the prompt is the user's turn of the tokenizer's chat template.
    ``stop_tokens``: as the engine's (default: the model's EOS); ``time_steps``: time every decode step."""
    check_sampling(max_new_tokens, temperature, top_p)
    if chat:
        prompt_ids = tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False).input_ids
    else:
        prompt_ids = tokenizer(prompt).input_ids
    check_context(model, len(prompt_ids) + max_new_tokens, "shorten the prompt or --max-new-tokens")
    engine = Engine(model, config, tokenizer=tokenizer, max_context=len(prompt_ids) + max_new_tokens)
    sampling = Sampling(temperature=temperature, top_p=top_p) if sample else Sampling()
    clock = _Progress(config.name, len(prompt_ids), max_new_tokens) if progress else None
    try:
        out = engine.generate([prompt_ids], max_new_tokens, sampling=sampling, seed=seed, stream=clock,
                              stop_tokens=stop_tokens, time_steps=time_steps)
    finally:
        if clock is not None:
            clock.end()
    return GenerationResult(text=out.texts[0], tokens=out.tokens[0], prompt_tokens=len(prompt_ids),
                            prefill_seconds=out.prefill_seconds, decode_seconds=out.decode_seconds,
                            stats=out.stats, kv_held_bytes=out.kv_held_bytes, kv_allocated_bytes=out.kv_device_bytes,
                            offloaded_bytes=out.kv_host_bytes, step_seconds=out.step_seconds)


def _to_stderr(line: str) -> None:
    """A loader's log line on stderr, so that a command's stdout holds only its output."""
    print(line, file=sys.stderr)


def _draw(args) -> tuple[float, float]:
    """--temperature and --top-p, or their defaults (1.0)."""
    return (1.0 if args.temperature is None else args.temperature), (1.0 if args.top_p is None else args.top_p)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", "an integer >= 1", max_new_tokens)
    if not temperature > 0:
        raise ConfigError("--temperature", "a number > 0", temperature)
    if not 0 < top_p <= 1:
        raise ConfigError("--top-p", "a number in (0, 1]", top_p)


def _describe(name: str, result: GenerationResult) -> str:
    s = result.stats
    return (f"[{name}] prefill of {result.prompt_tokens} tokens: {result.prefill_seconds:.2f} s; "
            f"{result.new_tokens} new tokens, decode {result.decode_seconds:.2f} s "
            f"({result.decode_tokens_per_second:.1f} tokens/s after the first); KV tokens attended per layer-head "
            f"per decode step: {s['attended_per_head']:.1f} of {s['context_per_head']:.1f} "
            f"({100 * s['fraction']:.1f}%); KV cache on the device: {result.kv_held_bytes / 2**20:.1f} MiB of "
            f"tokens held, {result.kv_allocated_bytes / 2**20:.1f} MiB allocated; offloaded to host memory: "
            f"{result.offloaded_bytes / 2**20:.1f} MiB")


def _method_spec(extra: tuple[str, ...]):
    def check(text: str) -> str:
        if text not in extra:
            try:
                parse_spec(text)
            except ConfigError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return check


def _method_args(parser: argparse.ArgumentParser, default_method: str, extra_choices: tuple[str, ...] = (),
                 generation: bool = True) -> None:
    """--method, --budget, --opt, --device, --dtype, --weights and, with ``generation``, the options of one
    generation."""
    parser.add_argument("--method", default=default_method, type=_method_spec(extra_choices), metavar="SPEC",
                        help=f"sparsity method: NAME or NAME:FIELD=VALUE,... with NAME one of "
                             f"{', '.join([*METHODS, *extra_choices])} (default: {default_method})")
    budget_default = "256 (the demo's)" if default_method == "all" else "the method's own"
    parser.add_argument("--budget", type=budget_arg, default=None,
                        help="token budget: KV tokens attended (or kept) per layer and KV head per decode step "
                             f"(OmniKV also takes a fraction of the prompt, e.g. 0.1); default: {budget_default}")
    parser.add_argument("--opt", action="append", default=[], metavar="FIELD=VALUE",
                        help="another field of the method's config, as in the spec, e.g. --opt page_size=32 "
                             "--opt per_query_head=false (repeatable)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default=None, help="float32, float16, bfloat16, float64, or auto (the dtype the "
                                                      "weights are stored in); default: bfloat16 on CUDA, float32 "
                                                      "on CPU")
    parser.add_argument("--weights", default="float", choices=["float", "int4", "gguf"],
                        help="float: as loaded (a GGUF dequantized); int4: the layers' linear weights quantized to "
                             "group-wise int4; gguf: a GGUF file's own Q4_0/Q4_1/Q8_0 blocks (default: float)")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"], help=KV_DTYPE_HELP)
    if not generation:
        return
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--sample", action="store_true",
                        help="sample instead of greedy decoding (with --temperature, --top-p, --seed)")
    parser.add_argument("--temperature", type=float, default=None, help="with --sample: > 0 (default: 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="with --sample: in (0, 1] (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the draws' seed with --sample, so that a run repeats (and the demo's pass key; "
                             "default: 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress of the prefill and decode on stderr")


def _setup(args, method: str, default_budget: int | None = None) -> tuple[torch.device, torch.dtype, MethodConfig]:
    """Device, dtype and the config of ``method`` (a spec) from the options; ``default_budget`` applies to methods
    with a budget when neither --budget nor the spec or --opt set token_budget."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if "temperature" in vars(args):  # a command that generates once (serve takes these per request)
        for name in ("temperature", "top_p"):
            if getattr(args, name) is not None and not args.sample:
                raise ConfigError(f"--{name.replace('_', '-')}", "given only with --sample (without it decoding is "
                                  "greedy)", getattr(args, name))
        check_sampling(args.max_new_tokens, *_draw(args))
    budget = args.budget
    if budget is None and takes_budget(method, args.opt):
        budget = default_budget
    config = build_config(method, budget, args.opt)
    return device, dtype, config if args.kv_dtype == "auto" else replace(config, kv_dtype=args.kv_dtype)


# Options that may differ between the processes of a torchrun launch: what the command is, and what each process
# shows (only the first prints). The prompt is compared by its text, wherever it was read from.
_PER_PROCESS = ("command", "func", "no_progress", "prompt", "prompt_file")


def cmd_generate(args) -> int:
    device, dtype, config = _setup(args, args.method)
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        stdin = args.prompt_file == "-"
        if not stdin and not path.is_file():
            raise FileNotFoundError(f"--prompt-file: no file at {str(path)!r}")
        try:
            prompt = (sys.stdin.buffer.read() if stdin else path.read_bytes()).decode("utf-8")
            if "\x00" in prompt:  # binary data that happens to decode
                raise UnicodeError
        except UnicodeError:
            raise ValueError(f"--prompt-file {path}: is not UTF-8 text (give a text file)") from None
        if not prompt.strip():
            raise ValueError(f"--prompt-file {path}: is empty (give the text to continue)")
    else:
        prompt = args.prompt
        if not prompt.strip():
            raise ValueError("--prompt: is empty (give the text to continue)")
    if parallel.launched() and not parallel.started():
        parallel.start()
    try:
        # Under torchrun every process must run the same generation: else the first prints one of several
        # different runs, or the processes' collectives part ways.
        parallel.check_agree({**{"--" + name.replace("_", "-"): value for name, value in sorted(vars(args).items())
                                 if name not in _PER_PROCESS}, "the prompt (--prompt or --prompt-file)": prompt})
        first = parallel.is_first()  # under torchrun every process generates the same tokens; the first one prints
        loaded = load_model(args.model, device, dtype, weights=args.weights,
                            log=_to_stderr if first else None)
        result = generate(loaded.model, loaded.tokenizer, config, prompt, args.max_new_tokens, args.sample,
                          *_draw(args), args.seed, progress=first and not args.no_progress,
                          chat=args.chat)
    except BaseException:
        parallel.finish(wait=False)  # every process stops; none waits at a barrier another never reaches
        raise
    if first:
        print(result.text)
        print(_describe(config.name, result), file=sys.stderr)
    parallel.finish()  # under torchrun: close the process group, with every process done
    return 0


def cmd_demo(args) -> int:
    from .eval import TaskOptions, get_task

    specs = [n for n in METHODS if n != "dense"] if args.method == "all" else [args.method]
    configs = []
    for spec in specs:
        device, dtype, config = _setup(args, spec, default_budget=256)
        configs.append(config)
    if args.prompt_tokens < 1:
        raise ConfigError("--prompt-tokens", "an integer >= 1", args.prompt_tokens)
    loaded = load_model(args.model or default_model(), device, dtype, weights=args.weights)
    model, tokenizer = loaded.model, loaded.tokenizer
    try:
        sample = get_task("passkey", TaskOptions()).samples(tokenizer, args.prompt_tokens, 0.5, args.seed, 1)[0]
    except EvalError as err:
        raise EvalError(f"--prompt-tokens {args.prompt_tokens}: {err}") from None
    prompt = sample.context + sample.question
    prompt_tokens = len(tokenizer(prompt).input_ids)
    check_context(model, prompt_tokens + args.max_new_tokens, "use a smaller --prompt-tokens")
    temperature, top_p = _draw(args)
    how = f"sampled (temperature {temperature}, top-p {top_p}, seed {args.seed})" if args.sample else "greedy"
    room = loaded.max_positions - prompt_tokens if loaded.max_positions is not None else DEMO_TIMED_STEPS
    steps = max(args.max_new_tokens, min(DEMO_TIMED_STEPS, room))
    print(f"sparsekv demo: model {args.model or 'sparsekv-llama-16m (the project-trained default)'}; a pass key "
          f"hidden mid-way in {prompt_tokens} prompt tokens (the answer is {sample.answer}); up to "
          f"{args.max_new_tokens} new tokens, {how}; {device}, {dtype}. Each method decodes the same prompt: its "
          f"answer, prefill time and decode speed, KV tokens attended per step and cache memory against dense.\n")
    generate(model, tokenizer, build_config("dense"), "Warm up.", 2)  # so that timings compare fairly
    # Every method decodes `steps` tokens, past the end of its answer, so that the decode speed is the median of
    # that many steps; the answer is cut at the model's EOS and at --max-new-tokens.
    sampling = dict(sample=args.sample, temperature=temperature, top_p=top_p, seed=args.seed,
                    progress=not args.no_progress, stop_tokens=[], time_steps=True)
    eos = _eos_ids(model, tokenizer)
    dense_config = build_config("dense")
    dense = generate(model, tokenizer, dense_config, prompt, steps, **sampling)
    dense_answer = _answer(dense.tokens, eos, args.max_new_tokens)
    print("| method | budget | answer | prefill s | decode tokens/s | KV tokens attended per layer-head per step "
          "| of dense | KV held (MiB) | KV allocated (MiB) | same tokens as dense |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for config in [dense_config, *(c for c in configs if c != dense_config)]:
        result = dense if config == dense_config else generate(model, tokenizer, config, prompt, steps, **sampling)
        answer_tokens = _answer(result.tokens, eos, args.max_new_tokens)
        agree = next((i for i, (a, b) in enumerate(zip(dense_answer, answer_tokens)) if a != b), len(dense_answer))
        s = result.stats
        answer = " ".join(tokenizer.decode(answer_tokens, skip_special_tokens=True).split())[:24]
        print(f"| {config.name} | {getattr(config, 'token_budget', '-')} | {answer} | {result.prefill_seconds:.2f} | "
              f"{result.decode_tokens_per_second:.1f} | {s['attended_per_head']:.0f} | {100 * s['fraction']:.0f}% | "
              f"{result.kv_held_bytes / 2**20:.1f} | {result.kv_allocated_bytes / 2**20:.1f} | "
              f"first {agree} of {len(dense_answer)} |", flush=True)
    print(f"\nDecode tokens/s: one over the median time of a decode step, over {steps} steps (each method decodes "
          f"past its answer for that). KV tokens attended: the mean over layers and KV heads, so above the budget "
          f"where some layers attend more: Quest's first dense_layers and OmniKV's filter layers attend the whole "
          f"context, RaaS keeps the prompt (prefill=\"keep\") and bounds only its decode pages, SnapKV attends its "
          f"compressed prompt plus every decoded token.")
    if device.type == "cpu":
        print("On the CPU the sparse methods gain little over dense, or lose: a decode step of this small model is "
              "mostly the work around attention (projections, MLP, Python overhead), so attending fewer tokens saves "
              "little, and choosing them (Quest's page scores, OmniKV's selection, RaaS's page bookkeeping) costs "
              "about as much; sparsity pays on a GPU at long contexts, where a decode step's time is reading the KV "
              "cache (README, Results).")
    print("Other fields are each method's defaults (see README, Methods); for one method, --method NAME:FIELD=VALUE "
          "or --method NAME --opt FIELD=VALUE sets them. KV held: keys and values of the tokens the cache holds; "
          "allocated: with the room for growth, page metadata and the method's state.")
    return 0


def cmd_prompt(args) -> int:
    """A sample of an eval task as a prompt on stdout (for ``generate --prompt-file -``), its expected answer on
    stderr."""
    from .eval import TaskOptions, get_task

    task = get_task(args.task, TaskOptions())
    if task.lengths is None:
        raise ValueError(f"task {args.task} reads its prompts from a dataset; give a generated task "
                         f"(passkey, niah, multikey, vartrack, 2stage, arith, ruler_*)")
    sample = task.samples(_tokenizer(args.model), args.length, args.depth if task.depths else None, args.seed, 1)[0]
    sys.stdout.write(sample.context + sample.question)
    sys.stdout.flush()
    tokens = sample.meta.get("prompt_tokens")
    print(f"[{task.name}] {'a prompt' if tokens is None else f'{tokens} tokens'}; the expected answer: "
          f"{sample.answer}", file=sys.stderr)
    return 0


def _tokenizer(spec: str | None):
    """``spec``'s tokenizer: a model folder's is read alone; a GGUF file's or a hub model's comes with the model."""
    from .models import TINY_PREFIX, find_gguf

    spec = spec or default_model()
    if spec.startswith(TINY_PREFIX):
        from .tiny import byte_tokenizer

        return byte_tokenizer()
    if Path(spec).is_dir() and find_gguf(spec) is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec)
    return load_model(spec, "cpu").tokenizer


def cmd_serve(args) -> int:
    try:
        from .serve import ServingEngine
        from .serve.server import serve
    except ImportError as err:
        raise ImportError(f"sparsekv serve needs the serve extra: pip install 'sparsekv[serve]' ({err})") from None
    if args.kv_memory_gib is not None and not args.kv_memory_gib > 0:
        raise ConfigError("--kv-memory-gib", "a number of GiB > 0 (default: what the pool holds)", args.kv_memory_gib)
    device, dtype, config = _setup(args, args.method)
    swaps_when_preempted(config, args.admission, args.preemption, "--preemption")  # before the model loads
    check_time_slice(config, args.admission, args.preemption, args.time_slice, "--time-slice")
    check_swap_space(config, args.admission, args.preemption, args.time_slice, args.swap_space_gib,
                     "--swap-space-gib")
    chat_template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template: no file at {str(path)!r}")
        chat_template = path.read_text()
    loaded = load_model(args.model, device, dtype, log=_to_stderr, weights=args.weights)
    kv_memory = None if args.kv_memory_gib is None else int(args.kv_memory_gib * 2**30)
    engine = ServingEngine(loaded.model, config, tokenizer=loaded.tokenizer, max_batch=args.max_batch,
                           max_context=args.max_context, max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, prefill_chunk=args.prefill_chunk,
                           prefill_share=args.prefill_share, max_queue=args.max_queue, compile=args.compile,
                           kv_memory_bytes=kv_memory,
                           prefix_cache_bytes=int(args.prefix_cache_gib * 2**30), admission=args.admission,
                           gpu_memory_utilization=args.gpu_memory_utilization, step_tokens=args.step_tokens,
                           preemption=args.preemption, time_slice=args.time_slice,
                           swap_space_bytes=int(args.swap_space_gib * 2**30))
    name = args.name or served_name(args.model)

    def ready(port: int) -> None:
        print(f"sparsekv serve: {name} with {config.name} on {device} ({dtype}), at http://{args.host}:{port}/v1",
              file=sys.stderr, flush=True)

    serve(engine, loaded.tokenizer, name, host=args.host, port=args.port, chat_template=chat_template,
          api_key=args.api_key or os.environ.get("SPARSEKV_API_KEY") or None, log_level=args.log_level, ready=ready)
    return 0


def served_name(spec: str | None) -> str:
    """The name clients ask for: a local folder's or file's name (without .gguf), else the spec as given."""
    if spec is None:
        spec = default_model()
    return Path(spec).stem if Path(spec).exists() else spec


def _port(text: str) -> int:
    """A TCP port, checked before the model loads."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port from 0 to 65535, got {text!r}")
    return int(text)


class _Version(argparse.Action):
    """``--version``: prints the installed package's version and exits. Read when asked, so that a checkout run
    without being installed (PYTHONPATH) still parses its other arguments."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print sparsekv's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"sparsekv {version('sparsekv')}")
        parser.exit()


# Decode steps each method of the demo runs at least: its decode speed is the median step of these.
DEMO_TIMED_STEPS = 32


def _eos_ids(model, tokenizer) -> set[int]:
    """The ids that end the model's answer: its generation config's EOS, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _answer(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    """``tokens`` up to and including the first of ``eos``, at most ``limit`` of them."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:min(end, limit)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsekv", description=__doc__)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt with a sparsity method")
    gen.add_argument("--model", help="local model directory, GGUF file or folder holding one, tiny:<arch>, or a hub "
                     "id (the local cache, then the hub where it is reachable); default: the project's trained model")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt's text")
    src.add_argument("--prompt-file", help="a UTF-8 text file holding the prompt; - reads it from stdin")
    _method_args(gen, "quest")
    gen.add_argument("--chat", action="store_true", help="give the prompt as the user's turn of the tokenizer's chat "
                     "template (instruct models; default: the prompt as it is)")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="the README's main job: dense vs every method (or --method X) on the default "
                                       "model, budget 256 unless --budget")
    _method_args(demo, "all", ("all",))
    demo.add_argument("--prompt-tokens", type=int, default=3000,
                      help="tokens of the pass-key prompt (default: %(default)s)")
    demo.add_argument("--model", help="model folder, GGUF file or tiny:<arch> (default: the project's trained model)")
    demo.set_defaults(func=cmd_demo, max_new_tokens=16)

    prm = sub.add_parser("prompt", help="print a generated eval task's prompt (e.g. a pass key in filler) for "
                                        "generate --prompt-file -; its answer goes to stderr")
    prm.add_argument("task", help="a generated task of sparsekv eval: passkey, niah, multikey, vartrack, 2stage, "
                                  "arith, ruler_*")
    prm.add_argument("--length", type=int, default=4000,
                     help="prompt tokens (arith: steps) by the model's tokenizer (default: %(default)s)")
    prm.add_argument("--depth", type=float, default=0.5, help="where the needle goes, 0 to 1 (default: %(default)s)")
    prm.add_argument("--seed", type=int, default=0, help="draws the sample (default: %(default)s)")
    prm.add_argument("--model", help="whose tokenizer measures the length (default: the project's trained model)")
    prm.set_defaults(func=cmd_prompt)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching) with a sparsity method")
    srv.add_argument("--model", help="as for generate (default: the project's trained model)")
    _method_args(srv, "quest", generation=False)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_port, default=8000, help="0-65535 (0: a free one; default: 8000)")
    srv.add_argument("--name", help="the model name clients ask for (default: the model folder's or file's name)")
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoding at once (rows)")
    srv.add_argument("--max-context", type=int, default=None,
                     help="largest prompt plus max_tokens of a request (default: the model's positions)")
    srv.add_argument("--max-new-tokens", type=int, default=None,
                     help="largest max_tokens of a request (default: --max-context); a smaller one shrinks the device "
                          "rows of OmniKV's offloaded layers (they hold only the decode tokens there)")
    srv.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="largest prompt of a request (default: --max-context less one; a longer one gets 400); a "
                          "smaller one shrinks RaaS's rows to the longest prompt's pages and the budget's")
    srv.add_argument("--prefill-chunk", type=int, default=4096,
                     help="prompt tokens prefilled between two decode steps of the running requests")
    srv.add_argument("--prefill-share", type=float, default=None,
                     help="decode priority: while requests decode, prompts' prefill takes at most about this share of "
                          "the decode steps' time (time per output token near (1 + share) x the step; a prompt that "
                          "arrives meanwhile waits about (1 + share) / share times its prefill); default: a chunk "
                          "per step")
    srv.add_argument("--step-tokens", type=int, default=None,
                     help="mixed steps (dense, quest): each step carries the running requests' decode tokens and the "
                          "next prompt tokens, this many tokens in all (as vLLM's --max-num-batched-tokens); default: "
                          "a prompt chunk of --prefill-chunk after each decode step")
    srv.add_argument("--max-queue", type=int, default=256, help="requests waiting for admission (beyond: 429)")
    srv.add_argument("--admission", choices=ADMISSIONS, default="reserve",
                     help="reserve: a request is admitted when the KV of its prompt and max_tokens fits; grow (dense, "
                          "quest): when its prompt's does, its pages taken as it grows, the newest request preempted "
                          "and later recomputed where they run out")
    srv.add_argument("--preemption", choices=PREEMPTIONS, default=None,
                     help="with --admission grow, how a preempted request comes back: recompute (its prompt and "
                          "tokens prefilled again; dense) or swap (its pages copied to host memory and back); "
                          "default: recompute for dense, swap for quest")
    srv.add_argument("--time-slice", type=int, default=None,
                     help="time slicing: while the queue's front waits for a row, a running request this many tokens "
                          "ahead of it yields its row, through host memory (rows that go there and back unchanged: "
                          "raas, the eviction methods, quest; dense with --preemption swap)")
    srv.add_argument("--swap-space-gib", type=float, default=0.0,
                     help="host memory set aside at the start for rows that go there (--time-slice, --preemption "
                          "swap), page-locked on a GPU, as vLLM's swap_space; copies beyond it are allocated as rows "
                          "go, and each is kept for the next")
    srv.add_argument("--kv-memory-gib", type=float, default=None,
                     help="device memory for the KV cache of all requests (default: what --gpu-memory-utilization "
                          "leaves, at most the rows' own)")
    srv.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="share of the GPU's total memory the server may take: weights, KV and the steps' memory, "
                          "measured by a profile step at start (as vLLM's option)")
    srv.add_argument("--prefix-cache-gib", type=float, default=0.0,
                     help="device memory for finished prompts' KV (and ended answers'), kept so that a prompt that "
                          "begins with the same tokens (a conversation's next turn, another question on one "
                          "document) prefills only the rest (dense, quest, lowbit, oracle, raas, omnikv without "
                          "offload; default 0: none)")
    srv.add_argument("--compile", action="store_true", help="fuse the decode step's layer code with torch.compile, "
                     "and build cuDNN's prompt attention plans at start")
    srv.add_argument("--chat-template", help="a Jinja chat template file, for a tokenizer that has none")
    srv.add_argument("--api-key", help="the key clients must give (Authorization: Bearer KEY) for /v1/ requests "
                                       "(default: $SPARSEKV_API_KEY, else none asked)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(func=cmd_serve)

    eval_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "no_progress", False):
        from transformers.utils import logging

        logging.disable_progress_bar()  # its weight-loading bar
    try:
        if getattr(args, "model", "") is None:
            default_model()  # without the repository around the package: say so before anything loads
        return args.func(args)
    except (ValueError, FileNotFoundError, EvalError, ImportError) as err:  # ImportError: a missing optional extra
        print(f"sparsekv {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nsparsekv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
