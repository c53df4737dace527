"""Quest's choice (page scores and top-k, ``kernels.quest_select``) for launch variants of the page-score kernel
(Llama-3-8B shape: 8 KV heads, 32 query heads, head dim 128, pages of 16, bf16, budget 2048; CUDA-graph replay,
median of 50): over a serving pool's rows, 9 rows of the saturating run's first prompt lengths in rows of 131328
tokens, through the rows' page table into shared pages and in rows of their own (bytes: the bounds of the rows'
pages and their table entries, over the copy bandwidth measured in the run); then over whole rows of their own at
batch 1 (32K-512K), 4 and 16 (128K), each graph running over enough copies of the bounds to read 4x the L2.

    PYTHONPATH=$PWD python benchmarks/results/serve/page_scores_table.py OUT.json
"""
import itertools
import json
import random
import sys

import torch

from sparsekv import kernels
from sparsekv.bench.common import Timer, copy_bandwidth
from sparsekv.kernels.triton.common import TUNING

dev = torch.device("cuda")
timer = Timer(dev, reps=50, warmup=5)
bw = copy_bandwidth(dev, timer)
rng = random.Random(0)
lengths = [rng.randint(32768, 131072) for _ in range(10)][:9]
rows, hkv, h, d, p, slots, k = len(lengths), 8, 32, 128, 16, (131072 + 256) // 16 + 1, 128
pages = [-(-n // p) for n in lengths]
torch.manual_seed(0)
q = torch.randn(rows, h, d, device=dev, dtype=torch.bfloat16)
slot_page = torch.full((rows, hkv, slots), -1, dtype=torch.long, device=dev)
for r, n in enumerate(pages):
    slot_page[r, :, :n] = torch.arange(n, device=dev)
cur_slot = torch.tensor([n - 1 for n in pages], device=dev).view(-1, 1).expand(rows, hkv).contiguous()
lo = torch.randn(rows, hkv, slots, d, device=dev, dtype=torch.bfloat16)
hi = lo + torch.rand_like(lo)
total = sum(pages)
table = torch.full((rows, slots), total, dtype=torch.long, device=dev)  # pages in one run a row, as assigned
store_lo = torch.empty(1, hkv, total + 1, d, device=dev, dtype=torch.bfloat16)
store_hi = torch.empty_like(store_lo)
start = 0
for r, n in enumerate(pages):
    table[r, :n] = torch.arange(start, start + n, device=dev)
    store_lo[0, :, start:start + n] = lo[r, :, :n]
    store_hi[0, :, start:start + n] = hi[r, :, :n]
    start += n
want = kernels.quest_select(q, lo, hi, slot_page, cur_slot, k, False, True)
assert torch.equal(kernels.quest_select(q, store_lo, store_hi, slot_page, cur_slot, k, False, True, table), want)
nbytes = total * hkv * d * 2 * 2 + total * 8
res = {"lengths": lengths, "bandwidth": bw, "bytes": nbytes, "floor_us": nbytes / bw * 1e6, "runs": []}
print(f"{total} pages, {nbytes / 1e6:.1f} MB of bounds and table entries, floor {res['floor_us']:.1f} us")
base = dict(TUNING)
for block, chunks, warps, stages in itertools.product([64, 128], [1, 2], [4, 8], [2, 3, 4]):
    TUNING.update(page_block=block, page_chunks=chunks, page_warps=warps, page_stages=stages)
    run = {"page_block": block, "page_chunks": chunks, "page_warps": warps, "page_stages": stages}
    try:
        run["table_us"] = 1e3 * timer.graph(lambda: kernels.quest_select(q, store_lo, store_hi, slot_page, cur_slot,
                                                                          k, False, True, table))
        run["rows_us"] = 1e3 * timer.graph(lambda: kernels.quest_select(q, lo, hi, slot_page, cur_slot, k, False,
                                                                         True))
    except Exception as err:  # a launch the device cannot run (shared memory, registers)
        run["error"] = str(err)[:200]
    TUNING.clear()
    TUNING.update(base)
    res["runs"].append(run)
    print(run, flush=True)
res["whole_rows"] = []
for batch, ctx in [(1, 32768), (1, 131072), (1, 524288), (4, 131072), (16, 131072)]:
    del lo, hi
    slots = ctx // p + 1
    copies = 1 + int(4 * 60e6 // (batch * hkv * slots * d * 4))
    q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
    slot_page = torch.arange(slots, device=dev).expand(batch, hkv, slots).contiguous()
    slot_page[:, :, -1] = -1
    cur_slot = torch.full((batch, hkv), slots - 2, device=dev, dtype=torch.long)
    lo = [torch.randn(batch, hkv, slots, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    hi = [t + torch.rand_like(t) for t in lo]

    def every_copy():
        for lo_c, hi_c in zip(lo, hi):
            kernels.quest_select(q, lo_c, hi_c, slot_page, cur_slot, k, False, True)

    for block, stages in [(64, 4), (64, 3), (128, 2), (128, 3)]:
        TUNING.update(page_block=block, page_stages=stages)
        run = {"batch": batch, "context": ctx, "page_block": block, "page_stages": stages,
               "us": 1e3 * timer.graph(every_copy) / copies}
        TUNING.clear()
        TUNING.update(base)
        res["whole_rows"].append(run)
        print(run, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
