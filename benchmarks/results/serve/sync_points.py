"""Where a serving run's host waits for the device: the steps of a ServingEngine (Llama-3-8B shape, 4 layers, random
fill, prompts of 4000-11500 tokens, 6 requests over 4 rows) after a warm-up, under
``torch.cuda.set_sync_debug_mode("warn")``, each synchronizing call counted by its last sparsekv frames.

    PYTHONPATH=$PWD python benchmarks/results/serve/sync_points.py [METHODS...]
"""
import collections
import sys
import traceback
import warnings

import torch

from sparsekv.bench.common import shape_model
from sparsekv.bench.e2e import random_passes
from sparsekv.serve.scheduler import Request, ServingEngine
from sparsekv.spec import build_config

dev = torch.device("cuda")
model = shape_model("llama3-8b", dev, torch.bfloat16, 20000, layers=4)
counts = collections.Counter()


def record(message, category, filename, lineno, file=None, line=None):
    frames = [f"{f.filename.split('sparsekv/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
              if "sparsekv" in f.filename and "benchmarks" not in f.filename]
    counts[" <- ".join(reversed(frames[-4:]))] += 1


for method in sys.argv[1:] or ["quest"]:
    engine = ServingEngine(model, build_config(method, None if method == "dense" else 2048), max_batch=4,
                           max_context=20000, prefill_chunk=2048, prefill=random_passes)
    for i in range(3):  # the warm-up: each batch size's step captured
        engine.submit(Request(prompt=[1 + i] * 5000, max_tokens=8, stop_tokens=()))
    while engine.has_work():
        engine.step()
    for i in range(6):
        engine.submit(Request(prompt=[7 + i] * (4000 + 1500 * i), max_tokens=12 + i, stop_tokens=()))
    counts.clear()
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    torch.cuda.set_sync_debug_mode(0)
    print(f"== {method}: {steps} steps, {sum(counts.values())} synchronizing calls", flush=True)
    for where, n in counts.most_common():
        print(f"{n:5d}  {where}", flush=True)
