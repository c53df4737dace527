"""Which heads a page estimate fails: its page scores against the true attention mass, per layer and head.

``python -m sparsekv.eval.selection --model M --task T --length L --methods quest,lowbit`` runs one prompt densely
and, in the first ``--steps`` decode steps of every layer, compares each method's page scores (its ``page_scores``:
Quest's bounds, ...) with the true attention mass of every page (the oracle's, float32), per selection row (KV head,
or query head for a per-query-head method):

- ``spearman``: rank correlation of the scores with the mass over the row's pages (ties in arbitrary order);
- ``top_rank``: where the scores rank the most attended page other than the current one (1 = first; the current
  page is always attended);
- ``mass_ratio``: the true mass on the pages the method selects at its budget, over the mass on the oracle's pages.

Each is the mean over the steps measured. It prints the layers and the worst rows of each method and writes the
whole table as JSON. The decode is dense, so every method is scored on the same states; layers a method keeps
dense are not scored.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..methods.base import Method, MethodConfig, attend_all, require
from ..methods.oracle import group_rows, true_attention
from ..kernels import reference
from ..models import load_model
from ..spec import build_config, takes_budget
from .base import EvalError, TaskOptions
from .engine import Engine
from .tasks import get_task


@dataclass(frozen=True, kw_only=True)
class SelectionConfig(MethodConfig):
    """estimates: the method configs whose page scores are compared (each has ``page_scores``), all of one page size
    (which the probe takes); steps: decode steps measured per layer (>= 1)."""

    estimates: tuple[MethodConfig, ...]
    steps: int = 4
    syncs_host: ClassVar[bool] = True  # reads every step on the host: never captured in a CUDA graph

    def __post_init__(self):
        require(len(self.estimates) > 0 and all(isinstance(e, MethodConfig) for e in self.estimates),
                "estimates", "one or more sparsekv method configs", self.estimates)
        sizes = {e.page_size for e in self.estimates}
        require(len(sizes) == 1, "estimates", "methods of one page size", sorted(sizes))
        object.__setattr__(self, "page_size", sizes.pop())
        require(isinstance(self.steps, int) and self.steps >= 1, "steps", "an integer >= 1", self.steps)
        super().__post_init__()

    def check_model(self, num_layers: int) -> None:
        for e in self.estimates:
            e.check_model(num_layers)

    def method_class(self):
        return SelectionProbe


class SelectionProbe(Method):
    """Dense decoding that scores every estimate's page choice against the true attention (see the module)."""

    def __init__(self, config: SelectionConfig, num_layers: int):
        super().__init__(config, num_layers)
        self.methods = [e.build(num_layers) for e in config.estimates]
        for m in self.methods:
            if not hasattr(m, "page_scores"):
                raise ValueError(f"method {m.config.name!r} has no page scores to compare (page_scores)")
        self.accepts_chunks = all(m.accepts_chunks for m in self.methods)
        self.done = [0] * num_layers
        # (method index, layer, row) -> [spearman, top_rank, mass_ratio, pages] lists
        self.rows: dict[tuple[int, int, int], list[list[float]]] = defaultdict(list)

    def prefill(self, layer_idx, q, layer, plan, scale):
        for m in self.methods:
            m.prefill(layer_idx, q, layer, plan, scale)

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        if self.done[layer_idx] < self.config.steps:
            self.done[layer_idx] += 1
            mass = true_attention(q, layer, seq_len, scale).sum(-1)  # (B, H, C + 1)
            for i, m in enumerate(self.methods):
                if layer_idx >= getattr(m.config, "dense_layers", 0):
                    self._score(i, layer_idx, m.page_scores(layer_idx, q, layer, seq_len, scale), mass, layer)
        return attend_all(q, layer, seq_len, scale)

    def _score(self, i, layer_idx, scores, mass, layer):
        b, hkv = layer.slot_page.shape[:2]
        hs = scores.shape[1]
        mass = group_rows(mass, hkv, hs != hkv)
        rows = hs // hkv
        valid = (layer.slot_page >= 0).repeat_interleave(rows, dim=1)
        cur = layer.cur_slot.repeat_interleave(rows, dim=1)
        budget = getattr(self.methods[i].config, "token_budget", None)
        for bi in range(b):
            for r in range(hs):
                ok = valid[bi, r].nonzero().squeeze(1)
                if len(ok) < 2:
                    continue
                s, w = scores[bi, r, ok].double(), mass[bi, r, ok].double()
                rank_s, rank_w = s.argsort().argsort().double(), w.argsort().argsort().double()
                rho = float(torch.corrcoef(torch.stack([rank_s, rank_w]))[0, 1].nan_to_num(0.0))
                others = ok != cur[bi, r]
                top = w.masked_fill(~others, -1.0).argmax()
                top_rank = 1 + int(((s > s[top]) & others).sum())
                ratio = 1.0
                if isinstance(budget, int):
                    k = budget // self.config.page_size
                    pick = reference.select_pages(scores[bi:bi + 1, r:r + 1], cur[bi:bi + 1, r:r + 1], k)
                    best = reference.select_pages(mass[bi:bi + 1, r:r + 1].float().masked_fill(
                        ~valid[bi:bi + 1, r:r + 1], float("-inf")), cur[bi:bi + 1, r:r + 1], k)

                    def covered(sel):
                        sel = sel[sel >= 0]
                        return float(mass[bi, r, sel].sum())

                    ratio = covered(pick) / max(covered(best), 1e-30)
                self.rows[(i, layer_idx, r)].append([rho, top_rank, ratio, len(ok)])

    def table(self) -> list[dict]:
        """Per method, in the order of ``estimates``: ``rows`` (layer, row, spearman, top_rank, mass_ratio, pages:
        means over the steps) and ``layers`` (their means per layer)."""
        out = []
        for i in range(len(self.methods)):
            rows = []
            for (j, layer_idx, r), values in sorted(self.rows.items()):
                if j == i:
                    mean = torch.tensor(values, dtype=torch.float64).mean(0).tolist()
                    rows.append({"layer": layer_idx, "row": r, "spearman": round(mean[0], 4),
                                 "top_rank": round(mean[1], 2), "mass_ratio": round(mean[2], 4),
                                 "pages": round(mean[3], 1)})
            layers = defaultdict(list)
            for row in rows:
                layers[row["layer"]].append(row)
            per_layer = [{"layer": k, **{f: round(sum(x[f] for x in v) / len(v), 4)
                                         for f in ("spearman", "top_rank", "mass_ratio")}}
                         for k, v in sorted(layers.items())]
            out.append({"rows": rows, "layers": per_layer})
        return out


def format_table(table: dict, worst: int = 10) -> str:
    """Markdown from {method spec: ``SelectionProbe.table`` entry}: each method's per-layer means, then its
    ``worst`` rows by rank correlation."""
    lines = []
    for name, t in table.items():
        rows = t["rows"]
        if not rows:
            continue
        mean = {f: sum(r[f] for r in rows) / len(rows) for f in ("spearman", "top_rank", "mass_ratio")}
        lines += [f"## {name}: mean spearman {mean['spearman']:.3f}, top-page rank {mean['top_rank']:.1f}, "
                  f"mass ratio {mean['mass_ratio']:.3f}", "",
                  "| layer | spearman | top-page rank | mass ratio |", "|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['spearman']:.3f} | {r['top_rank']:.1f} | {r['mass_ratio']:.3f} |"
                  for r in t["layers"]]
        lines += ["", f"Worst {worst} rows (KV head, or query head when selected per query head):", "",
                  "| layer | row | spearman | top-page rank | pages | mass ratio |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['row']} | {r['spearman']:.3f} | {r['top_rank']:.1f} | {r['pages']:.0f} | "
                  f"{r['mass_ratio']:.3f} |" for r in sorted(rows, key=lambda r: r["spearman"])[:worst]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsekv.eval.selection",
                                description="rank correlation of each method's page scores with the true attention "
                                            "mass, per layer and head, on one prompt")
    p.add_argument("--model", help="as for sparsekv eval (default: the project's model)")
    p.add_argument("--task", required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--depth", type=float, help="needle depth (passkey, niah; default 0.5)")
    p.add_argument("--sample", type=int, default=0, help="which sample of the task's seeded list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=["quest"], metavar="SPEC",
                   help="method specs with page scores (quest, oracle, ...); default quest")
    p.add_argument("--budget", type=int, default=64, help="token budget of methods whose spec sets none")
    p.add_argument("--steps", type=int, default=4, help="decode steps measured per layer")
    p.add_argument("--question-mode", choices=["decode", "prefill"], default="prefill")
    p.add_argument("--chat", choices=["on", "off"], default="off")
    p.add_argument("--haystack-dir")
    p.add_argument("--worst", type=int, default=10, help="rows listed per method")
    p.add_argument("--out", help="JSON file for the whole table")
    args = p.parse_args(argv)
    try:
        estimates = tuple(build_config(s, args.budget if takes_budget(s) else None) for s in args.methods)
        config = SelectionConfig(estimates=estimates, steps=args.steps)
        task = get_task(args.task, TaskOptions(haystack_dir=args.haystack_dir))
        loaded = load_model(args.model, "auto", "auto", print)
        depth = args.depth if args.depth is not None or task.depths is None else 0.5
        samples = task.samples(loaded.tokenizer, args.length, depth, args.seed, args.sample + 1)
        out, prompt_tokens = Engine(loaded, config, args.question_mode, args.chat == "on").run(samples[-1])
    except (EvalError, ValueError, FileNotFoundError) as err:
        print(f"sparsekv.eval.selection: error: {err}", file=sys.stderr)
        return 2
    table = dict(zip(args.methods, out.method.table()))
    print(f"# Page scores against the true attention mass: {args.task}, {prompt_tokens} tokens, "
          f"{args.steps} decode steps per layer\n")
    print(format_table(table, args.worst))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": loaded.name, "task": args.task, "prompt_tokens": prompt_tokens,
                                              "steps": args.steps, "methods": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
