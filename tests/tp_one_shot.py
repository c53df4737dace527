"""Started by torchrun (2 processes, one GPU each) from tests/test_tensor_parallel.py: the one-shot all-reduce
(``parallel.sum_partials`` with ``parallel.one_shot``) against NCCL's, bit for bit, eagerly, compiled and replayed
from a CUDA graph, on shapes that fit its buffer and on ones that NCCL sums (larger than the buffer; an odd count of
bf16 values, which the one-shot kernel's 4-byte words do not take). Writes ``OUT`` (its
one argument) from the first process: {case: true when equal}."""

import json
import sys

import torch
import torch.distributed as dist

from sparsekv import parallel


def main(out: str) -> None:
    device = parallel.start()
    group = dist.group.WORLD
    parallel.set_all_reduce("one-shot")
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        fast = parallel.one_shot(group, dtype, device)
        step = torch.compile(lambda x, fast=fast: parallel.sum_partials(x * 2, group, fast) + 1, dynamic=False)
        shapes = [(1, 4096), (3, 1000), (1, 7), (32, 4096 * 4 // dtype.itemsize), (fast.capacity + 8,)]
        for shape in shapes:
            x = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(dist.get_rank()))
            x = x.to(dtype)
            want = parallel.sum_partials(x, group)
            results[f"eager {dtype} {shape}"] = torch.equal(parallel.sum_partials(x, group, fast), want)
            if shape == shapes[0]:  # a compile per shape costs tens of seconds: one decode row
                results[f"compiled {dtype} {shape}"] = torch.equal(step(x), step_ref(x, group))
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            parallel.sum_partials(static, group, fast)  # warm up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                captured = parallel.sum_partials(static, group, fast)
            for seed in (5, 6):
                static.copy_(torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(
                    seed + dist.get_rank())).to(dtype))
                graph.replay()
                results[f"graph {seed} {dtype} {shape}"] = torch.equal(captured, parallel.sum_partials(static, group))
    torch.cuda.synchronize()
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({case: gathered[0][case] and gathered[1][case] for case in results}, f, indent=1)
    del graph, captured
    parallel.finish()


def step_ref(x: torch.Tensor, group) -> torch.Tensor:
    """What the compiled step computes, through NCCL."""
    return parallel.sum_partials(x * 2, group) + 1


if __name__ == "__main__":
    main(sys.argv[1])
