"""OmniKV: dense at a budget covering the prompt, selectors against brute force, layer roles, offload."""

from __future__ import annotations


import pytest
import torch
from omni_raas_util import DEVICE, assert_dense, beam_search, generate, padded_prompts

import sparsekv
from sparsekv import DenseConfig, OmniKVConfig, kernels
from sparsekv.cache import PagedKVCache
from sparsekv.kernels import reference
from sparsekv.methods.base import Tally
from sparsekv.methods.omnikv import prompt_budget, top_tokens
from sparsekv.tiny import ARCHITECTURES, tiny_model


@pytest.mark.parametrize("n,width", [(1, 1), (40, 8), (300, 64), (64, 64)])
def test_top_tokens_are_the_best_ascending(n, width):
    gen = torch.Generator().manual_seed(n)
    scores = torch.randn(3, n, generator=gen)  # distinct scores: one right answer
    scores[1, n // 2:] = float("-inf")  # fewer candidates than the width
    for per_row in (None, torch.tensor([width, max(width - 3, 0), width // 2])):
        got = top_tokens(scores, per_row, width)
        assert got.shape == (3, width)
        for b in range(3):
            take = width if per_row is None else int(per_row[b])
            order = scores[b].argsort(descending=True)[:take]
            best = sorted(int(i) for i in order if scores[b, i] > float("-inf"))
            assert got[b].tolist() == [-1] * (width - len(best)) + best


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_budget_covering_prompt_is_dense(arch):
    model = tiny_model(arch, layers=4, seed=1)
    ids, mask = padded_prompts([41, 26], seed=2)
    dense = generate(model, DenseConfig(page_size=8), ids, 16, mask)[:2]
    for selector, offload, budget in [("last", False, 1.0), ("uniform", True, 10**6), ("exponential", False, 10**6),
                                      ("last", True, 1.0)]:
        config = OmniKVConfig(page_size=8, token_budget=budget, filter_layers=(1,), wait_layers=0, selector=selector,
                              window=4, offload=offload)
        assert_dense(dense, model, config, ids, mask)


def test_beam_search_covering_prompt_is_dense():
    model = tiny_model("qwen2", layers=3, seed=1)
    ids, mask = padded_prompts([30, 21], seed=2)
    dense = beam_search(model, DenseConfig(page_size=4), ids, mask, 10)
    config = OmniKVConfig(page_size=4, token_budget=1.0, filter_layers=(1,), wait_layers=0, selector="uniform",
                          window=4, offload=True)
    assert torch.equal(beam_search(model, config, ids, mask, 10), dense)


def test_small_budget_attends_chosen_tokens_and_every_decode_token():
    model = tiny_model("qwen3", layers=5, seed=3)
    ids, mask = padded_prompts([50, 33], seed=4)
    config = OmniKVConfig(page_size=4, token_budget=8, filter_layers=(1,), wait_layers=1)
    _, _, session = generate(model, config, ids, 20, mask)
    kv_heads, steps = 2, 19  # the first of the 20 tokens comes from the prompt pass
    expected = kv_heads * sum(2 * 8 + 2 * s for s in range(1, steps + 1))  # 2 sequences: 8 chosen + s decoded
    for layer in (3, 4):
        assert float(session.stats.per_layer[layer]) == expected
    assert session.stats.summary()["fraction"] < 0.75


def _brute_force_choice(keys, prompt_q, decode_q, prompt_len, budget, selector, window, scale):
    """keys: (Hkv, T, D) of one sequence by position; prompt_q: (H, Lp, D); decode_q: [(H, D)] in step order.
    Returns the set of chosen prompt positions, by plain loops."""
    queries = [(p, prompt_q[:, p]) for p in range(prompt_len)]
    queries += [(prompt_len + i, q) for i, q in enumerate(decode_q)]
    entries = queries[-1:] if selector == "last" else queries[-window:]
    h, hkv = prompt_q.shape[0], keys.shape[0]
    score = torch.zeros(prompt_len, dtype=torch.float64)
    for j, (pos, q) in enumerate(entries):
        age = len(entries) - 1 - j
        alpha = 2.0 ** -age if selector == "exponential" else 1.0
        seen = min(pos + 1, prompt_len)
        best = torch.zeros(prompt_len, dtype=torch.float64)
        for head in range(h):
            logits = torch.tensor([float(q[head] @ keys[head // (h // hkv), t]) * scale for t in range(seen)])
            probs = torch.softmax(logits.double(), dim=0)
            best[:seen] = torch.maximum(best[:seen], probs)
        score += alpha * best
    return set(score.topk(min(budget, prompt_len)).indices.tolist())


@pytest.mark.parametrize("selector", ["last", "uniform", "exponential"])
@pytest.mark.parametrize("budget", [5, 0.5])
def test_selection_matches_brute_force(selector, budget):
    g = torch.Generator().manual_seed(11)
    b, h, hkv, d, s, window, scale = 2, 4, 2, 8, 12, 4, 0.3
    lengths = [12, 7]
    valid = torch.zeros(b, s, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, s - n:] = True
    config = OmniKVConfig(page_size=4, token_budget=budget, filter_layers=(0,), selector=selector, window=window)
    method = config.build(1)
    cache = PagedKVCache(1, page_size=4)
    keys = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    prompt_q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    plan = cache.begin(s, valid, b, torch.device("cpu"))
    layer = cache.append(0, keys, keys)
    method.prefill(0, prompt_q, layer, plan, scale)
    decode_keys, decode_q = [], []
    for _ in range(6):
        cache.begin(1, None, b, torch.device("cpu"))
        k = torch.randn(b, hkv, 1, d, generator=g, dtype=torch.float64)
        q = torch.randn(b, h, d, generator=g, dtype=torch.float64)
        decode_keys.append(k)
        decode_q.append(q)
        layer = cache.append(0, k, k)
        method.decode(0, q, layer, cache.seq_len, scale, Tally(b, q.device))
        for row, n in enumerate(lengths):
            row_keys = torch.cat([keys[row, :, s - n:]] + [dk[row] for dk in decode_keys], dim=1)
            rows = prompt_budget(budget, n)
            want = _brute_force_choice(row_keys, prompt_q[row, :, s - n:], [dq[row] for dq in decode_q], n, rows,
                                       selector, window, scale)
            got = set(method.tokens[0][row].tolist()) - {-1}
            assert got == want, (row, len(decode_q))


def test_sparse_layers_use_the_nearest_filter_layer_below(monkeypatch):
    model = tiny_model("llama", layers=8, seed=5)
    ids, mask = padded_prompts([60], seed=6)
    config = OmniKVConfig(page_size=4, token_budget=6, filter_layers=(1, 4), wait_layers=1)
    method = config.build(8)
    assert method.role == ["dense", "filter", "dense", "sparse", "filter", "dense", "sparse", "sparse"]
    assert [method.source_filter(i) for i in range(8)] == [None, None, None, 1, None, None, 4, 4]

    seen, latest, current = [], {}, {}
    spy_target = kernels.sparse_decode_tokens

    def spy(q, k, v, tokens, scale):
        seen.append((current["layer"], tokens.clone()))
        return spy_target(q, k, v, tokens, scale)

    monkeypatch.setattr(kernels, "sparse_decode_tokens", spy)
    with sparsekv.apply(model, config) as session:
        run = session.method
        decode = run.decode

        def traced(layer_idx, *args):
            current["layer"] = layer_idx
            out = decode(layer_idx, *args)
            if run.role[layer_idx] == "filter":
                latest[layer_idx] = run.tokens[layer_idx].clone()
                seen.append(("chose", layer_idx, latest[layer_idx]))
            return out

        run.decode = traced
        model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)

    chosen, checked, differs = {}, 0, False
    for entry in seen:
        if entry[0] == "chose":
            chosen[entry[1]] = entry[2]
            differs |= 1 in chosen and 4 in chosen and not torch.equal(chosen[1], chosen[4])
            continue
        layer_idx, tokens = entry
        # Each sparse layer makes one call over its filter layer's choice of prompt tokens (< 60), then the decode
        # tokens (>= 60, -1 where not written yet).
        mine = chosen[run.source_filter(layer_idx)]
        first, rest = tokens[:, 0, :mine.shape[1]], tokens[:, 0, mine.shape[1]:]
        if torch.equal(first, mine) and bool((rest[rest >= 0] >= 60).all()) and bool((rest >= 0).any()):
            checked += 1
    assert checked == 11 * 3  # every step, every sparse layer used its filter layer's fresh choice
    assert differs  # the two filter layers did choose differently


def test_offload_matches_on_device_and_holds_less_on_the_device():
    model = tiny_model("mistral", layers=8, seed=7).to(DEVICE)
    ids, mask = padded_prompts([301, 250], seed=8)
    results = {}
    for offload, device_layers in ((False, None), (True, 0), (True, 2)):
        config = OmniKVConfig(page_size=16, token_budget=32, filter_layers=(2,), wait_layers=1, selector="uniform",
                              window=8, offload=offload, device_layers=device_layers)
        out, scores, session = generate(model, config, ids, 12, mask)
        results[offload, device_layers] = (out, scores, session.cache.resident_bytes(),
                                           session.cache.offloaded_bytes())
    none, every, some = results[False, None], results[True, 0], results[True, 2]
    for run in (every, some):
        assert torch.equal(run[0], none[0])
        torch.testing.assert_close(run[1], none[1], rtol=1e-6, atol=1e-6)
    assert none[3] == 0
    # Layers 4-7 of 8 are sparse: their prompt (about half the model's KV) lives in host memory; with
    # device_layers=2, layers 4 and 5 keep theirs on the device and 6, 7 go.
    assert every[3] > 0
    assert every[2] < 0.7 * none[2]
    assert some[3] == pytest.approx(every[3] / 2)
    assert every[2] < some[2] < none[2]


@pytest.mark.parametrize("hs", [1, 2, 4])
def test_token_attention_merges_to_attention_over_the_union(hs):
    g = torch.Generator().manual_seed(3)
    b, h, hkv, n, d = 2, 4, 2, 30, 8
    q = torch.randn(b, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(b * hs)]).view(b, hs, n)
    first, second = perm[..., :7].clone(), perm[..., 7:12].clone()
    first[0, :, -2:] = -1  # unused places
    parts = [reference.sparse_decode_tokens(q, k, v, t, 0.4) for t in (first, second)]
    out = reference.merge_attention(parts, q.dtype)
    for bi in range(b):
        for head in range(h):
            row = head // (h // hs) if hs > 1 else 0
            idx = torch.cat([first[bi, row], second[bi, row]])
            idx = idx[idx >= 0]
            kv = head // (h // hkv)
            w = torch.softmax(k[bi, kv, idx] @ q[bi, head] * 0.4, dim=0)
            torch.testing.assert_close(out[bi, head], w @ v[bi, kv, idx])


def test_fractional_budget_rounds_down_as_the_official_code():
    """int(fraction * prompt): a 97-token prompt at 0.1 attends 9 prompt tokens (not 10), 7 tokens at 0.5 attend 3."""
    assert prompt_budget(0.1, 97) == 9 and prompt_budget(0.5, 7) == 3 and prompt_budget(1.0, 97) == 97
    assert prompt_budget(64, 97) == 64 and prompt_budget(128, 97) == 97
    config = OmniKVConfig(page_size=4, token_budget=0.1, filter_layers=(0,))
    method = config.build(1)
    cache = PagedKVCache(1, page_size=4)
    plan = cache.begin(97, None, 1, torch.device("cpu"))
    layer = cache.append(0, torch.randn(1, 2, 97, 8), torch.randn(1, 2, 97, 8))
    method.prefill(0, torch.randn(1, 4, 97, 8), layer, plan, 0.3)
    assert method.per_row.tolist() == [9]


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_budget=0), "token_budget"),
    (dict(token_budget=-5), "token_budget"),
    (dict(token_budget=0.0), "token_budget"),
    (dict(token_budget=1.5), "token_budget"),
    (dict(token_budget=True), "token_budget"),
    (dict(filter_layers=(8, 2)), "filter_layers"),
    (dict(filter_layers=(2, 2)), "filter_layers"),
    (dict(filter_layers=(-1, 2)), "filter_layers"),
    (dict(filter_layers=()), "filter_layers"),
    (dict(selector="median"), "selector"),
    (dict(window=0), "window"),
    (dict(wait_layers=-1), "wait_layers"),
    (dict(offload="yes"), "offload"),
    (dict(device_layers=-1), "device_layers"),
])
def test_bad_configs_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OmniKVConfig(**kwargs)


def test_filter_layers_out_of_range_raise():
    with pytest.raises(ValueError, match="filter_layers.*4 layers"):
        OmniKVConfig(filter_layers=(1, 4)).build(4)


def test_default_filter_layers_scale_the_papers():
    config = OmniKVConfig()
    assert config.layers_for(32) == (2, 8, 18)
    assert config.layers_for(28) == (2, 7, 16)
    assert all(i < 4 for i in config.layers_for(4))


def test_host_store_fetch_gathers_the_listed_positions():
    from sparsekv.cache.host_store import HostKVStore

    g = torch.Generator().manual_seed(5)
    store = HostKVStore(3, 2, 2, 10, 4, 3, torch.float32, torch.device("cpu"))
    kv = [(torch.randn(2, 2, 10, 4, generator=g), torch.randn(2, 2, 10, 4, generator=g)) for _ in range(3)]
    for i, (k, v) in enumerate(kv):
        store.put(i, k[:, :, :6], v[:, :, :6])
        store.put(i, k[:, :, 6:], v[:, :, 6:], start=6)
    tokens = torch.tensor([[7, 1, 4], [-1, 9, 0]])
    store.fetch(tokens)
    for i, (k, v) in enumerate(kv):
        keys, values = store.layer(i)
        for row in range(2):
            idx = tokens[row].clamp(min=0)
            assert torch.equal(keys[row], k[row][:, idx])
            assert torch.equal(values[row], v[row][:, idx])
    store.reorder(torch.tensor([1, 1]))
    store.fetch(tokens)
    assert torch.equal(store.layer(2)[1][0], kv[2][1][1][:, tokens[0]])
    assert store.host_bytes() == 3 * 2 * 2 * 2 * 10 * 4 * 4


def test_offload_beyond_host_memory_is_refused_before_any_store(monkeypatch):
    """Every offloaded layer's prompt is counted at once: the refusal names the context and the memory it needs, and
    no host store was allocated (not the first group's before the second's is refused)."""
    from sparsekv.cache import host_store

    model = tiny_model("mistral", layers=8, seed=7).to(DEVICE)
    ids, mask = padded_prompts([301, 250], seed=8)
    config = OmniKVConfig(page_size=16, token_budget=32, filter_layers=(2, 5), wait_layers=1, selector="uniform",
                          window=8, offload=True, device_layers=0)
    one_layer = 2 * 301 * model.config.num_key_value_heads * 2 * \
        (model.config.hidden_size // model.config.num_attention_heads) * 4
    # Each group's store fits on its own, both do not.
    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 3 * one_layer // 2)
    made = []
    monkeypatch.setattr(host_store.HostKVStore, "_allocate", lambda self, *a: made.append(a))
    with pytest.raises(ValueError, match=r"offload: the prompt KV of 2 layers at context 301 \(batch 2\) needs"):
        generate(model, config, ids, 4, mask)
    assert made == []
