"""Paged KV storage with per-page key bounds.

Every (layer, sequence, KV head) owns a row of page *slots*. A slot holds one logical page: page ``j`` of a
sequence covers its token positions ``[j * page_size, (j + 1) * page_size)``, counted from the sequence's first
real token (left padding is never stored). ``slot_page`` is the page table read backwards: it says which logical
page each slot holds, or -1 when the slot is free. Without eviction slot ``j`` simply holds page ``j``; a method
that evicts frees slots (``PagedLayer.free``) and the next new page takes the lowest free one, so memory stops
growing once the method caps the slot count (``PagedKVCache.max_pages``).

Keys are stored after RoPE, exactly as the model attends to them, and every slot keeps the channel-wise min and
max of its keys, updated on every append (prefill and decode alike, the last partial page included). With
``kv_dtype="fp8"`` keys, values and bounds are float8_e4m3fn, unscaled (saturated at +-448); the bounds are the min
and max of the stored (quantized) keys, which fp8 holds exactly, so Quest's bound stays a bound of what is attended.

One extra *scratch* slot at the end of each row receives the padding tokens of a batch, so that appends are a
single scatter with a fixed shape; it never holds a page and is never attended.

A serving pool's rows may instead keep their pages in *shared pages* (``SharedPages``): one store of N pages per
layer for all rows (keys, values and bounds), and a page table per row naming the store page of each of its slots,
so that a row holds the memory of its own request's tokens rather than of the longest request's. ``slot_page`` and
``cur_slot`` stay per row; the kernels read the store through the table (``PagedLayer.attend``, Quest's page
scores), the decode append writes through it (``kernels.append_token``'s ``table``), and so do a prompt's passes,
through a table of one row beside the pool's (``SharedPages.beside``, ``PagedLayer.beside``), whose pages the
request's row then takes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels.reference import gather, raw
from ..errors import ConfigError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Storage of the keys, values and page bounds: "auto" the model's dtype, "fp8" float8_e4m3fn (1 byte per element).
KV_DTYPES = {"auto": None, "fp8": kernels.reference.FP8}
KV_DTYPE_HELP = ("storage of keys, values and page bounds: auto (the model's dtype) or fp8 (float8_e4m3fn, 1 byte "
                 "per element; default: auto)")


def storage_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a cache of ``kv_dtype`` for a model computing in ``dtype``."""
    return KV_DTYPES[kv_dtype] or dtype


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ConfigError("kv_dtype", " or ".join(map(repr, KV_DTYPES)), kv_dtype)


def bound_fill(dtype: torch.dtype, upper: bool) -> float:
    """The bound of a slot without keys: +inf for the min, -inf for the max; fp8 has no infinity, and its largest
    finite magnitude bounds every stored key (``to_cache`` saturates there)."""
    big = kernels.reference.FP8_MAX if dtype == kernels.reference.FP8 else float("inf")
    return -big if upper else big


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size < 1 or page_size > 256 or page_size & (page_size - 1):
        raise ConfigError("page_size", "a power of two from 1 to 256", page_size)


@dataclass
class AppendPlan:
    """Where the tokens of one forward pass go; shared by all layers of that pass.

    valid: (B, S) bool, True for real tokens (False for padding).
    position: (B, S) int64, position of each new token in its sequence (-1 for padding).
    prev_len, new_len: per-sequence token counts before and after the pass, on the host.
    prev_seq_len: (B,) int64, ``prev_len`` on the device.
    prompt: the pass is (a chunk of) the prompt; prompt_end: it is the prompt's last pass, after which the method
    takes over (compresses, starts its state).
    """

    valid: torch.Tensor
    position: torch.Tensor
    prev_len: list[int]
    new_len: list[int]
    prev_seq_len: torch.Tensor
    prompt: bool
    prompt_end: bool

    @property
    def seq_len(self) -> torch.Tensor:
        """(B,) int64 tokens per sequence after the pass, on the device."""
        return self.prev_seq_len + self.valid.sum(dim=1)


def device_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """(len(values),) int64 of the host's ``values`` on ``device``, copied without waiting for the work queued there:
    on CUDA from pinned memory, asynchronously (a copy from pageable memory waits for the stream, which would hold
    a server's host, queuing a prompt's passes, until the decode step launched before them has run)."""
    host = torch.tensor(values, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def free_slots(slot_page: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> None:
    """Frees ``slots`` (B, Hkv, N) of ``slot_page`` (B, Hkv, C + 1) where ``mask`` (B, Hkv, N) is True, in place; the
    others write the scratch slot C, which is always free. A function of tensors, so that a method's compiled step
    frees with it."""
    slot_page.scatter_(2, torch.where(mask, slots, slot_page.shape[2] - 1), -1)


def host_slots(size: tuple[int, ...], dtype: torch.dtype, fill: float | None = None) -> torch.Tensor:
    """A (B, Hkv, S, ...) tensor in host memory laid out slot-major, (B, S, Hkv, ...) in memory, page-locked where
    CUDA is: a row's slots [a, b) are one dense block, which ``copy_pages`` moves to or from a device in one
    transfer. ``fill``: its value (None: left unwritten)."""
    pinned = torch.cuda.is_available()
    t = torch.empty((size[0], size[2], size[1], *size[3:]), dtype=dtype, pin_memory=pinned).transpose(1, 2)
    return t if fill is None else t.fill_(fill)


def copy_pages(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without waiting for the device. Between a device and host memory torch copies a view that
    is not dense through a pageable host temporary, at the host's speed and waiting for the device; a dense host view
    (``host_slots``) goes in one transfer, through a device tensor in the host view's memory order."""
    if dst.device.type == "cpu" and src.device.type != "cpu":
        staged = torch.empty_like(dst, device=src.device)
        staged.copy_(src)
        dst.copy_(staged, non_blocking=True)
    else:
        dst.copy_(to_device(src, dst.device), non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: from host memory in one transfer (``copy_pages``), in ``t``'s memory order."""
    if t.device == device:
        return t
    staged = torch.empty_like(t, device=device)
    staged.copy_(t, non_blocking=True)
    return staged


class SharedPages:
    """The page table of a pool whose rows keep their pages in one store of ``pages`` pages per layer,
    plus a scratch page (store page ``pages``), shared by every layer (each layer has its own store, the same table).

    table: (B, C + 1) int64, the store page of each slot of each row; the scratch page where the slot has none
    (its last column, the rows' scratch slot, always). ``held[b]``: the store pages of row b in slot order, on the
    host; ``free``: the store pages no row holds.
    """

    def __init__(self, rows: int, slots: int, pages: int, device: torch.device):
        if pages < 1:
            raise ValueError(f"SharedPages: pages must be >= 1, got {pages}")
        self.pages = pages
        self.table = torch.full((rows, slots + 1), pages, dtype=torch.long, device=device)
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self._runs: list[list[tuple[int, int, int]]] = [[] for _ in range(rows)]  # ``runs``, made at ``assign``
        self.free = list(range(pages - 1, -1, -1))  # popped from the end: the lowest first

    @classmethod
    def over(cls, table: torch.Tensor, pages: int) -> "SharedPages":
        """The page table of rows whose store pages another allocator hands out (vLLM's block manager): ``table``
        (B, C + 1) int64 as above, over a store of ``pages`` pages; nothing here assigns or frees them."""
        shared = cls.__new__(cls)
        shared.pages, shared.table, shared.free = pages, table, []
        shared.held = shared._runs = [[] for _ in range(table.shape[0])]
        return shared

    @property
    def free_pages(self) -> int:
        return len(self.free)

    def assign(self, row: int, pages: int) -> None:
        """Gives ``row`` store pages for its slots up to ``pages`` (logical pages len(held) .. pages - 1; the pages it
        holds stay), written before the tokens are: a page is read only up to the row's length."""
        have = len(self.held[row])
        if not max(have, 1) <= pages <= min(have + len(self.free), self.table.shape[1] - 1):
            raise ValueError(f"SharedPages.assign: {pages} pages asked for row {row}, which holds {have}, with "
                             f"{len(self.free)} free and {self.table.shape[1] - 1} slots a row")
        taken = [self.free.pop() for _ in range(pages - have)]
        if not taken:
            return
        idx = device_tensor(taken, self.table.device)
        self.table[row, have:pages] = idx
        self.held[row] += taken
        runs = self._runs[row]
        for slot, page in enumerate(taken, have):
            if runs and page == runs[-1][1] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((slot, page, 1))

    def release(self, row: int) -> None:
        """Returns the store pages of ``row`` to the free ones."""
        if self.held[row]:
            self.table[row, :len(self.held[row])] = self.pages
            self.free.extend(reversed(self.held[row]))
            self.held[row], self._runs[row] = [], []

    def runs(self, row: int, used: int) -> list[tuple[int, int, int]]:
        """The store pages of slots [0, used) of ``row`` as runs of consecutive pages, (first slot, first store
        page, length) each, a run is read and written as a slice: a row's pages come off the free list in runs
        (``free`` keeps freed rows' pages in order)."""
        return [(slot, page, min(n, used - slot)) for slot, page, n in self._runs[row] if slot < used]

    def move(self, row: int, source_row: int, source: "SharedPages | None" = None) -> None:
        """``row``, which holds none, takes the pages of ``source_row`` of ``source`` (this table, or another over the
        same store pages: ``beside``); nothing is copied, and the source row then holds none."""
        source = self if source is None else source
        if self.held[row]:
            raise ValueError(f"SharedPages.move: row {row} holds pages already")
        if source.free is not self.free:
            raise ValueError("SharedPages.move: the source table is not over the same store pages")
        self.table[row] = source.table[source_row]
        source.table[source_row] = self.pages
        self.held[row], source.held[source_row] = source.held[source_row], []
        self._runs[row], source._runs[source_row] = source._runs[source_row], []

    def beside(self, rows: int) -> "SharedPages":
        """Another table, of ``rows`` rows holding none, over the same store pages: its rows take pages from the
        same free list and give them back to it (a prompt prefilled straight into shared pages, whose request's
        row then takes them: ``move``)."""
        other = copy.copy(self)
        other.table = torch.full((rows, self.table.shape[1]), self.pages, dtype=torch.long, device=self.table.device)
        other.held = [[] for _ in range(rows)]
        other._runs = [[] for _ in range(rows)]
        return other


class PagedLayer:
    """The pages of one layer.

    k, v: (B, Hkv, C + 1, P, D) with C page slots plus the scratch slot, in the model's dtype or fp8; with ``shared``
    (``SharedPages``), the layer's store of the rows' pages, (1, Hkv, N + 1, P, D), read through ``shared.table``
    (``table``), as are the bounds (1, Hkv, N + 1, D).
    kmin, kmax: (B, Hkv, C + 1, D), channel-wise bounds of the keys in each slot; with one token per page they are
    views of ``k`` (a token is its own bound), so token-granular methods store nothing extra.
    slot_page: (B, Hkv, C + 1) int64, logical page held by each slot, -1 if free.
    cur_slot: (B, Hkv) int64, slot of each row's last (current) page.

    Methods that evict also use: ``max_pages``, a cap on this layer's slots per row; ``dropped``, pages each row
    has dropped for good (host ints), so that the cache allocates for what is held rather than for the sequence
    length; ``slot_state``, per-slot tensors (B, Hkv, C + 1, ...) of the method (e.g. H2O's accumulated attention) that
    move with the slots when the layer grows, is compacted or reordered.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, page_size: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, shared: SharedPages | None = None,
                 host_copy: bool = False):
        """``host_copy``: a copy in host memory of a device's rows (``serve.Runner.swap_out``): its tensors
        ``host_slots``, so that a row's pages go to and from the device at the bus's speed without waiting on the
        host, and its keys, values and bounds left unwritten (a free slot's are never read; the slots copied in
        are)."""
        self.page_size = page_size
        self.capacity = capacity
        shape = (batch, kv_heads, capacity + 1)
        self.shared = shared
        if shared is not None and (page_size == 1 or shared.table.shape != (batch, capacity + 1)):
            raise ValueError(f"PagedLayer: shared pages need pages of more than one token and a table of "
                             f"{(batch, capacity + 1)}, got page_size {page_size} and {tuple(shared.table.shape)}")
        store = shape if shared is None else (1, kv_heads, shared.pages + 1)

        def pages(*size, fill: float = 0.0) -> torch.Tensor:
            if host_copy:
                return host_slots(size, dtype)
            return torch.full(size, fill, dtype=dtype, device=device)

        self.k = pages(*store, page_size, head_dim)
        self.v = pages(*store, page_size, head_dim)
        if page_size > 1:
            self._kmin = pages(*store, head_dim, fill=bound_fill(dtype, False))
            self._kmax = pages(*store, head_dim, fill=bound_fill(dtype, True))
        self.host_copy = host_copy
        self.slot_page = (host_slots(shape, torch.long, -1) if host_copy
                          else torch.full(shape, -1, dtype=torch.long, device=device))
        self.cur_slot = torch.full(shape[:2], -1, dtype=torch.long, device=device, pin_memory=host_copy
                                   and torch.cuda.is_available())
        # Until a slot is freed, slot j holds page j and allocation needs no search.
        self.has_holes = False
        self.max_pages: int | None = None
        self.dropped = [0] * batch
        self.slot_state: dict[str, torch.Tensor] = {}
        self._slot_ids: torch.Tensor | None = None

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor,
             slot_page: torch.Tensor, cur_slot: torch.Tensor,
             page_state: dict[str, torch.Tensor] | None = None) -> "PagedLayer":
        """A layer over a store of pages that something else keeps and fills (vLLM's blocks), allocating nothing:
        k, v (1, Hkv, N, P, D) and kmin, kmax (1, Hkv, N, D), any strides with head_dim contiguous; table (B, C + 1)
        int64, the store page of each row's slot; slot_page (B, Hkv, C + 1) and cur_slot (B, Hkv) as above, slot j
        holding page j or free (no holes). page_state: the method's tensors per store page (1, Hkv, N, ...) (lowbit's
        key codes), kept as ``slot_state`` and read through the table as the pages are."""
        layer = cls.__new__(cls)
        layer.page_size, layer.capacity = k.shape[3], table.shape[1] - 1
        layer.shared = SharedPages.over(table, k.shape[2])
        layer.k, layer.v, layer._kmin, layer._kmax = k, v, kmin, kmax
        layer.slot_page, layer.cur_slot = slot_page, cur_slot
        layer.has_holes, layer.max_pages, layer.dropped = False, None, [0] * table.shape[0]
        layer.host_copy = False
        layer.slot_state, layer._slot_ids = dict(page_state or {}), None
        return layer

    @property
    def table(self) -> torch.Tensor | None:
        """(B, C + 1) the store page of each slot of each row in shared pages, else None."""
        return None if self.shared is None else self.shared.table

    @property
    def kmin(self) -> torch.Tensor:
        return self._kmin if self.page_size > 1 else self.k[:, :, :, 0]

    @property
    def kmax(self) -> torch.Tensor:
        return self._kmax if self.page_size > 1 else self.k[:, :, :, 0]

    @property
    def slot_ids(self) -> torch.Tensor:
        """(C + 1,) int64 0, 1, ..., C: made once per capacity, so that a decode step that attends every slot
        launches nothing to list them."""
        c = self.capacity + 1
        if self._slot_ids is None or self._slot_ids.shape[0] != c:
            self._slot_ids = torch.arange(c, device=self.k.device)
        return self._slot_ids

    @property
    def paged(self) -> tuple[str, ...]:
        """Attributes holding the pages' keys, values and bounds, per row (B, Hkv, C + 1, ...) or in shared pages
        (1, Hkv, N + 1, ...)."""
        return ("k", "v") + (("_kmin", "_kmax") if self.page_size > 1 else ())

    @property
    def stored(self) -> tuple[str, ...]:
        """Attributes holding per-slot tensors (B, Hkv, C + 1, ...): the pages too unless they are in shared pages."""
        return (self.paged if self.shared is None else ()) + ("slot_page",)

    @property
    def per_slot(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor (B, Hkv, C + 1, ...): pages, bounds, page table and the method's state."""
        return (*(getattr(self, n) for n in self.stored), *self.slot_state.values())

    @property
    def allocated(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the layer allocates: its per-slot tensors (``per_slot``) and its store of shared pages."""
        store = () if self.shared is None else tuple(getattr(self, n) for n in self.paged)
        return (*self.per_slot, *store)

    def resident_bytes(self) -> int:
        """Bytes of the layer's per-slot tensors and of its store of shared pages."""
        return sum(t.numel() * t.element_size() for t in self.allocated)

    def slot_bytes(self) -> int:
        """Bytes one slot of one row takes: its page (keys, values, bounds) and its per-slot tensors."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in self.allocated)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, kv_heads, slots including scratch, head_dim)."""
        return (*self.slot_page.shape, self.k.shape[-1])

    def row_pages(self, row: int, used: int, names: tuple[str, ...] | None = None,
                  first: int = 0) -> dict[str, torch.Tensor]:
        """The pages of slots [first, used) of ``row`` by attribute (``names``, default ``paged``): (Hkv, used -
        first, ...) each, views, or in shared pages views where the slots' store pages are one run
        (``SharedPages.runs``: a prompt's, taken from a free list in order), else gathered (contiguous)."""
        names = self.paged if names is None else names
        if self.shared is None:
            return {n: getattr(self, n)[row, :, first:used] for n in names}
        runs = [run for run in self.shared.runs(row, used) if run[0] + run[2] > first]
        if len(runs) == 1:  # the one run of pages that holds slots first .. used - 1
            start = runs[0][1] + first - runs[0][0]
            return {n: getattr(self, n)[0, :, start:start + used - first] for n in names}
        idx = self.shared.table[row, first:used]
        return {n: raw(t)[0].index_select(1, idx).view(t.dtype) for n in names for t in (getattr(self, n),)}

    def row_tokens(self, row: int, end: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (1, Hkv, end - start, D) of tokens ``start .. end - 1`` of ``row``, whose slot j holds
        page j (a prompt's): views, or gathered through the page table in shared pages (``row_pages``)."""
        first = start // self.page_size
        pages = self.row_pages(row, -(-end // self.page_size), ("k", "v"), first)
        offset = start - first * self.page_size
        return tuple(pages[n].flatten(1, 2)[None, :, offset:offset + end - start] for n in ("k", "v"))

    def attend(self, q: torch.Tensor, slots: torch.Tensor, seq_len: torch.Tensor, scale: float,
               attended: torch.Tensor | None = None, in_order: bool = False) -> torch.Tensor:
        """``kernels.sparse_decode`` over ``slots`` (B, Hs, K) of this layer (-1: none), read through the page
        table in shared pages. q: (B, H, D); returns (B, H, D)."""
        table = None if self.shared is None else self.shared.table[:slots.shape[0]]
        return kernels.sparse_decode(q, self.k, self.v, self.slot_page, slots, seq_len, scale, attended, in_order,
                                     table)

    def grow(self, capacity: int) -> None:
        """Reallocates to ``capacity`` slots; amortised by the caller asking for geometric growth."""
        self._not_shared("grow")
        old = self.capacity

        def grown(t: torch.Tensor, fill) -> torch.Tensor:
            new = torch.full((*t.shape[:2], capacity + 1, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)
            new[:, :, :old] = t[:, :, :old]
            return new

        dtype = self.k.dtype
        for name in self.stored:
            fill = {"_kmin": bound_fill(dtype, False), "_kmax": bound_fill(dtype, True), "slot_page": -1}.get(name, 0)
            setattr(self, name, grown(getattr(self, name), fill))
        self.slot_state = {name: grown(t, 0) for name, t in self.slot_state.items()}
        self.capacity = capacity

    def compact(self, capacity: int) -> torch.Tensor:
        """Moves each row's held pages to its lowest slots, in slot order, and reallocates to ``capacity`` slots,
        which must be at least the most pages a row holds: releases the memory of pages dropped for good.
        Returns (B, Hkv, capacity) the old slot of each new slot."""
        if not 1 <= capacity <= self.capacity:
            raise ValueError(f"capacity must be from 1 to the current {self.capacity} slots, got {capacity}")
        self._not_shared("compact")
        cap = self.capacity
        order = torch.argsort((self.slot_page[:, :, :cap] < 0).to(torch.int8), dim=2, stable=True)[:, :, :capacity]
        with_scratch = torch.cat([order, torch.full_like(order[:, :, :1], cap)], dim=2)

        def take(t: torch.Tensor) -> torch.Tensor:
            idx = with_scratch.view(*with_scratch.shape, *[1] * (t.dim() - 3)).expand(*with_scratch.shape,
                                                                                      *t.shape[3:])
            return gather(t, 2, idx)

        for name in self.stored:
            setattr(self, name, take(getattr(self, name)))
        self.slot_state = {name: take(t) for name, t in self.slot_state.items()}
        new_slot = torch.full((*order.shape[:2], cap + 1), -1, dtype=torch.long, device=order.device)
        new_slot.scatter_(2, order, torch.arange(capacity, device=order.device).expand_as(order))
        moved = new_slot.gather(2, self.cur_slot.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        self.cur_slot = torch.where(self.cur_slot >= 0, moved, -1)
        self.capacity = capacity
        self.has_holes = True  # slot j no longer holds page j
        return order

    def _not_shared(self, name: str) -> None:
        if self.shared is not None:
            raise ValueError(f"PagedLayer.{name}: a layer in shared pages keeps its slots (a pool's rows are sized "
                             f"once, and methods that evict do not use shared pages)")

    def free(self, slots: torch.Tensor, mask: torch.Tensor) -> None:
        """Frees ``slots`` (B, Hkv, N) where ``mask`` (B, Hkv, N) is True; their memory is reused by later pages."""
        free_slots(self.slot_page, slots, mask)
        self.has_holes = True

    def rows(self, n: int) -> "PagedLayer":
        """The layer of rows [0, n): its tensors are views of this layer's, so a step over it updates these rows in
        place (a pool of rows serving several requests decodes the rows in use)."""
        view = copy.copy(self)
        for name in (*self.stored, "cur_slot"):
            setattr(view, name, getattr(self, name)[:n])
        if self.shared is not None:  # the store is the pool's; the table is read for rows [0, n) (``attend``)
            view.shared = copy.copy(self.shared)
            view.shared.table = self.shared.table[:n]
        view.slot_state = {name: t[:n] for name, t in self.slot_state.items()}
        view.dropped = self.dropped[:n]
        return view

    def beside(self, shared: SharedPages) -> "PagedLayer":
        """A layer over this one's store of shared pages whose rows are those of ``shared``, another table over the
        same pages (``SharedPages.beside``), with no page yet: a prompt's passes write there through that table, so
        that its request's row takes the pages once it is prefilled, with no copy."""
        if self.shared is None or shared.free is not self.shared.free:
            raise ValueError("PagedLayer.beside: a layer in shared pages and a table over its store pages are needed")
        other = copy.copy(self)
        rows = shared.table.shape[0]
        other.shared = shared
        other.slot_page = torch.full((rows, *self.slot_page.shape[1:]), -1, dtype=torch.long,
                                     device=self.slot_page.device)
        other.cur_slot = torch.full((rows, self.cur_slot.shape[1]), -1, dtype=torch.long, device=self.cur_slot.device)
        other.has_holes, other.max_pages, other.dropped, other.slot_state = False, None, [0] * rows, {}
        return other

    def copy_row(self, row: int, source: "PagedLayer", source_row: int, pages: int, moved: bool = False) -> None:
        """Makes ``row`` hold what row ``source_row`` of ``source`` (this layer or another of the same heads) holds:
        its pages in the same slots, their bounds, its method's per-slot state, its current slot and its dropped
        count; the other slots are free. ``pages``: the pages the source row has had (its tokens over the page
        size), which bounds the slots it uses, since a new page takes the lowest free slot: only those are copied.
        ``moved``: the source row's shared pages were moved to ``row`` (``SharedPages.move``): they are in place. Raises
        ValueError when the source holds pages in slots this layer does not have, or has holes this layer
        does not search for."""
        c = min(self.capacity, source.capacity)
        if source.capacity > c and bool((source.slot_page[source_row, :, c:source.capacity] >= 0).any()):
            raise ValueError(f"copy_row: the source row holds pages beyond this layer's {self.capacity} slots")
        if source.has_holes and not self.may_have_holes:
            raise ValueError("copy_row: the source row has freed slots but this layer does not search for them")
        self.copy_slots(row, source, source_row, min(c, pages), moved)
        copy_pages(self.cur_slot[row], source.cur_slot[source_row])
        self.dropped[row] = source.dropped[source_row]

    def copy_slots(self, row: int, source: "PagedLayer", source_row: int, used: int, moved: bool = False) -> None:
        """Slots [0, used) of ``row`` take those of row ``source_row`` of ``source`` (page table, pages and their
        bounds unless ``moved`` there already, per-slot state); the row's other slots are freed. In shared pages
        the row's slots must have their store pages already."""
        copy_pages(self.slot_page[row, :, :used], source.slot_page[source_row, :, :used])
        if not moved:
            runs = [(0, 0, used)] if self.shared is None else self.shared.runs(row, used)
            for name, src in source.row_pages(source_row, used).items():
                dst = getattr(self, name)[row if self.shared is None else 0]
                # Asynchronous to and from page-locked host memory (a row swapped out and back): the device reads
                # those pages after the copy, in stream order, and the host once ``swap_out`` has waited.
                if len(runs) == 1:
                    _, page, n = runs[0]
                    copy_pages(dst[:, page:page + n], src)
                elif runs:  # store pages scattered: one transfer, then one scatter on the device
                    raw(dst).index_copy_(1, self.shared.table[row, :used], raw(to_device(src, dst.device)))
        # A free slot's keys and bounds are never read: a page that takes it restarts them.
        self.slot_page[row, :, used:].fill_(-1)
        for name, src in source.slot_state.items():
            if name not in self.slot_state:
                size = (*self.slot_page.shape, *src.shape[3:])
                self.slot_state[name] = (host_slots(size, src.dtype, 0) if self.host_copy
                                         else torch.zeros(size, dtype=src.dtype, device=self.slot_page.device))
            copy_pages(self.slot_state[name][row, :, :used], src[source_row, :, :used])

    def token_position(self) -> torch.Tensor:
        """(B, Hkv, C + 1, P) position of every stored token, -1 where the slot is free."""
        offs = torch.arange(self.page_size, device=self.k.device)
        pos = self.slot_page.unsqueeze(-1) * self.page_size + offs
        return torch.where(self.slot_page.unsqueeze(-1) >= 0, pos, -1)

    @property
    def may_have_holes(self) -> bool:
        """Whether a new page must search for a free slot: a slot was freed, or the layer evicts (``max_pages``), so
        that a decode step captured before its first eviction still searches after it."""
        return self.has_holes or self.max_pages is not None

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, plan: AppendPlan) -> None:
        """Writes the new tokens (B, Hkv, S, D) into their pages and updates the page bounds. One token per sequence
        (a decode step) takes the fused ``kernels.append_token`` (one Triton kernel on CUDA, slot choice included);
        more take ``kernels.append_pages`` (one kernel a pass, or a row's pass where the rows' lengths differ) when
        every token is real and slot j holds page j (a prompt pass or chunk), else scatters."""
        s = k_new.shape[2]
        if s == 1 and not plan.prompt:
            kernels.append_token(self.k, self.v, self.kmin, self.kmax, self.slot_page, self.cur_slot,
                                 plan.position[:, 0], k_new[:, :, 0], v_new[:, :, 0], self.may_have_holes, self.table)
            return
        if self.shared is not None and (len(plan.prev_len) > 1 or plan.new_len[0] - plan.prev_len[0] != s):
            raise ValueError("a layer in shared pages takes decode tokens, one per row, and the passes of one "
                             "prompt with no padding (``beside``)")
        if self.may_have_holes or any(n - p != s for p, n in zip(plan.prev_len, plan.new_len)):
            self.scatter_append(k_new, v_new, plan)
            return
        state = (self.k, self.v, self.kmin, self.kmax, self.slot_page, self.cur_slot)
        if len(set(plan.prev_len)) == 1:
            kernels.append_pages(*state, k_new, v_new, plan.prev_len[0], 0, self.table)
        else:
            for row, start in enumerate(plan.prev_len):
                kernels.append_pages(*state, k_new[row:row + 1], v_new[row:row + 1], start, row, self.table)

    def scatter_append(self, k_new: torch.Tensor, v_new: torch.Tensor, plan: AppendPlan) -> None:
        """``append`` for any number of tokens per sequence, padding included, by scatters."""
        p, cap = self.page_size, self.capacity
        b, h, s, d = k_new.shape
        page = torch.where(plan.valid, plan.position // p, -1)  # (B, S)
        offset = torch.where(plan.valid, plan.position % p, 0)
        first_new = (plan.prev_seq_len + p - 1) // p  # (B,) first logical page that starts in this pass
        if self.may_have_holes:
            # New pages take free slots in ascending order; pages that already hold tokens keep theirs.
            free_order = torch.argsort((self.slot_page[:, :, :cap] >= 0).to(torch.int8), dim=2, stable=True)
            rank = (page - first_new[:, None]).clamp(min=0).unsqueeze(1).expand(b, h, s)
            new_slot = free_order.gather(2, rank.clamp(max=max(cap - 1, 0)))
        else:
            new_slot = page.clamp(min=0).unsqueeze(1).expand(b, h, s)
        in_current = (page < first_new[:, None]).unsqueeze(1)
        slot = torch.where(in_current, self.cur_slot.unsqueeze(-1), new_slot)
        slot = torch.where(plan.valid.unsqueeze(1), slot, cap)  # (B, Hkv, S); padding goes to scratch

        self.slot_page.scatter_(2, slot, page.unsqueeze(1).expand(b, h, s))
        self.slot_page[:, :, cap] = -1

        flat = (slot * p + offset.unsqueeze(1)).unsqueeze(-1).expand(b, h, s, d)
        dtype = self.k.dtype
        k_new, v_new = kernels.reference.to_cache(k_new, dtype), kernels.reference.to_cache(v_new, dtype)
        raw(self.k).view(b, h, -1, d).scatter_(2, flat, raw(k_new))
        raw(self.v).view(b, h, -1, d).scatter_(2, flat, raw(v_new))
        if p > 1:
            # fp8 bounds are reduced in float32, which holds them exactly (torch has no fp8 reductions on the CPU):
            # a prompt pass converts the layer's bounds twice, a cost of the prefill, never of a decode step.
            wide = torch.float32 if dtype == kernels.reference.FP8 else dtype
            lo, up, k_new = self._kmin.to(wide), self._kmax.to(wide), k_new.to(wide)
            low, high = bound_fill(dtype, False), bound_fill(dtype, True)
            fresh = torch.where((plan.valid & ~in_current.squeeze(1)).unsqueeze(1), slot, cap)
            lo.scatter_(2, fresh.unsqueeze(-1).expand(b, h, s, d), low)
            up.scatter_(2, fresh.unsqueeze(-1).expand(b, h, s, d), high)
            idx = slot.unsqueeze(-1).expand(b, h, s, d)
            lo.scatter_reduce_(2, idx, k_new, "amin")
            up.scatter_reduce_(2, idx, k_new, "amax")
            lo[:, :, cap] = low  # padding keys were reduced into the scratch slot
            up[:, :, cap] = high
            if wide != dtype:
                self._kmin.copy_(lo)
                self._kmax.copy_(up)

        last_col = torch.where(plan.valid, plan.position, -1).argmax(dim=1)  # (B,)
        last_slot = slot.gather(2, last_col.view(b, 1, 1).expand(b, h, 1)).squeeze(-1)
        self.cur_slot.copy_(torch.where(plan.valid.any(dim=1, keepdim=True), last_slot, self.cur_slot))


class PagedKVCache:
    """Pages of every layer of a model, plus the per-sequence lengths they share.

    seq_len: (B,) int64 tokens per sequence on the device, updated in place (a captured decode step reads and
    advances the same tensor at every replay); ``lengths`` the same on the host, so that page allocation never
    waits for the device. The host copy is advanced by whoever replays a captured step (``advance``).
    ``in_prompt``: the next pass belongs to the prompt, which may come in several chunks (the last one is marked
    by ``begin(prompt_end=True)``). ``planned_tokens``: tokens per row the caller expects to store (prompt and
    new tokens), so that layers are allocated once at that size rather than grown by doubling.
    """

    def __init__(self, num_layers: int, page_size: int = 16, max_pages: int | None = None, kv_dtype: str = "auto"):
        check_page_size(page_size)
        check_kv_dtype(kv_dtype)
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.max_pages = max_pages
        self.layers: list[PagedLayer | None] = [None] * num_layers
        self.lengths: list[int] = []
        self.seq_len: torch.Tensor | None = None
        self.plan: AppendPlan | None = None
        self.in_prompt = True
        self.planned_tokens: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def begin(self, num_new: int, valid: torch.Tensor | None, batch: int, device: torch.device,
              prompt_end: bool = True) -> AppendPlan:
        """Plans a forward pass of ``num_new`` columns; ``valid`` (B, S) marks real tokens (None: all real).
        While the prompt comes in chunks, ``prompt_end=False`` says that more chunks follow.

        Padding is allowed only before a row's first token (left padding over one or more prompt chunks, or a
        right-padded prompt in one pass): afterwards every row grows by the same number of real tokens.
        A decode pass (one token per row after the prompt), or any pass with ``valid`` None, reads no host value
        (so it does not wait for the device's queued work) and updates ``seq_len`` in place.
        """
        masked = valid is not None
        if not masked:
            valid = torch.ones(batch, num_new, dtype=torch.bool, device=device)
        valid = valid.to(device=device, dtype=torch.bool)
        if valid.shape != (batch, num_new):
            raise ValueError(f"attention_mask: expected the last {num_new} columns for batch {batch}, "
                             f"got shape {tuple(valid.shape)}")
        if not self.lengths:
            self.lengths = [0] * batch
            self.seq_len = torch.zeros(batch, dtype=torch.long, device=device)
        elif batch != self.batch_size:
            raise ValueError(f"batch size changed from {self.batch_size} to {batch} within one cache")
        prev = list(self.lengths)
        prompt = self.in_prompt
        if masked and (prompt or num_new > 1):
            counts = valid.sum(dim=1).tolist()  # a host sync per prompt chunk given a mask, never per decode token
            if any(p > 0 and c != num_new for p, c in zip(prev, counts)):
                raise ValueError("attention_mask: padding is only supported before a sequence's first token (the "
                                 "prompt's left padding); later tokens must all be real")
        else:
            counts = [num_new] * batch
        new = [p + c for p, c in zip(prev, counts)]
        position = self.seq_len.unsqueeze(1) + valid.long().cumsum(dim=1) - 1
        position = torch.where(valid, position, -1)
        self.plan = AppendPlan(valid=valid, position=position, prev_len=prev, new_len=new,
                               prev_seq_len=self.seq_len.clone(), prompt=prompt, prompt_end=prompt and prompt_end)
        self.lengths = new
        self.seq_len.add_(valid.sum(dim=1))
        self.in_prompt = prompt and not prompt_end
        return self.plan

    def seed(self, source: "PagedKVCache", tokens: int, row: int = 0) -> None:
        """Starts this cache, empty and of one row, with the first ``tokens`` tokens (whole pages) of ``row`` of
        ``source``, a cache that holds them as the passes and steps wrote them (no page evicted or moved: slot j
        holds page j): every layer allocated as an append would (``planned_tokens``), or the layers it has already
        (in shared pages, with their pages assigned: ``PagedLayer.beside``), with those pages, their bounds and
        per-slot state copied. The next pass continues the prompt at position ``tokens``."""
        pages = tokens // self.page_size
        if self.lengths:
            raise ValueError("seed: the cache already holds tokens")
        if tokens % self.page_size or not 0 < tokens <= source.lengths[row]:
            raise ValueError(f"seed: tokens must be whole pages of the source row's {source.lengths[row]} tokens, "
                             f"got {tokens}")
        for i, src in enumerate(source.layers):
            layer = self.layers[i] or PagedLayer(1, src.shape[1], src.shape[3], self.page_size,
                                                 self._size(pages, None), src.k.dtype, src.k.device)
            layer.copy_slots(0, src, row, pages)
            layer.cur_slot.fill_(pages - 1)
            self.layers[i] = layer
        self.lengths = [tokens]
        self.seq_len = torch.tensor([tokens], device=source.seq_len.device)

    def advance(self, steps: int) -> None:
        """Moves the host lengths on by ``steps`` decode tokens per row that ran without Python (graph replays)."""
        self.lengths = [n + steps for n in self.lengths]

    def reserve(self, tokens: int) -> None:
        """Gives every layer the slots for each row to grow by ``tokens`` more tokens (within the layers' caps), so
        that the decode steps that follow allocate nothing."""
        for layer in self.layers:
            if layer is not None and layer.capacity < self.needed_pages(layer, tokens):
                layer.grow(self.needed_pages(layer, tokens))

    def needed_pages(self, layer: PagedLayer | None = None, extra: int = 0) -> int:
        """Slots per row the next append needs in ``layer`` (with ``extra`` more tokens per row): each row's pages
        less those it dropped for good, capped by ``max_pages`` and the layer's own ``max_pages``."""
        if not self.lengths:
            return 0
        dropped = layer.dropped if layer is not None else [0] * self.batch_size
        pages = max(-(-(n + extra) // self.page_size) - d for n, d in zip(self.lengths, dropped))
        return min([pages] + self._caps(layer))

    def _size(self, need: int, layer: PagedLayer | None) -> int:
        """Slots to allocate for a layer that needs ``need``: without a plan, doubling (amortised growth); with
        ``planned_tokens``, the plan at once (no copy later, and no doubling past it at long contexts)."""
        if self.planned_tokens is None:
            size = need if layer is None else max(need, 2 * layer.capacity)
        else:
            size = max(need, -(-self.planned_tokens // self.page_size))
        return max(need, min([size] + self._caps(layer)))

    def _caps(self, layer: PagedLayer | None) -> list[int]:
        return [c for c in (self.max_pages, None if layer is None else layer.max_pages) if c is not None]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> PagedLayer:
        """Stores the pass's keys and values (B, Hkv, S, D) of one layer and returns the layer's pages."""
        if self.plan is None:
            raise RuntimeError("PagedKVCache.append called before begin()")
        if k.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {k.dtype} is not supported; allowed: {', '.join(map(str, SUPPORTED_DTYPES))}")
        layer = self.layers[layer_idx]
        if layer is not None and layer.max_pages is not None and not self.plan.prompt and k.shape[2] > 1:
            raise ValueError(f"this method evicts tokens and takes one token per forward pass after the prompt; "
                             f"got {k.shape[2]} tokens at once (feed them one by one)")
        need = max(self.needed_pages(layer), 1)
        if layer is None:
            b, h, _, d = k.shape
            layer = PagedLayer(b, h, d, self.page_size, self._size(need, None), storage_dtype(self.kv_dtype, k.dtype),
                               k.device)
            self.layers[layer_idx] = layer
        elif layer.capacity < need:
            layer.grow(self._size(need, layer))
        layer.append(k, v, self.plan)
        return layer

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps the sequences ``index`` (beam search, batch selection)."""
        idx = index.tolist()
        self.lengths = [self.lengths[i] for i in idx]
        self.seq_len = self.seq_len.index_select(0, index.to(self.seq_len.device))
        for layer in self.layers:
            if layer is None:
                continue
            layer._not_shared("reorder")
            for name in (*layer.stored, "cur_slot"):
                t = getattr(layer, name)
                setattr(layer, name, t.index_select(0, index.to(t.device)))
            layer.slot_state = {name: t.index_select(0, index.to(t.device)) for name, t in layer.slot_state.items()}
            layer.dropped = [layer.dropped[i] for i in idx]

    def rows(self, n: int) -> "PagedKVCache":
        """The cache of rows [0, n) after their prompts (``PagedLayer.rows``): ``seq_len`` a view of this cache's, the
        host lengths a copy, which the caller writes back after the steps it runs on the view."""
        view = copy.copy(self)
        view.layers = [None if layer is None else layer.rows(n) for layer in self.layers]
        view.lengths = self.lengths[:n]
        view.seq_len = self.seq_len[:n]
        view.plan = None
        return view

    def held_bytes(self) -> int:
        """Bytes of the keys and values of the tokens the pages hold, on all layers: without the slots allocated
        ahead for growth, the scratch slot and the page metadata (``resident_bytes`` counts those)."""
        total = 0
        for layer in self.layers:
            if layer is not None:
                pos = layer.token_position()  # (B, Hkv, C + 1, P)
                held = ((pos >= 0) & (pos < self.seq_len.view(-1, 1, 1, 1))).sum()
                total += int(held) * 2 * layer.k.shape[-1] * layer.k.element_size()
        return total

    def slot_bytes(self) -> int:
        """Bytes of one slot of one row, summed over the layers: pages, metadata and per-slot state."""
        return sum(layer.slot_bytes() for layer in self.layers if layer is not None)

    def resident_bytes(self) -> int:
        """Bytes allocated for the pages and their metadata on all layers."""
        return sum(layer.resident_bytes() for layer in self.layers if layer is not None)
