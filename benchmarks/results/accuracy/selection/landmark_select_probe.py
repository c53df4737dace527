"""Probe (H200): landmark_select against quest_select and lowbit_select over 30 layers of metadata (cold L2),
Llama-3-8B shape, batch 1, 128K, budget 2048, captured in a CUDA graph; landmark over TUNING variants."""
import itertools, json, os, sys
import torch
from sparsekv import kernels
from sparsekv.kernels.triton import TUNING
from sparsekv.kernels import reference as ref

dev = "cuda"
B, H, HKV, D, P, L = 1, 32, 8, 128, 16, 30
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
C = ctx // P
g = torch.Generator(device=dev).manual_seed(0)
bf = torch.bfloat16
q = torch.randn(B, H, D, device=dev, dtype=bf)
slot_page = torch.arange(C + 1, device=dev).where(torch.arange(C + 1, device=dev) < C, -1).view(1, 1, -1).expand(B, HKV, -1).contiguous()
cur_slot = torch.full((B, HKV), C - 1, device=dev)
seq_len = torch.full((B,), ctx, device=dev)
k = torch.randn(B, HKV, C + 1, P, D, device=dev, dtype=bf)  # one layer's keys (the current page only is read)
means = [torch.randn(B, HKV, C + 1, 2, D, device=dev, dtype=bf) for _ in range(L)]
kmin = [torch.randn(B, HKV, C + 1, D, device=dev, dtype=bf) for _ in range(L)]
kmax = [m + 1 for m in kmin]
codes = [torch.randint(0, 255, (B, HKV, C + 1, P, D // 4), device=dev, dtype=torch.uint8) for _ in range(L)]
n = 2048 // P
scale = D ** -0.5


def timed(fn, reps=50):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / L)
    return sorted(times)[len(times) // 2]


def quest():
    for i in range(L):
        kernels.quest_select(q, kmin[i], kmax[i], slot_page, cur_slot, n, False, True)


def landmark():
    for i in range(L):
        kernels.landmark_select(q, k, means[i], slot_page, cur_slot, seq_len, scale, n, 1, False, True)


chosen = torch.empty(B, HKV, n, dtype=torch.long, device=dev)


def lowbit():
    for i in range(L):
        kernels.lowbit_select(q, k, kmin[i], kmax[i], codes[i], slot_page, cur_slot, seq_len, seq_len, chosen, scale, 2,
                              n, 1, False, None, True)


rows = {"context": ctx, "quest_us": timed(quest), "lowbit_us": timed(lowbit)}
print(f"quest_select {rows['quest_us']:.2f} us/layer, lowbit_select {rows['lowbit_us']:.2f}", flush=True)
base = dict(TUNING)
grid = []
sweep = [(32, 4, 64, 3), (64, 4, 64, 3)] if ctx < 131072 else itertools.product([32, 64, 128], [4, 8], [32, 64, 128],
                                                                                 [2, 3, 4])
for block, warps, block_k, stages in sweep:
    TUNING.update(base, landmark_block=block, landmark_warps=warps, landmark_block_k=block_k, landmark_stages=stages)
    try:
        t = timed(landmark)
    except Exception as err:  # a tile too large for the device
        print(f"landmark {block} {warps} {block_k} {stages}: {type(err).__name__}", flush=True)
        continue
    grid.append({"landmark_block": block, "landmark_warps": warps, "landmark_block_k": block_k,
                 "landmark_stages": stages, "us": t})
    print(f"landmark_select block {block:4d} warps {warps} block_k {block_k:3d} stages {stages}: {t:.2f} us/layer "
          f"({t / rows['quest_us']:.3f}x quest)", flush=True)
TUNING.update(base)
rows["landmark"] = grid
best = min(grid, key=lambda r: r["us"])
print("best", best, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"tune_landmark_{ctx}.json"), "w"), indent=1)
