"""Ops of the decode path. Each name dispatches on the device of its first tensor: a fused Triton kernel for CUDA
tensors where one is registered, the PyTorch reference otherwise. Both share one signature (see ``reference``)."""

from __future__ import annotations

from typing import Callable

from . import reference

# Filled by the Triton module when it imports (CUDA and triton present); name -> op with the reference's signature.
FAST: dict[str, Callable] = {}


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)

    def op(first, *args, **kwargs):
        fast = FAST.get(name)
        if fast is not None and first.is_cuda:
            return fast(first, *args, **kwargs)
        return ref(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


page_scores = _dispatch("page_scores")
select_pages = _dispatch("select_pages")
sparse_decode = _dispatch("sparse_decode")
attend = _dispatch("attend")
attend_with_weights = _dispatch("attend_with_weights")
window_token_scores = _dispatch("window_token_scores")
sparse_decode_tokens = _dispatch("sparse_decode_tokens")
count_attended = reference.count_attended
merge_attention = reference.merge_attention

__all__ = ["page_scores", "select_pages", "sparse_decode", "attend", "attend_with_weights", "window_token_scores",
           "sparse_decode_tokens", "count_attended", "merge_attention", "reference", "FAST"]
