"""A pass of real tokens only into a layer without freed slots takes ``kernels.append_pages`` (one op a pass, or a
row's pass where the rows' lengths differ): it must leave the layer bit for bit as the general scatter path
(``scatter_append``) does."""

import copy

import pytest
import torch

from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.cache.paged import PagedLayer, storage_dtype

GENERAL = PagedLayer.scatter_append
PAGES = kernels.append_pages


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same(layer: PagedLayer, twin: PagedLayer, where) -> None:
    for name in ("k", "v", "kmin", "kmax"):
        assert torch.equal(as_bits(getattr(layer, name)), as_bits(getattr(twin, name))), (where, name)
    for name in ("slot_page", "cur_slot"):
        assert torch.equal(getattr(layer, name), getattr(twin, name)), (where, name)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                            (torch.bfloat16, "fp8"), (torch.float32, "fp8")])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("lead", [[0], [0, 0, 0], [0, 5, 2]], ids=["B1", "B3-equal", "B3-unequal"])
def test_append_pages_matches_scatter_append(lead, page_size, dtype, kv_dtype, monkeypatch):
    """Chunks that start and end mid-page, one-token chunks and whole pages, after a first chunk that left-pads
    rows by ``lead`` tokens (so that later chunks start rows at unequal lengths), then decode steps."""
    gen = torch.Generator().manual_seed(page_size * 7 + len(lead) + sum(lead))
    b, h, d = len(lead), 2, 8
    sizes = [6, 1, 3, 2 * page_size + 3, 1, page_size, 5, 37]
    total = sum(sizes) + 3
    cache = PagedKVCache(num_layers=1, page_size=page_size, kv_dtype=kv_dtype)
    layer = PagedLayer(b, h, d, page_size, -(-total // page_size), storage_dtype(kv_dtype, dtype), torch.device("cpu"))
    copies = []
    monkeypatch.setattr(kernels, "append_pages", lambda *a: copies.append(a[9]) or PAGES(*a))
    for step, s in enumerate(sizes + [1, 1, 1]):
        # Keys past fp8's range, so that saturation is covered; values of both signs around zero.
        keys = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).mul(200).to(dtype)
        vals = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).to(dtype)
        valid = None
        if step == 0:
            valid = torch.arange(s).unsqueeze(0) >= torch.tensor(lead).unsqueeze(1)
        plan = cache.begin(s, valid, b, keys.device, prompt_end=step == len(sizes) - 1)
        twin = copy.deepcopy(layer)
        GENERAL(twin, keys, vals, plan)
        copies.clear()
        layer.append(keys, vals, plan)
        assert_same(layer, twin, (step, s))
        if step == 0 and any(lead):
            assert not copies  # padding takes the general path
        elif plan.prompt or s > 1:
            assert copies == ([0] if len(set(plan.prev_len)) == 1 else list(range(b)))  # each op's first row


def test_freed_slots_take_the_general_path(monkeypatch):
    """Once a slot is freed, a new page takes the lowest free slot, which ``append_pages`` (slot j for page j)
    cannot place."""
    cache = PagedKVCache(num_layers=1, page_size=4)
    layer = PagedLayer(1, 2, 8, 4, 8, torch.float32, torch.device("cpu"))
    keys = torch.randn(1, 2, 9, 8)
    layer.append(keys, keys, cache.begin(9, None, 1, keys.device, prompt_end=False))
    layer.free(torch.tensor([[[0], [1]]]), torch.tensor([[[True], [True]]]))
    plan = cache.begin(9, None, 1, keys.device, prompt_end=False)
    twin = copy.deepcopy(layer)
    GENERAL(twin, keys, keys, plan)
    monkeypatch.setattr(kernels, "append_pages", lambda *a: pytest.fail("append_pages with freed slots"))
    layer.append(keys, keys, plan)
    assert_same(layer, twin, "holes")
