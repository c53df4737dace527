"""One summary of several result folders of ``sparsekv eval``: score against the fraction of the KV cache attended,
a line per method and a point per budget (kvpress's presentation), a panel per task and length; the same numbers as
a markdown table and as JSON.

    python -m sparsekv.eval.summary benchmarks/results/accuracy/smollm2-135m

reads every ``results.jsonl`` one level below the folder and writes ``summary.md``, ``summary.json`` and
``summary.png`` (needs matplotlib) into it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from ..methods import selection_bytes
from ..models import model_shape, saved_config
from ..spec import build_config
from .base import EvalError
from .report import group_by, layer_recall, mean_of
from .runner import RESULTS, read_results

CACHE_ITEMSIZE = 2  # bytes read are counted for a 16-bit cache, whatever dtype a run computed in


@functools.lru_cache(maxsize=None)
def _shape(model: str) -> tuple[int, int, int] | None:
    config = saved_config(model)
    return None if config is None else model_shape(config)


def read_bytes(model: str, method: str, budget: int | float | None, length: int, attended: float) -> int | None:
    """Bytes a decode step of ``method`` at ``budget`` reads from a 16-bit cache of ``length`` tokens of ``model``
    (a results record's spec): the KV tokens it attends (``attended`` per layer and KV head, as measured) and the
    page metadata it reads to choose them (``methods.selection_bytes``); None where the model's config is not
    found on this machine."""
    shape = _shape(model)
    if shape is None:
        return None
    layers, kv_heads, head_dim = shape
    try:
        config = build_config(method, budget)
    except (ConfigError, ValueError):
        return None
    kv = attended * layers * kv_heads * 2 * head_dim * CACHE_ITEMSIZE
    return int(kv) + selection_bytes(config, layers, kv_heads, head_dim, CACHE_ITEMSIZE, length)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, length, method, budget), in order of first appearance with budgets ascending (``task``
    is the record's ``source`` where it has one, e.g. a folder, so that grids of one task made with other settings
    stay apart): runs, mean
    score, mean part-match (RULER tasks), mean KV tokens attended per step and (layer, KV head), mean fraction of
    the dense context attended, mean attention recall over layers (runs made with ``--recall``), and the MiB a
    decode step reads (``read_bytes``; None where the model is not found here)."""
    groups = group_by([{**r, "task": r.get("source", r["task"])} for r in records], "task", "length", "method",
                      "budget")
    first = {key[:3]: i for i, key in reversed(list(enumerate(groups)))}
    rows = []
    for key in sorted(groups, key=lambda k: (first[k[:3]], -1 if k[3] is None else k[3])):
        rs = groups[key]
        attended = mean_of(r["kv"]["attended_per_head"] for r in rs)
        read = read_bytes(rs[0]["model"], key[2], key[3], key[1], attended)
        rows.append({"task": key[0], "length": key[1], "method": key[2], "budget": key[3], "runs": len(rs),
                     "metric": rs[0]["metric"], "score": mean_of(r["score"] for r in rs),
                     "part_match": mean_of(r.get("part_match") for r in rs), "attended": attended,
                     "fraction": mean_of(r["kv"]["fraction"] for r in rs),
                     "recall": mean_of(layer_recall(rs)), "read_mib": None if read is None else read / 2**20})
    return rows


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def markdown(rows: list[dict]) -> str:
    """Per task and length: a row per method, a column per budget, each cell ``score (fraction attended)``."""
    lines = ["# Summary", "", "Each cell: mean score (mean fraction of the dense context attended per decode step and "
             "(layer, KV head)); budget-free methods in the first column.", ""]
    for (task, length), rs in group_by(rows, "task", "length").items():
        budgets = sorted({r["budget"] for r in rs if r["budget"] is not None})
        metric = rs[0]["metric"] + (" (lower is better)" if rs[0]["metric"] == "perplexity" else "")
        runs = sorted({r["runs"] for r in rs})
        lines += [f"## {task}, length {length}", "", f"Metric: {metric}; runs per cell: "
                  f"{', '.join(map(str, runs))}.", "", "| method | - | " + " | ".join(f"@{b}" for b in budgets)
                  + " |", "|---|---|" + "---|" * len(budgets)]
        cells = {(r["method"], r["budget"]): r for r in rs}
        for method in dict.fromkeys(r["method"] for r in rs):
            row = [method] + [f"{_fmt(c['score'])} ({_fmt(c['fraction'], 2)})" if (c := cells.get((method, b)))
                              else "" for b in [None, *budgets]]
            lines.append("| " + " | ".join(row) + " |")
        if any(r["read_mib"] is not None for r in rs):
            lines += ["", "MiB a decode step reads from a 16-bit cache (the KV attended and the page metadata read to "
                      "choose it):", "", "| method | - | " + " | ".join(f"@{b}" for b in budgets) + " |",
                      "|---|---|" + "---|" * len(budgets)]
            for method in dict.fromkeys(r["method"] for r in rs):
                lines.append("| " + " | ".join([method] + [_fmt(c["read_mib"]) if (c := cells.get((method, b)))
                                                           else "" for b in [None, *budgets]]) + " |")
        if any(r["recall"] is not None for r in rs):
            lines += ["", "Attention recall (share of the dense attention mass on the tokens attended):", "",
                      "| method | budget | recall |", "|---|---|---|"]
            lines += [f"| {r['method']} | {r['budget'] or '-'} | {_fmt(r['recall'])} |" for r in rs
                      if r["recall"] is not None]
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path | None:
    """Score vs fraction of KV attended, a line per method (points: budgets, ascending), dense as a dashed level;
    a panel per (task, length). Returns None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = group_by(rows, "task", "length")
    cols = min(3, len(panels))
    n_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.6 * cols, 3.6 * n_rows), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colours = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2))
    for ax, ((task, length), rs) in zip(axes.flat, panels.items()):
        for method in methods:
            pts = [(r["fraction"], r["score"]) for r in rs if r["method"] == method and r["budget"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, color=colours[method], label=method)
            for r in rs:
                if r["method"] == method and r["budget"] is None:
                    ax.axhline(r["score"], linestyle="--", color=colours[method], label=method)
        ax.set_xscale("log")
        ax.set_xticks([0.01, 0.03, 0.1, 0.3, 1], ["0.01", "0.03", "0.1", "0.3", "1"])
        ax.minorticks_off()
        if rs[0]["metric"] == "perplexity":
            ax.set_yscale("log")
        ax.set_xlabel("fraction of the KV cache attended per step")
        ax.set_ylabel(rs[0]["metric"])
        ax.set_title(f"{task}, {length} tokens", fontsize="medium")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    legend = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), fontsize="small")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.eval.summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help=f"a folder whose subfolders hold {RESULTS}")
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob(f"*/{RESULTS}"))
    if not files:
        print(f"sparsekv.eval.summary: error: no */{RESULTS} under {args.folder}", file=sys.stderr)
        return 2
    try:
        records = [(f, read_results(f)) for f in files]
    except EvalError as err:
        print(f"sparsekv.eval.summary: error: {err}", file=sys.stderr)
        return 2
    # A folder holding one task under another name (e.g. recall/) is its own panel.
    rows = summarize([{**r, "source": r["task"] if f.parent.name == r["task"] else f"{r['task']} ({f.parent.name})"}
                      for f, rs in records for r in rs])
    (args.folder / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.folder / "summary.md").write_text(markdown(rows))
    png = plot(rows, args.folder / "summary.png")
    print(f"wrote {args.folder / 'summary.md'}, summary.json" + (", summary.png" if png else
                                                                  " (no plot: pip install 'sparsekv[eval]')"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
