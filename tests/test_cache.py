"""The paged cache against brute force: token placement, page bounds, padding, growth, eviction reuse."""

import copy

import pytest
import torch

from sparsekv.cache import PagedKVCache, PagedLayer
from sparsekv.kernels.reference import raw  # a tensor's bits: fp8 tensors compare on the CPU


def stored_tokens(layer, b, h, length):
    """Keys of row (b, h) in position order, read back through slot_page."""
    p = layer.page_size
    out = torch.empty(length, layer.k.shape[-1], dtype=layer.k.dtype)
    for slot, page in enumerate(layer.slot_page[b, h].tolist()):
        if page >= 0:
            lo, hi = page * p, min(page * p + p, length)
            out[lo:hi] = layer.k[b, h, slot, : hi - lo]
    return out


def check_bounds(layer, keys_per_row):
    """keys_per_row[b][h]: (L, D) keys in position order; every held page's min/max equals brute force."""
    p = layer.page_size
    for b, rows in enumerate(keys_per_row):
        for h, keys in enumerate(rows):
            held = 0
            for slot, page in enumerate(layer.slot_page[b, h].tolist()):
                if page < 0:
                    continue
                held += 1
                chunk = keys[page * p : page * p + p]
                torch.testing.assert_close(layer.kmin[b, h, slot], chunk.min(0).values, rtol=0, atol=0)
                torch.testing.assert_close(layer.kmax[b, h, slot], chunk.max(0).values, rtol=0, atol=0)
            assert held == -(-len(keys) // p)
            cur_page = layer.slot_page[b, h, layer.cur_slot[b, h]].item()
            assert cur_page == (len(keys) - 1) // p


@pytest.mark.parametrize("length", [1, 15, 16, 17, 1000])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prefill_then_decode_bounds_match_brute_force(length, page_size):
    torch.manual_seed(length + page_size)
    b, h, d = 2, 3, 8
    cache = PagedKVCache(num_layers=1, page_size=page_size)
    keys = torch.randn(b, h, length + 20, d, dtype=torch.float64)
    vals = torch.randn_like(keys)
    cache.begin(length, None, b, keys.device)
    layer = cache.append(0, keys[:, :, :length], vals[:, :, :length])
    check_bounds(layer, [[keys[i, j, :length] for j in range(h)] for i in range(b)])
    for t in range(length, length + 20):  # decode appends, crossing page boundaries
        cache.begin(1, None, b, keys.device)
        layer = cache.append(0, keys[:, :, t : t + 1], vals[:, :, t : t + 1])
    n = length + 20
    check_bounds(layer, [[keys[i, j, :n] for j in range(h)] for i in range(b)])
    for i in range(b):
        for j in range(h):
            torch.testing.assert_close(stored_tokens(layer, i, j, n), keys[i, j, :n], rtol=0, atol=0)
    assert cache.lengths == [n, n] and cache.seq_len.tolist() == [n, n]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_not_stored(side):
    torch.manual_seed(0)
    lengths, s, h, d, p = [5, 13, 1], 13, 2, 4, 4
    keys = torch.randn(3, h, s, d)
    valid = torch.zeros(3, s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if side == "left":
            valid[i, s - n :] = True
        else:
            valid[i, :n] = True
    cache = PagedKVCache(num_layers=1, page_size=p)
    plan = cache.begin(s, valid, 3, keys.device)
    layer = cache.append(0, keys, keys)
    assert cache.lengths == lengths and plan.prev_len == [0, 0, 0]
    rows = [[keys[i, j][valid[i]] for j in range(h)] for i in range(3)]
    check_bounds(layer, rows)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(stored_tokens(layer, i, 0, n), rows[i][0])
    # Decode keeps every sequence's own positions.
    step = torch.randn(3, h, 1, d)
    cache.begin(1, None, 3, keys.device)
    layer = cache.append(0, step, step)
    assert cache.lengths == [n + 1 for n in lengths]
    check_bounds(layer, [[torch.cat([rows[i][j], step[i, j]]) for j in range(h)] for i in range(3)])


def test_padding_after_prompt_is_refused():
    cache = PagedKVCache(num_layers=1, page_size=4)
    cache.begin(3, None, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="padding is only supported before a sequence.s first token"):
        cache.begin(2, torch.tensor([[True, True], [False, True]]), 2, torch.device("cpu"))


def test_a_prompt_without_a_mask_plans_as_one_of_real_tokens():
    """``begin(valid=None)`` (no padding: a server's prompts) plans each chunk as a mask of ones does, without reading
    the mask's counts back from the device."""
    plans = []
    for valid in (None, torch.ones(2, 10, dtype=torch.bool)):
        cache = PagedKVCache(num_layers=1, page_size=4)
        for i, n in enumerate((3, 4, 3)):
            chunk = None if valid is None else valid[:, :n]
            plans.append(cache.begin(n, chunk, 2, torch.device("cpu"), prompt_end=i == 2))
        plans.append(cache.begin(1, None, 2, torch.device("cpu")))  # a decode pass
    for got, want in zip(plans[:4], plans[4:]):
        assert got.prev_len == want.prev_len and got.new_len == want.new_len and got.prompt == want.prompt
        assert got.prompt_end == want.prompt_end and torch.equal(got.position, want.position)
        assert torch.equal(got.valid, want.valid) and torch.equal(got.prev_seq_len, want.prev_seq_len)
    assert plans[3].new_len == [11, 11]


def test_growth_keeps_contents_and_freed_slots_are_reused():
    torch.manual_seed(1)
    cache = PagedKVCache(num_layers=1, page_size=2)
    keys = torch.randn(1, 2, 40, 4)
    cache.begin(3, None, 1, keys.device)
    layer = cache.append(0, keys[:, :, :3], keys[:, :, :3])
    first_capacity = layer.capacity
    for t in range(3, 30):
        cache.begin(1, None, 1, keys.device)
        layer = cache.append(0, keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    assert layer.capacity > first_capacity
    torch.testing.assert_close(stored_tokens(layer, 0, 1, 30), keys[0, 1, :30])

    # Free the slots of pages 3 and 5 in head 0 only; the next new page takes the lowest of them.
    slots = torch.tensor([[[3, 5], [0, 0]]])
    layer.free(slots, torch.tensor([[[True, True], [False, False]]]))
    assert (layer.slot_page[0, 0] == 3).sum() == 0 and (layer.slot_page[0, 1] == 3).sum() == 1
    for t in range(30, 32):  # position 30 starts page 15
        cache.begin(1, None, 1, keys.device)
        layer = cache.append(0, keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    assert layer.slot_page[0, 0, 3].item() == 15
    assert layer.cur_slot[0, 0].item() == 3
    torch.testing.assert_close(layer.k[0, 0, 3], keys[0, 0, 30:32])
    torch.testing.assert_close(layer.kmax[0, 0, 3], keys[0, 0, 30:32].max(0).values)


def test_max_pages_caps_allocation():
    cache = PagedKVCache(num_layers=1, page_size=4, max_pages=3)
    cache.begin(12, None, 1, torch.device("cpu"))
    layer = cache.append(0, torch.randn(1, 1, 12, 2), torch.randn(1, 1, 12, 2))
    assert layer.capacity == 3


@pytest.mark.parametrize("page_size", [0, 3, 512, 2.0])
def test_bad_page_size(page_size):
    with pytest.raises(ValueError, match="page_size must be a power of two from 1 to 256"):
        PagedKVCache(num_layers=1, page_size=page_size)


def test_unsupported_dtype():
    cache = PagedKVCache(num_layers=1, page_size=4)
    cache.begin(2, None, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype torch.int32 is not supported"):
        cache.append(0, torch.zeros(1, 1, 2, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32))


DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_append_matches_scatter_append(page_size, device, dtype):
    """A decode step's token goes through the fused ``append_token`` op (the Triton kernel on CUDA); the general
    scatter path must leave the same pages, bounds and current slots: across page boundaries, into freed slots,
    and with a padded row."""
    torch.manual_seed(page_size)
    b, h, d = 3, 2, 8
    cache = PagedKVCache(num_layers=1, page_size=page_size)
    valid = torch.tensor([[True], [False], [True]], device=device)  # a one-token prompt with row 1 padded
    keys = torch.randn(b, h, 1, d, device=device, dtype=dtype)
    layer = None
    for t in range(14):
        plan = cache.begin(1, valid if t == 0 else None, b, keys.device)
        if t == 9:  # free two held pages of one head; the next new pages take the lowest freed slot
            layer.free(torch.tensor([[[0, 1]] * h] * b, device=device),
                       torch.tensor([[[True, True], [False, False]]] * b, device=device))
        if layer is not None and layer.capacity < cache.needed_pages(layer):
            layer.grow(2 * cache.needed_pages(layer))
        if layer is not None:
            twin = copy.deepcopy(layer)
            twin.scatter_append(keys, keys + 1, plan)
        layer = cache.append(0, keys, keys + 1)
        if t > 0:
            for name in ("k", "v", "kmin", "kmax", "slot_page", "cur_slot"):
                assert torch.equal(getattr(layer, name), getattr(twin, name)), (t, name)
        keys = torch.randn(b, h, 1, d, device=device, dtype=dtype)


def test_shared_pages_assign_release_move_and_runs():
    """A pool's page table: rows take the lowest free store pages, give them back in order (so that later rows
    take them in runs), move by their table; a row holds none twice, and the pages asked must be free."""
    from sparsekv.cache import SharedPages

    shared = SharedPages(rows=3, slots=6, pages=10, device=torch.device("cpu"))
    shared.assign(0, 4)
    shared.assign(1, 3)
    assert shared.held[:2] == [[0, 1, 2, 3], [4, 5, 6]] and shared.free_pages == 3
    assert shared.table[1].tolist() == [4, 5, 6, 10, 10, 10, 10]
    shared.release(0)
    shared.assign(2, 6)  # the lowest free pages: the released row's four, then the first never used
    assert shared.held[2] == [0, 1, 2, 3, 7, 8] and shared.runs(2, 6) == [(0, 0, 4), (4, 7, 2)]
    assert shared.runs(2, 3) == [(0, 0, 3)]
    shared.move(0, 2)
    assert shared.held[0] == [0, 1, 2, 3, 7, 8] and shared.held[2] == [] and bool((shared.table[2] == 10).all())
    with pytest.raises(ValueError, match="1 pages asked for row 0, which holds 6"):
        shared.assign(0, 1)
    with pytest.raises(ValueError, match="2 pages asked for row 2, which holds 0, with 1 free"):
        shared.assign(2, 2)
    with pytest.raises(ValueError, match="row 1 holds pages already"):
        shared.move(1, 0)
    # A prompt's table beside the pool's: its row takes pages from the same free list; a pool row takes them over
    # (nothing copied) and grows by the pages of its new tokens.
    shared.release(1)
    job = shared.beside(1)
    job.assign(0, 2)
    assert job.held[0] == [4, 5] and shared.free_pages == 2
    shared.move(1, 0, job)
    assert job.held[0] == [] and bool((job.table == 10).all()) and shared.table[1, :2].tolist() == [4, 5]
    shared.assign(1, 4)
    assert shared.held[1] == [4, 5, 6, 9] and shared.runs(1, 4) == [(0, 4, 3), (3, 9, 1)]
    assert shared.free_pages == 0
    with pytest.raises(ValueError, match="not over the same store pages"):
        shared.move(2, 0, SharedPages(rows=1, slots=6, pages=10, device=torch.device("cpu")))
    for row in range(3):
        shared.release(row)
    job.release(0)
    assert sorted(shared.free) == list(range(10)) and bool((shared.table == 10).all())


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_prompt_prefilled_into_shared_pages_matches_a_cache_of_its_own(kv_dtype):
    """A prompt's passes written through a table beside a pool's (``SharedPages.beside``, ``PagedLayer.beside``)
    into store pages that lie in two runs, in chunks that start and end inside pages, leave the same keys, values,
    bounds, page table and current slot as a cache of its own, and ``row_tokens`` (what the prompt's attention reads)
    gives the same keys and values; a pool row then takes the pages with nothing copied and reads the same."""
    from sparsekv.cache import PagedLayer, SharedPages, storage_dtype

    torch.manual_seed(0)
    cpu, h, d, p, n = torch.device("cpu"), 2, 8, 4, 23  # 6 pages, the last one partial
    shared = SharedPages(rows=2, slots=8, pages=12, device=cpu)
    pool = PagedLayer(2, h, d, p, 8, storage_dtype(kv_dtype, torch.float32), cpu, shared)
    shared.assign(0, 2)
    shared.assign(1, 1)
    shared.release(0)
    table = shared.beside(1)
    table.assign(0, 6)
    assert table.runs(0, 6) == [(0, 0, 2), (2, 3, 4)]
    own = PagedKVCache(num_layers=1, page_size=p, kv_dtype=kv_dtype)
    into = PagedKVCache(num_layers=1, page_size=p, kv_dtype=kv_dtype)
    into.layers = [pool.beside(table)]
    chunks = [5, 3, 9, 6]
    for i, s in enumerate(chunks):
        k, v = torch.randn(1, h, s, d), torch.randn(1, h, s, d)
        for cache in (own, into):
            cache.begin(s, None, 1, cpu, prompt_end=i == len(chunks) - 1)
            cache.append(0, k, v)
    mine, theirs = own.layers[0], into.layers[0]
    for name, pages in theirs.row_pages(0, 6).items():
        assert torch.equal(raw(pages), raw(getattr(mine, name)[0, :, :6])), name
    assert torch.equal(theirs.slot_page, mine.slot_page[:, :, :9]) and torch.equal(theirs.cur_slot, mine.cur_slot)
    for got, want in zip(theirs.row_tokens(0, n), mine.row_tokens(0, n)):
        assert got.shape == (1, h, n, d) and torch.equal(raw(got), raw(want))
    for start, end in [(5, 23), (8, 16), (9, 11), (12, 23)]:  # across the runs, inside one, inside one page
        for got, want in zip(theirs.row_tokens(0, end, start), mine.row_tokens(0, n)):
            assert torch.equal(raw(got), raw(want[:, :, start:end])), (start, end)
    # The first 8 tokens lie in one run of store pages: read where they lie, nothing gathered.
    for got, want, store in zip(theirs.row_tokens(0, 8), mine.row_tokens(0, 8), (pool.k, pool.v)):
        assert got.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
        assert torch.equal(raw(got), raw(want))
    shared.move(0, 0, table)
    pool.copy_row(0, theirs, 0, 6, moved=True)
    assert table.held[0] == [] and shared.held[0] == [0, 1, 3, 4, 5, 6]
    for name, pages in pool.row_pages(0, 6).items():
        assert torch.equal(raw(pages), raw(getattr(mine, name)[0, :, :6])), name
    assert torch.equal(pool.cur_slot[:1], mine.cur_slot)


@pytest.mark.parametrize("device", [d for d, _ in DEVICES])
@pytest.mark.parametrize("used", [1, 4, 7])
def test_a_row_goes_to_a_host_copy_and_back_unchanged(device, used):
    """A row's pages, bounds, page table and per-slot state go to a host copy (``host_copy``: slot-major, page-locked
    on CUDA), whose copied slots are one dense block, and back into another row unchanged (float64, awkward shapes:
    3 heads, pages of 3 tokens, head_dim 5, 7 slots)."""
    torch.manual_seed(used)
    h, d, p, c = 3, 5, 3, 7
    pool = PagedLayer(2, h, d, p, c, torch.float64, torch.device(device))
    for name in pool.paged:
        getattr(pool, name).copy_(torch.randn_like(getattr(pool, name)))
    pool.slot_page[0, :, :used] = torch.arange(used, device=device)
    pool.cur_slot[0] = used - 1
    pool.slot_state["stamp"] = torch.randn(pool.slot_page.shape, dtype=torch.float64, device=device)
    host = PagedLayer(1, h, d, p, c, torch.float64, torch.device("cpu"), host_copy=True)
    host.copy_row(0, pool, 0, used)
    if device == "cuda":
        torch.cuda.synchronize()
        assert host.k.is_pinned() and host.slot_page.is_pinned()
    for name in (*pool.paged, "slot_page"):
        block = getattr(host, name)[0, :, :used]
        assert block.transpose(0, 1).is_contiguous(), name
        assert torch.equal(block, getattr(pool, name)[0, :, :used].cpu()), name
    assert torch.equal(host.slot_state["stamp"][0, :, :used], pool.slot_state["stamp"][0, :, :used].cpu())
    pool.copy_row(1, host, 0, used)
    for name in (*pool.paged, "slot_page"):
        assert torch.equal(getattr(pool, name)[1, :, :used], getattr(pool, name)[0, :, :used]), name
    assert torch.equal(pool.cur_slot[1], pool.cur_slot[0])
    assert torch.equal(pool.slot_state["stamp"][1, :, :used], pool.slot_state["stamp"][0, :, :used])
    assert bool((pool.slot_page[1, :, used:] == -1).all())


@pytest.mark.parametrize("device", [d for d, _ in DEVICES])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_row_in_shared_pages_goes_to_a_host_copy_and_back_into_other_runs(device, kv_dtype):
    """In shared pages: a row whose store pages lie in two runs goes to a host copy (gathered), and comes back into
    a row whose pages lie in two runs of other pages (one transfer, one scatter), holding the same keys, values,
    bounds and page table (float64 or fp8, 3 heads, pages of 3 tokens, head_dim 5)."""
    from sparsekv.cache import SharedPages, storage_dtype

    torch.manual_seed(1)
    dev, h, d, p, used = torch.device(device), 3, 5, 3, 5
    shared = SharedPages(rows=4, slots=7, pages=16, device=dev)
    pool = PagedLayer(4, h, d, p, 7, storage_dtype(kv_dtype, torch.float64), dev, shared)
    for name in pool.paged:
        t = getattr(pool, name)
        raw(t).copy_(raw(torch.randn(t.shape, dtype=torch.float64, device=dev).to(t.dtype)))
    shared.assign(1, 2)
    shared.assign(0, 2)
    shared.release(1)
    shared.assign(2, 1)
    shared.assign(0, 3)
    assert len(shared.runs(0, used)) == 2
    pool.slot_page[0, :, :used] = torch.arange(used, device=dev)
    pool.cur_slot[0] = used - 1
    host = PagedLayer(1, h, d, p, 7, pool.k.dtype, torch.device("cpu"), host_copy=True)
    host.copy_row(0, pool, 0, used)
    shared.assign(1, 1)
    shared.assign(3, 1)
    shared.release(1)
    shared.assign(2, 1)
    shared.assign(1, used)
    assert len(shared.runs(1, used)) == 2 and not set(shared.held[1]) & set(shared.held[0])
    pool.copy_row(1, host, 0, used)
    for name, pages in pool.row_pages(1, used).items():
        assert torch.equal(raw(pages), raw(pool.row_pages(0, used)[name])), name
    assert torch.equal(pool.slot_page[1, :, :used], pool.slot_page[0, :, :used])
    assert torch.equal(pool.cur_slot[1], pool.cur_slot[0])
