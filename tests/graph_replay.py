"""A CPU stand-in for CUDA graph capture, so that CI can check that a decode step is capturable.

A CUDA graph records the kernels a step launches, with their arguments and memory addresses, and a replay runs
those kernels again and nothing else: no Python, no host reads. ``emulated_graph`` does the same with PyTorch
ops: it runs the step once under a dispatch mode that records every op with its argument tensors, and a replay
calls the recorded ops again on the same tensors, writing each op's fresh result into the tensor the recording
produced (an op's output that aliases its input, a view or an in-place op, needs no copy). So a step that keeps
state in Python, reads a tensor on the host, or replaces a tensor instead of updating it in place goes wrong on
replay exactly as it would on the GPU. Host reads (``.item()``, ``.tolist()``, ``bool(t)``) and ops whose output
shape depends on data raise at once, as capture would.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that read tensor data on the host or size their output by it: not allowed while a CUDA stream captures.
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2",
              "unique_consecutive", "unique_dim", "equal", "is_nonzero", "allclose"}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in HOST_READS:
            raise RuntimeError(f"host read in a captured step: {func}")
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        if any(not isinstance(o, torch.Tensor) for o in outs if o is not None):
            raise RuntimeError(f"op returning a host value in a captured step: {func}")
        fresh = [i for i, r in enumerate(func._schema.returns) if r.alias_info is None]
        self.ops.append((func, args, kwargs, [outs[i] for i in fresh if i < len(outs)]))
        return out


def emulated_graph(step):
    """Records ``step`` (running it once) and returns its replay, with the semantics of ``engine.capture_graph``."""
    recorder = _Recorder()
    with recorder:
        step()

    def replay() -> None:
        with torch.no_grad():
            for func, args, kwargs, recorded in recorder.ops:
                out = func(*args, **kwargs)
                if recorded:
                    outs, _ = tree_flatten(out)
                    fresh = [o for o, r in zip(outs, func._schema.returns) if r.alias_info is None]
                    for dst, src in zip(recorded, fresh):
                        dst.copy_(src)

    return replay
