"""Ops of the decode path, each registered with ``torch.library`` as one op ``sparsekv::<name>``: the PyTorch
reference (``reference``) for CPU tensors (and any device without a kernel of its own), the fused Triton kernel
(the ``triton`` package) for CUDA tensors where there is one, and a fake implementation that gives the output
shapes and dtypes without computing them. torch.compile and CUDA-graph capture thus see each op as one unit (its
Triton launches included), and meta tensors run through it.

The names here (``kernels.quest_select`` ...) take the reference's signature, call the registered op and tell the
observers (``observe``) about the call. ``count_attended`` and ``merge_attention`` are plain compositions of torch
ops, not registered (``count_attended`` is fused by torch.compile on CUDA, for a method that attends other than
through ``sparse_decode``, which counts within its kernels).

The Triton kernels are imported the first time an op sees a CUDA tensor, so CPU-only use never imports triton;
without triton, CUDA tensors run the reference ops (with a warning)."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from . import reference

# name -> Triton op: None until an op first sees a CUDA tensor, then empty if triton cannot be imported.
_fast: dict[str, Callable] | None = None
# Called after every op call made through this package's names (see ``observe``).
_observers: list[Callable] = []


def _cuda_impl(name: str) -> Callable:
    """The CUDA implementation of op ``name``: its Triton kernel, else the reference."""
    ref = getattr(reference, name)

    def impl(*args, **kwargs):
        global _fast
        if _fast is None:
            try:
                from .triton import OPS
            except ImportError as err:
                warnings.warn(f"sparsekv: triton is not importable ({err}); CUDA tensors use the PyTorch reference "
                              "ops", stacklevel=2)
                OPS = {}
            _fast = OPS
        return _fast.get(name, ref)(*args, **kwargs)

    return impl


@contextmanager
def observe(callback: Callable) -> Iterator[None]:
    """Within the block, ``callback(name, arguments, result)`` runs after every call of an op of this package made
    through its names (``kernels.sparse_decode`` ...; not ``count_attended`` or ``merge_attention``): ``name`` the
    op's name, ``arguments`` a dict from the reference's parameter names to the values passed (defaults included;
    a tensor the op mutates is seen after the call), ``result`` what the op returned. An exception in the callback
    propagates to the op's caller. Eager calls only: a compiled graph or a CUDA-graph replay runs no Python here."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


_programmatic = False  # see set_programmatic_launch


def set_programmatic_launch(enabled: bool) -> None:
    """Turns programmatic dependent launch (PDL, CUDA on Hopper and later) on or off for the whole process. On, every
    kernel of ours is launched so that the GPU may start it while the kernel before it in the stream still runs: it
    waits for that kernel's writes (``griddepcontrol.wait``) only once its own prologue is done (the 4-bit products
    copy their first weight stages before it), then lets the kernel after it launch (``launch_dependents``); and the
    Triton kernels torch.compile generates from then on do the same (inductor's ``triton.enable_pdl``). Launches
    captured in a CUDA graph keep the setting of their capture. Raises RuntimeError where this torch's inductor has
    no such option."""
    global _programmatic
    import torch._inductor.config as inductor

    if not hasattr(inductor.triton, "enable_pdl"):
        raise RuntimeError(f"set_programmatic_launch: torch {torch.__version__}'s inductor has no triton.enable_pdl; "
                           "torch.compile's kernels could not take part")
    inductor.triton.enable_pdl = bool(enabled)
    _programmatic = bool(enabled)


def programmatic_launch() -> bool:
    """Whether kernels are launched with programmatic dependent launch (``set_programmatic_launch``)."""
    return _programmatic


# The ``sparsekv`` op namespace, defined through the low-level API: a call costs a few us on the host, where
# torch.library.custom_op's Python autograd and version-counter wrappers measured 25-30 us per op and over 100 us
# for append_token's six mutated tensors. Nothing differentiates through a decode step: no autograd formula is
# registered.
_lib = torch.library.Library("sparsekv", "DEF")


def _register(name: str, fake: Callable, mutates: tuple[str, ...] = ()) -> Callable:
    """Defines ``sparsekv::name`` (schema from the reference's annotations) with the reference for every device,
    the CUDA implementation and ``fake``, and returns the package's name for it: a function with the reference's
    signature and docstring that calls the op and then the observers."""
    ref = getattr(reference, name)
    _lib.define(name + torch.library.infer_schema(ref, mutates_args=mutates))
    _lib.impl(name, ref, "CompositeExplicitAutograd")
    _lib.impl(name, _cuda_impl(name), "CUDA")
    torch.library.register_fake(f"sparsekv::{name}", fake, lib=_lib)
    overload = getattr(torch.ops.sparsekv, name).default
    signature = inspect.signature(ref)

    @functools.wraps(ref)
    def call(*args, **kwargs):
        result = overload(*args, **kwargs)
        if _observers:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            for observer in tuple(_observers):
                observer(name, bound.arguments, result)
        return result

    call.__module__ = __name__
    return call


# Fake implementations: outputs of the reference's shapes and dtypes (on CUDA the Triton kernels return the same).

def _page_scores_fake(q, kmin, kmax, slot_page, per_query_head=False, table=None):
    b, h, _ = q.shape
    return q.new_empty(b, h if per_query_head else slot_page.shape[1], slot_page.shape[2],
                       dtype=reference.acc_dtype(q.dtype))


def _select_pages_fake(scores, cur_slot, num_pages):
    reference.check_num_pages(num_pages)
    b, hs, c = scores.shape
    return scores.new_empty(b, hs, min(num_pages, c), dtype=torch.long)


def _quest_select_fake(q, kmin, kmax, slot_page, cur_slot, num_pages, per_query_head=False, in_order=False,
                      table=None):
    return _select_pages_fake(_page_scores_fake(q, kmin, kmax, slot_page, per_query_head), cur_slot, num_pages)


def _raas_select_fake(q, kmin, kmax, slot_page, cur_slot, prompt_pages, num_pages):
    scores = _page_scores_fake(q, kmin, kmax, slot_page)
    return scores, _select_pages_fake(scores, cur_slot, num_pages)


def _attend_with_weights_fake(q, k, v, slot_page, slots, q_pos, scale):
    b, h, s, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(b, h, s, slots.shape[2] * k.shape[3], dtype=reference.acc_dtype(q.dtype))


def _attention_mass_fake(q, k, slot_page, slots, q_pos, scale, in_order=False, lse=None):
    return q.new_empty(q.shape[0], q.shape[1], slots.shape[2] * k.shape[3], dtype=reference.acc_dtype(q.dtype))


def _attend_fake(q, k, v, slot_page, slots, q_pos, scale):
    return q.new_empty(q.shape)


def _sparse_decode_fake(q, k, v, slot_page, slots, seq_len, scale, attended=None, in_order=False, table=None):
    return q.new_empty(q.shape)


def _window_token_maxima_fake(q, k, key_pos, q_pos, limit, scale):
    return q.new_empty(q.shape[0], q.shape[2], k.shape[2], dtype=reference.acc_dtype(q.dtype))


def _sparse_decode_tokens_fake(q, k, v, tokens, scale):
    acc = reference.acc_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=acc), q.new_empty(q.shape[:2], dtype=acc)


def _linear_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_quantized_fake(x, codes, scale, minimum, bias=None):
    return x.new_empty(*x.shape[:-1], reference.quantized_outputs(codes, scale))


def _coded_scores_fake(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head=False, table=None):
    return _page_scores_fake(q, kmin, kmax, slot_page, per_query_head, table)


def _lowbit_select_fake(q, k, kmin, kmax, codes, slot_page, cur_slot, seq_len, first, chosen, scale, bits, num_pages,
                        reuse=1, per_query_head=False, table=None, in_order=False):
    return None


def _code_page_fake(k, kmin, kmax, codes, cur_slot, bits, table=None):
    return None


def _append_token_fake(k, v, kmin, kmax, slot_page, cur_slot, position, k_new, v_new, has_holes, table=None):
    return None


def _append_pages_fake(k, v, kmin, kmax, slot_page, cur_slot, k_new, v_new, start, row, table=None):
    return None


def _page_bounds_fake(k, kmin, kmax, slot_mapping):
    return None


def _landmark_means_fake(k, means, slot_page, cur_slot, seq_len, table=None):
    return None


def _landmark_page_scores_fake(q, means, slot_page, seq_len, page_size, scale, per_query_head=False, table=None):
    return _page_scores_fake(q, None, None, slot_page, per_query_head)


def _landmark_select_fake(q, k, means, slot_page, cur_slot, seq_len, scale, num_pages, sink_pages=0,
                          per_query_head=False, in_order=False, table=None):
    return _select_pages_fake(_page_scores_fake(q, None, None, slot_page, per_query_head), cur_slot, num_pages)


def _page_means_fake(k, means, slot_mapping):
    return None


def _spread_stats_fake(k, stats, slot_page, cur_slot, seq_len, table=None):
    return None


def _spread_page_scores_fake(q, stats, slot_page, spread, per_query_head=False, table=None):
    return _page_scores_fake(q, None, None, slot_page, per_query_head)


def _spread_select_fake(q, k, stats, slot_page, cur_slot, seq_len, spread, num_pages, sink_pages=0,
                        per_query_head=False, in_order=False, table=None):
    return _select_pages_fake(_page_scores_fake(q, None, None, slot_page, per_query_head), cur_slot, num_pages)


def _page_stats_fake(k, stats, slot_mapping):
    return None


def _merge_lse_fake(a, lse_a, b, lse_b):
    return a.new_empty(a.shape), lse_a.new_empty(lse_a.shape)


def _page_codes_fake(k, kmin, kmax, codes, slot_mapping, bits):
    return None


def _raas_update_fake(scores, slot_page, cur_slot, stamp, seq_len, limit, prompt_pages, page_size, capacity,
                      decode_pages, top_fraction, alpha, scale):
    return None


page_scores = _register("page_scores", _page_scores_fake)
select_pages = _register("select_pages", _select_pages_fake)
quest_select = _register("quest_select", _quest_select_fake)
raas_select = _register("raas_select", _raas_select_fake)
coded_scores = _register("coded_scores", _coded_scores_fake)
lowbit_select = _register("lowbit_select", _lowbit_select_fake, mutates=("codes", "chosen"))
code_page = _register("code_page", _code_page_fake, mutates=("codes",))
sparse_decode = _register("sparse_decode", _sparse_decode_fake, mutates=("attended",))
attend = _register("attend", _attend_fake)
attend_with_weights = _register("attend_with_weights", _attend_with_weights_fake)
attention_mass = _register("attention_mass", _attention_mass_fake)
window_token_maxima = _register("window_token_maxima", _window_token_maxima_fake)
sparse_decode_tokens = _register("sparse_decode_tokens", _sparse_decode_tokens_fake)
append_token = _register("append_token", _append_token_fake,
                         mutates=("k", "v", "kmin", "kmax", "slot_page", "cur_slot"))
append_pages = _register("append_pages", _append_pages_fake,
                         mutates=("k", "v", "kmin", "kmax", "slot_page", "cur_slot"))
page_bounds = _register("page_bounds", _page_bounds_fake, mutates=("kmin", "kmax"))
landmark_means = _register("landmark_means", _landmark_means_fake, mutates=("means",))
landmark_page_scores = _register("landmark_page_scores", _landmark_page_scores_fake)
landmark_select = _register("landmark_select", _landmark_select_fake, mutates=("means",))
page_means = _register("page_means", _page_means_fake, mutates=("means",))
spread_stats = _register("spread_stats", _spread_stats_fake, mutates=("stats",))
spread_page_scores = _register("spread_page_scores", _spread_page_scores_fake)
spread_select = _register("spread_select", _spread_select_fake, mutates=("stats",))
page_stats = _register("page_stats", _page_stats_fake, mutates=("stats",))
merge_lse = _register("merge_lse", _merge_lse_fake)
page_codes = _register("page_codes", _page_codes_fake, mutates=("codes",))
raas_update = _register("raas_update", _raas_update_fake, mutates=("slot_page", "stamp"))
linear = _register("linear", _linear_fake)
linear_quantized = _register("linear_quantized", _linear_quantized_fake)


def fused(fn: Callable, dynamic: bool | None = None) -> Callable:
    """``fn`` (a pure composition of torch ops) fused by torch.compile for CUDA tensors, so that a decode step's
    small bookkeeping costs one kernel instead of a dozen; CPU tensors run ``fn`` as it is. ``dynamic``: as
    torch.compile's (False: a graph per distinct shape and int argument)."""
    compiled = None

    def op(first, *args, **kwargs):
        nonlocal compiled
        if not first.is_cuda:
            return fn(first, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        return compiled(first, *args, **kwargs)

    op.__name__ = fn.__name__
    op.__doc__ = fn.__doc__
    return op


count_attended = fused(reference.count_attended)
merge_attention = reference.merge_attention
weigh_window = reference.weigh_window

__all__ = ["page_scores", "select_pages", "quest_select", "raas_select", "coded_scores", "lowbit_select", "code_page",
           "sparse_decode", "attend", "attend_with_weights", "attention_mass", "window_token_maxima", "weigh_window",
           "sparse_decode_tokens", "append_token", "append_pages", "page_bounds", "page_codes", "raas_update", "linear",
           "linear_quantized", "landmark_means", "landmark_page_scores", "landmark_select", "page_means",
           "spread_stats", "spread_page_scores", "spread_select", "page_stats",
           "merge_lse", "count_attended", "merge_attention", "observe", "fused", "reference",
           "set_programmatic_launch", "programmatic_launch"]
