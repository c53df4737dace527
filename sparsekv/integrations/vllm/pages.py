"""sparsekv's decode step over vLLM's paged KV cache, in plain torch and our ops (no vLLM import: the CPU tests run
it without vLLM).

vLLM's FlashAttention cache of one layer is a view (NB, Hkv, BS, 2D) of blocks of BS tokens, each token's key and
value side by side (K | V) per KV head. The backend asks vLLM for pages ``tail_bytes`` longer than that
(``page_size_padded``): the end of each block's page holds, per KV head, the channel-wise min and max of its keys
(Hkv, 2, D), then for lowbit its keys' codes (Hkv, BS, D * bits / 8) bytes, for landmark its runs' mean keys
(Hkv, L, D) and for spread its keys' mean and deviation (Hkv, 2, D), so vLLM's KV planning counts them, prefix
caching shares them with the block, and a block copy moves them. ``BlockStore`` views that memory as our store of
shared pages: keys and values (1, Hkv, NB, BS, D), bounds (1, Hkv, NB, D), codes (1, Hkv, NB, BS, D * bits / 8) and
summaries (1, Hkv, NB, rows, D), so the ops and methods of ``kernels`` and ``methods`` read it unchanged.
``DecodeRows`` turns vLLM's block table and sequence lengths into our rows' page tables, in buffers that a captured
CUDA graph keeps reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import kernels
from ...cache.paged import PagedLayer
from ...methods.base import Method, MethodConfig, Tally
from ...methods.landmark import LandmarkConfig, means_entry
from ...methods.lowbit import LowBitConfig, codes_entry
from ...methods.spread import STATS, SpreadConfig


def bounds_bytes(num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes a block's page adds for its keys' bounds: a min and a max vector per KV head."""
    return 2 * num_kv_heads * head_size * torch.empty((), dtype=dtype).element_size()


def code_bits(config: MethodConfig) -> int:
    """Bits per key channel of the codes a block keeps for the method (lowbit's), 0 for none."""
    return config.bits if isinstance(config, LowBitConfig) else 0


@dataclass(frozen=True)
class Summary:
    """What each block keeps of its keys beside their bounds for a method (``quest.Summarized``): ``rows`` vectors
    per KV head in ``page_state[entry]``, written by ``kernels.page_means`` (landmark's mean keys of its runs) or,
    with ``spread``, by ``kernels.page_stats`` (spread's mean and deviation)."""

    entry: str
    rows: int
    spread: bool = False


def page_summary(config: MethodConfig) -> Summary | None:
    """What a block keeps of its keys for the method beside their bounds (landmark's and spread's), None for none."""
    if isinstance(config, LandmarkConfig):
        return Summary(means_entry(config.landmarks), config.landmarks)
    if isinstance(config, SpreadConfig):
        return Summary(STATS, 2, spread=True)
    return None


def tail_bytes(config: MethodConfig, num_kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype) -> int:
    """Bytes a block's page adds for the method: its keys' bounds, and lowbit's codes or the summary of its keys
    (``page_summary``)."""
    codes = num_kv_heads * block_size * head_size * code_bits(config) // 8
    summary = page_summary(config)
    rows = summary.rows if summary else 0
    return bounds_bytes(num_kv_heads, head_size, dtype) + codes + num_kv_heads * rows * head_size * torch.empty(
        (), dtype=dtype).element_size()


class BlockStore:
    """One layer's vLLM cache as a store of pages. kv_cache: (NB, Hkv, BS, 2D), vLLM's FlashAttention view of pages
    of ``tail_bytes`` more than their keys and values (any layout of the block: NHD or HND); bits: of the codes the
    pages keep (``code_bits``, 0: none); summary: what a page keeps of its keys besides (``page_summary``).

    k, v: (1, Hkv, NB, BS, D) views; kmin, kmax: (1, Hkv, NB, D) views of the end of each page; page_state, after
    the bounds: the codes (1, Hkv, NB, BS, D * bits / 8) uint8 by lowbit's name for them (``codes_entry``), then
    the summaries (1, Hkv, NB, rows, D) by the method's (``Summary.entry``).
    """

    def __init__(self, kv_cache: torch.Tensor, bits: int = 0, summary: Summary | None = None):
        nb, hkv, bs, d2 = kv_cache.shape
        d = d2 // 2
        page = kv_cache.stride(0)
        data = bs * hkv * d2  # the page's keys and values come first, whatever their layout
        item = kv_cache.element_size()
        codes = -(-hkv * bs * d * bits // (8 * item))  # elements the codes take, after the bounds
        rows = summary.rows if summary else 0
        need = data + hkv * d2 + codes + hkv * rows * d
        if kv_cache.stride(3) != 1 or page < need:
            extra = " and codes" if bits else " and summaries" if summary else ""
            raise ValueError(f"BlockStore: a cache of pages with room for the bounds{extra} is needed: {need} "
                             f"elements a block, got a block stride of {page} (strides {kv_cache.stride()})")
        self.kv_cache, self.bits, self.summary = kv_cache, bits, summary
        self.k = kv_cache[..., :d].permute(1, 0, 2, 3).unsqueeze(0)
        self.v = kv_cache[..., d:].permute(1, 0, 2, 3).unsqueeze(0)
        bounds = torch.as_strided(kv_cache, (hkv, nb, 2, d), (d2, page, d, 1), kv_cache.storage_offset() + data)
        self.kmin, self.kmax = bounds[None, :, :, 0], bounds[None, :, :, 1]
        self.page_state: dict[str, torch.Tensor] = {}
        if bits:
            width = d * bits // 8
            raw = torch.empty(0, dtype=torch.uint8, device=kv_cache.device)
            start = (kv_cache.storage_offset() + data + hkv * d2) * item
            raw.set_(kv_cache.untyped_storage(), start, (1, hkv, nb, bs, width),
                     (0, bs * width, page * item, width, 1))
            self.page_state[codes_entry(bits)] = raw
        if summary:
            self.page_state[summary.entry] = torch.as_strided(
                kv_cache, (1, hkv, nb, rows, d), (0, rows * d, page, d, 1),
                kv_cache.storage_offset() + data + hkv * d2 + codes)

    def write(self, slot_mapping: torch.Tensor) -> None:
        """After vLLM wrote a pass's keys at ``slot_mapping`` (T,) int64 (block * BS + offset, -1 for padding),
        the bounds of every block written, then its keys' codes or summary."""
        kernels.page_bounds(self.k, self.kmin, self.kmax, slot_mapping)
        if self.bits:
            kernels.page_codes(self.k, self.kmin, self.kmax, self.page_state[codes_entry(self.bits)], slot_mapping,
                               self.bits)
        if self.summary:
            write = kernels.page_stats if self.summary.spread else kernels.page_means
            write(self.k, self.page_state[self.summary.entry], slot_mapping)


class DecodeRows:
    """The decode rows of a step as our rows of shared pages, in buffers allocated at the first ``fill`` (vLLM's
    block table keeps its width from then on) and kept, so that a captured decode step reads them at the same
    addresses every replay. Row b's slot j holds page j of its request, in vLLM's block ``block_table[b, j]``.

    table: (R, C + 1) int64 (C: the block table's width; the last column, the scratch slot, is never read);
    slot_page: (R, 1, C + 1) int64, j for the request's pages, -1 past them; cur_slot: (R, 1); seq_len: (R,) int64.
    """

    def __init__(self, max_rows: int, block_size: int, device: torch.device):
        self.max_rows, self.block_size, self.device = max_rows, block_size, device
        self.table: torch.Tensor | None = None

    def fill(self, block_table: torch.Tensor, seq_lens: torch.Tensor, n: int) -> None:
        """Rows [0, n) from vLLM's block_table (>= n, C) int32 and seq_lens (>= n,) int32, each row's tokens
        including its decode token. A padded row (length 0) reads one token of its first block, vLLM's null block
        there, and its output is dropped."""
        c = block_table.shape[1]
        if self.table is None:
            self.table = torch.zeros(self.max_rows, c + 1, dtype=torch.long, device=self.device)
            self.slot_page = torch.full((self.max_rows, 1, c + 1), -1, dtype=torch.long, device=self.device)
            self.cur_slot = torch.zeros(self.max_rows, 1, dtype=torch.long, device=self.device)
            self.seq_len = torch.ones(self.max_rows, dtype=torch.long, device=self.device)
            self.slot_ids = torch.arange(c + 1, device=self.device)
        if n > self.max_rows or c != self.table.shape[1] - 1:
            raise ValueError(f"DecodeRows: at most {self.max_rows} rows of {self.table.shape[1] - 1} blocks, got "
                             f"{n} of {c}")
        self.table[:n, :c].copy_(block_table[:n])
        seq = seq_lens[:n].clamp(min=1)
        self.seq_len[:n].copy_(seq)
        pages = (seq + self.block_size - 1) // self.block_size
        self.slot_page[:n, 0].copy_(torch.where(self.slot_ids < pages.unsqueeze(1), self.slot_ids, -1))
        self.cur_slot[:n, 0].copy_(pages - 1)

    def layer(self, store: BlockStore, n: int) -> PagedLayer:
        """Rows [0, n) over one layer's store."""
        hkv = store.k.shape[1]
        c = self.table.shape[1]
        return PagedLayer.over(store.k, store.v, store.kmin, store.kmax, self.table[:n],
                               self.slot_page[:n].expand(n, hkv, c), self.cur_slot[:n].expand(n, hkv),
                               store.page_state)


def leading_decodes(cam) -> tuple[int, int]:
    """(requests, tokens) of the batch's leading decode requests: a token each, past their prompt. A request still
    in its prompt is not one even with one token this step (FlashAttention takes it); a CUDA graph's padding
    requests (no token) at the end of a batch of decodes count as decodes. ``cam``: vLLM's CommonAttentionMetadata
    (``num_reqs``, ``query_start_loc_cpu`` (num_reqs + 1,), ``is_prefilling`` (the real requests',) bool or None);
    vLLM's own ``split_decodes_and_prefills`` reads ``is_prefilling`` against the padded requests and fails."""
    n = cam.num_reqs
    start = cam.query_start_loc_cpu[:n + 1]
    prompt = torch.zeros(n, dtype=torch.bool)
    if cam.is_prefilling is not None:
        prompt[:len(cam.is_prefilling)] = cam.is_prefilling[:n]
    later = ((start[1:] - start[:-1]) > 1) | prompt
    decodes = int(later.int().argmax()) if bool(later.any()) else n
    return decodes, int(start[decodes])


class Uncounted(Tally):
    """A tally that counts nothing: vLLM keeps no decode statistics of ours."""

    def __init__(self):
        super().__init__(0, torch.device("cpu"))

    def rows(self, hs: int) -> None:
        return None


def decode(method: Method, layer_idx: int, q: torch.Tensor, store: BlockStore, rows: DecodeRows,
           scale: float) -> torch.Tensor:
    """One layer's attention of the decode rows [0, B) (filled by ``rows.fill``) through ``method``. q: (B, H, D);
    returns (B, H, D)."""
    n = q.shape[0]
    return method.decode(layer_idx, q, rows.layer(store, n), rows.seq_len[:n], scale, Uncounted())
