"""sparsekv's part of the vLLM backend, on vLLM's cache layout, without vLLM: the blocks' key bounds (and lowbit's
codes) kept as vLLM writes keys (prompt chunks, decode tokens, blocks reused with stale contents, padding) equal our
own cache's pages', and a method's decode over vLLM's blocks equals the same method over our own cache."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.errors import ConfigError
from sparsekv.integrations import vllm as plugin
from sparsekv.integrations.vllm.pages import (BlockStore, DecodeRows, Summary, bounds_bytes, code_bits, decode,
                                              leading_decodes, page_summary, tail_bytes)
from sparsekv.kernels import reference
from sparsekv.methods.base import Tally
from sparsekv.methods.landmark import means_entry
from sparsekv.methods.lowbit import codes_entry
from sparsekv.methods.spread import STATS
from sparsekv.spec import build_config


def vllm_cache(blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, layout: str,
               gen: torch.Generator, spare: int = 0, device: str = "cpu", bits: int = 0,
               rows: int = 0) -> torch.Tensor:
    """A layer's cache as vLLM's FlashAttention backend sees it with padded pages: (NB, Hkv, BS, 2D) over pages of
    ``tail_bytes`` (for codes of ``bits`` and ``rows`` summary vectors; plus ``spare`` elements) more than the keys and
    values, filled with garbage (a reused block's stale contents)."""
    d2 = 2 * head_dim
    codes = kv_heads * block_size * head_dim * bits // 8 // torch.empty((), dtype=dtype).element_size()
    page = block_size * kv_heads * d2 + kv_heads * d2 + codes + kv_heads * rows * head_dim + spare
    raw = torch.randn(blocks * page, generator=gen, dtype=torch.float64).mul(50).to(device, dtype)
    if layout == "NHD":
        return torch.as_strided(raw, (blocks, block_size, kv_heads, d2), (page, kv_heads * d2, d2, 1)).transpose(1, 2)
    return torch.as_strided(raw, (blocks, kv_heads, block_size, d2), (page, block_size * d2, d2, 1))


def write(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What vLLM's reshape_and_cache_flash does: token t's key and value (T, Hkv, D) at slot_mapping[t] (-1: not)."""
    d = keys.shape[-1]
    bs = kv_cache.shape[2]
    ok = slot_mapping >= 0
    slots = slot_mapping[ok]
    per_token = kv_cache.transpose(1, 2)  # (NB, BS, Hkv, 2D)
    per_token[..., :d][slots // bs, slots % bs] = keys[ok]
    per_token[..., d:][slots // bs, slots % bs] = values[ok]


class Requests:
    """Requests growing in vLLM's blocks (from a shuffled free list, so blocks are out of order and hold garbage)
    and, beside each, our own cache of one row fed the same keys and values."""

    def __init__(self, kv_cache: torch.Tensor, n: int, gen: torch.Generator, ops=kernels, bits: int = 0,
                 summary: Summary | None = None):
        self.cache = kv_cache
        self.store = BlockStore(kv_cache, bits, summary)
        self.ops = ops
        self.gen = gen
        self.free = torch.randperm(kv_cache.shape[0] - 1, generator=gen).add(1).tolist()  # block 0: vLLM's null block
        self.blocks: list[list[int]] = [[] for _ in range(n)]
        self.length = [0] * n
        bs, hkv, d = kv_cache.shape[2], kv_cache.shape[1], kv_cache.shape[3] // 2
        self.bs, self.hkv, self.d = bs, hkv, d
        self.ours = [PagedKVCache(1, bs) for _ in range(n)]
        self.layers = [None] * n
        self.written: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]

    def feed(self, r: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Our cache of request r takes keys and values (T, Hkv, D) as one pass."""
        self.ours[r].begin(k.shape[0], None, 1, torch.device("cpu"))
        self.layers[r] = self.ours[r].append(0, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
        self.written[r].append((k, v))

    def fork(self, source: int, blocks: int) -> int:
        """A new request whose prompt begins with the first ``blocks`` (full) blocks of ``source``, which it reads
        where they are (vLLM's prefix cache): its index."""
        self.blocks.append(self.blocks[source][:blocks])
        self.length.append(blocks * self.bs)
        self.ours.append(PagedKVCache(1, self.bs))
        self.layers.append(None)
        self.written.append([])
        k, v = (torch.cat(t)[:blocks * self.bs] for t in zip(*self.written[source]))
        self.feed(len(self.blocks) - 1, k, v)
        return len(self.blocks) - 1

    def step(self, counts: list[int], padding: int = 0) -> None:
        """One forward: ``counts[r]`` new tokens of request r (0: none), written as vLLM writes a batch, then the
        bounds (and codes, means) of the blocks written, by ``ops``; ``padding`` trailing slots of -1 (a padded
        CUDA-graph batch)."""
        slots, keys, values = [], [], []
        for r, c in enumerate(counts):
            if not c:
                continue
            k = torch.randn(c, self.hkv, self.d, generator=self.gen, dtype=torch.float64).mul(3)
            v = torch.randn(c, self.hkv, self.d, generator=self.gen, dtype=torch.float64)
            k, v = k.to(self.cache.dtype), v.to(self.cache.dtype)
            for pos in range(self.length[r], self.length[r] + c):
                if pos % self.bs == 0:
                    self.blocks[r].append(self.free.pop())
                slots.append(self.blocks[r][pos // self.bs] * self.bs + pos % self.bs)
            self.length[r] += c
            keys.append(k)
            values.append(v)
            self.feed(r, k, v)
        dev = self.cache.device
        slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.long, device=dev)
        pad = torch.zeros(padding, self.hkv, self.d, dtype=self.cache.dtype)
        write(self.cache, torch.cat(keys + [pad]).to(dev), torch.cat(values + [pad]).to(dev), slot_mapping)
        store = self.store
        self.ops.page_bounds(store.k, store.kmin, store.kmax, slot_mapping)
        if store.bits:
            self.ops.page_codes(store.k, store.kmin, store.kmax, store.page_state[codes_entry(store.bits)],
                                slot_mapping, store.bits)
        if store.summary:
            keep = self.ops.page_stats if store.summary.spread else self.ops.page_means
            keep(store.k, store.page_state[store.summary.entry], slot_mapping)

    def block_table(self) -> torch.Tensor:
        width = max(map(len, self.blocks)) + 2
        table = torch.zeros(len(self.blocks), width, dtype=torch.int32)
        for r, blocks in enumerate(self.blocks):
            table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table


def grown(dtype=torch.float64, layout="NHD", seed=0, ops=kernels, device="cpu", bits=0, summary=None) -> Requests:
    """Three requests: prompts in chunks that start and end mid-block, one prompt finishing while the others
    decode, then decode steps together, the last batch padded; ``ops``: the module whose ``page_bounds``,
    ``page_codes``, ``page_means`` and ``page_stats`` keep the blocks' bounds, codes of ``bits`` (0: none) and
    ``summary`` (``pages.Summary``, None: none);
    vLLM's cache on ``device`` (our own caches stay on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    rows = summary.rows if summary else 0
    reqs = Requests(vllm_cache(40, 2, 4, 8, dtype, layout, gen, device=device, bits=bits, rows=rows), 3, gen, ops,
                    bits, summary)
    for counts in ([6, 9, 0], [5, 1, 13], [1, 7, 2], [1, 1, 3], [1, 1, 1], [1, 1, 1]):
        reqs.step(counts)
    reqs.step([1, 1, 1], padding=2)
    return reqs


def with_page_state(reqs: Requests) -> None:
    """Our caches' layers get lowbit's codes, landmark's means or spread's stats of every page, as those methods'
    prefill makes them."""
    bits, summary = reqs.store.bits, reqs.store.summary
    for r, layer in enumerate(reqs.layers):
        if bits:
            layer.slot_state[codes_entry(bits)] = reference.key_codes(layer.k, layer.kmin, layer.kmax, bits)
        if summary:
            n = torch.tensor([reqs.length[r]])
            kept = (reference.page_spreads(layer.k, layer.slot_page, n) if summary.spread
                    else reference.page_landmarks(layer.k, layer.slot_page, n, summary.rows))
            layer.slot_state[summary.entry] = reference.to_cache(kept, layer.k.dtype)


def assert_blocks_equal_our_pages(reqs: Requests) -> None:
    bits, summary = reqs.store.bits, reqs.store.summary
    with_page_state(reqs)
    for r, blocks in enumerate(reqs.blocks):
        ours = reqs.layers[r]
        for j, block in enumerate(blocks):
            assert torch.equal(reqs.store.kmin[0, :, block], ours.kmin[0, :, j]), (r, j)
            assert torch.equal(reqs.store.kmax[0, :, block], ours.kmax[0, :, j]), (r, j)
            n = min(reqs.bs, reqs.length[r] - j * reqs.bs)
            assert torch.equal(reqs.store.k[0, :, block, :n], ours.k[0, :, j, :n])
            assert torch.equal(reqs.store.v[0, :, block, :n], ours.v[0, :, j, :n])
            if bits:
                codes = reqs.store.page_state[codes_entry(bits)]
                assert torch.equal(codes[0, :, block, :n], ours.slot_state[codes_entry(bits)][0, :, j, :n]), (r, j)
            if summary:
                kept = reqs.store.page_state[summary.entry]
                assert torch.equal(kept[0, :, block], ours.slot_state[summary.entry][0, :, j]), (r, j)


def summary_of(spec: str) -> Summary | None:
    """What a block keeps for the method of ``spec`` (pages of 4)."""
    return page_summary(build_config(spec + ("," if ":" in spec else ":") + "page_size=4"))


@pytest.mark.parametrize("bits, spec", [(0, "quest"), (1, "quest"), (2, "quest"), (4, "quest"),
                                        (0, "landmark:landmarks=2"), (0, "landmark:landmarks=4"),
                                        (2, "landmark:landmarks=1"), (0, "spread"), (2, "spread")])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_block_bounds_equal_our_pages(dtype, layout, bits, spec):
    assert_blocks_equal_our_pages(grown(dtype, layout, bits=bits, summary=summary_of(spec)))


def test_shared_prefix_blocks_hold_for_every_reader():
    """vLLM's prefix cache: a request whose prompt begins with another's full blocks reads them where they are;
    their bounds, written once, are its own cache's, and its decode over them equals its own cache's."""
    reqs = grown()
    shared = reqs.fork(0, 2)  # request 0's first 2 blocks (8 of its tokens)
    reqs.step([0, 0, 0, 5])  # the rest of its prompt, into blocks of its own
    reqs.step([1, 1, 1, 1])
    assert reqs.blocks[shared][:2] == reqs.blocks[0][:2]
    assert_blocks_equal_our_pages(reqs)
    config = build_config("quest:token_budget=8,dense_layers=0,page_size=4")
    rows = DecodeRows(4, reqs.bs, torch.device("cpu"))
    rows.fill(reqs.block_table(), torch.tensor(reqs.length, dtype=torch.int32), 4)
    q = torch.randn(4, 4, reqs.d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out = decode(config.method_class()(config, 1), 0, q, reqs.store, rows, 0.3)
    for r in range(4):
        ours = config.method_class()(config, 1).decode(0, q[r:r + 1], reqs.layers[r], torch.tensor([reqs.length[r]]),
                                                       0.3, Tally(1, q.device))
        torch.testing.assert_close(out[r:r + 1], ours, rtol=1e-12, atol=1e-12)


def test_bounds_change_only_the_end_of_the_written_blocks():
    """The bounds live past each block's keys and values (and before vLLM's own padding, if any): writing them
    changes nothing else."""
    gen = torch.Generator().manual_seed(3)
    cache = vllm_cache(6, 2, 4, 8, torch.float64, "NHD", gen, spare=5)
    page = cache.stride(0)
    flat = torch.as_strided(cache, (6 * page,), (1,))
    before = flat.clone()
    BlockStore(cache).write(torch.tensor([8, 9, 10, -1]))  # block 2, offsets 0-2
    changed = (flat != before).nonzero().squeeze(1)
    data = 4 * 2 * 16
    assert changed.min() >= 2 * page + data and changed.max() < 2 * page + data + 2 * 16
    keys = cache[2, :, :3, :8]  # (Hkv, 3, D)
    bounds = flat[2 * page + data:2 * page + data + 32].view(2, 2, 8)  # per KV head: min, max
    assert torch.equal(bounds[:, 0], keys.amin(1)) and torch.equal(bounds[:, 1], keys.amax(1))


def test_codes_change_only_their_place_in_the_written_blocks():
    """lowbit's codes follow the bounds in the page's tail: writing a block changes its bounds and codes only."""
    gen = torch.Generator().manual_seed(3)
    cache = vllm_cache(6, 2, 4, 8, torch.float32, "HND", gen, spare=3, bits=4)
    page = cache.stride(0)
    flat = torch.as_strided(cache, (6 * page,), (1,))
    before = flat.clone()
    store = BlockStore(cache, 4)
    store.write(torch.tensor([-1, 12, 13]))  # block 3, offsets 0-1
    changed = (flat != before).nonzero().squeeze(1)
    data = 4 * 2 * 16
    codes = 2 * 4 * 8 * 4 // 8 // 4  # elements of float32
    assert changed.min() >= 3 * page + data and changed.max() < 3 * page + data + 2 * 16 + codes
    want = reference.key_codes(store.k[0, :, 3], store.kmin[0, :, 3], store.kmax[0, :, 3], 4)
    assert torch.equal(store.page_state[codes_entry(4)][0, :, 3, :2], want[:, :2])


def test_means_change_only_their_place_in_the_written_blocks():
    """landmark's means follow the bounds in the page's tail: writing a block changes its bounds and means only;
    a block's means are of its keys up to the last one written."""
    gen = torch.Generator().manual_seed(3)
    cache = vllm_cache(6, 2, 4, 8, torch.float64, "NHD", gen, spare=3, rows=2)
    page = cache.stride(0)
    flat = torch.as_strided(cache, (6 * page,), (1,))
    before = flat.clone()
    store = BlockStore(cache, summary=Summary(means_entry(2), 2))
    store.write(torch.tensor([-1, 4, 5, 6]))  # block 1, offsets 0-2
    changed = (flat != before).nonzero().squeeze(1)
    data = 4 * 2 * 16
    assert changed.min() >= page + data and changed.max() < page + data + 2 * 16 + 2 * 2 * 8
    keys = store.k[0, :, 1]  # (Hkv, BS, D)
    want = torch.stack([keys[:, :2].mean(1), keys[:, 2]], 1)  # runs of 2 tokens: 2 stored, then 1
    assert torch.equal(store.page_state[means_entry(2)][0, :, 1], want)


def test_tail_bytes_and_a_page_too_short():
    assert bounds_bytes(8, 128, torch.bfloat16) == 4096
    quest, lowbit = build_config("quest:page_size=16"), build_config("lowbit:page_size=16,bits=2")
    assert (code_bits(quest), code_bits(lowbit)) == (0, 2)
    assert tail_bytes(quest, 8, 16, 128, torch.bfloat16) == 4096
    assert tail_bytes(lowbit, 8, 16, 128, torch.bfloat16) == 4096 + 8 * 16 * 128 * 2 // 8
    landmark = build_config("landmark:page_size=16,landmarks=4")
    assert (code_bits(landmark), page_summary(landmark), page_summary(quest)) == (0, Summary(means_entry(4), 4), None)
    assert tail_bytes(landmark, 8, 16, 128, torch.bfloat16) == 4096 + 8 * 4 * 128 * 2
    spread = build_config("spread:page_size=16")
    assert page_summary(spread) == Summary(STATS, 2, spread=True)
    assert tail_bytes(spread, 8, 16, 128, torch.bfloat16) == 4096 + 8 * 2 * 128 * 2
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(5, 4, 2, 8, generator=gen).transpose(1, 2)  # FlashAttention's cache without the room
    with pytest.raises(ValueError, match="room for the bounds"):
        BlockStore(plain)
    bounds_only = vllm_cache(5, 2, 4, 8, torch.float32, "NHD", gen)
    BlockStore(bounds_only)
    with pytest.raises(ValueError, match="room for the bounds and codes"):
        BlockStore(bounds_only, 2)
    with pytest.raises(ValueError, match="room for the bounds and summaries"):
        BlockStore(bounds_only, 0, Summary(STATS, 2, spread=True))


SPECS = ["quest:token_budget=8,dense_layers=0", "quest:token_budget=8,dense_layers=0,per_query_head=true",
         "spread:token_budget=8,dense_layers=0", "sparq:token_budget=8,dense_layers=0,channels=3",
         "landmark:token_budget=8,dense_layers=0",
         "oracle:token_budget=8,dense_layers=0",
         "quest:token_budget=8,dense_layers=1",
         "lowbit:token_budget=8,dense_layers=0", "lowbit:token_budget=8,dense_layers=0,bits=4,per_query_head=true",
         "lowbit:token_budget=8,dense_layers=0,bits=1"]


@pytest.mark.parametrize("spec", SPECS)
def test_decode_over_blocks_equals_our_cache(spec):
    """Each row's output through vLLM's blocks (batched, a padded row at the end) equals the same method over the
    row's own cache (float64, references); the budget of 2 pages leaves most pages out."""
    config = build_config(spec + ",page_size=4")
    reqs = grown(bits=code_bits(config), summary=page_summary(config))
    with_page_state(reqs)
    method = config.method_class()(config, 2)
    n = len(reqs.blocks)
    rows = DecodeRows(n + 1, reqs.bs, torch.device("cpu"))
    table = torch.cat([reqs.block_table(), torch.zeros(1, reqs.block_table().shape[1], dtype=torch.int32)])
    rows.fill(table, torch.tensor(reqs.length + [0], dtype=torch.int32), n + 1)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n + 1, 4, reqs.d, generator=gen, dtype=torch.float64)
    out = decode(method, 1, q, reqs.store, rows, 0.3)
    for r in range(n):
        ours = config.method_class()(config, 2).decode(1, q[r:r + 1], reqs.layers[r],
                                                        torch.tensor([reqs.length[r]]), 0.3, Tally(1, q.device))
        torch.testing.assert_close(out[r:r + 1], ours, rtol=1e-12, atol=1e-12)
    assert out[:n].isfinite().all()


def test_leading_decodes():
    """Decodes first (a token each, past their prompt); a prompt's last single token is not one; a CUDA graph's
    padding requests (no token, no ``is_prefilling`` entry) after decodes count as decodes."""
    from types import SimpleNamespace

    def batch(starts, prefilling):
        return SimpleNamespace(num_reqs=len(starts) - 1, query_start_loc_cpu=torch.tensor(starts),
                               is_prefilling=None if prefilling is None else torch.tensor(prefilling))

    assert leading_decodes(batch([0, 1, 2, 3], [False] * 3)) == (3, 3)
    assert leading_decodes(batch([0, 1, 2, 3, 3], [False] * 3)) == (4, 3)  # one padding request
    assert leading_decodes(batch([0, 1, 2, 40], [False, False, True])) == (2, 2)
    assert leading_decodes(batch([0, 1, 2, 3], [False, True, False])) == (1, 1)  # a prompt's last token
    assert leading_decodes(batch([0, 30, 31], [True, False])) == (0, 0)
    assert leading_decodes(batch([0, 1, 9, 9], [False, True])) == (1, 1)  # prefill, then padding
    assert leading_decodes(batch([0, 1, 2], None)) == (2, 2)


def test_method_config():
    cfg = plugin.method_config({"sparsekv": "quest:token_budget=2048"}, 16, 32)
    assert (cfg.token_budget, cfg.page_size, cfg.dense_layers) == (2048, 16, 2)
    cases = [({}, "additional_config"), ({"sparsekv": 3}, "additional_config"),
             ({"sparsekv": "raas"}, "method must be one of quest, lowbit, spread, sparq, landmark, oracle"),
             ({"sparsekv": "lowbit:reuse=4"}, "reuse must be 1 inside vLLM"),
             ({"sparsekv": "quest:token_budget=2048"}, "page_size must be vLLM's block size \\(32\\)"),
             ({"sparsekv": "oracle:granularity=token"}, "granularity"),
             ({"sparsekv": "quest:dense_layers=40"}, "dense_layers"),
             ({"sparsekv": "quest:token_budget=100"}, "token_budget")]
    for extra, match in cases:
        block = 32 if "page_size" in match else 16
        with pytest.raises(ConfigError, match=match):
            plugin.method_config(extra, block, 32)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_says_what_is_missing():
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'"):
        plugin.require_vllm()
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'"):
        importlib.import_module("sparsekv.integrations.vllm.backend")


def test_entry_point_names_register():
    from importlib.metadata import entry_points

    (point,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "sparsekv"]
    assert point.value == "sparsekv.integrations.vllm:register"


triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_read_vllm_blocks(dtype, layout):
    """The Triton kernels on vLLM's padded blocks: bounds, codes, means and spread's stats equal the reference's;
    Quest's, lowbit's, landmark's and spread's choices and the sparse decode through the rows' table equal the
    reference ops on the same views."""
    from sparsekv.kernels import reference as ref
    from sparsekv.kernels import triton as tops

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reqs = grown(dtype, layout, seed=4, ops=tops, device=dev, bits=2, summary=summary_of("landmark"))
    twin = grown(dtype, layout, seed=4, ops=ref, bits=2, summary=summary_of("landmark"))
    for got, want in ((reqs.store.kmin, twin.store.kmin), (reqs.store.kmax, twin.store.kmax),
                      (reqs.store.page_state[codes_entry(2)], twin.store.page_state[codes_entry(2)]),
                      (reqs.store.page_state[means_entry(2)], twin.store.page_state[means_entry(2)])):
        assert torch.equal(got.cpu(), want)
    n = len(reqs.blocks)
    rows = DecodeRows(n, reqs.bs, dev)
    rows.fill(reqs.block_table().to(dev), torch.tensor(reqs.length, dtype=torch.int32, device=dev), n)
    layer = rows.layer(reqs.store, n)
    q = torch.randn(n, 4, reqs.d, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
    args = (q, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot, 2, False, True, layer.table)
    slots = tops.quest_select(*args)
    want = ref.quest_select(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    assert torch.equal(slots.sort(-1).values.cpu(), want.sort(-1).values)
    seq = rows.seq_len[:n]
    got = tops.sparse_decode(q, layer.k, layer.v, layer.slot_page, slots, seq, 0.3, None, False, layer.table)
    want = ref.sparse_decode(q, layer.k, layer.v, layer.slot_page, slots, seq, 0.3, None, False, layer.table)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert got.device.type == dev.type
    codes = reqs.store.page_state[codes_entry(2)]
    for per_query_head in (False, True):
        hs = 4 if per_query_head else 2
        args = (q.float(), layer.k.float(), layer.kmin.float(), layer.kmax.float(), codes, layer.slot_page,
                layer.cur_slot, seq, seq, None, 0.3, 2, 2, 1, per_query_head, layer.table)
        chosen = [torch.full((n, hs, 2), -7, dtype=torch.long, device=dev) for _ in range(2)]
        tops.lowbit_select(*args[:9], chosen[0], *args[10:])
        ref.lowbit_select(*args[:9], chosen[1], *args[10:])
        assert torch.equal(chosen[0].sort(-1).values, chosen[1].sort(-1).values), per_query_head
    means = reqs.store.page_state[means_entry(2)]
    for per_query_head in (False, True):
        args = (q.float(), layer.k.float(), means.float(), layer.slot_page, layer.cur_slot, seq, 0.3, 2, 1,
                per_query_head, True, layer.table)
        got = tops.landmark_select(*args)
        assert torch.equal(got.sort(-1).values.cpu(), ref.landmark_select(*args).sort(-1).values.cpu()), per_query_head
    spread = grown(dtype, layout, seed=4, ops=tops, device=dev, summary=summary_of("spread"))
    spread_twin = grown(dtype, layout, seed=4, ops=ref, summary=summary_of("spread"))
    stats = spread.store.page_state[STATS]
    # float32 sums in another order: the deviations may differ in their last bit (bf16: after rounding to it)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(stats.float().cpu(), spread_twin.store.page_state[STATS].float(), **tol)
    layer = rows.layer(spread.store, n)
    for per_query_head in (False, True):
        args = (q.float(), layer.k.float(), stats.float(), layer.slot_page, layer.cur_slot, seq, 2.0, 2, 1,
                per_query_head, True, layer.table)
        got = tops.spread_select(*args)
        assert torch.equal(got.sort(-1).values.cpu(), ref.spread_select(*args).sort(-1).values.cpu()), per_query_head
