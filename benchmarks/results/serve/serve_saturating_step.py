"""Where the saturating run's time goes (``bench.serve``'s 64 requests of 32K-128K, max batch 6, random fill):
the serving runner's captured decode step over ROWS rows of the workload's prompt lengths, whole (CUDA events,
median of 30 steps) and per kernel (torch.profiler over 5 steps), and one prefill call of the runner (a chunk of
8192 tokens through every layer, random keys and values) and one join (the prompt copied into its row), timed
with the device synchronized and per kernel.

    PYTHONPATH=$PWD [COMPILE=1] python benchmarks/results/serve/serve_saturating_step.py OUT.json [ROWS] [METHODS...]

COMPILE=1: the runner's step compiled (``Runner(compile=True)``), as ``bench.serve --compile`` runs it.
"""
import gc
import json
import os
import random
import statistics
import sys
import time
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from sparsekv.bench.common import Timer, copy_bandwidth, kernel_table, shape_model
from sparsekv.bench.e2e import random_passes
from sparsekv.engine import Sampling
from sparsekv.eval.runner import method_runs
from sparsekv.serve.runner import Runner

out = sys.argv[1]
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 6
methods = sys.argv[3:] or ["dense", "quest"]
dev = torch.device("cuda")
max_context = 131072 + 256
model = shape_model("llama3-8b", dev, torch.bfloat16, max_context + 64)
bw = copy_bandwidth(dev, Timer(dev))
torch.cuda.empty_cache()  # the model's float32 build and the copy's buffers
weights = sum(p.numel() * p.element_size() for p in model.parameters())
rng = random.Random(0)
lengths = [rng.randint(32768, 131072) for _ in range(rows + 1)]
compiled = os.environ.get("COMPILE") == "1"
res = {"rows": rows, "compile": compiled, "lengths": lengths, "bandwidth": bw, "weights_bytes": weights, "methods": {}}


def synced(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


for method in methods:
    config = method_runs([method], [2048])[0].config
    runner = Runner(model, config, max_batch=rows, max_context=max_context, prefill_chunk=8192, cuda_graph=None,
                    compile=compiled, passes=random_passes, max_new_tokens=256)
    m = {"prefill_call_ms": [], "join_ms": []}
    for i, n in enumerate(lengths[:rows]):
        job = runner.start([1] * n)
        calls = 0
        while job.logits is None:
            m["prefill_call_ms"].append(synced(partial(runner.prefill, job, runner.prefill_budget)))
            calls += 1
        m["join_ms"].append(synced(partial(runner.join, i, job, 1, Sampling(), 0, 256)))
        runner.discard(job)
    print(f"== {method}: prefill call median {statistics.median(m['prefill_call_ms']):.2f} ms "
          f"(first {m['prefill_call_ms'][:3]}), join {[round(x, 1) for x in m['join_ms']]} ms", flush=True)
    job = runner.start([1] * lengths[rows])
    runner.prefill(job, runner.prefill_budget)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.prefill(job, runner.prefill_budget)
        torch.cuda.synchronize()
    print("  prefill call kernels:")
    m["prefill_kernels"] = kernel_table(prof, 1, show=15)
    runner.discard(job)
    step_ms = Timer(dev, reps=30, warmup=5).eager(runner.decode)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.decode()
        torch.cuda.synchronize()
    m["step_ms"] = step_ms
    print(f"  decode step over {rows} rows: {m['step_ms']:.2f} ms", flush=True)
    m["step_kernels"] = kernel_table(prof, 5, show=25)
    res["methods"][method] = m
    del runner, job, prof
    gc.collect()  # the captured steps hold the pool through reference cycles
    torch.cuda.empty_cache()
json.dump(res, open(out, "w"), indent=1, default=str)
