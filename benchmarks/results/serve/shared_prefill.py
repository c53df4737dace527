"""What one prefill for a prompt's choices saves: PROMPTS prompts of LENGTH random tokens, CHOICES requests each
(a client's n), NEW greedy tokens per request, through ``ServingEngine`` (Llama-3-8B shape, random weights, bf16,
METHOD at budget 2048, a real chunked prefill of 8192 tokens a chunk), all submitted at once into PROMPTS x CHOICES
rows; against the same number of requests whose prompts all differ (so that none shares a prefill). Wall time to the
last token and mean time to first token, in the same process, the shared run second.

    PYTHONPATH=$PWD python benchmarks/results/serve/shared_prefill.py METHOD PROMPTS CHOICES LENGTH NEW OUT.json
"""
import json
import sys
import time

import torch

from sparsekv.bench.common import shape_model
from sparsekv.eval.runner import method_runs
from sparsekv.serve import Request, ServingEngine

method, prompts, choices, length, new, out = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
dev = torch.device("cuda")
model = shape_model("llama3-8b", dev, torch.bfloat16, length + new + 64)
config = method_runs([method], [2048])[0].config
engine = ServingEngine(model, config, max_batch=prompts * choices, max_context=length + new, prefill_chunk=8192,
                       max_new_tokens=new)
g = torch.Generator().manual_seed(0)


def draw() -> list[int]:
    return torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()


def serve(texts: list[list[int]]) -> dict:
    """Submits one request per prompt, all at once, and steps until every one has ended."""
    began = time.perf_counter()
    ids = {engine.submit(Request(prompt=p, max_tokens=new)): i for i, p in enumerate(texts)}
    first, work = {}, engine.metrics()["prefill_work"]
    while engine.has_work():
        for event in engine.step():
            if event.tokens and event.request_id not in first:
                first[event.request_id] = time.perf_counter() - began
    torch.cuda.synchronize()
    return {"requests": len(ids), "wall_s": time.perf_counter() - began,
            "mean_ttft_s": sum(first.values()) / len(first),
            "prefilled_tokens": (engine.metrics()["prefill_work"] - work) // model.config.num_hidden_layers}


serve([draw()])  # warm-up: kernels built, first steps captured
res = {"method": method, "prompts": prompts, "choices": choices, "length": length, "new_tokens": new,
       "device": torch.cuda.get_device_name(dev)}
res["distinct"] = serve([draw() for _ in range(prompts * choices)])
res["shared"] = serve([p for p in (draw() for _ in range(prompts)) for _ in range(choices)])
for kind in ("distinct", "shared"):
    r = res[kind]
    print(f"{method} {kind}: {r['requests']} requests, {r['prefilled_tokens']} prompt tokens prefilled, "
          f"wall {r['wall_s']:.2f} s, mean TTFT {r['mean_ttft_s']:.2f} s", flush=True)
json.dump(res, open(out, "w"), indent=1)
