"""The Triton kernels against the float64 reference ops.

Without a GPU the kernels run in Triton's CPU interpreter on small shapes; with one, on CUDA with the larger shapes
too. Error budget: at most about twice the error of PyTorch's own path in the same dtype (the reference ops on
bf16/fp16 inputs, fp32 accumulation), both measured against float64 on the same rounded inputs.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET=1 (set by tests/conftest.py before triton is imported) is missing",
                allow_module_level=True)

from sparsekv.kernels import reference as ref  # noqa: E402
from sparsekv.kernels import triton as tops  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
# The page-score kernel multiplies free slots' infinite bounds before masking them, and an empty token row takes the
# log of 0 (numpy warns in the interpreter); both are masked.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")]
F64 = torch.float64


def rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output"
    return ((out.to(F64) - exact).norm() / exact.norm().clamp(min=1e-30)).item()


def make_cache(batch, kv_heads, head_dim, page_size, lengths, dtype, spare=2, seed=0, in_order=False):
    """A filled paged cache with pages scattered over the slots (as after evictions; ``in_order``: slot j holds
    page j), free slots, garbage in the unwritten rows, and exact key bounds. Returns k, v, kmin, kmax, slot_page,
    cur_slot, seq_len."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    seq_len = torch.tensor(lengths, device=DEV)
    pages = (seq_len + page_size - 1) // page_size  # (B,)
    cap = max(-(-n // page_size) for n in lengths) + spare
    shape = (batch, kv_heads, cap + 1, page_size, head_dim)
    k = torch.randn(shape, generator=g, device=DEV)
    v = torch.randn(shape, generator=g, device=DEV).to(dtype)
    perm = torch.rand(batch, kv_heads, cap, generator=g, device=DEV).argsort(-1)  # slot of page i = perm[..., i]
    if in_order:
        perm = torch.arange(cap, device=DEV).expand(batch, kv_heads, cap)
    rank = torch.arange(cap, device=DEV).expand(batch, kv_heads, cap)
    slot_page = torch.full((batch, kv_heads, cap + 1), -1, dtype=torch.long, device=DEV)
    slot_page.scatter_(2, perm, torch.where(rank < pages.view(-1, 1, 1), rank, -1))
    cur_slot = perm.gather(2, (pages - 1).view(-1, 1, 1).expand(batch, kv_heads, 1)).squeeze(-1)
    pos = slot_page.unsqueeze(-1) * page_size + torch.arange(page_size, device=DEV)
    written = ((slot_page.unsqueeze(-1) >= 0) & (pos < seq_len.view(-1, 1, 1, 1))).unsqueeze(-1)
    k = torch.where(written, k, 1e3).to(dtype)  # unwritten rows must never be attended
    kmin = torch.where(written, k.float(), float("inf")).amin(3).to(dtype)
    kmax = torch.where(written, k.float(), float("-inf")).amax(3).to(dtype)
    return k, v, kmin, kmax, slot_page, cur_slot, seq_len


def up(*ts):
    return [t.to(F64) if t.is_floating_point() else t for t in ts]


def crossed(*axes: dict, full: int = 2, each: int = 1) -> list:
    """Cases over ``axes``, each a dict of id -> the tuple of its arguments' values: on a GPU their product; in the
    CPU interpreter the product of the first ``full`` axes, each case taking the further axes' entries in turn, so
    that every path meets every shape at a fraction of the product's cases. Case n, whose entries of the first axes
    have indices summing to s, takes entry s of the next axis (a Latin square: it changes along each of the first
    axes), and entry s + n // (the product of the lengths of the axes between) of each further one; ``each``: that
    many cases per entry of the first axes, their entries of the next axis spread over it."""
    entries = [list(axis.items()) for axis in axes]
    if ON_GPU:
        combos = list(itertools.product(*entries))
    else:
        combos = []
        heads = itertools.product(*(range(len(axis)) for axis in entries[:full]))
        for n, index in enumerate(heads):
            for r in range(each):
                rest, step = [], 0
                for axis in entries[full:]:
                    shift = n // step if step else r * len(axis) // each
                    rest.append(axis[(sum(index) + shift) % len(axis)])
                    step = (step or 1) * len(axis)
                combos.append((*(axis[i] for axis, i in zip(entries, index)), *rest))
    return [pytest.param(*(v for _, values in combo for v in values), id="-".join(i for i, _ in combo if i))
            for combo in combos]


def cases(params: list) -> dict:
    """A list of pytest.params as an axis of ``crossed``."""
    return {p.id: tuple(p.values) for p in params}


def axis(values: list, ids=str) -> dict:
    """One argument's values as an axis of ``crossed``; ``ids``: a function of the value, or a list."""
    names = ids if isinstance(ids, list) else [ids(v) for v in values]
    return {name: (v,) for name, v in zip(names, values)}


# (batch, heads, kv_heads, head_dim, page_size, lengths, pages selected, per_query_head)
SHAPES = [
    pytest.param(1, 4, 1, 64, 16, [5], 1, False, id="one-page-gqa4"),
    pytest.param(3, 8, 2, 64, 4, [1, 13, 37], 4, False, id="ragged-batch-gqa4"),
    pytest.param(2, 6, 6, 128, 8, [9, 20], 10, False, id="budget-over-context-mha"),
    pytest.param(2, 8, 1, 128, 16, [100, 33], 3, False, id="gqa8"),
    pytest.param(2, 6, 2, 64, 8, [30, 17], 3, False, id="gqa3"),
    pytest.param(2, 8, 4, 64, 4, [21, 6], 3, True, id="per-query-head-gqa2"),
    pytest.param(1, 2, 1, 32, 1, [7], 5, False, id="page-size-1"),
]
if ON_GPU:
    SHAPES += [
        pytest.param(64, 32, 8, 128, 16, [4096 - 37 * i for i in range(64)], 128, False, id="gpu-b64-llama3"),
        pytest.param(16, 32, 32, 128, 16, [8192 - 5 * i for i in range(16)], 64, False, id="gpu-b16-llama2"),
        pytest.param(8, 32, 8, 64, 32, [3000 + 99 * i for i in range(8)], 64, True, id="gpu-b8-d64-per-head"),
        pytest.param(4, 16, 2, 128, 64, [20000, 17, 1000, 5555], 300, False, id="gpu-gqa8-long"),
    ]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,long_rows,dtype", crossed(
    cases(SHAPES), axis([False, True], ["", "long-rows"]), axis(DTYPES)))
def test_page_scores_and_decode(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, dtype,
                                long_rows, monkeypatch):
    """Scores and attention against float64; ``long_rows``: the attention takes the launch of rows of many tokens."""
    if long_rows:
        monkeypatch.setitem(tops.TUNING, "attn_long_tokens", 1)
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, dtype)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(dtype)
    scale = head_dim ** -0.5

    scores = tops.page_scores(q, kmin, kmax, slot_page, per_head)
    exact = ref.page_scores(*up(q, kmin, kmax), slot_page, per_head)
    assert torch.equal(scores.isinf(), exact.isinf()), "free slots must score -inf, and only they"
    fin = exact.isfinite()
    torch_err = rel_err(ref.page_scores(q, kmin, kmax, slot_page, per_head)[fin], exact[fin])
    assert rel_err(scores[fin], exact[fin]) <= 2 * torch_err + 1e-6

    slots = ref.select_pages(exact, cur_slot, n_pages)
    slots[..., -1:] = torch.where(torch.rand(slots.shape[:2], device=DEV) < 0.3, -1, slots[..., -1]).unsqueeze(-1)
    # Twice, adding the attended tokens into running totals (the count is fused into the attention on CUDA).
    attended = torch.full(slots.shape[:2], 5, dtype=torch.long, device=DEV)
    exact = ref.sparse_decode(*up(q, k, v), slot_page, slots, seq_len, scale)
    torch_err = rel_err(ref.sparse_decode(q, k, v, slot_page, slots, seq_len, scale), exact)
    for _ in range(2):
        out = tops.sparse_decode(q, k, v, slot_page, slots, seq_len, scale, attended)
        assert rel_err(out, exact) <= 2 * torch_err
    assert torch.equal(attended, 5 + 2 * ref.count_attended(slot_page, slots, seq_len, page_size))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head", SHAPES)
def test_decode_in_order(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, dtype):
    """Every slot of a layer without holes, read up to each row's length (rows in a layer of far more slots, as in
    a serving pool), against float64 over the same slots, with the slots not read by the kernel; the reference
    refuses slots out of order or a layer with holes."""
    cap = max(-(-n // page_size) for n in lengths)
    k, v, _, _, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, dtype,
                                                   spare=cap + 3, in_order=True)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(dtype)
    slots = torch.arange(slot_page.shape[2], device=DEV).expand_as(slot_page)
    exact = ref.sparse_decode(*up(q, k, v), slot_page, slots, seq_len, 0.2)
    torch_err = rel_err(ref.sparse_decode(q, k, v, slot_page, slots, seq_len, 0.2, in_order=True), exact)
    out = tops.sparse_decode(q, k, v, slot_page, slots, seq_len, 0.2, in_order=True)
    assert rel_err(out, exact) <= 2 * torch_err
    # In order the kernel takes slot j for entry j and never reads the slots (a read would put a load before the
    # page's, and that before the keys'): slots that break the promise change nothing there.
    unread = torch.full_like(slots, -1)
    assert torch.equal(tops.sparse_decode(q, k, v, slot_page, unread, seq_len, 0.2, in_order=True), out)
    with pytest.raises(ValueError, match="slots listing all .* slots of every row in order"):
        ref.sparse_decode(q, k, v, slot_page, slots.flip(-1), seq_len, 0.2, in_order=True)
    with pytest.raises(ValueError, match="slot j to hold page j"):
        ref.sparse_decode(q, k, v, slot_page.roll(1, -1), slots, seq_len, 0.2, in_order=True)


def shared_store(slot_page, *pages, seed=0):
    """The slots of a cache whose slot j holds page j (the same pages for every KV head), moved into one store of
    shared pages in a random order, as a serving pool keeps them: each of ``pages`` (B, Hkv, C, ...), keys, values
    or bounds, as a store (1, Hkv, N + 1, ...) (store page N the scratch page), and the table (B, C) of each slot's
    store page."""
    b, h, c = slot_page.shape
    n = b * c
    table = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).view(b, c).to(DEV)
    stores = []
    for t in pages:
        store = torch.full((1, h, n + 1, *t.shape[3:]), 7.0, device=DEV).to(t.dtype)
        store[0, :, table.flatten()] = t.transpose(0, 1).flatten(1, 2)
        stores.append(store)
    return *stores, table


@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,dtype",
                         crossed(cases(SHAPES), axis(DTYPES), full=1))
def test_decode_through_a_page_table(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head,
                                     dtype):
    """A serving pool's rows in shared pages (``PagedLayer.attend``'s operands): every page in order through the
    rows' tables, Quest's page scores and choice through them, and a selection read through them, attended tokens
    counted, give the very outputs of the same pages in rows of their own."""
    if page_size == 1:
        pytest.skip("shared pages hold pages of more than one token")
    cap = max(-(-n // page_size) for n in lengths)
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                                dtype, spare=cap + 3, in_order=True)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(dtype)
    store_k, store_v, store_min, store_max, table = shared_store(slot_page, k, v, kmin, kmax)
    every = torch.arange(slot_page.shape[2], device=DEV).expand_as(slot_page)
    for ops in (ref, tops):
        want = ops.sparse_decode(q, k, v, slot_page, every, seq_len, 0.2, in_order=True)
        scores = ops.page_scores(q, kmin, kmax, slot_page, per_head)
        assert torch.equal(ops.page_scores(q, store_min, store_max, slot_page, per_head, table), scores)
        slots = ops.quest_select(q, kmin, kmax, slot_page, cur_slot, n_pages, per_head, True)
        assert torch.equal(ops.quest_select(q, store_min, store_max, slot_page, cur_slot, n_pages, per_head, True,
                                            table), slots)
        assert torch.equal(ops.sparse_decode(q, store_k, store_v, slot_page, every, seq_len, 0.2, in_order=True,
                                             table=table), want)
        slots[:, :, -1] = -1
        counts = [torch.full(slots.shape[:2], 3, dtype=torch.long, device=DEV) for _ in range(2)]
        assert torch.equal(ops.sparse_decode(q, store_k, store_v, slot_page, slots, seq_len, 0.2, counts[0],
                                             table=table),
                           ops.sparse_decode(q, k, v, slot_page, slots, seq_len, 0.2, counts[1]))
        assert torch.equal(*counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_append_token_through_a_page_table(dtype):
    """A decode token written through the rows' tables into shared pages: the store then holds the keys, values
    and bounds that rows of their own hold (the page table and current slots are the rows' either way)."""
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(3, 2, 64, 4, [8, 6, 3], dtype, spare=3,
                                                                in_order=True)
    *stores, table = shared_store(slot_page, k, v, kmin, kmax, seed=1)
    position = torch.tensor([8, 6, -1], device=DEV)
    k_new = torch.randn(3, 2, 64, device=DEV).to(dtype)
    v_new = torch.randn(3, 2, 64, device=DEV).to(dtype)
    rows = [t.clone() for t in (k, v, kmin, kmax, slot_page, cur_slot)]
    ref.append_token(*rows, position, k_new, v_new, False)
    for ops in (ref, tops):
        state = [t.clone() for t in (*stores, slot_page, cur_slot)]
        ops.append_token(*state, position, k_new, v_new, False, table)
        for got, want in zip(state[4:], rows[4:]):
            assert torch.equal(got, want)
        for got, want in zip(state[:4], rows[:4]):
            assert torch.equal(got[0, :, table.flatten()], want.transpose(0, 1).flatten(1, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,store,n_tokens,rows", [
    pytest.param(1, 4, 2, 64, 20, 8, 2, id="short"),
    pytest.param(3, 8, 2, 128, 120, 24, 8, id="per-query-head"),
    pytest.param(2, 8, 1, 64, 40, 100, 1, id="one-set-gqa8-more-than-store"),
    pytest.param(2, 6, 3, 32, 50, 7, 1, id="one-set-gqa2"),
    *([pytest.param(32, 32, 8, 128, 9000, 2048, 8, id="gpu-b32"),
       pytest.param(4, 32, 8, 128, 70000, 4096, 1, id="gpu-one-set")] if ON_GPU else []),
])
def test_decode_tokens(batch, heads, kv_heads, head_dim, store, n_tokens, rows, dtype):
    """OmniKV's op: listed rows of a flat token store, fp32 output and log-sum-exp (-1 entries and duplicates
    included; a row listing nothing gives zeros and -inf)."""
    g = torch.Generator(device=DEV).manual_seed(1)
    k, v = torch.randn(2, batch, kv_heads, store, head_dim, generator=g, device=DEV).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g, device=DEV).to(dtype)
    tokens = torch.randint(-1, store, (batch, rows, n_tokens), generator=g, device=DEV)
    tokens[0, 0] = -1
    out, lse = tops.sparse_decode_tokens(q, k, v, tokens, 0.1)
    exact, exact_lse = ref.sparse_decode_tokens(*up(q, k, v), tokens, 0.1)
    torch_out, torch_lse = ref.sparse_decode_tokens(q, k, v, tokens, 0.1)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(lse.isinf(), exact_lse.isinf())
    fin = exact_lse.isfinite()
    # fp32 outputs on both paths: errors near 1e-7, hence the small floor on top of twice torch's.
    assert rel_err(out, exact) <= 2 * rel_err(torch_out, exact) + 1e-5
    assert rel_err(lse[fin], exact_lse[fin]) <= 2 * rel_err(torch_lse[fin], exact_lse[fin]) + 1e-5


def window_inputs(batch, heads, kv_heads, head_dim, n, window, limits, dtype, seed=0):
    """OmniKV's filter-layer inputs: a flat store of n tokens whose positions are scattered (a permutation) with
    -1 holes (position 0 is always there, so limit 1 leaves exactly one candidate), window positions at random
    (some before candidates, so the causal mask matters; the first entry empty for W > 1). Returns q, k, key_pos,
    q_pos, limit."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(batch, heads, window, head_dim, generator=g, device=DEV).to(dtype)
    k = torch.randn(batch, kv_heads, n, head_dim, generator=g, device=DEV).to(dtype)
    key_pos = torch.stack([torch.randperm(n, generator=g, device=DEV) for _ in range(batch)])
    holes = (torch.rand(batch, n, generator=g, device=DEV) < 0.2) & (key_pos != 0)
    key_pos = torch.where(holes, -1, key_pos)
    q_pos = torch.randint(-1, n + 2, (batch, window), generator=g, device=DEV)
    if window > 1:
        q_pos[:, 0] = -1
    return q, k, key_pos, q_pos, torch.tensor(limits, device=DEV)


WINDOW_VARIANTS = {  # TUNING overrides: each shape of the window-scoring tiles
    "default": {},
    # query heads in chunks of 16 // padded window rows (several chunks; the last one partial for G = 3 at W = 5,
    # G = 6 at W = 3)
    "chunks": {"window_rows": 16},
    # blocks of 16 tokens, so that pass 1 splits rows of more than one block
    "block16": {"window_block_n": 16},
}


WINDOW_SHAPES = [
    pytest.param(1, 4, 4, 32, 1, 1, [1], id="one-token-mha"),
    pytest.param(1, 8, 2, 64, 37, 2, [1], id="one-candidate-gqa4"),
    pytest.param(2, 4, 2, 64, 150, 4, [100, 37], id="gqa2-ragged-limits"),
    pytest.param(2, 8, 1, 32, 90, 16, [80, 200], id="gqa8-window16"),
    pytest.param(2, 3, 3, 64, 200, 1, [150, 20], id="mha-w1"),
    pytest.param(1, 6, 2, 16, 70, 5, [60], id="gqa3-w5-d16"),
    pytest.param(2, 12, 2, 32, 45, 3, [40, 9], id="gqa6-w3"),
    *([pytest.param(1, 32, 8, 128, 70000, 1, [65536], id="gpu-llama3-w1"),
       pytest.param(4, 32, 8, 128, 20000, 16, [20000, 19000, 7, 12345], id="gpu-llama3-b4-w16")] if ON_GPU else []),
]


@pytest.mark.parametrize("variant,batch,heads,kv_heads,head_dim,n,window,limits,dtype", crossed(
    axis(list(WINDOW_VARIANTS)), cases(WINDOW_SHAPES), axis([*DTYPES, torch.float32])))
def test_window_token_maxima(batch, heads, kv_heads, head_dim, n, window, limits, dtype, variant, monkeypatch):
    """OmniKV's filter-layer scores: -inf exactly on non-candidates, 0 exactly where no head's query sees a
    candidate (empty window entries, tokens after a query), else within the error budget (fp32 outputs on both
    paths, hence the small floor)."""
    for key, value in WINDOW_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    q, k, key_pos, q_pos, limit = window_inputs(batch, heads, kv_heads, head_dim, n, window, limits, dtype)
    scale = 1.5 * head_dim ** -0.5
    out = tops.window_token_maxima(q, k, key_pos, q_pos, limit, scale)
    exact = ref.window_token_maxima(*up(q, k), key_pos, q_pos, limit, scale)
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert torch.equal(out.isfinite(), exact.isfinite()) and torch.equal(out == float("-inf"), exact == float("-inf"))
    assert torch.equal(out[exact == 0], torch.zeros_like(out[exact == 0]))
    fin = exact.isfinite()
    torch_err = rel_err(ref.window_token_maxima(q, k, key_pos, q_pos, limit, scale)[fin], exact[fin])
    assert rel_err(out[fin], exact[fin]) <= 2 * torch_err + 1e-5


MASS_SHAPES = [
    pytest.param(1, 2, 1, 1, 32, 1, [7], 5, id="page-size-1-one-slot-row"),
    pytest.param(3, 8, 2, 2, 64, 4, [1, 13, 37], 9, id="ragged-gqa4-partial-pages"),
    pytest.param(2, 8, 1, 8, 32, 1, [70, 33], 40, id="gqa8-rows-per-query-head"),
    pytest.param(2, 6, 2, 2, 64, 16, [30, 17], 20, id="gqa3-one-page"),
    pytest.param(2, 4, 4, 4, 16, 1, [150, 90], 70, id="mha-many-blocks"),
    pytest.param(2, 8, 2, 2, 64, 1, [150, 61], 1, id="decode-query-gqa4"),
]


@pytest.mark.parametrize("batch,heads,kv_heads,rows,head_dim,page_size,lengths,queries,dtype", crossed(
    cases(MASS_SHAPES), axis(DTYPES + [ref.FP8]), full=1, each=2))
def test_attention_mass(batch, heads, kv_heads, rows, head_dim, page_size, lengths, queries, dtype):
    """H2O's prompt scores: each token's weights summed over queries at any positions (padding queries at -1,
    unordered; one query at its row's last position: a decode step's weights, H2O's and TOVA's step scores), over
    pages scattered in the slots with free slots, -1 slot entries and partial pages, for 1-8
    query heads per KV head and selection rows per KV head or per query head; tokens no query sees get exactly 0."""
    k, _, _, _, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                   torch.float32 if dtype == ref.FP8 else dtype, seed=heads)
    q_dtype = torch.bfloat16 if dtype == ref.FP8 else dtype
    k = ref.to_cache(k, dtype) if dtype == ref.FP8 else k
    g = torch.Generator(device=DEV).manual_seed(queries)
    q = torch.randn(batch, heads, queries, head_dim, generator=g, device=DEV).to(q_dtype)
    q_pos = (torch.rand(batch, queries, generator=g, device=DEV) * seq_len.view(-1, 1)).long()
    q_pos[:, ::4] = -1
    if queries == 1:
        q_pos = (seq_len - 1).view(-1, 1)
    slots = torch.arange(k.shape[2], device=DEV).expand(batch, rows, -1).clone()
    slots[:, :, 1::5] = -1
    scale = head_dim ** -0.5
    out = tops.attention_mass(q, k, slot_page, slots, q_pos, scale)
    exact = ref.attention_mass(*up(q, k), slot_page, slots, q_pos, scale)
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert torch.equal(out == 0, exact == 0), "exactly the tokens no query sees score 0"
    torch_err = rel_err(ref.attention_mass(q, k.to(q_dtype), slot_page, slots, q_pos, scale), exact)
    assert rel_err(out, exact) <= 2 * torch_err + 1e-5
    # A query spreads a total weight of 1 over the tokens it sees (0 where the slots list none of them).
    assert (exact.sum(-1) <= (q_pos >= 0).sum(-1, keepdim=True).to(F64) + 1e-6).all() and exact.sum() > 0


@pytest.mark.parametrize("batch,heads,kv_heads,rows,head_dim,page_size,lengths,queries,dtype", crossed(
    cases([p for p in MASS_SHAPES if p.values[3] == p.values[2]]), axis(DTYPES), full=1, each=2))
def test_attention_mass_in_order(batch, heads, kv_heads, rows, head_dim, page_size, lengths, queries, dtype):
    """A prompt's layer (slot j holds page j, many spare slots past the rows, garbage in the partial pages): with
    ``in_order`` the kernels take token t at position t and walk no token past the queries, and give what they
    give without it, queries anywhere in the rows (the last at the row's end, padding at -1); the reference checks
    the promise."""
    k, _, _, _, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, dtype, seed=heads,
                                                   spare=2 * max(lengths) // page_size + 3, in_order=True)
    g = torch.Generator(device=DEV).manual_seed(queries)
    q = torch.randn(batch, heads, queries, head_dim, generator=g, device=DEV).to(dtype)
    q_pos = (torch.rand(batch, queries, generator=g, device=DEV) * seq_len.view(-1, 1)).long()
    q_pos[:, -1] = seq_len - 1
    q_pos[:, ::3] = -1
    slots = torch.arange(k.shape[2], device=DEV).expand(batch, kv_heads, -1)
    scale = head_dim ** -0.5
    out = tops.attention_mass(q, k, slot_page, slots, q_pos, scale, in_order=True)
    exact = ref.attention_mass(*up(q, k), slot_page, slots, q_pos, scale, in_order=True)
    assert torch.equal(out == 0, exact == 0) and (out[:, :, seq_len.max():] == 0).all()
    assert rel_err(out, exact) <= 2 * rel_err(ref.attention_mass(q, k, slot_page, slots, q_pos, scale), exact) + 1e-5
    torch.testing.assert_close(out, tops.attention_mass(q, k, slot_page, slots, q_pos, scale), rtol=1e-5, atol=1e-6)
    # Each query's log-sum-exp given (as a prompt's attention gives it, 0 at padding): pass 1 is skipped.
    keys = k.to(F64).flatten(2, 3).repeat_interleave(heads // kv_heads, 1)  # token t at position t
    held = (slot_page >= 0).repeat_interleave(page_size, 2).repeat_interleave(heads // kv_heads, 1)
    sees = held[:, :, None, :] & (torch.arange(keys.shape[2], device=DEV) <= q_pos[:, None, :, None])
    lse = (torch.einsum("bhsd,bhtd->bhst", q.to(F64), keys) * scale).masked_fill(~sees, float("-inf")).logsumexp(-1)
    lse = lse.nan_to_num(0.0, neginf=0.0).float()
    given = tops.attention_mass(q, k, slot_page, slots, q_pos, scale, in_order=True, lse=lse)
    assert torch.equal(given == 0, exact == 0) and rel_err(given, exact) <= 2 * rel_err(out, exact) + 1e-5
    with pytest.raises(ValueError, match=r"attention_mass: lse must have shape"):
        tops.attention_mass(q, k, slot_page, slots, q_pos, scale, lse=lse[:, :1])
    with pytest.raises(ValueError, match="attention_mass: in_order needs slot j to hold page j"):
        ref.attention_mass(q, k, slot_page.roll(1, -1), slots, q_pos, scale, in_order=True)


@pytest.mark.parametrize("batch,heads,kv_heads,rows,head_dim,page_size,lengths,queries,one,dtype", crossed(
    cases(MASS_SHAPES), axis([True, False], ["one-query", "several"]), axis(DTYPES), full=2))
def test_attend_with_weights(batch, heads, kv_heads, rows, head_dim, page_size, lengths, queries, one, dtype):
    """The output and the weights of one query a row (a decode step's: split-K attention and the query's mass, a
    row of them with nothing to see), against the reference in fp64; several queries a row are the reference's."""
    k, v, _, _, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, dtype, seed=heads)
    queries = 1 if one else queries
    g = torch.Generator(device=DEV).manual_seed(queries)
    q = torch.randn(batch, heads, queries, head_dim, generator=g, device=DEV).to(dtype)
    q_pos = (seq_len - 1).view(-1, 1).expand(batch, queries) - torch.arange(queries, device=DEV).flip(0)
    q_pos = q_pos.clone()
    q_pos[-1] = -1
    slots = torch.arange(k.shape[2], device=DEV).expand(batch, rows, -1).clone()
    slots[:, :, 1::5] = -1
    scale = head_dim ** -0.5
    out, weights = tops.attend_with_weights(q, k, v, slot_page, slots, q_pos, scale)
    exact_out, exact_weights = ref.attend_with_weights(*up(q, k, v), slot_page, slots, q_pos, scale)
    assert out.dtype == dtype and weights.dtype == torch.float32 and weights.shape == exact_weights.shape
    assert torch.equal(weights == 0, exact_weights == 0) and out[-1].eq(0).all()
    torch_out, torch_weights = ref.attend_with_weights(q, k, v, slot_page, slots, q_pos, scale)
    assert rel_err(out, exact_out) <= 2 * rel_err(torch_out, exact_out) + 1e-5
    assert rel_err(weights, exact_weights) <= 2 * rel_err(torch_weights, exact_weights) + 1e-5


def test_window_token_maxima_edge_cases():
    """No candidate at all (limit 0), an empty window, and fp64 (the reference itself)."""
    q, k, key_pos, q_pos, limit = window_inputs(2, 4, 2, 32, 40, 3, [0, 30], torch.bfloat16)
    q_pos[1] = -1
    out = tops.window_token_maxima(q, k, key_pos, q_pos, limit, 0.2)
    assert torch.equal(out, ref.window_token_maxima(*up(q, k), key_pos, q_pos, limit, 0.2).float())
    assert out[0].isinf().all() and out[1][out[1].isfinite()].eq(0).all()
    q, k = up(q, k)
    q_pos[1] = 35
    assert torch.equal(tops.window_token_maxima(q, k, key_pos, q_pos, limit, 0.2),
                       ref.window_token_maxima(q, k, key_pos, q_pos, limit, 0.2))


def stable_selection(scores, cur_slot, n_pages):
    """The reference's contract with ties broken to the lower slot (torch.topk leaves that open), as sorted sets."""
    rows = scores.shape[1] // cur_slot.shape[1]
    forced = scores.scatter(2, cur_slot.clamp(min=0).repeat_interleave(rows, 1).unsqueeze(-1), float("inf"))
    idx = torch.sort(forced, dim=2, descending=True, stable=True).indices[..., :min(n_pages, scores.shape[2])]
    return torch.where(forced.gather(2, idx) > float("-inf"), idx, -1).sort(-1).values


SELECT_VARIANTS = {  # TUNING overrides: each path of select_pages on the small shapes
    "default": {},
    # rows over 64 slots: top of segments of 128 slots first, then the radix select of those
    "segments": {"select_group_rows": 1 << 30, "select_one_program": 64, "select_block": 128},
    # 4-bit digits end exactly at bit 0; 5-bit ones on a digit overlapping known bits
    "bits4": {"select_digit_bits": 4},
    # rows over 64 slots through their groups, group maxima from programs of 64 slots
    "groups": {"select_group_rows": 1, "select_one_program": 64, "select_group_block": 64},
    "groups-bits4": {"select_group_rows": 1, "select_one_program": 64, "select_digit_bits": 4},
    "groups-wide": {"select_group_rows": 1, "select_one_program": 64, "select_group_scale": 4},
}


SELECT_SHAPES = [
    pytest.param(2, 4, 2, 50, 8, False, id="gqa-rows"),
    pytest.param(3, 2, 1, 7, 20, False, id="budget-over-slots"),
    pytest.param(2, 4, 4, 1, 3, False, id="one-slot"),
    pytest.param(2, 4, 2, 30, 1, False, id="one-page-budget"),
    pytest.param(1, 2, 2, 300, 1, False, id="one-page-budget-long"),
    pytest.param(1, 3, 3, 300, 17, True, id="ties"),
    pytest.param(2, 4, 1, 64, 40, True, id="ties-gqa4-most-selected"),
    pytest.param(1, 2, 2, 32, 32, False, id="all-of-one-piece"),
    pytest.param(1, 2, 2, 33, 32, False, id="one-slot-in-the-tail"),
    pytest.param(1, 2, 1, 2050, 128, False, id="32k-context-rows"),
    pytest.param(1, 2, 2, 2047, 2000, True, id="ties-pieces-just-full"),
    pytest.param(1, 2, 2, 3000, 2999, False, id="all-but-one"),
    pytest.param(2, 2, 1, 1000, 64, True, id="ties-long"),
    *([pytest.param(16, 32, 8, 32770, 256, False, id="gpu-512k"), pytest.param(4, 8, 8, 5000, 64, True, id="gpu-ties"),
       pytest.param(1, 8, 8, 65536, 128, True, id="gpu-longest-in-registers"),
       pytest.param(2, 8, 8, 9000, 2000, False, id="gpu-large-k")] if ON_GPU else []),
]


# Two paths a shape on the CPU (the whole product on a GPU): the long rows take seconds each in the interpreter.
@pytest.mark.parametrize("batch,rows,kv_heads,slots,n_pages,ties,variant", crossed(
    cases(SELECT_SHAPES), axis(list(SELECT_VARIANTS)), full=1, each=2))
def test_select_pages(batch, rows, kv_heads, slots, n_pages, ties, variant, monkeypatch):
    """Exact: the same slots as the reference, ties to the lower slot, -1 for free slots, the current page forced in
    (cur_slot -1 forces slot 0, as the reference does)."""
    for key, value in SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    scores = torch.randn(batch, rows, slots, device=DEV)
    if ties:
        scores = scores.mul(2).round()
    scores[torch.rand(scores.shape, device=DEV) < 0.3] = float("-inf")  # free slots
    cur_slot = torch.randint(-1, slots, (batch, kv_heads), device=DEV)
    cur_slot[0, 0] = -1
    got = tops.select_pages(scores, cur_slot, n_pages)
    assert got.shape == ref.select_pages(scores, cur_slot, n_pages).shape
    # The order of the selected slots is not part of the contract (the kernel lists them by slot or by segment).
    assert torch.equal(got.sort(-1).values, stable_selection(scores, cur_slot, n_pages))


@pytest.mark.parametrize("variant,data,n_pages", crossed(
    axis(["default", "segments", "groups"]), axis(["narrow", "narrow-ties", "equal", "mostly-free", "one-finite-bin"]),
    axis([1, 16, 150])))
def test_select_pages_shared_leading_bits(data, n_pages, variant, monkeypatch):
    """Scores that share their sign and exponent bits (as Quest's bounds do), so that the radix select starts below
    those bits; also when the k-th key lies outside them (free slots) or all keys are equal."""
    for key, value in SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    g = torch.Generator(device=DEV).manual_seed(n_pages)
    scores = 150 + 20 * torch.rand(2, 2, 400, generator=g, device=DEV)
    if data == "narrow-ties":
        scores = scores.round()
    elif data == "equal":
        scores = torch.full_like(scores, 3.5)
    elif data == "mostly-free":
        scores[torch.rand(scores.shape, generator=g, device=DEV) < 0.9] = float("-inf")
    elif data == "one-finite-bin":  # finite keys differ in the last bits only, below them free slots
        scores = (1 + torch.randint(0, 4, scores.shape, generator=g, device=DEV) * 2.0 ** -22).float()
        scores[:, :, 200:] = float("-inf")
    cur_slot = torch.tensor([[350, 3], [-1, 0]], device=DEV)
    got = tops.select_pages(scores, cur_slot, n_pages)
    assert torch.equal(got.sort(-1).values, stable_selection(scores, cur_slot, n_pages))


@pytest.mark.parametrize("free", [0.9, 1.0])
def test_select_pages_groups_mostly_free(free, monkeypatch):
    """The group filter when fewer pages are valid than selected: the bound is the -inf key, tied everywhere."""
    monkeypatch.setitem(tops.TUNING, "select_group_rows", 1)
    monkeypatch.setitem(tops.TUNING, "select_one_program", 64)
    scores = torch.randn(2, 4, 700, device=DEV)
    scores[torch.rand(scores.shape, device=DEV) < free] = float("-inf")
    cur_slot = torch.tensor([[650, 3], [-1, 0]], device=DEV)
    got = tops.select_pages(scores, cur_slot, 100)
    assert torch.equal(got.sort(-1).values, stable_selection(scores, cur_slot, 100))


def test_select_pages_groups_clustered(monkeypatch):
    """Scores rising with the slot (the top pages all in the last groups): more candidates than the compaction
    buffer holds, so the whole tile of the kept groups is selected from."""
    monkeypatch.setitem(tops.TUNING, "select_group_rows", 1)
    monkeypatch.setitem(tops.TUNING, "select_one_program", 64)
    scores = torch.arange(2000, device=DEV).float().expand(2, 2, 2000) + torch.rand(2, 2, 2000, device=DEV)
    cur_slot = torch.tensor([[5], [-1]], device=DEV)
    got = tops.select_pages(scores, cur_slot, 128)
    assert torch.equal(got.sort(-1).values, stable_selection(scores, cur_slot, 128))


QUEST_SELECT_VARIANTS = {  # TUNING overrides: each path of quest_select on the small shapes
    "default": {},
    # group maxima from the page-score kernel: several groups per block of slots, or one (a block of 16 slots,
    # groups of 16 or 32)
    "fused": {"select_fused_rows": 1, "select_one_program": 64},
    "fused-wide": {"select_fused_rows": 1, "select_one_program": 64, "select_fused_scale": 4, "page_block": 16},
    "fused-scale2": {"select_fused_rows": 1, "select_one_program": 64, "select_fused_scale": 2},
    # page scores over head-dim slices of 16 (the loop of the page-score kernel)
    "fused-slices16": {"select_fused_rows": 1, "select_one_program": 64, "page_block_k": 16},
    # too few rows to fuse: select_pages through groups
    "unfused-groups": {"select_fused_rows": 1 << 30, "select_group_rows": 1, "select_one_program": 64},
}


QUEST_SELECT_SHAPES = [
    pytest.param(2, 8, 2, 64, 4, [1500, 903], 16, False, id="gqa4"),
    pytest.param(2, 4, 2, 32, 2, [700, 1301], 9, True, id="per-query-head"),
    pytest.param(1, 2, 1, 32, 1, [300], 40, False, id="mostly-selected"),
    *([pytest.param(4, 32, 8, 128, 16, [131072 - 999 * i for i in range(4)], 128, False, id="gpu-128k-32-rows"),
       pytest.param(1, 32, 8, 128, 16, [524288], 128, False, id="gpu-512k-8-rows"),
       pytest.param(1, 32, 32, 128, 16, [524288 - 77], 128, False, id="gpu-512k-mha-16k-programs")] if ON_GPU else []),
]


@pytest.mark.parametrize("variant,batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,in_order", crossed(
    axis(list(QUEST_SELECT_VARIANTS)), cases(QUEST_SELECT_SHAPES), axis([False, True], ["", "in-order"])))
def test_quest_select(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, variant, in_order,
                      monkeypatch):
    """The fused op selects exactly what ``select_pages`` selects from ``page_scores`` (the group maxima written by
    the page-score kernel included), on every path; ``in_order``: slot j holds page j in a layer of more slots than
    the rows use (a serving pool), whose bounds past each row's current slot are not read."""
    for key, value in QUEST_SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    spare = max(-(-n // page_size) for n in lengths) // 2 if in_order else 2
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                                torch.bfloat16, spare=spare, in_order=in_order)
    del k, v
    q = torch.randn(batch, heads, head_dim, device=DEV).to(torch.bfloat16)
    got = tops.quest_select(q, kmin, kmax, slot_page, cur_slot, n_pages, per_head, in_order)
    scores = tops.page_scores(q, kmin, kmax, slot_page, per_head)
    assert got.shape == ref.quest_select(q, kmin, kmax, slot_page, cur_slot, n_pages, per_head, in_order).shape
    assert torch.equal(got.sort(-1).values, stable_selection(scores, cur_slot, n_pages))
    if in_order:
        with pytest.raises(ValueError, match="without holes"):
            ref.quest_select(q, kmin, kmax, slot_page.roll(1, -1), cur_slot, n_pages, per_head, True)


@pytest.mark.parametrize("variant,batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,in_order", crossed(
    axis(list(QUEST_SELECT_VARIANTS)), cases([s for s in QUEST_SELECT_SHAPES if not s.values[7]]),
    axis([False], [""])))
def test_raas_select(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, variant, in_order,
                     monkeypatch):
    """RaaS's choice on every path of Quest's: the bounds as ``page_scores`` writes them, and the slots that
    ``select_pages`` chooses with each row's pages from its prompt_pages on at +inf (a row with none past its
    prompt, one whose decode pages fill more than the budget, one in between; free slots stay out)."""
    for key, value in QUEST_SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    _, _, kmin, kmax, slot_page, cur_slot, _ = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                          torch.bfloat16)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(torch.bfloat16)
    pages = [-(-n // page_size) for n in lengths]
    prompt_pages = torch.tensor([[p, max(0, p - n_pages - 3), p // 2, p - 2][i % 4] for i, p in enumerate(pages)],
                                device=DEV)
    scores, got = tops.raas_select(q, kmin, kmax, slot_page, cur_slot, prompt_pages, n_pages)
    want_scores = tops.page_scores(q, kmin, kmax, slot_page)
    assert torch.equal(scores, want_scores)
    ranked = torch.where(slot_page < prompt_pages.view(-1, 1, 1), want_scores, float("inf"))
    assert got.shape == ref.raas_select(q, kmin, kmax, slot_page, cur_slot, prompt_pages, n_pages)[1].shape
    assert torch.equal(got.sort(-1).values, stable_selection(ranked, cur_slot, n_pages))
    exact_scores = ref.raas_select(*up(q, kmin, kmax), slot_page, cur_slot, prompt_pages, n_pages)[0]
    assert torch.equal(exact_scores.isinf(), scores.isinf())


def test_select_pages_long_rows_use_torch_topk(monkeypatch):
    monkeypatch.setitem(tops.TUNING, "select_max_slots", 64)
    scores = torch.randn(2, 2, 100, device=DEV)
    cur_slot = torch.tensor([[3], [-1]], device=DEV)
    assert torch.equal(tops.select_pages(scores, cur_slot, 9).sort(-1).values, stable_selection(scores, cur_slot, 9))


def test_nothing_to_attend_gives_zeros():
    k, v, _, _, slot_page, _, seq_len = make_cache(2, 2, 64, 4, [6, 3], torch.bfloat16)
    q = torch.randn(2, 4, 64, device=DEV).to(torch.bfloat16)
    slots = torch.full((2, 2, 3), -1, device=DEV)
    assert torch.equal(tops.sparse_decode(q, k, v, slot_page, slots, seq_len, 0.1), torch.zeros_like(q))


@pytest.mark.parametrize("search", [4096, 4], ids=["search4096", "search4"])
@pytest.mark.parametrize("has_holes", [False, True], ids=["no-holes", "holes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_append_token_matches_reference(dtype, has_holes, search, monkeypatch):
    """Fresh pages (in the lowest free slot, found in several scan blocks with search 4), the current page, and a
    sequence without a token; the op also picks the slot and updates the current slots."""
    monkeypatch.setitem(tops.TUNING, "append_search", search)
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(4, 2, 64, 4, [8, 6, 3, 20], dtype, spare=6)
    slot_page[3, 1, :3] = -1  # freed slots ahead of the others in one row
    slot_page[0, 0, :6] = 7  # and none in the first two scan blocks of another (search 4)
    position = torch.tensor([8, 6, -1, 20], device=DEV)
    k_new = torch.randn(4, 2, 64, device=DEV).to(dtype)
    v_new = torch.randn(4, 2, 64, device=DEV).to(dtype)
    free = slot_page[:, :, :-1] < 0
    expected = cur_slot.clone()
    expected[[0, 3]] = free[[0, 3]].to(torch.int8).argmax(-1) if has_holes else torch.tensor([[2], [5]], device=DEV)
    state = [t.clone() for t in (k, v, kmin, kmax, slot_page, cur_slot)]
    ref.append_token(*state, position, k_new, v_new, has_holes)
    tops.append_token(k, v, kmin, kmax, slot_page, cur_slot, position, k_new, v_new, has_holes)
    for got, want in zip((k, v, kmin, kmax, slot_page, cur_slot), state):
        assert torch.equal(got, want)
    assert torch.equal(cur_slot, expected)
    assert torch.equal(slot_page[[0, 1, 3]].gather(2, cur_slot[[0, 1, 3]].unsqueeze(-1)).squeeze(-1),
                       torch.tensor([[2, 2], [1, 1], [5, 5]], device=DEV))


@pytest.mark.parametrize("start,tokens,rows,page_size,head_dim,dtype,through_table,pages_tokens", crossed(
    {str(c): c for c in [(0, 37, (0, 3)), (6, 1, (1, 2)), (5, 3, (0, 3)), (8, 8, (2, 3)), (3, 70, (1, 3))]},
    {str(c): c for c in [(1, 64), (4, 48), (16, 64)]}, axis([torch.bfloat16, torch.float32, ref.FP8]),
    axis([False, True], ["rows", "table"]), axis([64, 16])))
def test_append_pages_matches_reference(dtype, page_size, head_dim, start, tokens, rows, through_table, pages_tokens,
                                        monkeypatch):
    """A prompt pass written into pages (rows of their own, or shared pages through the rows' tables): passes from
    a page's start or its middle, within one page, one page exactly, over many pages, with a head dim that is not
    a power of two and programs of one or several pages; the pages the rows were filling merge their bounds, the
    fresh ones restart them, and no other slot changes. fp8 keys and values beyond its range are saturated."""
    monkeypatch.setitem(tops.TUNING, "append_pages_tokens", pages_tokens)
    wide = torch.float32 if dtype == ref.FP8 else dtype
    k, v, kmin, kmax, slot_page, cur_slot, _ = make_cache(3, 2, head_dim, page_size, [max(start, 1)] * 3, wide,
                                                          spare=80, in_order=True)
    if dtype == ref.FP8:
        k, v, kmin, kmax = (ref.to_cache(t, dtype) for t in (k, v, kmin, kmax))
    if page_size == 1:
        kmin = kmax = k[:, :, :, 0]
    r = rows[1] - rows[0]
    gen = torch.Generator().manual_seed(tokens)
    k_new, v_new = (torch.randn(r, 2, tokens, head_dim, generator=gen).to(DEV, wide) * 200 for _ in range(2))
    table = None
    state = [k, v, kmin, kmax, slot_page, cur_slot]
    if through_table:
        *stores, table = shared_store(slot_page, k, v, kmin, kmax, seed=1)
        state = [*stores, slot_page, cur_slot]
        if page_size == 1:
            state[2] = state[3] = state[0][:, :, :, 0]
    want = [t.clone() for t in state]
    if page_size == 1:
        want[2] = want[3] = want[0][:, :, :, 0]
    ref.append_pages(*want, k_new, v_new, start, rows[0], table)
    tops.append_pages(*state, k_new, v_new, start, rows[0], table)
    for got, exp in zip(state, want):
        assert torch.equal(ref.raw(got), ref.raw(exp))
    assert bool((state[4][rows[0]:rows[1], :, :(start + tokens - 1) // page_size + 1] >= 0).all())


def test_refuses_mismatched_dtypes():
    k, v, kmin, kmax, slot_page, _, seq_len = make_cache(1, 1, 64, 4, [5], torch.bfloat16)
    with pytest.raises(ValueError, match="q .* must have the cache's dtype"):
        tops.page_scores(torch.randn(1, 2, 64, device=DEV), kmin, kmax, slot_page)


@pytest.mark.skipif(not ON_GPU, reason="dispatch and CUDA graphs need a GPU")
def test_dispatch_picks_triton_and_step_replays_in_cuda_graph(monkeypatch):
    """The registered ops run the Triton kernels on CUDA tensors (``tops.OPS``, spied on), and a step of them
    replays in a CUDA graph."""
    from sparsekv.bench.attention import QuestStep

    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(4, 8, 128, 16, [3000, 2000, 1000, 17],
                                                                torch.bfloat16, spare=1)
    for name in ("page_scores", "select_pages", "quest_select", "sparse_decode", "sparse_decode_tokens",
                 "window_token_maxima", "append_token"):
        assert tops.OPS[name] is getattr(tops, name)
    step = QuestStep(k, v, kmin, kmax, slot_page, cur_slot, seq_len, heads=32, num_pages=16, per_query_head=False)
    q = torch.randn(4, 32, 128, device=DEV).to(torch.bfloat16)
    k_new, v_new = torch.randn(2, 4, 8, 128, device=DEV).to(torch.bfloat16)
    state = [t.clone() for t in (k, v, kmin, kmax, slot_page, cur_slot, seq_len)]
    called = []
    with monkeypatch.context() as patch:
        for name, fast in list(tops.OPS.items()):
            patch.setitem(tops.OPS, name, lambda *args, _name=name, _fast=fast: called.append(_name) or _fast(*args))
        eager = step.run(q, k_new, v_new)
    assert called == ["append_token", "quest_select", "sparse_decode"]
    for t, s in zip((k, v, kmin, kmax, slot_page, cur_slot, seq_len), state):
        t.copy_(s)
    graph = step.capture(q, k_new, v_new)
    for t, s in zip((k, v, kmin, kmax, slot_page, cur_slot, seq_len), state):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(step.out, eager)
    exact = ref.sparse_decode(*up(q, k, v), slot_page, step.slots, seq_len, 128 ** -0.5)
    assert rel_err(step.out, exact) < 1e-2


@pytest.mark.skipif(not ON_GPU, reason="dispatch and CUDA graphs need a GPU")
def test_window_token_maxima_dispatch_and_cuda_graph(monkeypatch):
    """The registered op runs the Triton kernel on CUDA tensors and replays in a CUDA graph (as in OmniKV's
    captured decode step), equal to the eager call."""
    from sparsekv import kernels

    q, k, key_pos, q_pos, limit = window_inputs(2, 32, 8, 128, 5000, 4, [4000, 4990], torch.bfloat16)
    called = []
    fast = tops.OPS["window_token_maxima"]
    monkeypatch.setitem(tops.OPS, "window_token_maxima", lambda *args: called.append(1) or fast(*args))
    eager = kernels.window_token_maxima(q, k, key_pos, q_pos, limit, 0.1)
    assert called
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.window_token_maxima(q, k, key_pos, q_pos, limit, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def raas_state(batch, kv_heads, slots, page_size, ties, seed):
    """RaaS book-keeping inputs: rows holding different numbers of distinct pages at scattered slots (padded
    batches, holes; slot C the always free scratch slot), scores -inf where free (with ``ties``: few distinct
    values, +0.0 and -0.0 among them), stamps below a long row's length, and per sequence: the next token starting a
    page or not, a limit reached or not, candidate slots [prompt_pages, limit) holding pages below and above
    prompt_pages."""
    g = torch.Generator().manual_seed(seed)
    slot_page = torch.full((batch, kv_heads, slots + 1), -1, dtype=torch.long)
    cur_slot = torch.zeros(batch, kv_heads, dtype=torch.long)
    held = [int(torch.randint(1, slots + 1, (1,), generator=g)) for _ in range(batch)]
    held[0] = slots  # one full row
    prompt_pages = torch.tensor([0 if b % 2 else int(torch.randint(0, slots, (1,), generator=g))
                                 for b in range(batch)])
    for b in range(batch):
        for h in range(kv_heads):
            where = torch.randperm(slots, generator=g)
            if h % 2 == 0:  # the current page a candidate (slot prompt_pages), else anywhere
                where = torch.cat([prompt_pages[b:b + 1], where[where != prompt_pages[b]]])
            where = where[:held[b]]
            pages = torch.randperm(2 * slots, generator=g)[:held[b]]
            slot_page[b, h, where] = torch.maximum(pages, torch.where(where >= prompt_pages[b], prompt_pages[b], 0))
            cur_slot[b, h] = where[0]
    scores = torch.randn(batch, kv_heads, slots + 1, generator=g)
    if ties:
        scores = (scores * 2).round() / 2 * torch.where(torch.rand(scores.shape, generator=g) < 0.5, -1.0, 1.0)
    scores = scores.masked_fill(slot_page < 0, float("-inf"))
    stamp = torch.randint(0, 10**6, (batch, kv_heads, slots + 1), generator=g)
    seq_len = torch.tensor([10**6 + page_size * (3 + b) + (b % 2) for b in range(batch)])  # odd rows: mid-page
    limit = torch.tensor([max(held[b] - b % 3 + (b % 3 == 2) * 2, int(prompt_pages[b]) + 1)
                          for b in range(batch)])  # reached, or not
    return [t.to(DEV) for t in (scores, slot_page, cur_slot, stamp, seq_len, limit, prompt_pages)]


@pytest.mark.parametrize("rule,batch,kv_heads,slots,block,ties,spare", crossed(
    axis([(0.1, None), (0.5, None), (1.0, None), (None, 0.01), (None, 0.3)]),
    {str(shape): shape for shape in [(1, 1, 1, 1024), (2, 2, 7, 1024), (3, 4, 130, 1024), (3, 2, 300, 64),
                                     (1, 1, 2500, 1024)]},
    axis([False, True], ["distinct", "ties"]), axis([0, 5], ["tight", "spare"])))
def test_raas_update_matches_reference(batch, kv_heads, slots, block, rule, ties, spare, monkeypatch):
    """Stamps and evictions exactly as the reference's: rows in one block or several (block 64), candidates in
    one chunk or several, ``decode_pages`` exactly the most a row holds or more."""
    monkeypatch.setitem(tops.TUNING, "raas_block", block)
    top_fraction, alpha = rule
    scores, slot_page, cur_slot, stamp, seq_len, limit, prompt_pages = raas_state(batch, kv_heads, slots, 4, ties,
                                                                                  seed=slots + batch)
    decode_pages = int((limit - prompt_pages).max()) + spare
    args = (4, slots, decode_pages, top_fraction, alpha, 0.7)
    want_stamp, want_pages = stamp.clone(), slot_page.clone()
    ref.raas_update(scores, want_pages, cur_slot, want_stamp, seq_len, limit, prompt_pages, *args)
    tops.raas_update(scores, slot_page, cur_slot, stamp, seq_len, limit, prompt_pages, *args)
    assert torch.equal(stamp, want_stamp)
    assert torch.equal(slot_page, want_pages)
    assert (want_stamp == seq_len.view(-1, 1, 1)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, k, bias", [(1, 16, False), (7, 100, True), (40, 1024, False), (33, 1000, True)])
@pytest.mark.parametrize("block_n", [1, 4])
def test_linear_of_one_row_matches_reference(n, k, bias, block_n, dtype, monkeypatch):
    monkeypatch.setitem(tops.TUNING, "gemv_block_k", 256)  # several slices, a partial one for k=1000
    monkeypatch.setitem(tops.TUNING, "gemv_block_n", block_n)  # 4: a partial block of rows for n=7 and n=33
    g = torch.Generator(device=DEV).manual_seed(n * k)
    x = torch.randn(1, 1, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEV).to(dtype) if bias else None
    exact = ref.linear(x.to(F64), w.to(F64), None if b is None else b.to(F64))
    out = tops.linear(x, w, b)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    torch_err = rel_err(torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype),
                        exact)
    assert rel_err(out, exact) <= 2 * torch_err + 1e-6
    rows = torch.randn(3, k, generator=g, device=DEV).to(dtype)  # several rows: F.linear
    assert torch.equal(tops.linear(rows, w, b), torch.nn.functional.linear(rows, w, b))


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # pages without tokens
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,bits,dtype", crossed(
    cases(SHAPES), axis([1, 2, 4]), axis([torch.float32, torch.bfloat16])))
def test_coded_scores(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, dtype, bits):
    """Page scores from low-bit key codes against float64 on the same codes: free slots -inf, and only they
    (pages scattered over the slots, partial last pages, padded rows of several lengths)."""
    k, _, kmin, kmax, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, dtype)
    codes = ref.key_codes(k, kmin, kmax, bits)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(dtype)
    scale = head_dim ** -0.5
    scores = tops.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_head)
    exact = ref.coded_scores(*up(q, kmin, kmax), codes, slot_page, seq_len, scale, bits, per_head)
    assert scores.shape == exact.shape and scores.dtype == torch.float32
    assert torch.equal(scores.isinf(), exact.isinf()), "free slots must score -inf, and only they"
    fin = exact.isfinite()
    torch_err = rel_err(ref.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_head)[fin],
                        exact[fin])
    # On the GPU the dequantized keys enter the product in the cache's dtype (tensor cores), rounding them once.
    assert rel_err(scores[fin], exact[fin]) <= 2 * torch_err + (1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,bits,dtype", crossed(
    cases(SHAPES), axis([1, 2, 4]), axis([torch.float32, torch.bfloat16, ref.FP8])))
def test_code_page_matches_reference(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, dtype,
                                     bits):
    """The current page's codes, bit for bit as the reference rounds them, only in each row's current slot: pages
    scattered over the slots, partial pages with garbage past the row's length (clamped), NaN keys (coded 0), a page
    whose keys are all alike (an empty range, coded 0) and a row without pages (cur_slot -1: slot 0)."""
    k, _, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                                torch.float32)
    if batch > 1:
        k[1, 0, cur_slot[1, 0]] = 0.5
        kmin[1, 0, cur_slot[1, 0]] = kmax[1, 0, cur_slot[1, 0]] = 0.5
    if dtype != ref.FP8:  # (Triton's interpreter converts fp8's NaN to 480)
        k[0, 0, cur_slot[0, 0], -1, :3] = float("nan")  # past the row's length, or a token of a full page
    cur_slot[0, -1] = -1
    k, kmin, kmax = (ref.to_cache(t, dtype) for t in (k, kmin, kmax))
    codes = torch.randint(0, 256, (*k.shape[:4], head_dim * bits // 8), dtype=torch.uint8, device=DEV)
    want = codes.clone()
    tops.code_page(k, kmin, kmax, codes, cur_slot, bits)
    ref.code_page(k, kmin, kmax, want, cur_slot, bits)
    assert torch.equal(codes, want)


@pytest.mark.skipif(not ON_GPU, reason="the CUDA kernel runs on CUDA only")
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 128), (8, 2, 64), (6, 2, 128), (16, 4, 128),
                                                       (10, 2, 64), (14, 2, 128), (16, 2, 128), (32, 8, 128)])
@pytest.mark.parametrize("chunk", [4, 128])
def test_cuda_coded_lse_matches_float64_reference(bits, dtype, heads, kv_heads, head_dim, chunk):
    """The CUDA kernel's page log-sum-exps against float64 on the same codes, for 1-8 query heads per KV head (two
    pages a product up to 4, one above), head dims 64 and 128: pages scattered over the slots, free slots, partial
    last pages, a row of one token, blocks of 4 slots (many, the last partial) and 128; its block totals against
    the log-sum-exp of its own page values; with a row not due (``reference.due_rows``) skipped, the due rows'
    values equal the ungated ones; given the keys, it codes every row's current page first, due or not, as
    ``reference.code_page`` does, and reads those codes."""
    from sparsekv.kernels import cuda
    from sparsekv.kernels.cuda import coded as cuda_coded

    if head_dim * bits < 128:
        pytest.skip("fewer than 128 bits of codes per token: the Triton kernel's")
    if not cuda.available(DEV, "coded"):
        pytest.skip("the CUDA kernel cannot be built here")
    lengths = [300, 17, 1, 162]
    k, _, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(len(lengths), kv_heads, head_dim, 16, lengths,
                                                                dtype, seed=heads + bits)
    codes = ref.key_codes(k, kmin, kmax, bits)
    q = torch.randn(len(lengths), heads, head_dim, device=DEV).to(dtype)
    scale = head_dim ** -0.5
    assert cuda_coded.supported(q, kmin, codes, bits)
    out, part = cuda_coded.coded_lse(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, None, chunk)
    exact = ref.coded_page_lse(*up(q, kmin, kmax), codes, slot_page, seq_len, scale, bits)
    assert out.shape == exact.shape and part.shape == (len(lengths) * heads, -(-slot_page.shape[2] // chunk))
    assert torch.equal(out.isinf(), exact.isinf()), "free slots must score -inf, and only they"
    fin = exact.isfinite()
    # The levels are exact; each page's q * (max - min) is rounded in the cache's dtype (the range, the product).
    assert rel_err(out[fin], exact[fin]) <= 2e-3
    blocks = torch.nn.functional.pad(out.to(F64), (0, part.shape[1] * chunk - out.shape[2]), value=-float("inf"))
    want = blocks.view(len(lengths) * heads, part.shape[1], chunk).logsumexp(-1)
    assert torch.equal(part.isinf(), want.isinf())
    assert rel_err(part[want.isfinite()], want[want.isfinite()]) <= 1e-6
    first = seq_len - 2
    first[0] = seq_len[0] - 1  # at reuse 4 rows 0 (its first step), 1 and 2 (positions 16, 0) are due, row 3 not
    assert ref.due_rows(seq_len, first, 4).tolist() == [True, True, True, False]
    gated, _ = cuda_coded.coded_lse(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, (first, 4), chunk)
    assert torch.equal(gated[:3], out[:3])
    rows = torch.arange(len(lengths), device=DEV).view(-1, 1), torch.arange(kv_heads, device=DEV).view(1, -1)
    for gate in (None, (first, 4)):
        blank = codes.clone()
        blank[(*rows, cur_slot.clamp(min=0))] = 0
        coded, _ = cuda_coded.coded_lse(q, kmin, kmax, blank, slot_page, seq_len, scale, bits, gate, chunk,
                                        (k, cur_slot))
        assert torch.equal(blank, codes)
        assert torch.equal(coded[:3], out[:3])


LOWBIT_SELECT_VARIANTS = {  # TUNING overrides: each path of lowbit_select's top-k on the small shapes
    **{name: SELECT_VARIANTS[name] for name in ("default", "segments", "groups")},
    # group maxima from the share kernel, in one block of slots or several
    "fused": {"select_fused_rows": 1, "select_one_program": 64},
    "fused-blocks": {"select_fused_rows": 1, "select_one_program": 64, "select_fused_scale": 2, "mass_block": 16},
    "torch-topk": {"select_max_slots": 16},
}
LOWBIT_SELECT_SHAPES = [
    pytest.param(3, 8, 2, 64, 4, [300, 170, 99], 8, False, id="gqa4"),
    pytest.param(3, 4, 4, 32, 4, [301, 5, 260], 5, True, id="per-query-head"),
    pytest.param(2, 8, 1, 64, 16, [40, 9], 1, False, id="one-page"),
]


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # pages without tokens
@pytest.mark.parametrize("variant,batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,"
                         "reuse,in_order", crossed(
    axis(list(LOWBIT_SELECT_VARIANTS)), cases(LOWBIT_SELECT_SHAPES), axis([1, 4]),
    axis([False, True], ["", "in-order"])))
def test_lowbit_select(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, variant, reuse,
                       in_order, monkeypatch):
    """Every row's current page is coded, due or not; the rows due (``reference.due_rows``: position a multiple of
    reuse, or the row's first decode position) get the selection of the coded scores written into ``chosen``; the
    others keep what it held, bit for bit, on each path of the selection (torch-topk: rows too long for the
    kernels); ``in_order``: slot j holds page j in a layer of more slots than the rows use, whose codes past each
    row's last page are not read."""
    for key, value in LOWBIT_SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    spare = max(-(-n // page_size) for n in lengths) // 2 if in_order else 2
    k, _, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                                torch.float32, spare=spare, in_order=in_order)
    codes = ref.key_codes(k, kmin, kmax, 2)
    q = torch.randn(batch, heads, head_dim, device=DEV)
    scale = head_dim ** -0.5
    first = seq_len - 2  # no row's first step ...
    first[0] = seq_len[0] - 1  # ... but the first row's
    hs = heads if per_head else kv_heads
    width = min(n_pages, slot_page.shape[2])
    before = torch.randint(-1, slot_page.shape[2], (batch, hs, width), device=DEV)
    chosen = before.clone()
    want_codes = codes.clone()
    ref.code_page(k, kmin, kmax, want_codes, cur_slot, 2)
    rows = torch.arange(batch, device=DEV).view(-1, 1), torch.arange(kv_heads, device=DEV).view(1, -1)
    codes[(*rows, cur_slot.clamp(min=0))] = 0  # each row's current page: coded by the op
    tops.lowbit_select(q, k, kmin, kmax, codes, slot_page, cur_slot, seq_len, first, chosen, scale, 2, n_pages,
                       reuse, per_head, None, in_order)
    assert torch.equal(codes, want_codes)
    due = ref.due_rows(seq_len, first, reuse)
    assert due.tolist() == ([True] * batch if reuse == 1 else [True] + [(n - 1) % reuse == 0 for n in lengths[1:]])
    scores = tops.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, 2, per_head)
    want = stable_selection(scores, cur_slot, n_pages)
    for row in range(batch):
        got = chosen[row].sort(-1).values if due[row] else chosen[row]
        assert torch.equal(got, want[row] if due[row] else before[row]), row


@pytest.mark.skipif(not ON_GPU, reason="the CUDA kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim, per_head", [
    (4, 4, 128, False), (8, 2, 64, False), (6, 2, 128, False), (16, 2, 128, False), (16, 2, 64, False),
    (32, 8, 128, False), (8, 4, 64, True), (12, 2, 128, True)], ids=str)
@pytest.mark.parametrize("mode", ["selected", "in-order", "table-selected", "table-in-order", "counted"])
@pytest.mark.parametrize("launch", [{}, {"cuda_fp8_blocks_per_sm": 1024}], ids=str)
def test_cuda_fp8_attention_matches_float64_reference(dtype, heads, kv_heads, head_dim, per_head, mode, launch,
                                                      monkeypatch):
    """``sparse_decode`` over an fp8 cache through the CUDA kernel (``kernels.cuda.fp8kv``), against float64 on the
    same fp8 values, for 1-8 query heads per selection row and head dims 64 and 128: pages scattered over the slots
    or in order (every slot listed, rows read up to their length), in rows of their own or through the rows' tables
    into shared pages, free slots, -1 entries and repeated pages in the selections, partial last pages, a row of one
    token and one whose selection holds nothing; its attended tokens added into a running total; and with splits of
    one page a warp."""
    from sparsekv.kernels.cuda import fp8kv as cuda_fp8kv

    monkeypatch.setitem(tops.TUNING, "attn_long_tokens", 1)  # every row is long enough for the CUDA kernel
    for key, value in launch.items():
        monkeypatch.setitem(tops.TUNING, key, value)
    lengths = [300, 17, 1, 162, 64]
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(len(lengths), kv_heads, head_dim, 16, lengths,
                                                                torch.float32, seed=heads + head_dim,
                                                                in_order=mode not in ("selected", "counted"))
    k, v = (ref.to_cache(t * 4, ref.FP8) for t in (k, v))
    q = torch.randn(len(lengths), heads, head_dim, device=DEV).to(dtype)
    hs = heads if per_head else kv_heads
    if not cuda_fp8kv.supported(q, k, hs):
        pytest.skip("the CUDA kernel cannot be built or run here")
    c = slot_page.shape[2]
    if mode in ("in-order", "table-in-order"):
        slots = torch.arange(c, device=DEV).expand(len(lengths), hs, c)
    else:
        slots = torch.randint(-1, c, (len(lengths), hs, 13), device=DEV)
        slots[:, :, 0] = slots[:, :, 1]  # a page listed twice is attended twice, as by the reference
        slots[4] = -1  # nothing selected: zeros
    scale = head_dim ** -0.5
    attended = torch.full((len(lengths), hs), 5, dtype=torch.long, device=DEV) if mode == "counted" else None
    if mode in ("table-selected", "table-in-order"):
        store_k, store_v, table = shared_store(slot_page, k, v)
        out = tops.sparse_decode(q, store_k, store_v, slot_page, slots, seq_len, scale, None,
                                 mode == "table-in-order", table)
    else:
        out = tops.sparse_decode(q, k, v, slot_page, slots, seq_len, scale, attended, mode == "in-order")
    want_counts = None if attended is None else 5 + ref.count_attended(slot_page, slots, seq_len, 16)
    exact = ref.sparse_decode(*up(q, k, v), slot_page, slots, seq_len, scale)
    assert out.dtype == dtype and out.shape == exact.shape
    fin = exact.abs().sum(-1) > 0
    assert torch.equal(out.abs().sum(-1) > 0, fin), "rows attending nothing give zeros, and only they"
    assert rel_err(out[fin], exact[fin]) <= 1e-2  # the output's rounding to bf16 (fp16: 1e-3)
    if attended is not None:
        assert torch.equal(attended, want_counts)


FP8_SHAPES = [*SHAPES, pytest.param(16, 8, 1, 32, 4, [1 + 3 * i for i in range(16)], 2, False, id="b16-gqa8")]


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # pages without tokens
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,lengths,n_pages,per_head,dtype", crossed(
    cases(FP8_SHAPES), axis([torch.bfloat16, torch.float32]), full=1))
def test_fp8_cache_ops(batch, heads, kv_heads, head_dim, page_size, lengths, n_pages, per_head, dtype):
    """Every op that reads the cache, over an fp8 cache (keys, values and bounds float8_e4m3fn) with queries in
    ``dtype``, against float64 on the same fp8 values: the kernels dequantize in registers, so their error is the
    one of a cache in q's dtype holding those values. Keys of magnitude past 448 saturate; the append stores
    quantized keys and bounds that are their exact min and max. Its draws come from a generator of its own: from
    torch's global one they depended on the tests run before it."""
    k, v, kmin, kmax, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                                torch.float32, spare=3)
    k, v, kmin, kmax = (ref.to_cache(t * 4, ref.FP8) for t in (k, v, kmin, kmax))  # some beyond fp8's normal range
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(batch, heads, head_dim, generator=g, device=DEV).to(dtype)
    scale = head_dim ** -0.5
    bound = 1e-2 if dtype == torch.bfloat16 else 5e-5  # bf16: outputs rounded to it; fp32: GPU reductions

    def close(got, exact, fn_args_exact):
        fin = exact.isfinite()
        assert torch.equal(got.isinf(), exact.isinf())
        assert rel_err(got[fin], exact[fin]) <= bound, fn_args_exact

    exact = ref.page_scores(*up(q, kmin, kmax), slot_page, per_head)
    close(tops.page_scores(q, kmin, kmax, slot_page, per_head), exact, "page_scores")
    slots = ref.select_pages(exact, cur_slot, n_pages)
    assert torch.equal(tops.quest_select(q, kmin, kmax, slot_page, cur_slot, n_pages, per_head).sort(-1).values,
                       ref.quest_select(*up(q, kmin, kmax), slot_page, cur_slot, n_pages, per_head).sort(-1).values)
    exact = ref.sparse_decode(*up(q, k, v), slot_page, slots, seq_len, scale)
    close(tops.sparse_decode(q, k, v, slot_page, slots, seq_len, scale), exact, "sparse_decode")

    flat_k, flat_v = k.flatten(2, 3), v.flatten(2, 3)
    tokens = torch.randint(-1, flat_k.shape[2], (batch, kv_heads, 9), generator=g, device=DEV)
    out, lse = tops.sparse_decode_tokens(q, flat_k, flat_v, tokens, scale)
    exact, exact_lse = ref.sparse_decode_tokens(*up(q, flat_k, flat_v), tokens, scale)
    close(out, exact, "sparse_decode_tokens")
    close(lse, exact_lse, "sparse_decode_tokens lse")

    key_pos = torch.where(slot_page.unsqueeze(-1) >= 0, slot_page.unsqueeze(-1) * page_size
                          + torch.arange(page_size, device=DEV), -1)[:, 0].flatten(1)  # (B, N) of KV head 0
    key_pos = torch.where(key_pos < seq_len.view(-1, 1), key_pos, -1)
    wq = q.view(batch, heads, 1, head_dim)
    got = tops.window_token_maxima(wq, flat_k, key_pos, seq_len.view(-1, 1) - 1, seq_len, scale)
    close(got, ref.window_token_maxima(*up(wq, flat_k), key_pos, seq_len.view(-1, 1) - 1, seq_len, scale),
          "window_token_maxima")

    codes = ref.key_codes(k, kmin, kmax, 2)
    close(tops.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, 2, per_head),
          ref.coded_scores(*up(q, kmin, kmax), codes, slot_page, seq_len, scale, 2, per_head), "coded_scores")

    no_token = (torch.arange(batch, device=DEV) == 1)  # the second sequence, if any, has no token
    position = torch.where(no_token, -1, seq_len)
    k_new, v_new = (torch.randn(batch, kv_heads, head_dim, generator=g, device=DEV).to(dtype) * 300
                    for _ in range(2))
    # Keys past 448 in both signs in every row whatever the draw: 300 x N(0, 1) leaves a row of 32 channels below
    # 448 in about 1% of draws.
    k_new[..., 0], k_new[..., 1] = 1000.0, -1000.0
    state = [t.clone() for t in (k, v, kmin, kmax, slot_page, cur_slot)]
    ref.append_token(*state, position, k_new, v_new, False)
    tops.append_token(k, v, kmin, kmax, slot_page, cur_slot, position, k_new, v_new, False)
    for got, want in zip((k, v, kmin, kmax, slot_page, cur_slot), state):
        assert torch.equal(got.view(torch.uint8) if got.dtype == ref.FP8 else got,
                           want.view(torch.uint8) if want.dtype == ref.FP8 else want)
    bi, hi = torch.arange(batch, device=DEV).view(-1, 1), torch.arange(kv_heads, device=DEV).view(1, -1)
    written = k[bi, hi, cur_slot, (seq_len % page_size).view(-1, 1)][~no_token]  # (rows, Hkv, D)
    assert torch.equal(written.float(), ref.to_cache(k_new[~no_token], ref.FP8).float())
    assert (written[..., 0].float() == ref.FP8_MAX).all() and (written[..., 1].float() == -ref.FP8_MAX).all()


# (batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, per_head): partial pages, free slots, pages
# scattered over the slots; page sizes and head dims not powers of two, odd head counts, groups of 1 and 3.
LANDMARK_SHAPES = [
    pytest.param(1, 4, 1, 64, 16, 2, [5], False, id="one-partial-page-gqa4"),
    pytest.param(3, 6, 2, 64, 8, 2, [1, 13, 37], False, id="ragged-gqa3"),
    pytest.param(2, 3, 3, 24, 12, 3, [30, 7], True, id="page-12-mha3-d24-per-head"),
    pytest.param(2, 9, 3, 32, 6, 2, [40, 17], False, id="page-6-gqa3"),
    pytest.param(2, 8, 4, 64, 4, 4, [21, 6], True, id="a-landmark-per-token"),
    pytest.param(1, 2, 1, 32, 1, 1, [7], False, id="page-size-1"),
]


def _through_table(t: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' slots (B, Hkv, C, ...) as a store of shared pages (1, Hkv, B * C + 3, ...) and the table (B, C)."""
    b, hkv, c = t.shape[:3]
    table = torch.randperm(b * c + 3, generator=torch.Generator().manual_seed(seed))[:b * c].view(b, c).to(DEV)
    store = torch.full((1, hkv, b * c + 3, *t.shape[3:]), float("nan"), device=DEV).to(t.dtype)
    for bi in range(b):
        store[0, :, table[bi]] = t[bi]
    return store, table


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # heads without runs
@pytest.mark.parametrize("through_table", [False, True], ids=["", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, ref.FP8], ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,landmarks,lengths,per_head", LANDMARK_SHAPES)
def test_landmark_page_scores(batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, per_head, dtype,
                              through_table):
    """Page scores from stored landmarks against float64 on the same landmarks (an fp8 cache's with bf16 queries):
    free slots -inf, and only they; whatever a free slot or a run without stored tokens holds (NaN here, fp8's
    largest value in fp8) is left out."""
    k, _, _, _, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, torch.float32)
    means = ref.page_landmarks(k, slot_page, seq_len, landmarks)
    empty = ~ref.stored_tokens(slot_page, seq_len, page_size).view(*slot_page.shape, landmarks, -1).any(-1)
    means[empty] = ref.FP8_MAX if dtype == ref.FP8 else float("nan")
    means = ref.to_cache(means, dtype)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(torch.bfloat16 if dtype == ref.FP8 else dtype)
    scale = head_dim ** -0.5
    exact = ref.landmark_page_scores(*up(q, means), slot_page, seq_len, page_size, scale, per_head)
    store, table = _through_table(means, 1) if through_table else (means, None)
    scores = tops.landmark_page_scores(q, store, slot_page, seq_len, page_size, scale, per_head, table)
    assert scores.shape == exact.shape and scores.dtype == torch.float32
    assert torch.equal(scores.isinf(), exact.isinf()), "free slots must score -inf, and only they"
    fin = exact.isfinite()
    torch_err = rel_err(ref.landmark_page_scores(q, means, slot_page, seq_len, page_size, scale, per_head)[fin],
                        exact[fin])
    assert rel_err(scores[fin], exact[fin]) <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("through_table", [False, True], ids=["", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, ref.FP8], ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,landmarks,lengths,per_head", LANDMARK_SHAPES)
def test_landmark_means_match_reference(batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, per_head,
                                        dtype, through_table):
    """Each row's current page's landmarks, as the reference rounds them into the cache's dtype, and nothing else
    written: partial pages with garbage past the row's length, a row without pages (cur_slot -1: slot 0), keys
    past fp8's range (saturated)."""
    k, _, _, _, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                          torch.float32)
    cur_slot[0, -1] = -1
    k = ref.to_cache(k * (300 if dtype == ref.FP8 else 1), dtype)
    means = torch.randn(*slot_page.shape, landmarks, head_dim, device=DEV).to(dtype)
    want = means.clone()
    if through_table:
        (k, table), (means, _), (want, _) = _through_table(k, 2), _through_table(means, 2), _through_table(want, 2)
    else:
        table = None
    tops.landmark_means(k, means, slot_page, cur_slot, seq_len, table)
    ref.landmark_means(k, want, slot_page, cur_slot, seq_len, table)
    # The sums of a run may be taken in another order: a float32 landmark within a few ulps, a rounded one the same.
    tol = {torch.float32: 1e-6, torch.bfloat16: 0.0, ref.FP8: 0.0}[dtype]
    torch.testing.assert_close(means.float(), want.float(), rtol=tol, atol=tol, equal_nan=True)


LANDMARK_SELECT_VARIANTS = {**{name: LOWBIT_SELECT_VARIANTS[name]
                               for name in ("default", "segments", "fused", "fused-blocks", "torch-topk")},
                            # the landmarks read in head-dim slices of 16, blocks of 16 slots
                            "slices16": {"landmark_block_k": 16, "landmark_block": 16}}
LANDMARK_SELECT_SHAPES = [
    pytest.param(3, 8, 2, 64, 4, 2, [300, 170, 99], 8, False, 1, id="gqa4"),
    pytest.param(2, 6, 3, 24, 6, 3, [260, 7], 5, True, 2, id="per-query-head-page6-d24"),
    pytest.param(2, 4, 1, 32, 4, 4, [1, 70], 3, False, 0, id="one-token-no-sink"),
]


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # heads without runs
@pytest.mark.parametrize("variant,batch,heads,kv_heads,head_dim,page_size,landmarks,lengths,n_pages,per_head,sinks,"
                         "in_order,through_table", crossed(
    axis(list(LANDMARK_SELECT_VARIANTS)), cases(LANDMARK_SELECT_SHAPES), axis([False, True], ["", "in-order"]),
    axis([False, True], ["", "table"])))
def test_landmark_select(batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, n_pages, per_head, sinks,
                         variant, in_order, through_table, monkeypatch):
    """The current pages' landmarks written as ``landmark_means`` writes them (stale ones there before), then exactly
    the selection of the landmark scores with the sink pages in, on each path of the top-k; ``in_order``: slot j
    holds page j in a layer of more slots than the rows use."""
    for key, value in LANDMARK_SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    spare = max(-(-n // page_size) for n in lengths) // 2 if in_order else 2
    k, _, _, _, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                          torch.float32, spare=spare, in_order=in_order)
    means = ref.page_landmarks(k, slot_page, seq_len, landmarks).float()
    rows = torch.arange(batch, device=DEV).view(-1, 1), torch.arange(kv_heads, device=DEV).view(1, -1)
    means[(*rows, cur_slot)] = torch.randn_like(means[(*rows, cur_slot)])  # stale: the op writes them
    want = means.clone()
    table = None
    if through_table:
        (k, table), (means, _), (want, _) = _through_table(k, 3), _through_table(means, 3), _through_table(want, 3)
    ref.landmark_means(k, want, slot_page, cur_slot, seq_len, table)
    scale = head_dim ** -0.5
    q = torch.randn(batch, heads, head_dim, device=DEV)
    got = tops.landmark_select(q, k, means, slot_page, cur_slot, seq_len, scale, n_pages, sinks, per_head, in_order,
                               table)
    torch.testing.assert_close(means, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    scores = tops.landmark_page_scores(q, means, slot_page, seq_len, page_size, scale, per_head, table)
    assert torch.equal(got.sort(-1).values, stable_selection(ref.with_sinks(scores, slot_page, sinks), cur_slot,
                                                             n_pages))
    assert torch.equal(got.sort(-1).values, ref.landmark_select(*up(q, k, means), slot_page, cur_slot, seq_len, scale,
                                                                n_pages, sinks, per_head, in_order,
                                                                table).sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, ref.FP8], ids=str)
@pytest.mark.parametrize("page_size,landmarks,head_dim", [(4, 2, 64), (6, 3, 24), (16, 2, 128), (1, 1, 32)])
def test_page_means_match_reference(page_size, landmarks, head_dim, dtype):
    """The landmarks of the pages a pass wrote by slot numbers (vLLM's blocks), from offset 0 to the last written:
    pages written whole, in part, continued from an earlier pass, and padding; nothing else written."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    n_pages, kv_heads = 7, 2
    k = ref.to_cache(torch.randn(1, kv_heads, n_pages, page_size, head_dim, generator=gen, device=DEV)
                     * (300 if dtype == ref.FP8 else 1), dtype)
    means = torch.randn(1, kv_heads, n_pages, landmarks, head_dim, generator=gen, device=DEV).to(dtype)
    want = means.clone()
    slots = [*range(2 * page_size, 3 * page_size), *range(5 * page_size + page_size // 2, 6 * page_size), -1,
             *range(page_size, page_size + max(1, page_size - 1)), -1, -1]
    slot_mapping = torch.tensor(slots, device=DEV)
    tops.page_means(k, means, slot_mapping)
    ref.page_means(k, want, slot_mapping)
    tol = {torch.float32: 1e-6, torch.bfloat16: 0.0, ref.FP8: 0.0}[dtype]
    torch.testing.assert_close(means.float(), want.float(), rtol=tol, atol=tol)
    untouched = [p for p in range(n_pages) if p not in (1, 2, 5)]
    assert torch.equal(means[0, :, untouched].float(), want[0, :, untouched].float())


# spread's stats as the kernels round them: float32 within a few ulps (sums in another order), a rounded one within
# an ulp of its dtype (the float32 value rounded may lie on the other side of a rounding boundary).
SPREAD_STATS_TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, ref.FP8: 0.13}
# spread's scores: float32 products in ieee, 16-bit ones of squares rounded to bf16.
SPREAD_SCORES_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, ref.FP8: 2e-2}


@pytest.mark.parametrize("through_table", [False, True], ids=["", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, ref.FP8], ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,landmarks,lengths,per_head", LANDMARK_SHAPES)
def test_spread_page_scores(batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, per_head, dtype,
                            through_table):
    """Page scores from stored means and deviations against float64 on the same stats (an fp8 cache's with bf16
    queries): free slots -inf, and only they, whatever they hold (NaN here)."""
    k, _, _, _, slot_page, _, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths, torch.float32)
    stats = ref.page_spreads(k, slot_page, seq_len)
    stats[slot_page < 0] = ref.FP8_MAX if dtype == ref.FP8 else float("nan")
    stats = ref.to_cache(stats, dtype)
    q = torch.randn(batch, heads, head_dim, device=DEV).to(torch.bfloat16 if dtype == ref.FP8 else dtype)
    exact = ref.spread_page_scores(*up(q, stats), slot_page, 1.7, per_head)
    store, table = _through_table(stats, 1) if through_table else (stats, None)
    scores = tops.spread_page_scores(q, store, slot_page, 1.7, per_head, table)
    assert scores.shape == exact.shape and scores.dtype == torch.float32
    assert torch.equal(scores.isinf(), exact.isinf()), "free slots must score -inf, and only they"
    fin = exact.isfinite()
    assert rel_err(scores[fin], exact[fin]) <= SPREAD_SCORES_TOL[dtype]


@pytest.mark.parametrize("through_table", [False, True], ids=["", "table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, ref.FP8], ids=str)
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page_size,landmarks,lengths,per_head", LANDMARK_SHAPES)
def test_spread_stats_match_reference(batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, per_head,
                                      dtype, through_table):
    """Each row's current page's mean and deviation, as the reference rounds them into the cache's dtype, and
    nothing else written: partial pages with garbage past the row's length, a row without pages (cur_slot -1: slot
    0), keys past fp8's range (saturated)."""
    k, _, _, _, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                          torch.float32)
    cur_slot[0, -1] = -1
    k = ref.to_cache(k * (300 if dtype == ref.FP8 else 1), dtype)
    stats = torch.randn(*slot_page.shape, 2, head_dim, device=DEV).to(dtype)
    want = stats.clone()
    if through_table:
        (k, table), (stats, _), (want, _) = _through_table(k, 2), _through_table(stats, 2), _through_table(want, 2)
    else:
        table = None
    tops.spread_stats(k, stats, slot_page, cur_slot, seq_len, table)
    ref.spread_stats(k, want, slot_page, cur_slot, seq_len, table)
    tol = SPREAD_STATS_TOL[dtype]
    torch.testing.assert_close(stats.float(), want.float(), rtol=tol, atol=tol, equal_nan=True)


SPREAD_SELECT_VARIANTS = {**{name: LOWBIT_SELECT_VARIANTS[name] for name in ("default", "segments", "torch-topk")},
                          # group maxima from the page-score kernel: blocks of 16 slots, two chunks a program
                          "fused": {"select_fused_rows": 1, "select_one_program": 64},
                          "fused-chunks": {"select_fused_rows": 1, "select_one_program": 64, "page_block": 16,
                                           "page_chunks": 2}}


@pytest.mark.parametrize("variant,batch,heads,kv_heads,head_dim,page_size,landmarks,lengths,n_pages,per_head,sinks,"
                         "in_order,through_table", crossed(
    axis(list(SPREAD_SELECT_VARIANTS)), cases(LANDMARK_SELECT_SHAPES), axis([False, True], ["", "in-order"]),
    axis([False, True], ["", "table"])))
def test_spread_select(batch, heads, kv_heads, head_dim, page_size, landmarks, lengths, n_pages, per_head, sinks,
                       variant, in_order, through_table, monkeypatch):
    """The current pages' stats written as ``spread_stats`` writes them (stale ones there before), then exactly the
    selection of the spread scores with the sink pages in, on each path of the top-k; ``in_order``: slot j holds
    page j in a layer of more slots than the rows use."""
    for key, value in SPREAD_SELECT_VARIANTS[variant].items():
        monkeypatch.setitem(tops.TUNING, key, value)
    spare = max(-(-n // page_size) for n in lengths) // 2 if in_order else 2
    k, _, _, _, slot_page, cur_slot, seq_len = make_cache(batch, kv_heads, head_dim, page_size, lengths,
                                                          torch.float32, spare=spare, in_order=in_order)
    stats = ref.page_spreads(k, slot_page, seq_len).float()
    rows = torch.arange(batch, device=DEV).view(-1, 1), torch.arange(kv_heads, device=DEV).view(1, -1)
    stats[(*rows, cur_slot)] = torch.randn_like(stats[(*rows, cur_slot)])  # stale: the op writes them
    want = stats.clone()
    table = None
    if through_table:
        (k, table), (stats, _), (want, _) = _through_table(k, 3), _through_table(stats, 3), _through_table(want, 3)
    ref.spread_stats(k, want, slot_page, cur_slot, seq_len, table)
    q = torch.randn(batch, heads, head_dim, device=DEV)
    got = tops.spread_select(q, k, stats, slot_page, cur_slot, seq_len, 2.0, n_pages, sinks, per_head, in_order,
                             table)
    torch.testing.assert_close(stats, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    scores = tops.spread_page_scores(q, stats, slot_page, 2.0, per_head, table)
    assert torch.equal(got.sort(-1).values, stable_selection(ref.with_sinks(scores, slot_page, sinks), cur_slot,
                                                             n_pages))
    assert torch.equal(got.sort(-1).values, ref.spread_select(*up(q, k, stats), slot_page, cur_slot, seq_len, 2.0,
                                                              n_pages, sinks, per_head, in_order,
                                                              table).sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, ref.FP8], ids=str)
@pytest.mark.parametrize("page_size,head_dim", [(4, 64), (6, 24), (16, 128), (1, 32)])
def test_page_stats_match_reference(page_size, head_dim, dtype):
    """The means and deviations of the pages a pass wrote by slot numbers (vLLM's blocks), from offset 0 to the last
    written: pages written whole, in part, continued from an earlier pass, and padding; nothing else written."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    n_pages, kv_heads = 7, 2
    k = ref.to_cache(torch.randn(1, kv_heads, n_pages, page_size, head_dim, generator=gen, device=DEV)
                     * (300 if dtype == ref.FP8 else 1), dtype)
    stats = torch.randn(1, kv_heads, n_pages, 2, head_dim, generator=gen, device=DEV).to(dtype)
    want = stats.clone()
    slots = [*range(2 * page_size, 3 * page_size), *range(5 * page_size + page_size // 2, 6 * page_size), -1,
             *range(page_size, page_size + max(1, page_size - 1)), -1, -1]
    slot_mapping = torch.tensor(slots, device=DEV)
    tops.page_stats(k, stats, slot_mapping)
    ref.page_stats(k, want, slot_mapping)
    tol = SPREAD_STATS_TOL[dtype]
    torch.testing.assert_close(stats.float(), want.float(), rtol=tol, atol=tol)
    untouched = [p for p in range(n_pages) if p not in (1, 2, 5)]
    assert torch.equal(stats[0, :, untouched].float(), want[0, :, untouched].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,heads,length,head_dim", [(1, 4, 37, 64), (2, 3, 5, 24), (1, 2, 130, 128)])
def test_merge_lse_matches_reference(rows, heads, length, head_dim, dtype):
    """Two parts of attention merged by their log-sum-exp, read through strided views (a prompt pass's padded
    parts), with positions where one part or both have no key (lse -inf): the float64 merge of the same inputs."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    pad = 3
    a = torch.randn(rows, heads, length + pad, head_dim, generator=gen, device=DEV).to(dtype)[:, :, pad:]
    b = torch.randn(rows, heads, length + 2 * pad, head_dim, generator=gen, device=DEV).to(dtype)[:, :, :length]
    lse_a = (torch.randn(rows, heads, length + pad, generator=gen, device=DEV) * 4)[:, :, pad:]
    lse_b = (torch.randn(rows, heads, length, generator=gen, device=DEV) * 4).transpose(0, 1).contiguous()
    lse_b = lse_b.transpose(0, 1)
    lse_a[:, :, 0] = float("-inf")
    lse_b[:, :, 1 % length] = float("-inf")
    lse_b[:, :, 0] = float("-inf")
    out, lse = tops.merge_lse(a, lse_a, b, lse_b)
    want, want_lse = ref.merge_lse(a.to(F64), lse_a.to(F64), b.to(F64), lse_b.to(F64))
    assert out.dtype == dtype and out.shape == a.shape and lse.dtype == torch.float32
    assert torch.equal(out[:, :, 0].float(), torch.zeros_like(out[:, :, 0].float()))
    assert lse[:, :, 0].eq(float("-inf")).all()
    assert rel_err(out, want) <= 2 * rel_err(ref.merge_lse(a, lse_a, b, lse_b)[0], want) + 1e-6
    torch.testing.assert_close(lse.to(F64), want_lse, rtol=1e-6, atol=1e-6)
