"""Block sizes, warps and stages of ``kernels.triton.mass``'s two passes, each timed alone on the H200 at Llama-3-8B's
attention shape (32 query heads, 8 KV heads, head dim 128, bf16, tokens one per slot), batch 1, 4096 queries at the
end of 32768 stored tokens (CUDA events, median of 5 runs after one warm-up); the outputs of each launch checked
against those of the launch ``attention_mass`` makes (``default``; in the committed JSON, the one it made before this
sweep: blocks of 64 x 64 in both passes). Writes prompt_mass_sweep.json beside this file or under $OUT.

    PYTHONPATH=. python benchmarks/results/h2o/prompt_mass_sweep.py
"""
import itertools
import json
import os
from pathlib import Path

import torch
import triton

from sparsekv.kernels.triton.common import LOG2E, TUNING, block_d, precision
from sparsekv.kernels.triton.mass import _mass_lse_kernel, _mass_sum_kernel
from sparsekv.timing import Timer

dev = torch.device("cuda")
timer = Timer(dev, reps=5, warmup=1)
context, queries, h, hkv, d = 32768, 4096, 32, 8, 128
g = torch.Generator(device=dev).manual_seed(0)
k = torch.randn(1, hkv, context + 1, 1, d, generator=g, device=dev).to(torch.bfloat16)
slot_page = torch.arange(context + 1, device=dev).expand(1, hkv, -1).clone()
slot_page[..., -1] = -1
slots = torch.arange(context + 1, device=dev).expand(1, hkv, -1)
q = torch.randn(1, h, queries, d, generator=g, device=dev).to(torch.bfloat16)
q_pos = torch.arange(context - queries, context, device=dev).view(1, -1)
n = context + 1
scale_log2 = d ** -0.5 * LOG2E
strides = (*q.stride(), k.stride(0), k.stride(1), k.stride(2), k.stride(3), *slot_page.stride(), *slots.stride(),
           *q_pos.stride())
flops = 2 * h * d * queries * (context - queries / 2)  # one pass of q . k over the visible tokens


def launch(pass_, block_q, block_k, warps, stages, lse, out):
    meta = dict(H=h, HS=hkv, HKV=hkv, P=1, D=d, BLOCK_D=block_d(d), BLOCK_Q=block_q, BLOCK_K=block_k,
                PRECISION=precision(q.dtype), UPCAST=False, num_warps=warps, num_stages=stages)
    if pass_ == 1:
        _mass_lse_kernel[(h, triton.cdiv(queries, block_q))](q, k, slot_page, slots, q_pos, lse, queries, n,
                                                             scale_log2, *strides, **meta)
    else:
        _mass_sum_kernel[(h, triton.cdiv(n, block_k))](q, k, slot_page, slots, q_pos, lse, out, queries, n,
                                                       scale_log2, *strides, **meta)


blocks, warps, stages = TUNING["prompt_mass_blocks"], TUNING["prompt_mass_warps"], TUNING["prompt_mass_stages"]
default = {p: (*blocks[p - 1], warps, stages) for p in (1, 2)}  # the launches attention_mass makes
lse_ref = torch.empty(1, h, queries, device=dev)
out_ref = torch.empty(1, h, n, device=dev)
launch(1, *default[1], lse_ref, out_ref)
launch(2, *default[2], lse_ref, out_ref)
rows = []
for pass_, bq, bk, w, st in itertools.product((1, 2), (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
    lse, out = torch.empty_like(lse_ref), torch.empty_like(out_ref)
    try:
        if pass_ == 2:
            lse.copy_(lse_ref)
        ms = timer.eager(lambda: launch(pass_, bq, bk, w, st, lse, out))
    except Exception as err:  # out of shared memory or registers
        rows.append({"pass": pass_, "block_q": bq, "block_k": bk, "warps": w, "stages": st, "error": repr(err)[:120]})
        continue
    got, want = (lse, lse_ref) if pass_ == 1 else (out, out_ref)
    row = {"pass": pass_, "block_q": bq, "block_k": bk, "warps": w, "stages": st, "ms": ms,
           "TFLOPs": flops / ms / 1e9, "rel_diff": float((got - want).norm() / want.norm()),
           "default": (bq, bk, w, st) == default[pass_]}
    rows.append(row)
    print(row, flush=True)
for pass_ in (1, 2):
    best = min((r for r in rows if r["pass"] == pass_ and "ms" in r), key=lambda r: r["ms"])
    print(f"pass {pass_} best: {best}", flush=True)
out_dir = Path(os.environ.get("OUT", Path(__file__).parent))
(out_dir / "prompt_mass_sweep.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                           indent=1))
