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

import functools
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import kernels, parallel
from ..cache import AppendPlan, PagedKVCache, PagedLayer
from ..methods.base import Method, MethodConfig, Tally, all_slots

ATTENTION_NAME = "sparsekv"
SUPPORTED_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class DecodeStats:
    """KV tokens attended in decode steps, summed over layers, sequences and KV heads (selection rows for
    per-query-head methods are normalised to KV heads), against what dense attention would have read.

    The sums are device tensors updated in place, so a captured decode step keeps adding to them at every replay:
    each layer's attention adds its tokens into the layer's ``Tally`` (no kernel of its own), and one small kernel
    per step adds the context; a layer whose method attends the whole context leaves its tally unused and costs
    nothing, its count being the context's. The host counters (``steps``, ``rows``) are advanced for replays by
    ``replayed``. Under tensor parallelism the sums cover this process's KV heads; ``summary`` adds up those of
    every process of ``tp_group``."""

    steps: int = 0
    rows: int = 0  # (layer, sequence, KV head) triples summed per step
    tp_group: object = None  # the process group sharing the heads (sparsekv.parallel), None when not split
    # Per layer, and "context" (each sequence's length summed over steps), for the current batch.
    _tallies: dict[object, Tally] = field(default_factory=dict)
    _weight: dict[int, float] = field(default_factory=dict)  # per counting layer: KV heads per selection row
    _whole: set[int] = field(default_factory=set)  # layers that attend the whole context
    _folded: dict[object, torch.Tensor] = field(default_factory=dict)  # sums of totals of an earlier batch size
    _frozen: dict[object, torch.Tensor] = field(default_factory=dict)  # totals as of each row's last live step
    _kv_heads: int = 0
    _layers: int = 0

    def tally(self, layer_idx: int, seq_len: torch.Tensor, kv_heads: int, num_layers: int) -> Tally:
        """The tally that layer ``layer_idx``'s decode step counts into (``counted`` after the step); seq_len: (B,).
        Layer 0 also adds the step's context."""
        if layer_idx == 0:
            self._current("context", seq_len).rows(1).add_(seq_len.unsqueeze(1))
            self._kv_heads, self._layers = kv_heads, num_layers
            self.steps += 1
        self.rows += seq_len.shape[0] * kv_heads
        tally = self._current(layer_idx, seq_len)
        tally.used = False
        return tally

    def _current(self, key, seq_len: torch.Tensor) -> Tally:
        """The tally of ``key`` (a layer, or "context": (B, 1) sequence lengths) for the batch of seq_len (B,); one
        of an earlier batch size is folded into ``_folded`` first."""
        tally = self._tallies.get(key)
        if tally is None or tally.batch != seq_len.shape[0]:
            if tally is not None and tally.total is not None:
                total = self._frozen.pop(key, tally.total)
                self._folded[key] = self._folded.get(key, 0) + total.sum(dtype=torch.float64)
            tally = self._tallies[key] = Tally(seq_len.shape[0], seq_len.device)
        return tally

    def counted(self, layer_idx: int, tally: Tally, kv_heads: int) -> None:
        """Ends layer ``layer_idx``'s step: a tally left unused means the layer attended the whole context."""
        whole = not tally.used
        if self.steps > 1 and (layer_idx in self._whole) != whole:
            raise RuntimeError(f"layer {layer_idx} changed between attending the whole context and a selection")
        if whole:
            self._whole.add(layer_idx)
        else:
            self._weight[layer_idx] = kv_heads / tally.total.shape[1]

    def freeze(self, live: torch.Tensor) -> None:
        """Ends the counting of rows that have ended: after a step, live: (B,) bool says which rows that step
        belonged to; the totals of the others stay as they were at their last live step (in place, one kernel per
        counting layer, so that a captured step runs it). ``trim`` then says how many steps each row ran."""
        for key, tally in self._tallies.items():
            if tally.total is None:
                continue
            alive = live.view(-1, 1)
            frozen = self._frozen.get(key)
            if frozen is None or frozen.shape != tally.total.shape:
                self._frozen[key] = torch.where(alive, tally.total, 0)
            else:
                torch.where(alive, tally.total, frozen, out=frozen)

    def trim(self, steps: list[int]) -> None:
        """Counts each row's own decode steps, ``steps`` (B,) on the host, in place of the steps every row of the
        current batch ran since the statistics started (rows that ended early, see ``freeze``)."""
        ran = self.steps
        if ran and steps:
            self.rows = self.rows * sum(steps) // (ran * len(steps))
            self.steps = max(steps)

    def _sum(self, key, total: torch.Tensor | None) -> torch.Tensor:
        total = self._frozen.get(key, total)
        return self._folded.get(key, 0) + (0 if total is None else total.sum(dtype=torch.float64))

    @property
    def context(self) -> torch.Tensor | None:
        """The dense context of every step, layer and KV head (float64 on the device), None before any step."""
        if "context" not in self._tallies:
            return None
        return self._sum("context", self._tallies["context"].total) * (self._kv_heads * self._layers)

    @property
    def per_layer(self) -> dict[int, torch.Tensor]:
        """Tokens attended per layer, summed over steps, sequences and KV heads (float64 on the device)."""
        out = {layer: self._sum(layer, self._tallies[layer].total) * weight for layer, weight in self._weight.items()}
        if self._whole:
            whole = self._sum("context", self._tallies["context"].total) * self._kv_heads
            out.update(dict.fromkeys(self._whole, whole))
        return out

    def replayed(self, steps: int, rows_per_step: int) -> None:
        """Counts ``steps`` decode steps that ran as replays of a captured step of ``rows_per_step`` rows."""
        self.steps += steps
        self.rows += steps * rows_per_step

    def summary(self) -> dict:
        """Means per decode step and (layer, sequence, KV head): tokens attended, dense context, their ratio.
        Under tensor parallelism the means run over every process's heads: a collective, which every process of
        ``tp_group`` calls."""
        if not self.rows:
            return {"decode_steps": 0, "attended_per_head": 0.0, "context_per_head": 0.0, "fraction": 0.0}
        context = self.context
        sums = torch.stack([sum(self.per_layer.values()), context,
                            torch.tensor(float(self.rows), dtype=torch.float64, device=context.device)])
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

    def __init__(self, method: Method, stats: DecodeStats | None = None, sliding_window: int | None = None,
                 max_positions: int | None = None):
        self.pages = PagedKVCache(method.num_layers, method.config.page_size, method.max_pages,
                                  method.config.kv_dtype)
        self.method = method
        self.stats = stats if stats is not None else DecodeStats()
        self.sliding_window = sliding_window
        self.max_positions = max_positions
        self.columns = 0
        self.pending_mask: torch.Tensor | None = None
        self.prompt_end = True  # False while a chunked prompt has more chunks to come
        super().__init__(layers=[_PagedLayerView(self) for _ in range(method.num_layers)])

    @torch.compiler.disable  # a compiled model calls into the cache eagerly: its bookkeeping is Python
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
        if not self.pages.in_prompt and s > 1 and not self.method.accepts_chunks:
            raise ValueError(f"{self.method.config.name} takes one token per forward pass after the prompt, got {s}")
        self.pages.begin(s, mask, b, key_states.device, self.prompt_end)
        self.columns += s
        if self.max_positions is not None and max(self.pages.lengths) > self.max_positions:
            raise ValueError(f"context of {max(self.pages.lengths)} tokens exceeds the model's "
                             f"max_position_embeddings ({self.max_positions}); shorten the prompt or max_new_tokens")
        if self.sliding_window is not None and max(self.pages.lengths) > self.sliding_window:
            raise ValueError(f"context of {max(self.pages.lengths)} tokens exceeds the model's sliding window "
                             f"({self.sliding_window}); sparsekv supports full-attention models only")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def replayed(self, steps: int, rows_per_step: int) -> None:
        """Advances the host-side counters by ``steps`` decode steps that ran as replays of a captured step."""
        self.pages.advance(steps)
        self.columns += steps
        self.stats.replayed(steps, rows_per_step)

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
        self.pages = PagedKVCache(self.method.num_layers, self.method.config.page_size, self.method.max_pages,
                                  self.method.config.kv_dtype)
        self.columns = 0

    def held_bytes(self) -> int:
        """KV bytes of the tokens the pages hold (``PagedKVCache.held_bytes``)."""
        return self.pages.held_bytes()

    def resident_bytes(self) -> int:
        """KV bytes allocated on the cache's device: the pages with their growth room and metadata, plus the
        method's own state (e.g. OmniKV's subset buffers)."""
        return self.pages.resident_bytes() + self.method.resident_bytes()

    def offloaded_bytes(self) -> int:
        """KV bytes the method keeps in host memory instead (OmniKV with ``offload=True``)."""
        return self.method.offloaded_bytes()


# Where cuDNN's kernel runs, a prompt pass's keys and queries are cut and padded to multiples of this many tokens
# before they reach it, so that prompts of any length meet a few shapes: cuDNN builds an execution plan for each
# new shape (65 ms on the H200), which every chunk of every new prompt length would otherwise pay.
PLAN_STEP = 2048


@functools.cache
def _cudnn_attention(device: torch.device) -> bool:
    """Whether prompt attention on ``device`` runs cuDNN's kernel: on Hopper GPUs, where it measured 1.8x torch's
    FlashAttention-2 (``docs/kernels.md``); elsewhere FlashAttention-2."""
    return (torch.backends.cudnn.is_available() and torch.backends.cudnn.version() >= 90000
            and torch.cuda.get_device_capability(device)[0] == 9)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence with its log-sum-exp, through a vendor kernel (no weights materialised): cuDNN's
    on Hopper GPUs, FlashAttention-2 on other GPUs (memory-efficient attention for float32), PyTorch's flash
    attention on the CPU. q: (1, H, S, D); k, v: (1, Hkv, T, D), H a multiple of Hkv (each group of query heads
    reads its KV head, nothing copied); ``causal``: query i sees keys 0..i (S == T). Returns out (1, H, S, D) in
    q's dtype and lse (1, H, S) in the accumulation dtype (float32; float64 for float64 queries)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention_lse takes as many keys as queries, got {k.shape[2]} and {q.shape[2]}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if _cudnn_attention(q.device):
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                          scale=scale)[:2]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                          scale=scale)[:2]
    elif q.is_cuda:  # memory-efficient attention reads one KV head per query head
        g = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, True, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.reshape(*lse.shape[:2], -1)[..., :q.shape[2]].to(kernels.reference.acc_dtype(q.dtype))


def _plan_step(q: torch.Tensor) -> int:
    """``PLAN_STEP`` for queries q that cuDNN's kernel attends (``attention_lse``), 1 (nothing padded) for others."""
    half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    return PLAN_STEP if half and _cudnn_attention(q.device) else 1


def _padded(x: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """x (1, H, S, D) at columns ``start .. start + S - 1`` of zeros (1, H, width, D) in x's dtype."""
    out = x.new_zeros(*x.shape[:2], width, x.shape[3])
    out[:, :, start:start + x.shape[2]] = x
    return out


def _plan_width(n: int, step: int) -> int:
    return -(-n // step) * step


def prompt_plans(most_tokens: int, max_context: int, step: int = PLAN_STEP) -> list[tuple[int, int, bool]]:
    """The (queries, keys, causal) of every ``attention_lse`` call that ``prompt_attention`` makes for passes of 1 to
    ``most_tokens`` tokens of prompts of at most ``max_context`` tokens, cut by ``step``: the causal square of a
    pass's width (its tokens after the split, padded), and the pass's queries (padded) over every split before it.
    In shared pages their tensors are contiguous, so that these shapes are all cuDNN's plans see."""
    own = [(w, w, True) for w in range(step, _plan_width(min(step - 1 + most_tokens, max_context), step) + 1, step)]
    before = [(w, split, False) for split in range(step, max_context, step)
              for w in range(step, _plan_width(min(most_tokens, max_context - split), step) + 1, step)]
    return own + before


def build_prompt_plans(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                       scale: float, most_tokens: int, max_context: int) -> int:
    """Runs ``attention_lse`` once on zeros of every shape of ``prompt_plans`` where cuDNN attends (``_plan_step``),
    so that the passes find its execution plans built (55-70 ms each on the H200; PyTorch keeps them per thread:
    call this from the thread that runs the passes). Returns the count of shapes run (0 where cuDNN does not
    attend)."""
    probe = torch.empty(0, dtype=dtype, device=device)
    step = _plan_step(probe)
    if step == 1:
        return 0
    shapes = prompt_plans(most_tokens, max_context, step)
    # Each shape a contiguous view of one buffer: tensors of every size would each leave a block in PyTorch's cache
    # (the serving run at 128K peaked 10 GiB over its budget so).
    q = torch.zeros(heads * max(s[0] for s in shapes) * head_dim, dtype=dtype, device=device)
    kv = torch.zeros(kv_heads * max(s[1] for s in shapes) * head_dim, dtype=dtype, device=device)
    for queries, keys, causal in shapes:
        k = kv[:kv_heads * keys * head_dim].view(1, kv_heads, keys, head_dim)
        attention_lse(q[:heads * queries * head_dim].view(1, heads, queries, head_dim), k, k, causal, scale)
    return len(shapes)


def prompt_attention(q: torch.Tensor, layer: PagedLayer, plan: AppendPlan, scale: float) -> torch.Tensor:
    """Dense causal attention of a prompt pass (the whole prompt or one chunk of it) over the sequence so far.

    q: (B, H, S, D), the pass's queries; the pass's keys are already stored in ``layer``, where during the prompt
    slot j holds page j, so a row's first n tokens are its first n (``PagedLayer.row_tokens``: views, or gathered
    through the page table in shared pages). Each row runs on its own (its real queries are the last
    ``new_len - prev_len`` columns, or the first ones of a right-padded prompt) in two parts merged by their
    log-sum-exp: the keys before ``split`` (the pass's first position, cut to a multiple of ``PLAN_STEP`` where
    cuDNN attends: ``_plan_step``), which every query sees, and the rest causally, as the square of queries and
    keys from ``split`` on whose queries before the pass are zeros, not read. Both are padded with zeros to
    multiples of that step (queries past the pass, keys past its end: no real query sees them), so that their
    shapes repeat across prompts (``prompt_plans``). Peak memory is one chunk's (in shared pages, one row's keys and
    values of one layer besides: gathered, or a contiguous copy), whatever the context. Padding queries give zeros.
    Returns out (B, H, S, D) and each query's log-sum-exp (B, H, S) in the accumulation dtype (natural log; 0 at
    padding), which methods that weigh tokens by the prompt's attention reuse (``Method.prefill_chunk``)."""
    out = torch.zeros_like(q)
    lse_out = q.new_zeros(q.shape[:3], dtype=kernels.reference.acc_dtype(q.dtype))
    step = _plan_step(q)
    for row, (prev, new) in enumerate(zip(plan.prev_len, plan.new_len)):
        n = new - prev
        if n == 0:
            continue
        cols = plan.valid[row].nonzero().squeeze(1) if n != q.shape[2] else slice(None)
        qr = q[row:row + 1, :, cols]  # (1, H, n, D)
        split = prev // step * step
        lead, width = prev - split, _plan_width(new - split, step)
        keys, values = layer.row_tokens(row, new, split)
        own, lse = attention_lse(_padded(qr, lead, width), _padded(keys.to(q.dtype), 0, width),
                                 _padded(values.to(q.dtype), 0, width), True, scale)
        own, lse = own[:, :, lead:lead + n], lse[:, :, lead:lead + n]
        if split:
            keys, values = (t.to(q.dtype) for t in layer.row_tokens(row, split))
            if layer.shared is not None:  # contiguous, as gathered ones are: cuDNN keys its plans by strides too, and
                keys, values = keys.contiguous(), values.contiguous()  # those of ``prompt_plans`` are built ahead
            before, lse_before = attention_lse(_padded(qr, 0, _plan_width(n, step)), keys, values, False, scale)
            own, lse = kernels.merge_lse(own, lse, before[:, :, :n], lse_before[:, :, :n])
        out[row:row + 1, :, cols] = own
        lse_out[row:row + 1, :, cols] = lse
    return out, lse_out


@torch.compiler.disable  # a compiled model (Engine(compile=True)) runs the method eagerly, between compiled parts
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
    if plan.prompt:
        out, lse = prompt_attention(query, layer, plan, scale)
        cache.method.prefill_chunk(module.layer_idx, query, layer, plan, scale, lse)
        if plan.prompt_end:
            cache.method.prefill(module.layer_idx, query, layer, plan, scale)
    elif query.shape[2] > 1:
        # A chunk after the prompt (e.g. a question appended at once) is attended densely, like a prefill.
        out = kernels.attend(query, layer.k, layer.v, layer.slot_page, all_slots(layer), plan.position, scale)
    else:
        tally = cache.stats.tally(module.layer_idx, pages.seq_len, key.shape[1], len(pages.layers))
        out = cache.method.decode(module.layer_idx, query[:, :, 0], layer, pages.seq_len, scale, tally).unsqueeze(2)
        cache.stats.counted(module.layer_idx, tally, key.shape[1])
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, sparsekv_attention)


def cache_argument(module: torch.nn.Module) -> str:
    """The name of the KV-cache argument of ``module``'s forward (a decoder or a decoder layer), read from its
    signature: transformers 5.24 renamed ``past_key_values`` to ``cache``. The old name is still accepted there,
    deprecated, but where both are given the model uses ``cache``, so the cache is passed under the declared name."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


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
    max_positions: int | None = None  # the model's max_position_embeddings: a longer context is refused

    def new_cache(self, sliding_window: int | None) -> SparseKVCache:
        self.cache = SparseKVCache(self.method, self.stats, sliding_window, self.max_positions)
        return self.cache


@contextmanager
def apply(model, config: MethodConfig) -> Iterator[Session]:
    """Runs ``config``'s method in every forward pass and ``generate`` of ``model`` inside the ``with`` block.

    On exit the attention implementation and hooks are restored, so the model is exactly dense again.
    """
    if not isinstance(config, MethodConfig):
        raise TypeError(f"config must be a sparsekv method config (e.g. QuestConfig), got {type(config).__name__}")
    _check_model(model)
    if model.config._attn_implementation == ATTENTION_NAME:
        raise ValueError("sparsekv.apply is already active on this model: nested apply is not supported; leave the "
                         "outer with-block before applying another config")
    decoder = model.get_decoder()
    method = config.build(model.config.num_hidden_layers)
    method.tp_group = parallel.head_group(model)
    session = Session(method, DecodeStats(tp_group=method.tp_group),
                      max_positions=getattr(model.config, "max_position_embeddings", None))
    window = _sliding_window(model.config)
    params = list(inspect.signature(decoder.forward).parameters)
    cache_arg = cache_argument(decoder)

    def pre_hook(module, args, kwargs):
        kwargs = dict(kwargs, **dict(zip(params, args)))
        use_cache = kwargs.get("use_cache")
        if use_cache is False or (use_cache is None and getattr(module.config, "use_cache", True) is False):
            # Without a cache every generation step would be a dense prefill of the whole sequence.
            raise ValueError("use_cache=False: sparsekv runs every pass through its cache; call with use_cache=True "
                             "(set model.config.use_cache = True)")
        # The caller's cache, under the decoder's name for it or the deprecated one (``cache_argument``).
        given = [kwargs.pop(name) for name in ("cache", "past_key_values") if name in kwargs]
        cache = next((c for c in given if c is not None), None)
        if not isinstance(cache, SparseKVCache) or cache.method is not method:
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(f"{cache_arg} already holds tokens from another cache; start the sequence "
                                 "inside sparsekv.apply")
            cache = session.new_cache(window)
        session.cache = cache
        cache.pending_mask = kwargs.get("attention_mask")
        kwargs[cache_arg] = cache
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
