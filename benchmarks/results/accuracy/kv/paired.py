"""Paired comparison of FP8 and float32 KV on SmolLM2: the same samples (seed 0) through both caches, per task and
method, the mean score of each, the mean of the per-sample differences and its standard error. Reads the
results.jsonl under paired_auto/ and paired_fp8/ (made by the commands in paired.md) and writes paired.json."""

import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def scores(kv: str, task: str) -> dict:
    rows = [json.loads(line) for line in (HERE / f"paired_{kv}" / task / "results.jsonl").read_text().splitlines()]
    return {(r["method"], r["budget"], r["sample"], r["depth"]): r["score"] for r in rows}


out = []
for task in ("ruler_niah_multivalue", "ruler_niah_multiquery"):
    auto, fp8 = scores("auto", task), scores("fp8", task)
    for method, budget in sorted({k[:2] for k in auto}, key=lambda m: (m[0], m[1] or 0)):
        keys = sorted(k for k in auto if k[:2] == (method, budget) and k in fp8)
        diff = [fp8[k] - auto[k] for k in keys]
        se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        out.append({"task": task, "method": method, "budget": budget, "samples": len(keys),
                    "float32_kv": statistics.mean(auto[k] for k in keys),
                    "fp8_kv": statistics.mean(fp8[k] for k in keys),
                    "mean_difference": statistics.mean(diff), "standard_error": se,
                    "samples_changed": sum(d != 0 for d in diff)})
(HERE / "paired.json").write_text(json.dumps(out, indent=1) + "\n")
print("| task | method | samples | float32 KV | FP8 KV | mean difference (SE) | samples changed |")
print("|---|---|---|---|---|---|---|")
for r in out:
    name = r["method"] + (f" @{r['budget']}" if r["budget"] else "")
    print(f"| {r['task']} | {name} | {r['samples']} | {r['float32_kv']:.3f} | {r['fp8_kv']:.3f} | "
          f"{r['mean_difference']:+.3f} ({r['standard_error']:.3f}) | {r['samples_changed']} |")
