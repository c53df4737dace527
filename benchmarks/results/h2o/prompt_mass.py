"""H2O's prompt scores per layer on one GPU: ``kernels.attention_mass`` (the Triton kernel) against the reference ops
(``reference.attention_mass``, which CUDA ran before the kernel existed), Llama-3-8B's attention shape (32 query
heads, 8 KV heads, head dim 128, bf16), batch 1, tokens one per slot (H2O's page size 1): one prompt pass of
``queries`` queries at the last positions of ``context`` stored tokens (a chunked prefill's last chunk). CUDA
events, median of a few runs after one warm-up. Writes prompt_mass.json beside this file or under $OUT.

    PYTHONPATH=. python benchmarks/results/h2o/prompt_mass.py
"""
import json
import os
import time
from pathlib import Path

import torch

from sparsekv import kernels
from sparsekv.kernels import reference
from sparsekv.timing import Timer

dev = torch.device("cuda")
timer = Timer(dev, reps=5, warmup=1)
rows = []
for context, queries in ((32768, 4096), (131072, 4096), (131072, 8192)):
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(1, 8, context + 1, 1, 128, generator=g, device=dev).to(torch.bfloat16)
    slot_page = torch.arange(context + 1, device=dev).expand(1, 8, -1).clone()
    slot_page[..., -1] = -1  # the scratch slot
    slots = torch.arange(context + 1, device=dev).expand(1, 8, -1)
    q = torch.randn(1, 32, queries, 128, generator=g, device=dev).to(torch.bfloat16)
    q_pos = torch.arange(context - queries, context, device=dev).view(1, -1)
    scale = 128 ** -0.5
    ms = timer.eager(lambda: kernels.attention_mass(q, k, slot_page, slots, q_pos, scale))
    flops = 2 * 2 * 32 * 128 * queries * (context - queries / 2)  # two passes of q . k over the visible tokens
    row = {"context": context, "queries": queries, "kernel_ms": ms, "kernel_TFLOPs": flops / ms / 1e9}
    if context == 32768:
        # The reference on 256 queries, scaled to the pass (its cost is linear in the queries).
        sub = 256
        torch.cuda.synchronize()
        start = time.perf_counter()
        reference.attention_mass(q[:, :, :sub], k, slot_page, slots, q_pos[:, :sub], scale)
        torch.cuda.synchronize()
        row["reference_ms_est"] = (time.perf_counter() - start) * 1e3 * queries / sub
        want = reference.attention_mass(q[:, :, :sub].double(), k.double(), slot_page, slots, q_pos[:, :sub], scale)
        got = kernels.attention_mass(q[:, :, :sub], k, slot_page, slots, q_pos[:, :sub], scale)
        row["rel_err"] = float((got.double() - want).norm() / want.norm())
    rows.append(row)
    print(row, flush=True)
out = Path(os.environ.get("OUT", Path(__file__).parent))
(out / "prompt_mass.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
