"""Pages ranked by the attention mass their landmarks (mean keys of runs of their tokens) estimate (``landmark``): two
against a brute force in float64; the means kept per slot through prefill and decode steps score as the reference
computes them from every key, in the engine and the selection diagnosis too; its config checks (what it shares with
spread and sparq, a landmark per token scoring the true page mass among it: ``test_reranked.py``)."""

import math

import pytest
import torch
from paged_util import one_layer

import sparsekv
from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.engine import Engine
from sparsekv.errors import ConfigError
from sparsekv.eval.selection import SelectionConfig
from sparsekv.kernels import reference
from sparsekv.methods import LandmarkConfig, QuestConfig
from sparsekv.methods.landmark import Landmark, means_entry
from sparsekv.methods.quest import Reranked
from sparsekv.tiny import tiny_model

B, HKV, D, P = 2, 2, 8, 4


def _layer(prompt: int, lengths=None):
    return one_layer(prompt, B, HKV, D, P, lengths, dtype=torch.float64)


def test_two_landmarks_equal_a_brute_force():
    """Per KV head: each run of P / 2 stored tokens weighs n exp(scale q . mean) in every query head's softmax over
    the row's runs; a page's score is the log of its runs' weights summed over the group's heads."""
    layer, seq_len = _layer(30, [30, 21])
    q = torch.randn(B, 6, D, dtype=torch.float64)
    got = reference.landmark_scores(q, layer.k, layer.slot_page, seq_len, 2, 0.4)
    g, slots = 3, layer.k.shape[2]
    pos = layer.token_position()
    for bi in range(B):
        for kv in range(HKV):
            runs = []  # (slot, count, mean)
            for s in range(slots):
                if layer.slot_page[bi, kv, s] < 0:
                    continue
                for r in range(2):
                    keys = [layer.k[bi, kv, s, j] for j in range(r * P // 2, (r + 1) * P // 2)
                            if 0 <= pos[bi, kv, s, j] < int(seq_len[bi])]
                    if keys:
                        runs.append((s, len(keys), torch.stack(keys).mean(0)))
            mass = torch.zeros(slots, dtype=torch.float64)
            for head in q[bi, kv * g:(kv + 1) * g]:
                weights = torch.tensor([n * math.exp(0.4 * float(head @ mean)) for _, n, mean in runs],
                                       dtype=torch.float64)
                for (s, _, _), w in zip(runs, weights / weights.sum()):
                    mass[s] += w
            for s in range(slots):
                if layer.slot_page[bi, kv, s] >= 0:
                    assert got[bi, kv, s].exp().item() == pytest.approx(mass[s].item(), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("page_size, landmarks, heads, per_query_head", [
    (4, 2, 6, False), (8, 4, 6, True), (4, 1, 2, False), (4, 4, 4, False)])
def test_stored_means_score_as_the_keys_through_decoding(page_size, landmarks, heads, per_query_head):
    """Means written for every page at the prompt's end (``prefill``) and for the current page at each decode step
    (pages filling and new ones starting; a left-padded batch of two lengths) give the scores the reference computes
    from every key, and once the steps are done every page's means are its keys'."""
    torch.manual_seed(0)
    method = LandmarkConfig(token_budget=2 * page_size, page_size=page_size, dense_layers=0, landmarks=landmarks,
                            per_query_head=per_query_head).build(1)
    pages = PagedKVCache(1, page_size)
    prompt, lengths = 13, torch.tensor([13, 9])
    pages.begin(prompt, torch.arange(prompt).view(1, -1) >= (prompt - lengths).view(-1, 1), B, torch.device("cpu"))
    layer = pages.append(0, *torch.randn(2, B, HKV, prompt, D, dtype=torch.float64))
    method.prefill(0, torch.randn(B, heads, prompt, D, dtype=torch.float64), layer, pages.plan, 0.3)
    for _ in range(2 * page_size + 1):
        pages.begin(1, None, B, torch.device("cpu"))
        layer = pages.append(0, *torch.randn(2, B, HKV, 1, D, dtype=torch.float64))
        q = torch.randn(B, heads, D, dtype=torch.float64)
        got = method.estimate(q, layer, pages.seq_len, 0.3)
        want = reference.landmark_scores(q, layer.k, layer.slot_page, pages.seq_len, landmarks, 0.3, per_query_head)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    used = layer.slot_page >= 0
    means = layer.slot_state[means_entry(landmarks)]
    assert means.shape == (*layer.slot_page.shape, landmarks, D) and means.dtype == torch.float64
    assert torch.equal(means[used], reference.page_landmarks(layer.k, layer.slot_page, pages.seq_len, landmarks)[used])


def test_the_current_page_means_through_a_page_table():
    """In a store of shared pages the current page's means are written at its store page (``table``), and the
    scores read through the table equal those of the rows' own means."""
    layer, seq_len = _layer(21, [21, 14])
    slots = layer.k.shape[2]
    table = torch.randperm(B * slots).view(B, slots)
    store = torch.zeros(1, HKV, B * slots, P, D, dtype=torch.float64)
    for bi in range(B):
        store[0, :, table[bi]] = layer.k[bi]
    own = torch.randn(*layer.slot_page.shape, 2, D, dtype=torch.float64)
    shared = torch.zeros(1, HKV, B * slots, 2, D, dtype=torch.float64)
    for bi in range(B):
        shared[0, :, table[bi]] = own[bi]
    kernels.landmark_means(layer.k, own, layer.slot_page, layer.cur_slot, seq_len)
    kernels.landmark_means(store, shared, layer.slot_page, layer.cur_slot, seq_len, table)
    assert torch.equal(reference.per_row(shared, table), own)
    q = torch.randn(B, 4, D, dtype=torch.float64)
    assert torch.equal(kernels.landmark_page_scores(q, shared, layer.slot_page, seq_len, P, 0.3, False, table),
                       kernels.landmark_page_scores(q, own, layer.slot_page, seq_len, P, 0.3))


def test_the_engine_decodes_the_tokens_of_the_means_from_the_keys(monkeypatch):
    """Through the engine (batched, chunked prefill), the stored means choose every step's pages (``landmark_select``)
    as the means computed from the keys at every step do (float64), so the tokens are the same."""
    model = tiny_model("llama", seed=3, layers=3, dtype=torch.float64)
    model.generation_config.eos_token_id = None
    prompts = [[(7 * i + 3) % 250 for i in range(90)], [(5 * i + 1) % 250 for i in range(61)]]
    config = LandmarkConfig(token_budget=24, page_size=8, dense_layers=1)

    def run():
        chosen, ops = [], set()

        def seen(name, arguments, result):
            ops.add(name)
            if name in ("select_pages", "landmark_select"):
                chosen.append(result.clone())

        with kernels.observe(seen):
            out = Engine(model, config, max_batch=2, prefill_chunk=32).generate(prompts, 12, stop_tokens=())
        return out, chosen, ops

    fast, fast_chosen, fast_ops = run()
    monkeypatch.setattr(Landmark, "select", Reranked.select)
    monkeypatch.setattr(Landmark, "estimate", lambda self, q, layer, seq_len, scale: reference.landmark_scores(
        q, layer.k, layer.slot_page, seq_len, self.config.landmarks, scale, self.config.per_query_head))
    keys, keys_chosen, keys_ops = run()
    assert "landmark_select" in fast_ops and not {"landmark_select", "landmark_means"} & keys_ops
    assert fast.tokens == keys.tokens and fast.stats == keys.stats
    assert len(fast_chosen) == len(keys_chosen) > 0
    assert all(torch.equal(a, b) for a, b in zip(fast_chosen, keys_chosen))


def test_the_selection_diagnosis_scores_the_stored_means():
    """In ``sparsekv.eval.selection`` (through ``apply`` and a model's own generate) a landmark per token is scored
    as the true mass (no sink page forced in), and two landmarks beside it keep means of their own."""
    model = tiny_model("llama", layers=3, heads=4, kv_heads=2, seed=0)
    estimates = (LandmarkConfig(token_budget=16, page_size=4, dense_layers=1, landmarks=4, sink_pages=0),
                 LandmarkConfig(token_budget=16, page_size=4, dense_layers=1, landmarks=2))
    ids = torch.randint(3, 259, (1, 70), generator=torch.Generator().manual_seed(0))
    with sparsekv.apply(model, SelectionConfig(estimates=estimates, steps=2)) as session, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    per_token, two = session.method.table()
    assert {(r["layer"], r["row"]) for r in per_token["rows"]} == {(i, j) for i in (1, 2) for j in range(2)}
    assert all(r["top_rank"] == 1 and r["mass_ratio"] == pytest.approx(1.0, abs=1e-5) for r in per_token["rows"])
    assert two["rows"] and all(0 < r["mass_ratio"] <= 1 + 1e-9 for r in two["rows"])


def test_two_landmarks_read_quests_bytes():
    assert LandmarkConfig(page_size=16).metadata_bytes(128, 2) == QuestConfig(page_size=16).metadata_bytes(128, 2)


@pytest.mark.parametrize("fields, match", [
    (dict(landmarks=0), r"landmarks must be a divisor of page_size \(16\)"),
    (dict(landmarks=3), "landmarks must be a divisor"),
    (dict(landmarks=True), "landmarks must be a divisor"),
])
def test_bad_fields_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        LandmarkConfig(token_budget=64, page_size=16, **fields)
