"""RaaS: dense at a budget covering the context, the paper's eviction rule step by step, constant memory."""

from __future__ import annotations

import math

import pytest
import torch
from omni_raas_util import assert_dense, beam_search, generate, padded_prompts

import sparsekv
from sparsekv import DenseConfig, RaaSConfig
from sparsekv.cache import PagedKVCache
from sparsekv.methods.base import Tally
from sparsekv.tiny import ARCHITECTURES, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("prefill", ["keep", "quest"])
def test_budget_covering_context_is_dense(arch, prefill):
    model = tiny_model(arch, layers=3, seed=1)
    ids, mask = padded_prompts([37, 20], seed=2)
    dense = generate(model, DenseConfig(page_size=4), ids, 24, mask)[:2]
    config = RaaSConfig(page_size=4, token_budget=128, prefill=prefill)  # quest: 64 prompt + 64 decode tokens
    assert_dense(dense, model, config, ids, mask)


def test_beam_search_covering_context_is_dense():
    model = tiny_model("llama", layers=3, seed=1)
    ids, mask = padded_prompts([30, 21], seed=2)
    dense = beam_search(model, DenseConfig(page_size=4), ids, mask, 10)
    assert torch.equal(beam_search(model, RaaSConfig(page_size=4, token_budget=128), ids, mask, 10), dense)


@pytest.mark.parametrize("prefill", ["keep", "quest"])
def test_small_budget_attends_less(prefill):
    model = tiny_model("llama", layers=2, seed=3)
    ids, mask = padded_prompts([40], seed=4)
    config = RaaSConfig(page_size=4, token_budget=32, prefill=prefill)
    _, _, session = generate(model, config, ids, 40, mask)
    summary = session.stats.summary()
    assert summary["fraction"] < 0.8
    if prefill == "quest":
        assert summary["attended_per_head"] <= 32  # the whole budget, prompt share and decode pages together


def _one_hot(i: int, dim: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), dim).float().view(1, 1, 1, dim)


def test_worked_example_cache_of_five_tokens():
    """The eviction rule of the paper replayed on a cache of 5 tokens with pages of one token.

    Token i has key e_i, so a query q scores token i exactly q . e_i (Quest's bound is exact for one-token pages).
    The prompt is tokens 0 and 1; decode step s appends token s + 1. Each step's query is 20 e_0 + 20 sum_{r in R_s}
    e_r: with alpha = 0.1 it refreshes token 0 and the tokens R_s (estimated probability ~1/|{0} + R_s|, the rest
    ~1e-9); the token just appended is refreshed as the current page. Timestamp = step of the last refresh (the cache
    stores the row's length then, the step + 2: the same order).

    step  append  R_s   stamps of decode tokens after the step      cache at the step's end (5 = full)
      1     2     {0}   2:1                                        0 1 2
      2     3     {2}   2:2 3:2                                    0 1 2 3
      3     4     {3}   2:2 3:3 4:3        -> full, evict 2 (ts 2)  0 1 3 4
      4     5     {3}   3:4 4:3 5:4        -> evict 4 (ts 3)        0 1 3 5
      5     6     {5}   3:4 5:5 6:5        -> evict 3 (ts 4)        0 1 5 6
      6     7     {}    5:5 6:5 7:6        -> tie 5/6, evict 5      0 1 6 7
    The prompt tokens 0 and 1 are never evicted although token 1 is never refreshed (a phoenix token may come back).
    Each new token takes the slot the last eviction freed, so the cache never holds more than 5 slots.
    """
    config = RaaSConfig(page_size=1, token_budget=5, top_fraction=None, alpha=0.1)
    method = config.build(1)
    cache = PagedKVCache(1, page_size=1)
    plan = cache.begin(2, None, 1, torch.device("cpu"))
    keys = torch.cat([_one_hot(0), _one_hot(1)], dim=2)
    layer = cache.append(0, keys, keys)
    method.prefill(0, torch.zeros(1, 1, 2, 8), layer, plan, 1.0)
    assert layer.max_pages == 5

    refresh = {1: [0], 2: [2], 3: [3], 4: [3], 5: [5], 6: []}
    expected_cache = {1: [0, 1, 2], 2: [0, 1, 2, 3], 3: [0, 1, 3, 4], 4: [0, 1, 3, 5], 5: [0, 1, 5, 6],
                      6: [0, 1, 6, 7]}
    expected_evicted = {1: None, 2: None, 3: 2, 4: 4, 5: 3, 6: 5}
    for step in range(1, 7):
        cache.begin(1, None, 1, torch.device("cpu"))
        token = _one_hot(step + 1)
        layer = cache.append(0, token, token)
        before = set(layer.slot_page[0, 0, :layer.capacity].tolist()) - {-1}
        q = 20 * (_one_hot(0) + sum((_one_hot(r) for r in refresh[step]), torch.zeros(1, 1, 1, 8)))
        method.decode(0, q.view(1, 1, 8), layer, cache.seq_len, 1.0, Tally(1, q.device))
        after = sorted(set(layer.slot_page[0, 0, :layer.capacity].tolist()) - {-1})
        assert after == expected_cache[step], step
        evicted = before - set(after)
        assert evicted == ({expected_evicted[step]} if expected_evicted[step] is not None else set()), step
        assert layer.capacity <= 5
    assert layer.capacity == 5


def test_top_fraction_refreshes_the_top_pages():
    """Decode pages in the top fraction of every cached page (prompt pages included) take the row's length as their
    stamp; prompt pages carry none (they are never evicted)."""
    config = RaaSConfig(page_size=1, token_budget=64, top_fraction=0.3)
    method = config.build(1)
    cache = PagedKVCache(1, page_size=1)
    g = torch.Generator().manual_seed(0)
    plan = cache.begin(4, None, 1, torch.device("cpu"))
    keys = torch.randn(1, 2, 4, 8, generator=g)
    layer = cache.append(0, keys, keys)
    method.prefill(0, torch.zeros(1, 4, 4, 8), layer, plan, 0.5)
    for _ in range(7):
        cache.begin(1, None, 1, torch.device("cpu"))
        new = torch.randn(1, 2, 1, 8, generator=g)
        layer = cache.append(0, new, new)
        keys = torch.cat([keys, new], dim=2)  # (1, 2, n, 8): one-token pages, page i in slot i
        q = torch.randn(1, 4, 8, generator=g)
        method.decode(0, q, layer, cache.seq_len, 0.5, Tally(1, q.device))
    stamps = layer.slot_state["raas_stamp"][0]
    for head in range(2):
        score = (q[0, 2 * head:2 * head + 2] @ keys[0, head].T).amax(dim=0)  # max over the group's heads
        top = set(score.topk(math.ceil(0.3 * 11)).indices.tolist()) | {10}  # the current page is always refreshed
        stamped = set(torch.nonzero(stamps[head, :11] == 11).flatten().tolist())  # 4 + 7 tokens
        assert stamped == top - {0, 1, 2, 3}
        assert stamps[head, :4].eq(0).all()


def test_memory_constant_and_prompt_kept_over_500_steps():
    model = tiny_model("qwen2", layers=2, seed=5)
    ids, mask = padded_prompts([20, 13], seed=6)
    config = RaaSConfig(page_size=16, token_budget=64)
    with sparsekv.apply(model, config) as session:
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = session.cache
        prompt_pages = [[0, 1], [0]]
        sizes = []
        token = out.logits[:, -1:].argmax(-1)
        full_mask = mask
        for _ in range(500):
            full_mask = torch.cat([full_mask, torch.ones_like(token)], dim=1)
            out = model(token, attention_mask=full_mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sizes.append(cache.resident_bytes())
            for layer in cache.pages.layers:
                held = layer.slot_page[:, :, :layer.capacity]
                for row, pages in enumerate(prompt_pages):
                    for page in pages:
                        assert (held[row] == page).any(dim=-1).all(), "a prompt page was evicted"
                assert ((held >= 0).sum(-1) <= 4).all()  # 64 tokens in pages of 16
    # Row 0 reaches 64 tokens after 44 steps; from then on nothing is allocated.
    assert len(set(sizes[44:])) == 1
    assert max(cache.pages.lengths) == 520
    assert all(layer.capacity == 4 for layer in cache.pages.layers)


def test_quest_prefill_keeps_prompt_and_caps_decode_pages():
    model = tiny_model("mistral", layers=2, seed=7)
    ids, mask = padded_prompts([100], seed=8)
    config = RaaSConfig(page_size=4, token_budget=32, prefill="quest", prefill_share=0.5)
    _, _, session = generate(model, config, ids, 60, mask)
    for layer in session.cache.pages.layers:
        held = layer.slot_page[:, :, :layer.capacity]
        assert all((held == p).any(dim=-1).all() for p in range(25))  # all 25 prompt pages kept
        assert ((held >= 25).sum(-1) <= 4).all()  # decode pages within the other half of the budget
    assert session.stats.summary()["attended_per_head"] <= 32


def test_chunk_after_prompt_is_refused():
    model = tiny_model("llama", layers=1)
    ids, _ = padded_prompts([10])
    with sparsekv.apply(model, RaaSConfig(page_size=4, token_budget=16)) as session:
        model(ids, use_cache=True)
        with pytest.raises(ValueError, match="one token per forward pass"):
            model(ids[:, :3], past_key_values=session.cache, use_cache=True)


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_budget=0), "token_budget"),
    (dict(token_budget=-16), "token_budget"),
    (dict(token_budget=24), "token_budget"),
    (dict(token_budget=32.0), "token_budget"),
    (dict(top_fraction=0.0), "top_fraction"),
    (dict(top_fraction=1.5), "top_fraction"),
    (dict(alpha=1e-4), "top_fraction / alpha"),
    (dict(top_fraction=None), "top_fraction / alpha"),
    (dict(top_fraction=None, alpha=1.0), "alpha"),
    (dict(prefill="drop"), "prefill"),
    (dict(prefill_share=1.0), "prefill_share"),
    (dict(prefill="quest", token_budget=16), "token_budget"),
    (dict(page_size=3), "page_size"),
])
def test_bad_configs_raise(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("/", ".")):
        RaaSConfig(**kwargs)
