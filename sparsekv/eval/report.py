"""Summaries of a results file: a markdown table and PNG plots (score vs budget per method, depth x length
heatmaps, attention recall per layer). Plots need matplotlib (``pip install sparsekv[eval]``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np


def _label(method: str, budget) -> str:
    return method if budget is None else f"{method} @{budget}"


def mean_of(values) -> float | None:
    """Mean of the values that are not None (None if there are none)."""
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def _fmt_score(v, metric: str) -> str:
    """Perplexities with two decimals whatever their size (3 significant digits would show 1.004 as "1" and
    4770 as "4.77e+03"); other metrics as ``_fmt``."""
    return f"{v:.2f}" if metric == "perplexity" and v is not None else _fmt(v)


def group_by(records, *keys) -> dict:
    """Records grouped by the tuple of their values at ``keys``, in order of appearance within each group."""
    out = defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _order(records) -> list[tuple]:
    """(method, budget) in order of first appearance, budgets ascending within a method."""
    seen = {}
    for r in records:
        seen.setdefault(r["method"], set()).add(r["budget"])
    return [(m, b) for m, bs in seen.items() for b in sorted(bs, key=lambda x: -1 if x is None else x)]


def layer_recall(records) -> list[float | None]:
    """Mean recall per layer over the records that measured it."""
    rows = [r["recall"] for r in records if r.get("recall")]
    if not rows:
        return []
    return [mean_of(row[i] for row in rows) for i in range(len(rows[0]))]


def markdown(records: list[dict], task: str) -> str:
    metric = records[0]["metric"]
    lengths = sorted({r["length"] for r in records}, key=lambda x: -1 if x is None else x)
    cells = group_by(records, "method", "budget", "length")
    lines = [f"# {task}", "", f"Model: {', '.join(sorted({r['model'] for r in records}))}; "
             f"seeds: {', '.join(str(s) for s in sorted({r['seed'] for r in records}))}; metric: {metric}"
             + (" (lower is better)" if metric == "perplexity" else "") + "; mean over depths and samples.", ""]
    head = ["method", *(("length " + str(n)) if n is not None else "all" for n in lengths)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, b in _order(records):
        row = [_label(m, b)] + [_fmt_score(mean_of(r["score"] for r in cells.get((m, b, n), [])), metric)
                                for n in lengths]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Per run means: KV tokens attended per decode step and (layer, KV head), its share of the dense "
              "context, KV cache bytes of the tokens held and allocated, decode tokens/s" + ", attention recall" * any(
                  r.get("recall") for r in records) + ".", ""]
    head = ["method", "runs", metric, "attended/step", "fraction", "KV MiB held", "KV MiB allocated", "decode tok/s"]
    with_recall = any(r.get("recall") for r in records)
    head += ["recall"] if with_recall else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_method = group_by(records, "method", "budget")
    for m, b in _order(records):
        rs = by_method[(m, b)]
        row = [_label(m, b), str(len(rs)), _fmt_score(mean_of(r["score"] for r in rs), metric),
               _fmt(mean_of(r["kv"]["attended_per_head"] for r in rs), 4),
               _fmt(mean_of(r["kv"]["fraction"] for r in rs)),
               _fmt(mean_of(r["kv_held_bytes"] / 2**20 if "kv_held_bytes" in r else None for r in rs)),
               _fmt(mean_of(r["kv_resident_bytes"] / 2**20 for r in rs)),
               _fmt(mean_of(r.get("decode_tokens_per_s") for r in rs))]
        if with_recall:
            row.append(_fmt(mean_of(v for v in layer_recall(rs))))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_report(records: list[dict], out: Path, task: str, plots: bool = True, log=print) -> None:
    records = [r for r in records if r.get("task") == task]
    if not records:
        log(f"no {task} results to report in {out}")
        return
    (out / f"{task}.md").write_text(markdown(records, task))
    log(f"wrote {out / f'{task}.md'}")
    if not plots:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots skipped: matplotlib is not installed (pip install 'sparsekv[eval]')")
        return
    for path in (_plot_budget(plt, records, out, task), _plot_heatmaps(plt, records, out, task),
                 _plot_recall(plt, records, out, task)):
        if path is not None:
            log(f"wrote {path}")


def _plot_budget(plt, records, out: Path, task: str) -> Path:
    """Score vs budget, a line per method (budget-free methods as dashed levels), a panel per length."""
    lengths = sorted({r["length"] for r in records}, key=lambda x: -1 if x is None else x)
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False)
    cells = group_by(records, "method", "budget", "length")
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
    for ax, n in zip(axes[0], lengths):
        for m in dict.fromkeys(r["method"] for r in records):
            pts = [(b, mean_of(r["score"] for r in cells[(m, b, n)])) for b in budgets if (m, b, n) in cells]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
            if (m, None, n) in cells:
                ax.axhline(mean_of(r["score"] for r in cells[(m, None, n)]), linestyle="--", label=m)
        if budgets:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget")
        ax.set_ylabel(records[0]["metric"])
        ax.set_title(f"{task}" + (f", length {n}" if n is not None else ""))
        ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(plt, fig, out / f"{task}_vs_budget.png")


def _plot_heatmaps(plt, records, out: Path, task: str) -> Path | None:
    """Depth x length score heatmaps, one per (method, budget)."""
    depths = sorted({r["depth"] for r in records if r["depth"] is not None})
    if not depths:
        return None
    lengths = sorted({r["length"] for r in records})
    keys = _order(records)
    cells = group_by(records, "method", "budget", "depth", "length")
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1, 3.2 * rows), squeeze=False, layout="constrained")
    for ax, (m, b) in zip(axes.flat, keys):
        grid = np.array([[mean_of(r["score"] for r in cells.get((m, b, d, n), [])) for n in lengths]
                         for d in depths], dtype=float)  # None (no runs) becomes nan: a blank cell
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("length")
        ax.set_ylabel("depth")
        ax.set_title(_label(m, b), fontsize="small")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return _save(plt, fig, out / f"{task}_depth_length.png")


def _plot_recall(plt, records, out: Path, task: str) -> Path | None:
    """Attention recall per layer, a line per (method, budget)."""
    by_method = group_by(records, "method", "budget")
    lines = [(_label(m, b), layer_recall(by_method[(m, b)])) for m, b in _order(records)]
    lines = [(name, ys) for name, ys in lines if ys]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, ys in lines:
        ax.plot(range(len(ys)), [np.nan if y is None else y for y in ys], marker="o", label=name)
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("attention recall")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{task}: dense attention mass covered")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(plt, fig, out / f"{task}_recall.png")


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
