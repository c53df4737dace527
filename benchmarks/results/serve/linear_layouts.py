"""The inputs a serving step's weight products get, eager and compiled, at ROWS rows (Quest, Llama-3-8B shape,
prompts of 4096 random keys), and each product's time at 1-16 rows on contiguous inputs (in a CUDA graph over 4
weights, median of 20). Compiled, the output projection's input (ROWS, 1, 4096) came with strides (4096, 128, 1),
which ``F.linear`` ran as a batch of matrix-vector products (``kernels.reference.linear`` folds the rows first).

    PYTHONPATH=$PWD python benchmarks/results/serve/linear_layouts.py OUT.json [ROWS]
"""
import collections
import json
import sys

import torch
import torch.nn.functional as F

from sparsekv.bench.common import shape_model
from sparsekv.bench.e2e import random_passes
from sparsekv.engine import Sampling
from sparsekv.eval.runner import method_runs
from sparsekv.serve.runner import Runner

out = sys.argv[1]
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 9
dev = torch.device("cuda")
model = shape_model("llama3-8b", dev, torch.bfloat16, 8192 + 64)
torch.cuda.empty_cache()
seen = collections.Counter()
plain = F.linear


def logged(x, w, b=None):
    seen[(tuple(x.shape), tuple(x.stride()), x.storage_offset(), tuple(w.shape), tuple(w.stride()))] += 1
    return plain(x, w, b)


res = {"rows": rows}
for compiled in (False, True):
    runner = Runner(model, method_runs(["quest"], [2048])[0].config, max_batch=rows, max_context=8192,
                    prefill_chunk=4096, cuda_graph=None, compile=compiled, passes=random_passes, max_new_tokens=64)
    for i in range(rows):
        job = runner.start([1] * 4096)
        while job.logits is None:
            runner.prefill(job, runner.prefill_budget)
        runner.join(i, job, 1, Sampling(), 0, 64)
        runner.discard(job)
    seen.clear()
    F.linear = logged
    runner.decode()  # the step's first run is eager: each product's call is seen
    F.linear = plain
    name = "compiled" if compiled else "eager"
    res[name] = [{"x_shape": k[0], "x_stride": k[1], "x_offset": k[2], "w_shape": k[3], "w_stride": k[4],
                  "calls": v} for k, v in seen.items()]
    print(name, *(f"\n  {k} x{v}" for k, v in seen.items()), flush=True)
    del runner
    torch.cuda.empty_cache()

shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
res["times_us"] = {}
for name, (n, k) in shapes.items():
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    for m in (1, 2, 4, 8, 9, 10, 11, 12, 13, 16):
        x = torch.randn(m, 1, k, device=dev, dtype=torch.bfloat16)
        for w in weights:
            F.linear(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(2):
                for w in weights:
                    F.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 8)
        res["times_us"][f"{name} M={m}"] = sorted(times)[10]
        print(f"{name:8s} M={m:2d} {sorted(times)[10]:7.1f} us  floor {n * k * 2 / 4.25e12 * 1e6:6.1f}", flush=True)
json.dump(res, open(out, "w"), indent=1)
