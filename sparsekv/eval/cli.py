"""``sparsekv eval``: the command line of the evaluation harness (also ``python -m sparsekv.eval``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cache import KV_DTYPE_HELP
from ..spec import budget_arg
from ..methods import METHODS
from ..models import resolve_device
from .base import EvalError, TaskOptions
from .runner import RESULTS, EvalSpec, method_runs, run_eval
from .tasks import TASKS, get_task

DEFAULT_BUDGETS = (128, 256, 512)
HELP = "evaluate methods on a task over a grid of budgets, lengths and depths"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``eval`` subcommand to an ``argparse`` subparsers object; its ``func`` default is ``run``."""
    p = subparsers.add_parser("eval", help=HELP, description=HELP + ". Results are appended to OUT/results.jsonl "
                              "(a rerun resumes), with OUT/<task>.md and PNG plots.")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS)}")
    p.add_argument("--methods", nargs="+", default=["dense", "quest"], metavar="SPEC",
                   help=f"methods to compare: NAME or NAME:FIELD=VALUE,... (e.g. quest:per_query_head=true) with "
                        f"NAME one of: {', '.join(METHODS)}; default: dense quest")
    p.add_argument("--budgets", nargs="+", type=budget_arg, default=list(DEFAULT_BUDGETS),
                   help="token budgets for methods that take one: token counts, or fractions of the prompt such as "
                        "0.1 (OmniKV) (default: %(default)s)")
    p.add_argument("--lengths", nargs="+", type=int, help="prompt lengths in tokens (generated tasks), window "
                   "length (perplexity) or truncation length (longbench); default: the task's")
    p.add_argument("--depths", nargs="+", type=float, help="needle depths in [0, 1] (passkey, niah)")
    p.add_argument("--model", help="local model folder, GGUF file (or a folder holding one), or tiny:<arch> "
                   "(random weights); default: the project's trained model, models/sparsekv-llama-16m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--weights", default="float", choices=["float", "int4", "gguf"],
                   help="float: as loaded (a GGUF dequantized); int4: the layers' linear weights quantized to "
                        "group-wise int4; gguf: a GGUF file's own Q4_0/Q4_1/Q8_0 blocks (default: float)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"], help=KV_DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--out", help="output folder (default: eval_results/<task>)")
    p.add_argument("--haystack-dir", help="folder of .txt files for niah (default: $SPARSEKV_HAYSTACK_DIR, else "
                   "../shared/data/haystack/paul_graham_essays, else the essays the package ships)")
    p.add_argument("--data", help="jsonl (gsm8k, math500, aime), text file or folder (perplexity), folder of "
                   "LongBench jsonl files (longbench)")
    p.add_argument("--datasets", nargs="+", default=(), help="LongBench datasets (default: all files in --data)")
    p.add_argument("--longbench-dir", help="folder with dataset2prompt.json and dataset2maxlen.json (default: "
                   "../shared/data/longbench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="samples per grid cell (generated tasks, default 5) or rows per "
                   "file (datasets, default all)")
    p.add_argument("--max-new-tokens", type=int, help="override the task's generation length")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="perplexity: tokens prefilled per window")
    p.add_argument("--question-mode", choices=["decode", "prefill"], default="decode",
                   help="decode: feed the question token by token through the method (default); prefill: with "
                        "the context")
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: if it has one)")
    p.add_argument("--recall", action="store_true", help="also measure attention recall per layer")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def task_options(args: argparse.Namespace) -> TaskOptions:
    """The task's options among the parsed arguments."""
    return TaskOptions(haystack_dir=args.haystack_dir, data=args.data, datasets=tuple(args.datasets),
                       longbench_dir=args.longbench_dir, max_new_tokens=args.max_new_tokens,
                       prefill_tokens=args.prefill_tokens)


# Rough seconds of one `sparsekv eval` run of the project's model on 2 CPU cores: a fixed part and a part per 1000
# prompt tokens (passkey's 210-run grid at 4K and 8K took about 35 minutes).
EVAL_RUN_SECONDS = (1.5, 1.5)


def eval_plan(args) -> str | None:
    """What ``sparsekv eval`` is about to run, said before it loads anything: the grid's runs and, for the project's
    model on the CPU, a rough time. None where the grid cannot be sized here (the run then reports the problem)."""
    try:
        task = get_task(args.task, task_options(args))
        methods = len(method_runs(args.methods, args.budgets))
        cpu = resolve_device(args.device).type == "cpu"
    except (EvalError, ValueError):
        return None
    samples = args.limit if args.limit is not None else task.default_samples
    if samples is None or (args.lengths and task.lengths is None) or (args.depths and task.depths is None):
        return None  # a dataset's rows (counted once read), or an axis the task refuses
    lengths = list(args.lengths or task.lengths or [None])
    depths = len(args.depths or task.depths or [None])
    runs = methods * len(lengths) * depths * samples
    axes = [_count(methods, "method configuration"), _count(len(lengths), "length") if lengths[0] else None,
            _count(depths, "depth") if task.depths else None, _count(samples, "sample")]
    line = f"sparsekv eval: {runs} runs ({' x '.join(filter(None, axes))}; runs already in --out are skipped)"
    if args.model is None and cpu and _short_answers(task.name):
        fixed, per_k = EVAL_RUN_SECONDS
        seconds = sum(methods * depths * samples * (fixed + per_k * n / 1000) for n in lengths)
        line += f", roughly {_duration(seconds)} for the project's model on 2 CPU cores"
    return line


def _short_answers(task: str) -> bool:
    """Whether a run of ``task`` is a prompt of its length in tokens and a short answer, which the estimate
    assumes (arith's lengths are step counts and it decodes long; perplexity decodes its windows)."""
    return task in ("passkey", "niah", "multikey", "vartrack", "2stage") or task.startswith("ruler_")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


def run(args: argparse.Namespace) -> int:
    """Runs ``sparsekv eval`` from parsed arguments (its plan said first, on stderr); returns the exit status."""
    out = args.out or f"eval_results/{args.task}"
    plan = eval_plan(args)
    if plan is not None:
        print(plan, file=sys.stderr, flush=True)
    try:
        options = task_options(args)
        spec = EvalSpec(task=args.task, methods=args.methods, budgets=args.budgets, lengths=args.lengths,
                        depths=args.depths, seed=args.seed, limit=args.limit, model=args.model, dtype=args.dtype,
                        weights=args.weights, kv_dtype=args.kv_dtype, device=args.device, out=out,
                        question_mode=args.question_mode, chat=args.chat, recall=args.recall,
                        plots=not args.no_plots, options=options)
        folder = run_eval(spec, progress=not args.no_progress)
    except (EvalError, ValueError) as e:
        print(f"sparsekv eval: error: {e}", file=sys.stderr)
        if (Path(out) / RESULTS).is_file():
            print(f"(finished runs are kept in {out}/{RESULTS}; rerun to resume)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nsparsekv eval: interrupted; finished runs are kept in {out}/{RESULTS}, rerun the same "
              f"command to resume", file=sys.stderr)
        return 130
    table = folder / f"{args.task}.md"
    if table.exists():
        print(table.read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.eval", description=HELP)
    _add_arguments(parser)
    return run(parser.parse_args(argv))
