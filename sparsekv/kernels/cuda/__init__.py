"""CUDA C++ kernels, for what Triton does not express at the speed the hardware allows: tensor-core products whose
operands are built in the fragments' registers, with no trip through shared memory. Each ``<name>.cu`` is built on
first use with the local CUDA compiler (``torch.utils.cpp_extension``: nvcc and ninja), for the GPUs present, and
has a Python module of the same name here: ``quant`` (int4 weights' products of 1-16 rows), ``coded`` (lowbit's page
scores from low-bit key codes), ``fp8kv`` (decode attention over an fp8 cache). Where a file cannot be built (no
compiler, a GPU before sm_80), ``available`` says so once in a warning and the caller takes its Triton kernels.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

# What serves instead of each file's kernels where it cannot be built.
_INSTEAD = {"quant": "int4 products use tinygemm and the Triton kernel instead",
            "coded": "lowbit's page scores use the Triton kernel instead",
            "fp8kv": "attention over fp8 caches uses the Triton kernel instead"}


@functools.cache
def module(name: str):
    """The extension built from ``name``.cu, or None when it cannot be built (warned once, with the reason)."""
    try:
        from torch.utils.cpp_extension import load
        return load(f"sparsekv_cuda_{name}", [str(Path(__file__).with_name(f"{name}.cu"))],
                    extra_cuda_cflags=["-O3"], verbose=False)
    except Exception as err:  # no nvcc, no ninja, a failed build: the Triton kernels serve
        warnings.warn(f"sparsekv: the CUDA kernels of {name}.cu could not be built ({type(err).__name__}: {err}); "
                      f"{_INSTEAD[name]} (needs nvcc and `pip install ninja`)", stacklevel=3)
        return None


@functools.cache
def available(device: torch.device, name: str) -> bool:
    """Whether the kernels of ``name``.cu run on ``device``: a CUDA GPU of sm_80 or later and an extension built
    here."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) and module(name) is not None
