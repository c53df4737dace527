"""The README's two pictures, drawn from the committed results (needs matplotlib: ``pip install -e '.[eval]'``).

    python -m sparsekv.bench.figures            # from the repository's root; writes benchmarks/results/figures/

* ``speed_vs_context.png``: milliseconds per decoded token against the context, batch 1, each method and dense
  through the engine, from ``benchmarks/results/e2e.json`` (``python -m sparsekv.bench.e2e``'s rows).
* ``accuracy_vs_budget.png``: score against the token budget per method on SmolLM2-135M, dense as a level, from
  ``benchmarks/results/accuracy/smollm2-135m/summary.json`` (``python -m sparsekv.eval.summary``'s rows; where it is
  absent, the grids' ``results.jsonl`` summarized the same way).

Only the fields both files are made of are read (context, batch, spec, decode_ms; task, length, method, budget,
metric, score), so a new run of either benchmark with the same structure redraws them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

E2E = Path("benchmarks/results/e2e.json")
ACCURACY = Path("benchmarks/results/accuracy/smollm2-135m")
OUT = Path("benchmarks/results/figures")
# The accuracy panels, (task, length): needle retrieval in essays, where selection and eviction part, and
# perplexity, where they do not.
PANELS = (("niah", 2048), ("perplexity", 1152))
# One colour per method in both pictures; dense is the reference, in black.
COLOURS = {"dense": "black", "vllm": "tab:gray", "quest": "tab:blue", "omnikv": "tab:orange", "raas": "tab:green",
           "lowbit": "tab:cyan", "oracle": "tab:olive", "snapkv": "tab:red", "tova": "tab:purple",
           "h2o": "tab:brown", "streamingllm": "tab:pink"}
DPI = 100
NUDGE = 0.01  # accuracy units between two methods' lines


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing the figures needs matplotlib: pip install -e '.[eval]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(method: str) -> str | None:
    return COLOURS.get(method.split(":")[0])


def speed_rows(e2e: dict) -> dict[str, list[tuple[int, float]]]:
    """(context, ms per token) per spec, the engine's batch-1 rows on one GPU, contexts ascending; transformers'
    own loops are left out (tens of ms a token, they would flatten the picture: the table has them)."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in e2e["rows"]:
        if r["batch"] == 1 and r.get("gpus", 1) == 1 and not r["spec"].startswith("transformers"):
            lines.setdefault(r["spec"], []).append((r["context"], r["decode_ms"]))
    return {spec: sorted(points) for spec, points in lines.items()}


def draw_speed(e2e_path: Path, out: Path) -> Path:
    plt = _pyplot()
    e2e = json.loads(e2e_path.read_text())
    lines = speed_rows(e2e)
    if "dense" not in lines:
        raise ValueError(f"{e2e_path}: no batch-1 dense rows to draw")
    meta = e2e.get("meta", {})
    budgets = sorted({r["budget"] for r in e2e["rows"] if r["batch"] == 1 and r.get("budget") is not None})
    dense = dict(lines["dense"])
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    labels = []
    peer = meta.get("peer") or {}
    for spec, points in lines.items():
        label = f"{spec} {peer['version']} (dense)" if spec == peer.get("peer") else spec
        ax.plot(*zip(*points), marker="o", markersize=4, color=_colour(spec), label=label,
                linestyle="--" if spec in ("dense", "vllm") else "-")
        context, ms = points[-1]
        if spec != "dense" and context in dense:  # the ratio at the longest context, where the gain is
            labels.append((ms, context, f"{dense[context] / ms:.2f}x dense", _colour(spec)))
    gap, last = 0.05 * max(ms for points in lines.values() for _, ms in points), None
    for ms, context, text, colour in sorted(labels):  # upwards, each at least `gap` above the one below
        y = ms if last is None else max(ms, last + gap)
        ax.annotate(text, (context, ms), xytext=(context * 1.08, y), va="center", fontsize="x-small", color=colour)
        last = y
    contexts = sorted({c for points in lines.values() for c, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
    ax.set_xlim(contexts[0] / 1.3, contexts[-1] * 1.6)  # room for the ratios at the right
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decoded token")
    shape = str(meta.get("model", "")).removeprefix("shape:")
    budget = f", budget {budgets[0]}" if len(budgets) == 1 else ""
    ax.set_title(f"Decode step, batch 1: {shape} {meta.get('dtype', '')} on {meta.get('device_name', '?')}{budget}",
                 fontsize="small")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", frameon=False)
    fig.tight_layout()
    return _save(plt, fig, out / "speed_vs_context.png")


def accuracy_rows(folder: Path) -> list[dict]:
    """The summary's rows (task, length, method, budget, metric, score, ...): ``summary.json`` where it is, else
    the grids' results summarized by ``sparsekv.eval.summary``."""
    if (folder / "summary.json").is_file():
        return json.loads((folder / "summary.json").read_text())
    from ..eval.runner import RESULTS, read_results
    from ..eval.summary import summarize

    files = sorted(folder.glob(f"*/{RESULTS}"))
    if not files:
        raise FileNotFoundError(f"{folder}: neither summary.json nor */{RESULTS}")
    return summarize([r for f in files for r in read_results(f)])


def draw_accuracy(folder: Path, out: Path) -> Path:
    plt = _pyplot()
    from ..eval.report import group_by

    cells = group_by(accuracy_rows(folder), "task", "length")
    panels = [(key, cells[key]) for key in PANELS if key in cells]
    if not panels:
        raise ValueError(f"{folder}: none of the panels {PANELS} in its results")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.3), squeeze=False)
    for ax, ((task, length), rows) in zip(axes[0], panels):
        metric = rows[0]["metric"]
        methods = group_by(rows, "method")
        for i, ((method,), points) in enumerate(methods.items()):
            # Scores of a few samples coincide (0, 1/3, 1): each method's line is nudged apart to stay visible;
            # dense, the reference, is not.
            nudge = 0 if metric == "perplexity" or method == "dense" else NUDGE * (i - len(methods) / 2)
            levels = [r["score"] + nudge for r in points if r["budget"] is None]
            curve = sorted((r["budget"], r["score"] + nudge) for r in points if r["budget"] is not None)
            if curve:
                ax.plot(*zip(*curve), marker="o", markersize=3, color=_colour(method), label=method)
            for level in levels:
                ax.axhline(level, linestyle="--", color=_colour(method), label=method)
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        if metric == "perplexity":
            ax.set_yscale("log")
            top = max(r["score"] for r in rows)
            ticks = [t for t in (10, 15, 20, 25, 30, 40, 60, 100, 150, 200, 400) if t <= top * 1.1]
            ax.set_yticks(ticks, [str(t) for t in ticks])
            ax.set_ylabel("perplexity (lower is better)")
        else:
            ax.set_ylim(-0.1, 1.1)
            ax.set_ylabel(f"{metric} (lines nudged apart)")
        ax.set_xlabel("token budget (KV tokens per layer and KV head)")
        ax.set_title(f"{task}, {length} tokens", fontsize="small")
        ax.grid(alpha=0.3)
    legend = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), fontsize="small", frameon=False)
    fig.suptitle("SmolLM2-135M (CPU): score against budget", fontsize="small")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(plt, fig, out / "accuracy_vs_budget.png")


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No metadata: the file changes only when the picture does.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e", type=Path, default=E2E, help="bench.e2e's JSON (default: %(default)s)")
    parser.add_argument("--accuracy", type=Path, default=ACCURACY,
                        help="a folder of sparsekv eval grids with their summary (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        paths = [draw_speed(args.e2e, args.out), draw_accuracy(args.accuracy, args.out)]
    except (ImportError, OSError, ValueError, KeyError) as err:
        print(f"sparsekv.bench.figures: error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
