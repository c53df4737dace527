"""Pages ranked by the attention mass their landmarks (mean keys of runs of their tokens) estimate (``landmark``): a
landmark per token is the oracle's true page mass; two against a brute force in float64; its config checks (what it
shares with spread and sparq: ``test_reranked.py``)."""

import math

import pytest
import torch
from paged_util import one_layer

from sparsekv.errors import ConfigError
from sparsekv.kernels import reference
from sparsekv.methods import LandmarkConfig, OracleConfig, QuestConfig

B, HKV, D, P = 2, 2, 8, 4


def _layer(prompt: int, lengths=None):
    return one_layer(prompt, B, HKV, D, P, lengths, dtype=torch.float64)


@pytest.mark.parametrize("h, per_query_head, lengths", [(2, False, None), (6, False, [37, 29]), (6, True, [37, 30])])
def test_a_landmark_per_token_is_the_true_page_mass(h, per_query_head, lengths):
    layer, seq_len = _layer(37, lengths)
    q = torch.randn(B, h, D, dtype=torch.float64)
    got = reference.landmark_scores(q, layer.k, layer.slot_page, seq_len, P, 0.3, per_query_head)
    oracle = OracleConfig(token_budget=8, page_size=P, dense_layers=0, per_query_head=per_query_head).build(1)
    want = oracle.page_scores(0, q, layer, seq_len, 0.3)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_two_landmarks_equal_a_brute_force():
    """Per KV head: each run of P / 2 stored tokens weighs n exp(scale q . mean) in every query head's softmax over
    the row's runs; a page sums its runs' weights over the group's heads."""
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
                    assert got[bi, kv, s].item() == pytest.approx(mass[s].item(), rel=1e-12, abs=1e-12)


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
