"""A CPU stand-in for CUDA graph capture, so that CI can check that a decode step is capturable.

A CUDA graph records the kernels a step launches, with their arguments and memory addresses, and a replay runs
those kernels again and nothing else: no Python, no host reads. ``emulated_graph`` does the same with PyTorch
ops: it runs the step once under a dispatch mode that records every op with its argument tensors, and a replay
calls the recorded ops again on the same tensors, writing each op's fresh result into the tensor the recording
produced (an op's output that aliases its input, a view or an in-place op, needs no copy). So a step that keeps
state in Python, reads a tensor on the host, or replaces a tensor instead of updating it in place goes wrong on
replay exactly as it would on the GPU. Host reads (``.item()``, ``.tolist()``, ``bool(t)``) and ops whose output
shape depends on data raise at once, as capture would.

The steps' graphs share one memory pool (``engine.GraphCapture``), so what a step allocates is another graph's
scratch once it ends: the emulation fills every tensor the step allocated with garbage after each run (NaN,
the dtype's largest int, negated bools). A step, or a host read after it, that reads what an earlier step left
in such a tensor instead of in one made before capture goes wrong here as it could on the GPU.
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


def _scramble(recorder: _Recorder) -> None:
    """Fills the tensors the recorded step allocated with garbage."""
    with torch.no_grad():
        for *_, recorded in recorder.ops:
            for t in recorded:
                if t.dtype == torch.bool:
                    t.logical_not_()
                elif t.is_floating_point() or t.is_complex():
                    t.fill_(float("nan"))
                else:
                    t.fill_(torch.iinfo(t.dtype).max)


def emulated_graph(step):
    """Records ``step`` (running it once) and returns its replay, with the semantics of ``engine.GraphCapture``."""
    recorder = _Recorder()
    with recorder:
        step()
    _scramble(recorder)

    def replay() -> None:
        with torch.no_grad():
            for func, args, kwargs, recorded in recorder.ops:
                out = func(*args, **kwargs)
                if recorded:
                    outs, _ = tree_flatten(out)
                    fresh = [o for o, r in zip(outs, func._schema.returns) if r.alias_info is None]
                    for dst, src in zip(recorded, fresh):
                        dst.copy_(src)
        _scramble(recorder)

    return replay
