"""The accuracy tables: every method at budgets 32..1024 on the trained model, with the harness.

    python -m training.accuracy_tables --model models/sparsekv-llama-16m            # every grid
    python -m training.accuracy_tables --model models/sparsekv-llama-16m --grids passkey recall

Grids (each a ``run_eval`` into ``--out/<grid>/``: results.jsonl, ``<task>.md``, PNGs; resumable, so a grid cut
by a time limit continues where it stopped when the same command runs again):

* ``passkey``: Quest's passkey table: every method x budget at 4K and 8K, 5 depths, the question fed token by
  token through the decode path;
* ``2stage``: OmniKV's 2StageRetr comparison, every method x budget at 4K and 8K;
* ``arith``: RaaS's accuracy vs budget on the long-decode task (the written working is longer than the prompt);
* ``memory``: RaaS's memory claim: resident KV bytes vs decode length (arith at growing step counts) for dense,
  Quest and RaaS at one budget;
* ``recall``: attention recall per layer (``--recall``) of every method on passkey.

``--out/README.md`` gathers the commands (this script's and the equivalent ``sparsekv eval`` lines), every table,
the memory table, and a mechanical check of each paper's claim against the numbers (consistent / CONTRADICTS), to
be read with the tables; a contradiction is reported, not tuned away.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from sparsekv.models import load_model
from sparsekv.eval.report import group_by, mean_of
from sparsekv.eval.base import EvalError
from sparsekv.eval.runner import RESULTS, EvalSpec, read_results, run_eval
from sparsekv.methods import METHODS

GRIDS = ("passkey", "2stage", "arith", "memory", "recall")
EVICTION = ("streamingllm", "h2o", "tova", "snapkv")
TOLERANCE = 0.05  # "matches dense": mean score within this of dense's
MIN_DENSE = 0.5  # below this dense score a task says nothing about a method


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.accuracy_tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="trained model folder (or tiny:<arch> to check the code paths)")
    p.add_argument("--out", default="benchmarks/results/accuracy")
    p.add_argument("--grids", nargs="+", default=list(GRIDS), choices=GRIDS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), help="method specs (default: every method)")
    p.add_argument("--budgets", nargs="+", type=int, default=[32, 64, 128, 256, 512, 1024])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192], help="passkey and 2stage prompt lengths")
    p.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--samples", type=int, default=3, help="samples per cell (passkey per depth; 2stage twice this)")
    p.add_argument("--arith-steps", nargs="+", type=int, default=[64],
                   help="arith step counts (64: a ~480-token prompt, a ~1000-token working)")
    p.add_argument("--arith-samples", type=int, default=3)
    p.add_argument("--memory-steps", nargs="+", type=int, default=[16, 32, 64, 128],
                   help="arith step counts of the memory grid (decode length grows with them)")
    p.add_argument("--memory-methods", nargs="+", default=["dense", "quest", "raas"])
    p.add_argument("--memory-budget", type=int, default=256)
    p.add_argument("--recall-length", type=int, default=4096)
    p.add_argument("--recall-budgets", nargs="+", type=int, default=[64, 256])
    p.add_argument("--recall-samples", type=int, default=1, help="samples per depth (depths 0.25 and 0.75)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--jobs", type=int, default=1,
                   help="processes that run the grids' (grid, method) parts side by side on the same device "
                        "(default 1: one process, grids in turn)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def grid_specs(args) -> dict[str, EvalSpec]:
    """The EvalSpec of every grid of ``args``."""
    common = dict(model=args.model, seed=args.seed, dtype=args.dtype, device=args.device, plots=not args.no_plots,
                  chat="off")
    out = Path(args.out)
    specs = {
        "passkey": EvalSpec(task="passkey", methods=args.methods, budgets=args.budgets, lengths=args.lengths,
                            depths=args.depths, limit=args.samples, out=str(out / "passkey"), **common),
        "2stage": EvalSpec(task="2stage", methods=args.methods, budgets=args.budgets, lengths=args.lengths,
                           limit=2 * args.samples, out=str(out / "2stage"), **common),
        "arith": EvalSpec(task="arith", methods=args.methods, budgets=args.budgets, lengths=args.arith_steps,
                          limit=args.arith_samples, out=str(out / "arith"), **common),
        "memory": EvalSpec(task="arith", methods=args.memory_methods, budgets=[args.memory_budget],
                           lengths=args.memory_steps, limit=1, out=str(out / "memory"), **common),
        "recall": EvalSpec(task="passkey", methods=args.methods, budgets=args.recall_budgets,
                           lengths=[args.recall_length], depths=[0.25, 0.75], limit=args.recall_samples,
                           recall=True, out=str(out / "recall"), **common),
    }
    return {name: specs[name] for name in args.grids}


def eval_command(spec: EvalSpec) -> str:
    """The ``sparsekv eval`` line that runs the same grid."""
    parts = ["sparsekv", "eval", "--task", spec.task, "--methods", *spec.methods]
    if spec.budgets:
        parts += ["--budgets", *map(str, spec.budgets)]
    parts += ["--lengths", *map(str, spec.lengths)]
    if spec.depths:
        parts += ["--depths", *(f"{d:g}" for d in spec.depths)]
    parts += ["--limit", str(spec.limit), "--seed", str(spec.seed), "--model", spec.model, "--dtype", spec.dtype,
              "--chat", spec.chat, "--out", spec.out]
    parts += ["--recall"] * spec.recall + ["--no-plots"] * (not spec.plots)
    return shlex.join(parts)


def matching_budget(records, method: str, length) -> int | None | str:
    """The smallest budget at which ``method``'s mean score is within TOLERANCE of dense's at ``length``; "-" when
    it never is, None when there is no dense or no run of the method."""
    cells = group_by(records, "method_name", "budget", "length")
    dense = [r for (m, _, n), rs in cells.items() if m == "dense" and n == length for r in rs]
    if not dense:
        return None
    target = mean_of(r["score"] for r in dense) - TOLERANCE
    budgets = sorted(b for (m, b, n) in cells if m == method and n == length and b is not None)
    if not budgets:
        return None
    return next((b for b in budgets if mean_of(r["score"] for r in cells[(method, b, length)]) >= target), "-")


def budget_table(records, title: str) -> list[str]:
    lengths = sorted({r["length"] for r in records})
    methods = [m for m in dict.fromkeys(r["method_name"] for r in records) if m != "dense"]
    lines = [f"**{title}**: smallest budget matching dense (mean score within {TOLERANCE}); - = never", "",
             "| method | " + " | ".join(f"length {n}" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(str(matching_budget(records, m, n)) for n in lengths) + " |")
    return lines + [""]


def _rank(value) -> float:
    """Budgets as numbers for comparisons; never matching is worst."""
    return float("inf") if value in ("-", None) else float(value)


def retrieval_claim(records, method: str, paper: str, claim: str) -> str:
    """Consistent when ``method`` matches dense at a budget no larger than every eviction baseline's, at every
    length."""
    verdicts = []
    for n in sorted({r["length"] for r in records}):
        dense = [r["score"] for r in records if r["method_name"] == "dense" and r["length"] == n]
        if dense and mean_of(dense) < MIN_DENSE:
            verdicts.append((None, f"length {n}: dense scores {mean_of(dense):.2f}"))
            continue
        ours = matching_budget(records, method, n)
        others = {m: matching_budget(records, m, n) for m in EVICTION}
        others = {m: v for m, v in others.items() if v is not None}
        if ours is None or not others:
            continue
        ok = ours != "-" and all(_rank(ours) <= _rank(v) for v in others.values())
        verdicts.append((ok, f"length {n}: {method} matches dense at budget {ours}; "
                             + ", ".join(f"{m} {v}" for m, v in others.items())))
    if not verdicts:
        return f"- {paper}: not enough runs to check."
    if all(ok is None for ok, _ in verdicts):
        return (f"- {paper} ({claim}): **not tested**: the model cannot do the task densely ("
                + "; ".join(text for _, text in verdicts) + f", below {MIN_DENSE}), so any method 'matches' dense.")
    word = "consistent" if all(ok for ok, _ in verdicts if ok is not None) else "CONTRADICTS"
    return f"- {paper} ({claim}): **{word}**. " + "; ".join(text for _, text in verdicts) + "."


def raas_claims(arith, memory, token_bytes: int | None = None) -> list[str]:
    lines = []
    if arith:
        parts, ok = [], True
        for n in sorted({r["length"] for r in arith}):
            raas, quest = matching_budget(arith, "raas", n), matching_budget(arith, "quest", n)
            if raas is None or quest is None:
                continue
            # Within one budget doubling of Quest: RaaS keeps only what it needs yet stays as accurate.
            ok &= _rank(raas) <= 2 * _rank(quest)
            parts.append(f"{n} steps: RaaS matches dense at budget {raas}, Quest at {quest}")
        if parts:
            lines.append(f"- RaaS (accuracy close to Quest's at the same budget on long decodes): "
                         f"**{'consistent' if ok else 'CONTRADICTS'}**. " + "; ".join(parts) + ".")
    if memory:
        # Total resident KV grows with the prompt too (arith's prompt grows with its step count), so the claim is
        # checked on the decode part: resident tokens (bytes / bytes per token) minus prompt tokens, where the model's
        # size per token is known.
        decode = {}
        for (m, b), rs in group_by(memory, "method_name", "budget").items():
            by_steps = group_by(rs, "length")
            decode[m] = [(n, mean_of(_decode_resident(r, token_bytes) for r in by_steps[(n,)]))
                         for (n,) in sorted(by_steps)]
        if "raas" in decode and not token_bytes:
            lines.append("- RaaS (KV memory flat in the decode length): not checked, the model's KV bytes per token "
                         "are unknown (no config.json)")
        elif "raas" in decode:
            budget = max(r["budget"] or 0 for r in memory if r["method_name"] == "raas")
            grows = {m: v[-1][1] / max(v[0][1], 1.0) for m, v in decode.items()}
            ok = (max(t for _, t in decode["raas"]) <= budget + 64 and grows["raas"] <= 1.25
                  and all(g > 1.5 for m, g in grows.items() if m in ("dense", "quest")))
            lines.append("- RaaS (KV memory flat in the decode length while Quest and dense grow): "
                         f"**{'consistent' if ok else 'CONTRADICTS'}**. Decode tokens resident (resident KV minus the "
                         f"prompt's) by step count: " + "; ".join(
                             f"{m} " + ", ".join(f"{n}: {t:.0f}" for n, t in v) for m, v in decode.items())
                         + f" (RaaS budget {budget}).")
    return lines


def _decode_resident(record, token_bytes: int | None) -> float:
    """KV tokens held beyond the prompt at the end of a run (page slots and bounds included, hence approximate)."""
    return record["kv_resident_bytes"] / token_bytes - record["prompt_tokens"] if token_bytes else float("nan")


def kv_token_bytes(model: str) -> int | None:
    """KV bytes per token of a saved model (all layers, keys and values, its own dtype); None for tiny models."""
    import json

    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    c = json.loads(path.read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    size = {"float32": 4}.get(c.get("dtype") or c.get("torch_dtype"), 2)
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * size


def memory_table(records) -> list[str]:
    lines = ["| method | steps | decode tokens | KV MiB | accuracy |", "|---|---|---|---|---|"]
    for (m, b, n), rs in sorted(group_by(records, "method", "budget", "length").items(),
                                key=lambda kv: (kv[0][0], kv[0][2])):
        label = m if b is None else f"{m} @{b}"
        lines.append(f"| {label} | {n} | {mean_of(r['new_tokens'] for r in rs):.0f} | "
                     f"{mean_of(r['kv_resident_bytes'] for r in rs) / 2**20:.3g} | "
                     f"{mean_of(r['score'] for r in rs):.2f} |")
    return lines + [""]


def write_readme(args, specs: dict[str, EvalSpec], argv: list[str]) -> Path:
    out = Path(args.out)
    records = {name: read_results(Path(spec.out) / RESULTS) for name, spec in specs.items()}
    lines = ["# Accuracy tables", "",
             f"Model `{args.model}`, seed {args.seed}, dtype {args.dtype}. Made with:", "", "```",
             shlex.join(["python", "-m", "training.accuracy_tables", *argv]), "```", "",
             "Each grid is the harness run below (its folder holds results.jsonl, the markdown table and plots; "
             "rerunning resumes):", "", "```", *(eval_command(s) for s in specs.values()), "```", ""]
    for name, spec in specs.items():
        table = Path(spec.out) / f"{spec.task}.md"
        if not table.exists():
            continue
        lines += [f"## {name}", "", *table.read_text().splitlines()[1:], ""]
        if name == "memory" and records[name]:
            lines += ["Resident KV bytes (after the prompt or at the end, whichever is larger) vs decode length:",
                      "", *memory_table(records[name])]
        if name in ("passkey", "2stage", "arith") and records[name]:
            lines += budget_table(records[name], name)
    claims = []
    if records.get("passkey"):
        claims.append(retrieval_claim(records["passkey"], "quest", "Quest",
                                      "passkey kept at small budgets where eviction loses the needle"))
    if records.get("2stage"):
        claims.append(retrieval_claim(records["2stage"], "omnikv", "OmniKV",
                                      "2StageRetr kept where eviction baselines drop"))
    claims += raas_claims(records.get("arith"), records.get("memory"), kv_token_bytes(args.model))
    lines += ["## The papers' claims against these numbers", "",
              "Mechanical checks (rules in `training/accuracy_tables.py`); read them with the tables above.", "",
              *(claims or ["- no grid with the runs needed"]), ""]
    notes = out / "NOTES.md"  # what the mechanical checks cannot say, written on reading the tables
    if notes.exists():
        lines += [notes.read_text()]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


def _run_part(spec: EvalSpec) -> str:
    """One (grid, method) part in a process of its own (``--jobs``)."""
    run_eval(spec, loaded=load_model(spec.model, spec.device, spec.dtype), log=lambda *_: None, progress=False)
    return spec.out


def run_parallel(specs: dict[str, EvalSpec], jobs: int) -> None:
    """Every grid split into one part per method, run by ``jobs`` processes, each into ``<grid>/parts/<i>/``, then
    merged into the grid's results.jsonl. The harness decodes batch 1 in an eager loop bound by host time, so
    processes sharing one GPU multiply the throughput. Parts resume like whole grids."""
    import concurrent.futures
    import dataclasses
    import json
    import multiprocessing
    import shutil

    # The longest grids first, so that the pool ends evenly.
    order = {"arith": 0, "passkey": 1, "memory": 2, "2stage": 3, "recall": 4}
    parts = [dataclasses.replace(spec, methods=[m], out=str(Path(spec.out) / "parts" / str(i)), plots=False)
             for name, spec in sorted(specs.items(), key=lambda kv: order[kv[0]]) for i, m in enumerate(spec.methods)]
    for part in parts:  # runs already merged into the grid are not run again
        grid = Path(part.out).parents[1] / RESULTS
        if grid.exists() and not (Path(part.out) / RESULTS).exists():
            Path(part.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(grid, Path(part.out) / RESULTS)
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for done in pool.map(_run_part, parts):
            print(f"part done: {done}", flush=True)
    for spec in specs.values():
        path = Path(spec.out) / RESULTS
        path.parent.mkdir(parents=True, exist_ok=True)
        have = {r["key"] for r in read_results(path)}
        with open(path, "a", encoding="utf-8") as f:
            for part in sorted((Path(spec.out) / "parts").glob(f"*/{RESULTS}")):
                for record in read_results(part):
                    if record["key"] not in have:
                        have.add(record["key"])
                        f.write(json.dumps(record, default=str) + "\n")
        shutil.rmtree(Path(spec.out) / "parts")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    specs = grid_specs(args)
    if args.jobs > 1:
        run_parallel(specs, args.jobs)
    try:
        loaded = load_model(args.model, args.device, args.dtype)
        for name, spec in specs.items():
            print(f"== {name}: {eval_command(spec)}", flush=True)
            run_eval(spec, loaded=loaded)  # after --jobs: every run is done, this writes the grid's report
    except (EvalError, ValueError, FileNotFoundError) as err:  # the user's request: said without a traceback
        print(f"training.accuracy_tables: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {write_readme(args, specs, argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
