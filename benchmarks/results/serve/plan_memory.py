"""Probe (#58; on the H200: `PYTHONPATH=$PWD python benchmarks/results/serve/plan_memory.py`): the device memory
outside PyTorch's allocator that cuDNN's prompt attention plans hold (every shape of ``prompt_plans`` for a 128K
context and passes of 16384 tokens), and a late pass's attention over its earlier keys in one call against blocks
of 16384 keys merged by log-sum-exp."""
import time

import torch

from sparsekv import kernels
from sparsekv.integrations.transformers import attention_lse, prompt_plans

dev = torch.device("cuda")


def outside() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(dev)
    return (total - free - torch.cuda.memory_reserved(dev)) / 2**20


tiny = torch.zeros(1, 8, 16, 128, dtype=torch.bfloat16, device=dev)
attention_lse(torch.zeros(1, 32, 16, 128, dtype=torch.bfloat16, device=dev), tiny, tiny, True, 0.088)
base = outside()
print(f"outside after one tiny plan: {base:.0f} MiB", flush=True)
shapes = prompt_plans(16384, 131328)
start = time.perf_counter()
for i, (queries, keys, causal) in enumerate(shapes):
    kv = torch.zeros(1, 8, keys, 128, dtype=torch.bfloat16, device=dev)
    attention_lse(torch.zeros(1, 32, queries, 128, dtype=torch.bfloat16, device=dev), kv, kv, causal, 0.088)
    if i in (0, 9, 49, 99, 199, 299, 399, len(shapes) - 1):
        torch.cuda.empty_cache()
        print(f"{i + 1} plans: outside {outside() - base:.0f} MiB, {time.perf_counter() - start:.1f} s", flush=True)

q = torch.randn(1, 32, 16384, 128, dtype=torch.bfloat16, device=dev)
k = torch.randn(1, 8, 114688, 128, dtype=torch.bfloat16, device=dev)
v = torch.randn_like(k)
blocks = [(k[:, :, i:i + 16384].contiguous(), v[:, :, i:i + 16384].contiguous()) for i in range(0, 114688, 16384)]


def one():
    return attention_lse(q, k, v, False, 0.088)


def blocked():
    out, lse = attention_lse(q, *blocks[0], False, 0.088)
    for kb, vb in blocks[1:]:
        out, lse = kernels.merge_lse(out, lse, *attention_lse(q, kb, vb, False, 0.088))
    return out, lse


for f in (one, blocked, one, blocked):
    f()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
    begin.record()
    for _ in range(5):
        f()
    end.record()
    torch.cuda.synchronize()
    print(f.__name__, f"{begin.elapsed_time(end) / 5:.2f} ms")
print("max diff", (one()[0].float() - blocked()[0].float()).abs().max().item())
