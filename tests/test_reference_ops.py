"""Reference ops against brute force: the Quest bound, top-k selection, attention over selected pages."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.cache import PagedKVCache
from sparsekv.kernels import reference as ref
from sparsekv.quant import quantize_int4


def filled_layer(lengths, hkv, d, page_size, dtype=torch.float64, seed=0):
    """A one-layer paged cache holding random keys/values for sequences of the given lengths (left padded)."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    keys = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    vals = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    valid = torch.arange(s).unsqueeze(0) >= (s - torch.tensor(lengths)).unsqueeze(1)
    cache = PagedKVCache(num_layers=1, page_size=page_size)
    cache.begin(s, valid, b, keys.device)
    layer = cache.append(0, keys, vals)
    return cache, layer, keys, vals, valid


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 70), page_size=st.sampled_from([1, 2, 4, 16]), group=st.integers(1, 4),
       seed=st.integers(0, 10_000))
def test_bound_dominates_every_dot_product(length, page_size, group, seed):
    cache, layer, keys, _, _ = filled_layer([length], 2, 8, page_size, seed=seed)
    q = torch.randn(1, 2 * group, 8, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    per_head = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page, per_query_head=True)
    per_kv = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page)
    for h in range(2 * group):
        kv = h // group
        dots = keys[0, kv] @ q[0, h]  # (L,)
        for slot, page in enumerate(layer.slot_page[0, kv].tolist()):
            if page < 0:
                assert per_head[0, h, slot] == -math.inf
                continue
            true_max = dots[page * page_size : (page + 1) * page_size].max()
            assert per_head[0, h, slot] >= true_max - 1e-12
            assert per_kv[0, kv, slot] >= per_head[0, h, slot]


def test_group_score_is_max_over_group():
    _, layer, _, _, _ = filled_layer([37], 2, 8, 4)
    q = torch.randn(1, 8, 8, dtype=torch.float64)
    per_head = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page, per_query_head=True)
    per_kv = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page)
    torch.testing.assert_close(per_kv, per_head.view(1, 2, 4, -1).amax(2))


@pytest.mark.parametrize("num_pages", [1, 3, 8, 100])
def test_selection_equals_brute_force_top_k(num_pages):
    torch.manual_seed(num_pages)
    _, layer, _, _, _ = filled_layer([45, 30, 3], 2, 8, 4)
    q = torch.randn(3, 4, 8, dtype=torch.float64)
    for per_query_head in (False, True):
        scores = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page, per_query_head)
        slots = ref.select_pages(scores, layer.cur_slot, num_pages)
        rows = scores.shape[1]
        for b in range(3):
            for r in range(rows):
                kv = r // (rows // 2)
                cur = layer.cur_slot[b, kv].item()
                valid = [c for c in range(scores.shape[2]) if layer.slot_page[b, kv, c] >= 0]
                rest = sorted((c for c in valid if c != cur), key=lambda c: -scores[b, r, c].item())
                expect = {cur, *rest[: num_pages - 1]}
                got = {c for c in slots[b, r].tolist() if c >= 0}
                assert got == expect


def test_budget_covering_context_selects_every_page():
    _, layer, _, _, _ = filled_layer([33], 1, 4, 4)
    scores = ref.page_scores(torch.randn(1, 1, 4, dtype=torch.float64), layer.kmin, layer.kmax, layer.slot_page)
    slots = ref.select_pages(scores, layer.cur_slot, 9)
    assert sorted(s for s in slots[0, 0].tolist() if s >= 0) == list(range(9))


def brute_force_attention(q, keys, vals, allowed, scale):
    """q: (D,), keys/vals: (L, D), allowed: (L,) bool; plain softmax attention in float64."""
    logits = (keys @ q) * scale
    logits[~allowed] = -math.inf
    return torch.softmax(logits, 0) @ vals


@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("per_query_head", [False, True])
def test_sparse_decode_equals_dense_on_selected_tokens(group, page_size, per_query_head):
    lengths, hkv, d = [50, 17, 1], 2, 8
    cache, layer, keys, vals, valid = filled_layer(lengths, hkv, d, page_size, seed=group)
    q = torch.randn(3, hkv * group, d, dtype=torch.float64)
    scores = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page, per_query_head)
    slots = ref.select_pages(scores, layer.cur_slot, 3)
    scale = d ** -0.5
    out = ref.sparse_decode(q, layer.k, layer.v, layer.slot_page, slots, cache.seq_len, scale)
    counts = ref.count_attended(layer.slot_page, slots, cache.seq_len, page_size)
    rows = slots.shape[1]
    for b, n in enumerate(lengths):
        for h in range(hkv * group):
            kv, r = h // group, h // (hkv * group // rows)
            pages = {layer.slot_page[b, kv, s].item() for s in slots[b, r].tolist() if s >= 0}
            allowed = torch.tensor([pos // page_size in pages for pos in range(n)])
            k_row, v_row = keys[b, kv][valid[b]], vals[b, kv][valid[b]]
            expect = brute_force_attention(q[b, h], k_row, v_row, allowed, scale)
            torch.testing.assert_close(out[b, h], expect, rtol=1e-12, atol=1e-12)
            assert counts[b, r].item() == allowed.sum().item()


def test_attend_is_causal_over_positions():
    cache, layer, keys, vals, _ = filled_layer([10], 1, 4, 4)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    q_pos = torch.tensor([[2, 9, -1]])
    slots = torch.arange(layer.shape[2]).expand(1, 1, -1)
    out = ref.attend(q, layer.k, layer.v, layer.slot_page, slots, q_pos, 0.5)
    for h in range(2):
        for i, pos in enumerate([2, 9]):
            allowed = torch.arange(10) <= pos
            expect = brute_force_attention(q[0, h, i], keys[0, 0], vals[0, 0], allowed, 0.5)
            torch.testing.assert_close(out[0, h, i], expect)
        assert torch.all(out[0, h, 2] == 0)  # a padding query attends to nothing


def test_select_pages_rejects_zero_pages():
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        ref.select_pages(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), 0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_linear_of_rows_laid_out_as_compiled_is_one_matrix_product(quantized, bias):
    """A decode step's (B, 1, K) input whose size-1 dim has a stride other than K (torch.compile's layout of the
    attention output) goes through one matrix product, not a batch of matrix-vector products that each read the
    whole weight, and gives F.linear's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    b, heads, d, n = 9, 4, 8, 24
    x = torch.randn(b * heads * d, generator=g).as_strided((b, 1, heads * d), (heads * d, d, 1))
    w = torch.randn(n, heads * d, generator=g)
    bias = torch.randn(n, generator=g) if bias else None
    if quantized:
        codes, scale, minimum = quantize_int4(w)
        w = ref.dequantize(codes, scale, minimum, heads * d)
    want = torch.nn.functional.linear(x.contiguous().view(b, heads * d), w, bias).view(b, 1, n)
    with Ops() as ops:
        if quantized:
            out = ref.linear_quantized(x, codes, scale, minimum, bias)
        else:
            out = ref.linear(x, w, bias)
    assert "bmm.default" not in ops.names and {"mm.default", "addmm.default"} & set(ops.names)
    assert out.shape == (b, 1, n)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
