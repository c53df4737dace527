"""A paired comparison of two evaluation runs over the same samples: two ``sparsekv eval`` output folders (or folders
of such folders, one per task) made with the same tasks, seed and samples but one setting changed (e.g. ``--kv-dtype
auto`` against ``fp8``). Per task and method run (method, budget): the samples both hold (same length, depth and
sample index), the mean score of each, the mean of the per-sample differences (B - A) and its standard error, and
how many samples changed score. Prints the markdown table and writes ``<tag>.json`` under ``--out`` (unless
``--print-only``).

    python -m sparsekv.bench.paired benchmarks/results/accuracy/kv/paired_auto \\
        benchmarks/results/accuracy/kv/paired_fp8 --labels "float32 KV" "FP8 KV" \\
        --out benchmarks/results/accuracy/kv --tag paired
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path

from .common import claim_results, markdown_table, output_args, refuse, run_setting, write_results


def scores(folder: Path) -> dict:
    """{(task, method, budget, length, depth, sample): score} of every results file in ``folder`` or its
    subfolders."""
    from ..eval.runner import RESULTS, read_results

    files = sorted(folder.glob(RESULTS)) + sorted(folder.glob(f"*/{RESULTS}"))
    if not files:
        raise FileNotFoundError(f"no {RESULTS} in {folder} or its subfolders")
    return {(r["task"], r["method"], r["budget"], r["length"], r["depth"], r["sample"]): r["score"]
            for f in files for r in read_results(f)}


def paired(a: dict, b: dict) -> list[dict]:
    """One row per (task, method, budget) over the keys both ``a`` and ``b`` hold, sorted by them."""
    rows = []
    runs = sorted({k[:3] for k in a if k in b}, key=lambda r: (r[0], r[1], r[2] or 0))
    for task, method, budget in runs:
        keys = sorted((k for k in a if k[:3] == (task, method, budget) and k in b),
                      key=lambda k: tuple(-1 if x is None else x for x in k[3:]))
        diff = [b[k] - a[k] for k in keys]
        se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        rows.append({"task": task, "method": method, "budget": budget, "samples": len(keys),
                     "a": statistics.mean(a[k] for k in keys), "b": statistics.mean(b[k] for k in keys),
                     "mean_difference": statistics.mean(diff), "standard_error": se,
                     "samples_changed": sum(d != 0 for d in diff)})
    return rows


def markdown(rows: list[dict], labels: tuple[str, str]) -> list[str]:
    columns = [("task", "task", "{}"), ("method", lambda r: r["method"] + (f" @{r['budget']}" if r["budget"] else ""),
                                        "{}"),
               ("samples", "samples", "{}"), (labels[0], "a", "{:.3f}"), (labels[1], "b", "{:.3f}"),
               ("mean difference (SE)", lambda r: f"{r['mean_difference']:+.3f} ({r['standard_error']:.3f})", "{}"),
               ("samples changed", "samples_changed", "{}")]
    return markdown_table(columns, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.paired", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="the first run's folder (the baseline)")
    parser.add_argument("b", type=Path, help="the second run's folder")
    parser.add_argument("--labels", nargs=2, default=["A", "B"], metavar=("A", "B"), help="the two runs' names")
    parser.add_argument("--print-only", action="store_true", help="print the table, write no file")
    output_args(parser, "paired")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    setting = run_setting("paired", args)
    path = Path(args.out) / f"{args.tag}.json"
    if not args.print_only:
        claim_results(path, None, setting, args.overwrite)
    from ..eval.base import EvalError

    try:
        rows = paired(scores(args.a), scores(args.b))
    except (FileNotFoundError, EvalError) as err:
        return refuse("sparsekv.bench.paired", str(err))
    lines = markdown(rows, tuple(args.labels))
    if not args.print_only:
        meta = {"a": str(args.a), "b": str(args.b), "labels": args.labels, "setting": setting,
                "command": "python -m sparsekv.bench.paired " + shlex.join(argv)}
        write_results(Path(args.out), args.tag, meta, rows, overwrite=args.overwrite)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
