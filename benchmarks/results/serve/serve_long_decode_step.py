"""Times the serving runner's captured decode step (``serve.runner.Runner``: the pool and step of
``bench.serve``'s long-decode run, 8704-token requests, max batch 80) over ROWS rows of 512-token prompts, whole
(CUDA events, median of 30 steps) and per kernel (torch.profiler over 5 steps), after each of the decode step
counts MARKS; the floor is (weights + the KV a step reads) / the copy bandwidth measured in the same run.

    PYTHONPATH=$PWD python benchmarks/results/serve/serve_long_decode_step.py METHOD ROWS OUT.json [MARKS]
"""
import json
import sys

import torch

from sparsekv.bench.common import Timer, copy_bandwidth, fill_rows, kernel_table, shape_model
from sparsekv.eval.runner import method_runs
from sparsekv.serve.runner import Runner

method, rows, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
marks = [int(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else [256, 1536, 2048]
dev = torch.device("cuda")
prompt_len, max_context = 512, 512 + 8192
model = shape_model("llama3-8b", dev, torch.bfloat16, max_context + 64)
bw = copy_bandwidth(dev, Timer(dev))
config = method_runs([method], [2048])[0].config
runner = Runner(model, config, max_batch=80, max_context=max_context, prefill_chunk=8192, cuda_graph=None,
                compile=False)
fill_rows(runner, rows, prompt_len, 8192)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
res = {"method": method, "rows": rows, "bandwidth": bw, "weights_bytes": weights, "points": []}
done = 0
for mark in marks:
    while done < mark:
        runner.decode()
        done += 1
    step_ms = Timer(dev, reps=30, warmup=0).eager(runner.decode)
    done += 30
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.decode()
            done += 1
    torch.cuda.synchronize()
    tokens = prompt_len + done
    held = min(tokens, 2048) if method == "raas" else tokens
    read = min(tokens, 2048)
    kv = rows * read * 32 * 8 * 128 * 2 * 2
    floor = (weights + kv) / bw * 1e3
    print(f"== {method} rows {rows} tokens/row {tokens} (held {held}) step {step_ms:.2f} ms, "
          f"floor {floor:.2f} ms (weights + {kv / 2**30:.2f} GiB KV read), x{step_ms / floor:.2f}",
          flush=True)
    table = kernel_table(prof, 5, show=25)
    res["points"].append({"tokens": tokens, "step_ms": step_ms, "floor_ms": floor,
                          "kernels": table})
json.dump(res, open(out, "w"), indent=1, default=str)
