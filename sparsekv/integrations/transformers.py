"""HuggingFace transformers integration through its public extension points.

* A ``Cache`` subclass (``SparseKVCache``) stores every layer's keys and values in the paged cache.
* An attention function registered in ``AttentionInterface`` as ``"sparsekv"``: dense causal attention for the
  prompt, the method's selection plus sparse attention for each decode step.
* A forward pre-hook on the decoder stack hands the cache (and the prompt's padding mask) to the layers, creating
  a ``SparseKVCache`` where the caller or ``generate`` would have made a dense one.

``apply(model, config)`` sets these up and takes them down again on exit, leaving the model exactly as it was.
The attention mask registry needs no entry: for an implementation it does not know, transformers builds no 4D
mask at all, which is what we want, since the cache tracks each sequence's length and padding itself.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import kernels, parallel
from ..cache import PagedKVCache
from ..methods.base import Method, MethodConfig, all_slots

ATTENTION_NAME = "sparsekv"
SUPPORTED_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class DecodeStats:
    """KV tokens attended in decode steps, summed over layers, sequences and KV heads (selection rows for
    per-query-head methods are normalised to KV heads). ``context`` is what dense attention would have read.
    Under tensor parallelism the sums and ``per_layer`` cover this process's KV heads; ``summary`` adds up those of
    every process of ``tp_group``."""

    steps: int = 0
    attended: torch.Tensor | None = None
    context: torch.Tensor | None = None
    rows: int = 0  # (layer, sequence, KV head) triples summed per step
    per_layer: dict[int, torch.Tensor] = field(default_factory=dict)
    tp_group: object = None  # the process group sharing the heads (sparsekv.parallel), None when not split

    def add(self, layer_idx: int, attended: torch.Tensor, seq_len: torch.Tensor, kv_heads: int) -> None:
        """attended: (B, Hs) tokens per selection row; seq_len: (B,)."""
        per_kv = attended.sum() * kv_heads / attended.shape[1]
        ctx = seq_len.sum() * kv_heads
        self.attended = per_kv if self.attended is None else self.attended + per_kv
        self.context = ctx if self.context is None else self.context + ctx
        self.per_layer[layer_idx] = self.per_layer.get(layer_idx, 0) + per_kv
        self.rows += seq_len.shape[0] * kv_heads
        if layer_idx == 0:
            self.steps += 1

    def summary(self) -> dict:
        """Means per decode step and (layer, sequence, KV head): tokens attended, dense context, their ratio.
        Under tensor parallelism the means run over every process's heads: a collective, which every process of
        ``tp_group`` calls."""
        if not self.rows:
            return {"decode_steps": 0, "attended_per_head": 0.0, "context_per_head": 0.0, "fraction": 0.0}
        sums = torch.tensor([float(self.attended), float(self.context), self.rows], dtype=torch.float64,
                            device=self.attended.device)
        attended, context, rows = parallel.all_reduce_sum(sums, self.tp_group).tolist()
        att, ctx = attended / rows, context / rows
        return {"decode_steps": self.steps, "attended_per_head": att, "context_per_head": ctx,
                "fraction": att / ctx if ctx else 0.0}


class _PagedLayerView(CacheLayerMixin):
    """What transformers' generic Cache code asks of a layer; storage lives in the shared PagedKVCache."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, owner: "SparseKVCache"):
        super().__init__()
        # A weak reference: a cycle would keep a finished cache's device memory until the garbage collector runs.
        self._owner = weakref.ref(owner)
        self.is_initialized = True

    @property
    def owner(self) -> "SparseKVCache":
        return self._owner()

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("SparseKVCache layers are updated through SparseKVCache.update")

    def get_mask_sizes(self, query_length):
        return self.owner.columns + query_length, 0

    def get_seq_length(self):
        return self.owner.columns

    def get_max_length(self):
        return -1


class SparseKVCache(Cache):
    """A transformers ``Cache`` whose storage is the paged cache and whose decode steps run ``method``.

    ``columns`` counts the attention-mask columns seen (padding included), which is what transformers calls the
    sequence length; the paged cache holds each sequence's real tokens only.
    """

    def __init__(self, method: Method, stats: DecodeStats | None = None, sliding_window: int | None = None):
        self.pages = PagedKVCache(method.num_layers, method.config.page_size, method.max_pages)
        self.method = method
        self.stats = stats if stats is not None else DecodeStats()
        self.sliding_window = sliding_window
        self.columns = 0
        self.pending_mask: torch.Tensor | None = None
        super().__init__(layers=[_PagedLayerView(self) for _ in range(method.num_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Appends the pass's keys/values (B, Hkv, S, D) to ``layer_idx`` and returns them unchanged."""
        if layer_idx == 0:
            self._begin_pass(key_states)
        self.pages.append(layer_idx, key_states, value_states)
        return key_states, value_states

    def _begin_pass(self, key_states: torch.Tensor) -> None:
        b, _, s, _ = key_states.shape
        mask = self.pending_mask
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < s:
                raise ValueError(f"attention_mask: sparsekv takes a 2D (batch, columns) padding mask, got shape "
                                 f"{tuple(mask.shape)} for {s} new tokens")
            mask = mask[:, -s:]
        self.pending_mask = None
        if self.pages.lengths and max(self.pages.lengths) > 0 and s > 1 and not self.method.accepts_chunks:
            raise ValueError(f"{self.method.config.name} takes one token per forward pass after the prompt, got {s}")
        self.pages.begin(s, mask, b, key_states.device)
        self.columns += s
        if self.sliding_window is not None and max(self.pages.lengths) > self.sliding_window:
            raise ValueError(f"context of {max(self.pages.lengths)} tokens exceeds the model's sliding window "
                             f"({self.sliding_window}); sparsekv supports full-attention models only")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        self._reorder(indices)

    def batch_repeat_interleave(self, repeats: int):
        n = self.pages.batch_size
        if n:
            self._reorder(torch.arange(n).repeat_interleave(repeats))

    def _reorder(self, index: torch.Tensor) -> None:
        self.pages.reorder(index)
        self.method.reorder(index)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SparseKVCache cannot be cropped (assisted or speculative decoding is not "
                                  "supported by sparsekv)")

    def reset(self):
        self.pages = PagedKVCache(self.method.num_layers, self.method.config.page_size, self.method.max_pages)
        self.columns = 0

    def resident_bytes(self) -> int:
        """KV bytes on the cache's device: the pages plus the method's own state (e.g. OmniKV's subset buffers)."""
        return self.pages.resident_bytes() + self.method.resident_bytes()

    def offloaded_bytes(self) -> int:
        """KV bytes the method keeps in host memory instead (OmniKV with ``offload=True``)."""
        return self.method.offloaded_bytes()


def _prefill_attention(q, k, v, valid: torch.Tensor, all_valid: bool, scale: float) -> torch.Tensor:
    """Dense causal attention among the prompt's own tokens. q: (B, H, S, D); k, v: (B, Hkv, S, D);
    valid: (B, S). Padding queries attend to themselves only, which keeps them finite."""
    if all_valid:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    s = q.shape[2]
    eye = torch.eye(s, dtype=torch.bool, device=q.device)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril() & valid[:, None, None, :]
    mask = mask | (eye & ~valid[:, None, :, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sparsekv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sparsekv_cache: SparseKVCache | None = None, **kwargs):
    """transformers attention function. query: (B, H, S, D); key, value: (B, Hkv, S, D), this pass's tokens.
    Returns ((B, S, H, D), None)."""
    if sparsekv_cache is None:
        raise RuntimeError("the 'sparsekv' attention implementation runs only inside sparsekv.apply(model, config)")
    if dropout:
        raise ValueError("sparsekv is an inference library: attention dropout must be 0 (call model.eval())")
    cache = sparsekv_cache
    pages = cache.pages
    plan = pages.plan
    layer = pages.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if plan.is_first:
        all_valid = all(n == query.shape[2] for n in plan.new_len)
        out = _prefill_attention(query, key, value, plan.valid, all_valid, scale)
        cache.method.prefill(module.layer_idx, query, layer, plan, scale)
    elif query.shape[2] > 1:
        # A chunk after the prompt (e.g. a question appended at once) is attended densely, like a prefill.
        out = kernels.attend(query, layer.k, layer.v, layer.slot_page, all_slots(layer), plan.position, scale)
    else:
        out, attended = cache.method.decode(module.layer_idx, query[:, :, 0], layer, pages.seq_len, scale)
        out = out.unsqueeze(2)
        cache.stats.add(module.layer_idx, attended, pages.seq_len, key.shape[1])
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, sparsekv_attention)


def _check_model(model) -> None:
    names = {cls.__name__ for cls in type(model).__mro__}
    if not names & set(SUPPORTED_MODELS):
        raise ValueError(f"model {type(model).__name__} is not supported; supported: {', '.join(SUPPORTED_MODELS)}")


def _sliding_window(config) -> int | None:
    """The window of models that use one (Mistral, Qwen2/3 with use_sliding_window), else None."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


@dataclass
class Session:
    """What ``apply`` yields: the method, its decode statistics, and the cache of the latest forward pass."""

    method: Method
    stats: DecodeStats
    cache: SparseKVCache | None = None

    def new_cache(self, sliding_window: int | None) -> SparseKVCache:
        self.cache = SparseKVCache(self.method, self.stats, sliding_window)
        return self.cache


@contextmanager
def apply(model, config: MethodConfig) -> Iterator[Session]:
    """Runs ``config``'s method in every forward pass and ``generate`` of ``model`` inside the ``with`` block.

    On exit the attention implementation and hooks are restored, so the model is exactly dense again.
    """
    if not isinstance(config, MethodConfig):
        raise TypeError(f"config must be a sparsekv method config (e.g. QuestConfig), got {type(config).__name__}")
    _check_model(model)
    decoder = model.get_decoder()
    method = config.build(model.config.num_hidden_layers)
    method.tp_group = parallel.head_group(model)
    session = Session(method, DecodeStats(tp_group=method.tp_group))
    window = _sliding_window(model.config)
    params = list(inspect.signature(decoder.forward).parameters)

    def pre_hook(module, args, kwargs):
        kwargs = dict(kwargs, **dict(zip(params, args)))
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, SparseKVCache) or cache.method is not method:
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("past_key_values already holds tokens from another cache; start the sequence "
                                 "inside sparsekv.apply")
            cache = session.new_cache(window)
        session.cache = cache
        cache.pending_mask = kwargs.get("attention_mask")
        kwargs["past_key_values"] = cache
        kwargs["sparsekv_cache"] = cache
        return (), kwargs

    previous = model.config._attn_implementation
    handle = decoder.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        model.set_attn_implementation(ATTENTION_NAME)
        yield session
    finally:
        handle.remove()
        model.set_attn_implementation(previous)
