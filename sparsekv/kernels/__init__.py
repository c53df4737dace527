"""Ops of the decode path. Each name dispatches on the device of its first tensor: a fused Triton kernel for CUDA
tensors where one is registered, the PyTorch reference otherwise. Both share one signature (see ``reference``).

The Triton kernels (``triton_ops``) are imported the first time an op sees a CUDA tensor, so CPU-only use never
imports triton; without triton, CUDA tensors run the reference ops (with a warning)."""

from __future__ import annotations

import warnings
from typing import Callable

from . import reference

# Filled by the Triton module when it imports (CUDA and triton present); name -> op with the reference's signature.
FAST: dict[str, Callable] = {}
_tried_fast = False


def _load_fast() -> None:
    global _tried_fast
    _tried_fast = True
    try:
        from . import triton_ops  # noqa: F401  (registers its ops in FAST)
    except ImportError as err:
        warnings.warn(f"sparsekv: triton is not importable ({err}); CUDA tensors use the PyTorch reference ops",
                      stacklevel=3)


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)

    def op(first, *args, **kwargs):
        if first.is_cuda:
            if not _tried_fast:
                _load_fast()
            fast = FAST.get(name)
            if fast is not None:
                return fast(first, *args, **kwargs)
        return ref(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


page_scores = _dispatch("page_scores")
select_pages = _dispatch("select_pages")
quest_select = _dispatch("quest_select")
sparse_decode = _dispatch("sparse_decode")
attend = _dispatch("attend")
attend_with_weights = _dispatch("attend_with_weights")
window_token_maxima = _dispatch("window_token_maxima")
sparse_decode_tokens = _dispatch("sparse_decode_tokens")
append_token = _dispatch("append_token")
count_attended = reference.count_attended
merge_attention = reference.merge_attention
weigh_window = reference.weigh_window

__all__ = ["page_scores", "select_pages", "quest_select", "sparse_decode", "attend", "attend_with_weights",
           "window_token_maxima", "weigh_window", "sparse_decode_tokens", "append_token", "count_attended",
           "merge_attention", "reference", "FAST"]
