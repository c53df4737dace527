"""OmniKV: dynamic context selection without token dropping (Hao et al., ICLR 2025).

The tokens that matter to a decode step are much the same across neighbouring layers. A few *filter layers* attend
to the full context and pick the prompt tokens that matter; the layers above them reuse that choice. A filter layer
scores each prompt token over an observation window of its most recent queries (the prompt's last ones, then each
decode step's): the score is ``sum_j alpha_j * max_h softmax_h,j(token)``, the softmax of query j (head h) running
over the prompt tokens it can see. ``selector`` sets alpha: "last" (only the newest query), "uniform" (1) or
"exponential" (``2 ** (j - |w|)``: each older query counts half as much). The ``token_budget`` prompt tokens with
the highest scores are chosen afresh at every step, one set per sequence shared by all heads; tokens generated
during decoding are always attended. Layers below the first filter layer and the ``wait_layers`` after each filter
layer attend fully; every other layer attends to the choice of the nearest filter layer below it plus all decode
tokens. Nothing is evicted: a token passed over now can be chosen at the next step.

``offload=True`` keeps the sparse layers' prompt KV in host memory after the prompt (``HostKVStore``): at each
filter layer the chosen tokens of every sparse layer of its group are gathered to the device as packed segments
(one per token, all layers of the group) by one asynchronous gather while the wait layers run. The device then
holds the fully attending layers' KV, the decode tokens and the subset buffers. Both modes run the same attention
(chosen subset merged with the decode tokens), so they give the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import kernels, parallel
from ..cache.host_store import HostKVStore, require_host
from .base import DEVICE_MARGIN, Method, MethodConfig, all_slots, attend_all, most_tokens, require

SELECTORS = ("last", "uniform", "exponential")
PAPER_LAYERS = 32
PAPER_FILTER_LAYERS = (2, 8, 18)  # Llama-3-8B (32 layers) in the paper


@dataclass(frozen=True, kw_only=True)
class OmniKVConfig(MethodConfig):
    """token_budget: prompt tokens the sparse layers attend per step (an int >= 1), or a fraction (0, 1] of each
    prompt's length (a float); decode tokens come on top. filter_layers: strictly increasing layer indices (None:
    the paper's {2, 8, 18} scaled from 32 layers to the model's). selector: "last", "uniform" or "exponential".
    window: queries in the observation window ("last" uses only the newest). wait_layers: fully attending layers
    after each filter layer. offload: keep the sparse layers' prompt KV in host memory. device_layers (with
    offload): sparse layers whose prompt KV stays on the device, the lowest ones; None: as many as the device's free
    memory holds once the prompt is in (on CUDA; elsewhere none), and in a serving pool as many as its rows leave room
    for (``pool_configs``)."""

    token_budget: int | float = 2048
    filter_layers: tuple[int, ...] | None = None
    selector: str = "last"
    window: int = 16
    wait_layers: int = 1
    offload: bool = False
    device_layers: int | None = None

    def __post_init__(self):
        super().__post_init__()
        budget = self.token_budget
        if isinstance(budget, float):
            require(0 < budget <= 1, "token_budget", "an int >= 1 (tokens) or a float in (0, 1] (fraction of the "
                                                     "prompt)", budget)
        else:
            require(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1, "token_budget",
                    "an int >= 1 (tokens) or a float in (0, 1] (fraction of the prompt)", budget)
        if self.filter_layers is not None:
            layers = self.filter_layers
            require(isinstance(layers, (tuple, list)) and len(layers) > 0
                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
                    and all(a < b for a, b in zip(layers, layers[1:])),
                    "filter_layers", "a non-empty, strictly increasing sequence of layer indices >= 0", layers)
            object.__setattr__(self, "filter_layers", tuple(layers))
        require(self.selector in SELECTORS, "selector", f"one of {', '.join(SELECTORS)}", self.selector)
        require(isinstance(self.window, int) and not isinstance(self.window, bool) and self.window >= 1,
                "window", "an int >= 1", self.window)
        require(isinstance(self.wait_layers, int) and not isinstance(self.wait_layers, bool)
                and self.wait_layers >= 0, "wait_layers", "an int >= 0", self.wait_layers)
        require(isinstance(self.offload, bool), "offload", "True or False", self.offload)
        require(self.device_layers is None or (isinstance(self.device_layers, int)
                                               and not isinstance(self.device_layers, bool)
                                               and self.device_layers >= 0),
                "device_layers", "None (as many as fit) or an int >= 0", self.device_layers)

    def layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The filter layers of a model of ``num_layers`` layers."""
        if self.filter_layers is not None:
            require(self.filter_layers[-1] < num_layers, "filter_layers",
                    f"layer indices below the model's {num_layers} layers", self.filter_layers)
            return self.filter_layers
        return tuple(sorted({min(round(i * num_layers / PAPER_LAYERS), num_layers - 1) for i in PAPER_FILTER_LAYERS}))

    def check_model(self, num_layers: int) -> None:
        self.layers_for(num_layers)

    def method_class(self):
        return OmniKV


def prompt_budget(budget: int | float, prompt: int) -> int:
    """Prompt tokens a sparse layer attends for a prompt of ``prompt`` tokens: ``budget`` tokens, or a float
    fraction of the prompt rounded down (``int(fraction * prompt)``, as the official code does), at most the
    prompt."""
    return min(prompt, int(budget * prompt) if isinstance(budget, float) else budget)


def selector_weights(selector: str, window: int, device=None) -> torch.Tensor:
    """alpha_j for the window entries, oldest first: (W,) with W = 1 for "last"."""
    if selector == "last":
        return torch.ones(1, device=device)
    if selector == "uniform":
        return torch.ones(window, device=device)
    return 2.0 ** torch.arange(1 - window, 1, device=device, dtype=torch.float32)


def top_tokens(scores: torch.Tensor, per_row: torch.Tensor | None, width: int) -> torch.Tensor:
    """The ``per_row[b]`` highest-scoring tokens of each row, ascending. scores: (B, N), -inf for non-candidates;
    per_row: (B,) int64 <= width, None when every row takes ``width``. Returns (B, width) int64 indices, -1 in the
    unused places (which come first)."""
    b, n = scores.shape
    # Ranking the top tokens by score costs a sort (22 us of a 128K row on the H200): only for rows that take fewer.
    top, idx = scores.topk(width, dim=1, sorted=per_row is not None)
    keep = top > float("-inf")
    if per_row is not None:
        keep &= torch.arange(width, device=scores.device) < per_row.unsqueeze(1)
    # Ascending by marking the kept tokens and counting the marks, in place of a sort of the indices (a 64-bit
    # radix sort, 30 us for 2K indices): a kept token's place is the marks up to it, after the row's unused places.
    marks = scores.new_zeros((b, n + 1), dtype=torch.int32).scatter_(1, torch.where(keep, idx, n), 1)[:, :n]
    place = marks.cumsum(dim=1, dtype=torch.int32) + (width - 1 - keep.sum(dim=1, dtype=torch.int32)).unsqueeze(1)
    out = torch.full((b, width + 1), -1, dtype=torch.long, device=scores.device)
    tokens = torch.arange(n, device=scores.device).expand(b, n)
    return out.scatter_(1, torch.where(marks > 0, place.long(), width), tokens)[:, :width]


class OmniKV(Method):
    """Layer roles: "dense" (below the first filter layer, or a wait layer), "filter", "sparse" (``source[i]``, the
    nearest filter layer below). State per prompt, per filter layer f: ``window_q[f]`` (B, H, W, D) and
    ``window_pos[f]`` (B, W) (-1 = empty), ``tokens[f]`` (B, K) the positions chosen at the latest step. A sparse
    layer whose prompt is on the device attends once over its group's choice and decode tokens; an offloaded one
    attends to the fetched choice and to its decode tokens, and merges the two."""

    config: OmniKVConfig
    accepts_chunks = False
    row_moves = False  # the offloaded layers' host store is not part of a row's copy
    sized_by_decode_tokens = True

    @property
    def prefix_reuse(self) -> bool:
        return not self.config.offload  # offloaded layers move their prompt to the host store at its end

    answer_reuse = prefix_reuse

    def __init__(self, config: OmniKVConfig, num_layers: int):
        super().__init__(config, num_layers)
        self.filters = config.layers_for(num_layers)
        self.role: list[str] = []
        self.source: list[int | None] = []
        for i in range(num_layers):
            f = max((x for x in self.filters if x <= i), default=None)
            sparse = f is not None and i - f > config.wait_layers
            self.role.append("filter" if i == f else "sparse" if sparse else "dense")
            self.source.append(f if sparse else None)
        self.group = {f: [i for i in range(num_layers) if self.source[i] == f] for f in self.filters}
        self.width = 1 if config.selector == "last" else config.window
        self.window_q: dict[int, torch.Tensor] = {}
        self.window_pos: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        # (f, room) -> this step's token list (B, 1, K + room) and its count (B, 1), shared by the group's layers
        # that keep their prompt on the device
        self.listed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.stores: dict[int, HostKVStore] = {}
        self.decode_start: dict[int, torch.Tensor] = {}  # sparse layer -> (B,) flat index of the first decode token
        self.first_decode: dict[int, int] = {}  # sparse layer -> the smallest of those, on the host
        self.offloaded: set[int] = set()  # sparse layers whose prompt KV is in host memory
        self.prompt_len: torch.Tensor | None = None
        self.per_row: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.k_max = 0
        self.full_rows = False  # every row takes k_max tokens

    def source_filter(self, layer_idx: int) -> int | None:
        """The filter layer whose choice layer ``layer_idx`` attends to, or None for a fully attending layer."""
        return self.source[layer_idx]

    def min_prompt_chunk(self):
        return self.width

    def prefill(self, layer_idx, q, layer, plan, scale):
        device = layer.k.device
        if layer_idx == 0:
            budget = self.config.token_budget
            lengths = plan.new_len
            rows = [prompt_budget(budget, n) for n in lengths]
            self.prompt_len = torch.tensor(lengths, device=device)
            self.per_row = torch.tensor(rows, device=device)
            self.k_max = max(max(rows), 1)
            self.full_rows = min(rows) == self.k_max
            self.weight = selector_weights(self.config.selector, self.width, device)
            self.stores.clear()
            self.tokens.clear()
            self.listed.clear()
            self.offloaded = self._placement(layer, lengths) if self.config.offload else set()
        role = self.role[layer_idx]
        if role == "filter":
            self._start_window(layer_idx, q, plan.position)
        elif role == "sparse":
            start = [0] * len(plan.new_len)
            if layer_idx in self.offloaded:
                start = self._offload(layer_idx, layer, plan.new_len)
            self.decode_start[layer_idx] = self.prompt_len - torch.tensor(start, device=device)
            self.first_decode[layer_idx] = min(n - s for n, s in zip(plan.new_len, start))

    def _start_window(self, f: int, q: torch.Tensor, position: torch.Tensor) -> None:
        """The prompt's last ``width`` queries of each sequence, oldest first, empty entries in front, and an empty
        choice of tokens: the state a decode step updates in place."""
        b, h, s, d = q.shape
        w = min(self.width, s)
        pos, col = position.topk(w, dim=1)
        pos, col = pos.flip(1), col.flip(1)
        wq = q.gather(2, col.view(b, 1, w, 1).expand(b, h, w, d))
        pad = self.width - w
        self.window_q[f] = torch.cat([wq.new_zeros(b, h, pad, d), wq], dim=2)
        self.window_pos[f] = torch.cat([pos.new_full((b, pad), -1), pos], dim=1)
        self.tokens[f] = torch.full((b, self.k_max), -1, dtype=torch.long, device=q.device)

    def _placement(self, layer, lengths: list[int]) -> set[int]:
        """The sparse layers whose prompt KV goes to host memory: all but the lowest ``device_layers``, or, with
        None on CUDA, all but as many as the free device memory holds after the fully attending layers' prompts and
        one sparse layer's in flight (the prefill runs layer by layer), less a margin for the decode steps."""
        sparse = [i for i, role in enumerate(self.role) if role == "sparse"]
        b, h, _, d = layer.shape
        keep = self.config.device_layers
        if keep is None:
            keep = 0
            if layer.k.is_cuda:
                per_layer = 2 * b * h * max(lengths) * d * layer.k.element_size()
                full = sum(role != "sparse" for role in self.role) - 1  # layer 0's prompt is stored already
                free = torch.cuda.mem_get_info(layer.k.device)[0] - (full + 1) * per_layer - DEVICE_MARGIN
                keep = max(0, free // per_layer)
        offloaded = set(sparse[keep:])
        # All of the host stores at once, before the first is allocated: a context that does not fit is refused
        # before any host memory is taken.
        require_host(len(offloaded), b, h, max(lengths), d, layer.k.dtype)
        return offloaded

    def _stored(self, f: int) -> list[int]:
        """The layers of filter layer ``f``'s group in its host store, in store order."""
        return [i for i in self.group[f] if i in self.offloaded]

    def _offload(self, layer_idx: int, layer, lengths: list[int]) -> list[int]:
        """Moves the layer's prompt KV to its group's host store and drops its full prompt pages from the device.
        Returns the position of each sequence's first token still on the device."""
        f = self.source[layer_idx]
        group = self._stored(f)
        b, h, _, d = layer.shape
        t = max(lengths)
        if f not in self.stores:
            self.stores[f] = HostKVStore(len(group), b, h, t, d, self.k_max, layer.k.dtype, layer.k.device)
        self.stores[f].put(group.index(layer_idx), layer.k.flatten(2, 3)[:, :, :t], layer.v.flatten(2, 3)[:, :, :t])
        full_pages = [n // layer.page_size for n in lengths]
        full = torch.tensor(full_pages, device=layer.k.device)
        held = layer.slot_page[:, :, :layer.capacity]  # slot j holds page j: nothing was evicted
        layer.free(all_slots(layer)[:, :, :layer.capacity], (held >= 0) & (held < full.view(-1, 1, 1)))
        layer.dropped = full_pages
        held_pages = max(-(-n // layer.page_size) - f for n, f in zip(lengths, full_pages))
        layer.compact(min(held_pages + 1, layer.capacity))  # room for the next page without growing
        return [n * layer.page_size for n in full_pages]

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        if self.role[layer_idx] != "sparse":  # filter and dense layers hold the whole context
            out = attend_all(q, layer, seq_len, scale)
            if self.role[layer_idx] == "filter":
                self._choose(layer_idx, q, layer, seq_len, scale)
            return out
        f = self.source[layer_idx]
        chosen = self.tokens[f]  # (B, K) positions
        k_flat, v_flat = layer.k.flatten(2, 3), layer.v.flatten(2, 3)
        width = k_flat.shape[2] - self.first_decode[layer_idx]
        if layer_idx not in self.offloaded:
            # The chosen and the decode tokens are positions of one store: one attention over both, and one list
            # for every such layer of the group (their decode tokens sit after the whole prompt alike), built by
            # the first of them.
            if (f, width) not in self.listed:
                decoded, attended = self._decoded(layer_idx, chosen, seq_len, width)
                self.listed[f, width] = torch.cat([chosen, decoded], dim=1).unsqueeze(1), attended
            listed, attended = self.listed[f, width]
            tally.rows(1).add_(attended)
            out, _ = kernels.sparse_decode_tokens(q, k_flat, v_flat, listed, scale)
            return out.to(q.dtype)
        decoded, attended = self._decoded(layer_idx, chosen, seq_len, width)
        tally.rows(1).add_(attended)
        k_sub, v_sub = self.stores[f].layer(self._stored(f).index(layer_idx))
        sub = torch.where(chosen >= 0, torch.arange(chosen.shape[1], device=chosen.device), -1)
        parts = [kernels.sparse_decode_tokens(q, k_sub, v_sub, sub.unsqueeze(1), scale),
                 kernels.sparse_decode_tokens(q, k_flat, v_flat, decoded.unsqueeze(1), scale)]
        return kernels.merge_attention(parts, q.dtype)

    def _decoded(self, layer_idx: int, chosen: torch.Tensor, seq_len: torch.Tensor,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat-store indices (B, width) of the layer's decode tokens, -1 where not written yet, and the tokens
        attended per row (B, 1) with the choice ``chosen`` (B, K). Decode tokens sit after the prompt in the flat
        store; the list has the width of the room the layer has for them (fixed while the layer does not grow, so a
        captured step reads a fixed shape)."""
        n_dec = (seq_len - self.prompt_len).unsqueeze(1)  # (B, 1)
        room = torch.arange(width, device=chosen.device)
        decoded = torch.where(room < n_dec, self.decode_start[layer_idx].unsqueeze(1) + room, -1)
        return decoded, (chosen >= 0).sum(dim=1, keepdim=True) + n_dec

    def _choose(self, f: int, q: torch.Tensor, layer, seq_len: torch.Tensor, scale: float) -> None:
        """Slides the window over the step's query and chooses the step's prompt tokens for the group of ``f``."""
        # The state is updated in place: a captured step reads and writes it at the same addresses every replay.
        wq, wpos = self.window_q[f], self.window_pos[f]
        wq.copy_(torch.cat([wq[:, :, 1:], q.unsqueeze(2).to(wq.dtype)], dim=2))
        wpos.copy_(torch.cat([wpos[:, 1:], (seq_len - 1).unsqueeze(1)], dim=1))
        # The layer never evicts, so its flat token index is the position and every KV head holds the same tokens.
        key_pos = layer.token_position()[:, 0].flatten(1)
        maxima = kernels.window_token_maxima(wq, layer.k.flatten(2, 3), key_pos, wpos, self.prompt_len, scale)
        # The max over heads spans every process's heads, and comes before the window's weighted sum.
        scores = kernels.weigh_window(parallel.all_reduce_max(maxima, self.tp_group), self.weight)
        self.tokens[f].copy_(top_tokens(scores, None if self.full_rows else self.per_row, self.k_max))
        for key in [key for key in self.listed if key[0] == f]:
            del self.listed[key]  # built again from this step's choice
        if f in self.stores:
            self.stores[f].fetch(self.tokens[f])

    def _sparse(self) -> list[int]:
        return [i for i, role in enumerate(self.role) if role == "sparse"]

    def _pool_offloaded(self) -> set[int]:
        """The sparse layers a pool keeps in host memory: all but the lowest ``device_layers`` (the pool's runner
        resolves None: ``pool_configs``)."""
        return set(self._sparse()[self.config.device_layers or 0:]) if self.config.offload else set()

    def pool_configs(self):
        # device_layers=None leaves the split to the pool: every count of sparse layers kept on the device, most first.
        if not self.config.offload or self.config.device_layers is not None:
            return [self.config]
        return [replace(self.config, device_layers=n) for n in range(len(self._sparse()), -1, -1)]

    def pool_pages(self, max_context, max_new_tokens, max_prompt_tokens):
        # An offloaded layer's row holds the prompt's last partial page (moved to the row's first slot when the
        # prompt went to the host) and the decode tokens: at most page_size - 1 + max_new_tokens tokens, and never
        # more than the whole context.
        page = self.config.page_size
        full = -(-most_tokens(max_context, max_new_tokens, max_prompt_tokens) // page)
        offloaded = self._pool_offloaded()
        return [min(-(-(page - 1 + max_new_tokens) // page), full) if i in offloaded else full
                for i in range(self.num_layers)]

    def prefill_device_tokens(self, max_context):
        # Layer by layer: an offloaded layer's prompt leaves the device at its last chunk, so one is there at a time.
        offloaded = len(self._pool_offloaded())
        return max_context * (self.num_layers - offloaded + min(offloaded, 1))

    def pool_host_tokens(self, max_context):
        return max_context * len(self._pool_offloaded())

    def start_pool(self, layers, max_context):
        # Every row takes up to the pool's widest choice (its own ``per_row``), and lists its decode tokens over
        # the whole store: fixed shapes whatever the rows' prompts.
        b, h, _, d = layers[0].shape
        device = layers[0].k.device
        self.max_context = max_context
        self.k_max = max(prompt_budget(self.config.token_budget, max_context), 1)
        self.full_rows = False
        self.prompt_len = torch.zeros(b, dtype=torch.long, device=device)
        self.per_row = torch.zeros(b, dtype=torch.long, device=device)
        self.weight = selector_weights(self.config.selector, self.width, device)
        self.tokens = {f: torch.full((b, self.k_max), -1, dtype=torch.long, device=device) for f in self.filters}
        self.window_pos = {f: torch.full((b, self.width), -1, dtype=torch.long, device=device) for f in self.filters}
        self.window_q.clear()  # (B, H, W, D), made at the first row's copy (H: the query heads)
        sparse = self._sparse()
        self.offloaded = self._pool_offloaded()
        self.store_tokens = {i: (layers[i].capacity + 1) * layers[i].page_size for i in sparse}
        for i in sparse:
            self.decode_start[i] = torch.zeros(b, dtype=torch.long, device=device)
            self.first_decode[i] = 0
            if i in self.offloaded:
                layers[i].has_holes = True  # a row's full prompt pages are dropped before it joins
        self.stores = {f: HostKVStore(len(self._stored(f)), b, h, max_context, d, self.k_max, layers[0].k.dtype,
                                      device) for f in self.filters if self._stored(f)}

    def request_config(self):
        if not self.config.offload:
            return self.config
        return replace(self.config, device_layers=len(self._sparse()) - len(self.offloaded))

    def copy_row(self, row, source, source_row, prompt_len):
        self.prompt_len[row] = source.prompt_len[source_row]
        self.per_row[row] = source.per_row[source_row]
        for f in self.filters:
            if f not in self.window_q:
                _, h, w, d = source.window_q[f].shape
                self.window_q[f] = source.window_q[f].new_zeros(self.prompt_len.shape[0], h, w, d)
            self.window_q[f][row] = source.window_q[f][source_row]
            self.window_pos[f][row] = source.window_pos[f][source_row]
            self.tokens[f][row] = -1  # chosen again at the next step, before any layer reads it
        for i in self._sparse():
            self.decode_start[i][row] = source.decode_start[i][source_row]
        for f, store in self.stores.items():
            store.host[row, :prompt_len].copy_(source.stores[f].host[source_row, :prompt_len])

    def rows(self, n, decode_tokens):
        view = super().rows(n, decode_tokens)
        # Each sparse layer lists the room of the rows' decode tokens, not its whole store.
        view.first_decode = {i: max(0, size - decode_tokens) for i, size in self.store_tokens.items()}
        view.prompt_len, view.per_row = self.prompt_len[:n], self.per_row[:n]
        view.window_q = {f: t[:n] for f, t in self.window_q.items()}
        view.window_pos = {f: t[:n] for f, t in self.window_pos.items()}
        view.tokens = {f: t[:n] for f, t in self.tokens.items()}
        view.decode_start = {i: t[:n] for i, t in self.decode_start.items()}
        view.stores = {f: store.rows(n) for f, store in self.stores.items()}
        view.listed = {}
        return view

    def held_tokens(self, prompt_len, total):
        on_host = prompt_len // self.config.page_size * self.config.page_size
        return total * self.num_layers - on_host * len(self.offloaded)

    def host_tokens(self, prompt_len):
        return prompt_len * len(self.offloaded)

    def reorder(self, index):
        if self.prompt_len is None:
            return
        for state in (self.window_q, self.window_pos, self.tokens, self.decode_start):
            for key, t in state.items():
                state[key] = t.index_select(0, index.to(t.device))
        self.prompt_len = self.prompt_len.index_select(0, index.to(self.prompt_len.device))
        self.per_row = self.per_row.index_select(0, index.to(self.per_row.device))
        for store in self.stores.values():
            store.reorder(index)  # the next step's filter layers fetch again

    def resident_bytes(self):
        state = [*self.window_q.values(), *self.window_pos.values(), *self.tokens.values()]
        return (sum(t.numel() * t.element_size() for t in state)
                + sum(store.device_bytes() for store in self.stores.values()))

    def offloaded_bytes(self):
        return sum(store.host_bytes() for store in self.stores.values())

    def release(self):
        self.stores.clear()
