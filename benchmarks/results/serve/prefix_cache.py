"""What the prefix cache saves: requests that begin with what an earlier one held, one after another, through
``ServingEngine`` (Llama-3-8B shape, random weights, bf16, METHOD at budget 2048, a real chunked prefill of 8192
tokens a chunk), with and without a prefix cache of CACHE_GIB, in the same process:

- questions: REQUESTS requests, each a document of LENGTH random tokens and a question of 128 tokens of its own;
- turns: a conversation of REQUESTS turns, each prompt the last one, its answer and 128 more tokens, starting from
  the document.

NEW greedy tokens per request. Per request: time to first token (submit to first token, the engine stepped in this
process), the prompt tokens prefilled, and whether its tokens equal those of the run without the cache (the
questions' prompts are the same in both runs; a turn's depend on the answers before it).

    PYTHONPATH=$PWD python benchmarks/results/serve/prefix_cache.py METHOD REQUESTS LENGTH NEW CACHE_GIB OUT.json
"""
import json
import sys
import time

import torch

from sparsekv.bench.common import shape_model
from sparsekv.eval.runner import method_runs
from sparsekv.serve import Request, ServingEngine

method, requests, length, new, cache_gib, out = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5]), sys.argv[6]
dev = torch.device("cuda")
context = length + requests * (128 + new) + 64
model = shape_model("llama3-8b", dev, torch.bfloat16, context)
config = method_runs([method], [2048])[0].config
layers = model.config.num_hidden_layers
g = torch.Generator().manual_seed(0)


def draw(n: int) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


def ask(engine: ServingEngine, prompt: list[int]) -> tuple[list[int], dict]:
    """One request alone: its tokens, time to first token and prompt tokens prefilled."""
    began = time.perf_counter()
    work = engine.metrics()["prefill_work"]
    rid = engine.submit(Request(prompt=prompt, max_tokens=new))
    tokens, ttft, cached = [], None, 0
    while engine.has_work():
        for event in engine.step():
            if event.request_id == rid:
                tokens += event.tokens
                cached = event.cached_tokens
                if ttft is None and event.tokens:
                    torch.cuda.synchronize()
                    ttft = time.perf_counter() - began
    return tokens, {"prompt": len(prompt), "ttft_s": ttft, "cached": cached, "tokens": tokens,
                    "prefilled": (engine.metrics()["prefill_work"] - work) // layers}


res = {"method": method, "requests": requests, "length": length, "new_tokens": new, "cache_gib": cache_gib,
       "device": torch.cuda.get_device_name(dev)}
document = draw(length)
questions = [draw(128) for _ in range(requests)]
for cached in (False, True):
    engine = ServingEngine(model, config, max_batch=1, max_context=context, prefill_chunk=8192, max_new_tokens=new,
                           prefix_cache_bytes=int(cache_gib * 2**30) if cached else 0)
    ask(engine, draw(length))  # warm-up: kernels built, first steps captured (its prompt shares nothing)
    runs = {"questions": [ask(engine, document + q)[1] for q in questions]}
    turns, prompt = [], document
    for q in questions:
        answer, stats = ask(engine, prompt + q)
        turns.append(stats)
        prompt = prompt + q + answer
    runs["turns"] = turns
    res["cached" if cached else "uncached"] = runs
    if cached:
        for kind, rows in runs.items():
            for row, plain in zip(rows, res["uncached"][kind]):
                row["same_tokens"] = row["tokens"] == plain["tokens"]
    for kind, rows in runs.items():
        print(f"{method} {'with' if cached else 'without'} prefix cache, {kind}: TTFT "
              + " ".join(f"{r['ttft_s']:.3f}" for r in rows) + " s; prefilled "
              + " ".join(str(r["prefilled"]) for r in rows)
              + ("; same tokens as without: " + " ".join(str(r["same_tokens"]) for r in rows) if cached else ""),
              flush=True)
json.dump(res, open(out, "w"), indent=1)
