"""The oracle selection against a brute-force ranking of the step's dense attention, its token granularity, its
config checks, and its place above Quest in attention recall."""

import pytest
import torch
from paged_util import one_layer

import sparsekv
from sparsekv import kernels
from sparsekv.errors import ConfigError
from sparsekv.eval.recall import RecallConfig
from sparsekv.methods import METHODS, OracleConfig, QuestConfig
from sparsekv.methods.base import Tally
from sparsekv.tiny import tiny_model

B, HKV, D, P = 2, 2, 8, 4


def _layer(prompt, h, seed=0, lengths=None):
    """``paged_util.one_layer`` of this file's shapes, and a query (B, h, D)."""
    layer, seq_len = one_layer(prompt, B, HKV, D, P, lengths, seed)
    return layer, seq_len, torch.randn(B, h, D)


def _brute_mass(q, layer, seq_len, scale):
    """(B, H, pages) float64 attention mass of every logical page, from the tokens in position order."""
    b, h = q.shape[:2]
    g = h // HKV
    out = torch.zeros(b, h, layer.k.shape[2], dtype=torch.float64)
    pos = layer.token_position()
    for bi in range(b):
        n = int(seq_len[bi])
        for hi in range(h):
            keys = torch.zeros(n, D, dtype=torch.float64)
            for s in range(layer.k.shape[2]):
                for j in range(P):
                    if 0 <= pos[bi, hi // g, s, j] < n:
                        keys[pos[bi, hi // g, s, j]] = layer.k[bi, hi // g, s, j].double()
            w = torch.softmax(keys @ q[bi, hi].double() * scale, -1)
            for t in range(n):
                out[bi, hi, t // P] += w[t]
    return out


@pytest.mark.parametrize("h,per_query_head", [(2, False), (6, False), (6, True)])
def test_oracle_attends_the_pages_of_most_true_attention(h, per_query_head):
    layer, seq_len, q = _layer(37, h, lengths=[37, 29])
    scale = D ** -0.5
    config = OracleConfig(token_budget=3 * P, page_size=P, dense_layers=0, per_query_head=per_query_head)
    calls = []
    with kernels.observe(lambda name, args, result: calls.append(args["slots"]) if name == "sparse_decode" else 0):
        out = config.build(1).decode(0, q, layer, seq_len, scale, Tally(B, q.device))
    mass = _brute_mass(q, layer, seq_len, scale)
    if not per_query_head:
        mass = mass.view(B, HKV, h // HKV, -1).sum(2)
    chosen = calls[0]
    for bi in range(B):
        cur = (int(seq_len[bi]) - 1) // P
        for r in range(chosen.shape[1]):
            ranked = [p for p in mass[bi, r].argsort(descending=True).tolist() if p != cur][:2]
            assert sorted(chosen[bi, r].tolist()) == sorted(ranked + [cur])  # slot j holds page j here
    assert out.shape == q.shape


def test_token_oracle_attends_the_heaviest_tokens_and_counts_them():
    layer, seq_len, q = _layer(30, 4, seed=1)
    scale = D ** -0.5
    tally = Tally(B, q.device)
    config = OracleConfig(token_budget=8, page_size=P, dense_layers=0, granularity="token", per_query_head=True)
    out = config.build(1).decode(0, q, layer, seq_len, scale, tally)
    assert tally.total.tolist() == [[8] * 4] * B
    k = layer.k.flatten(2, 3)[:, :, :31].double()
    v = layer.v.flatten(2, 3)[:, :, :31].double()
    for bi in range(B):
        for hi in range(4):
            logits = k[bi, hi // 2] @ q[bi, hi].double() * scale
            keep = set(logits.softmax(-1)[:30].topk(7).indices.tolist()) | {30}
            idx = torch.tensor(sorted(keep))
            expected = logits[idx].softmax(-1) @ v[bi, hi // 2, idx]
            torch.testing.assert_close(out[bi, hi].double(), expected, rtol=1e-5, atol=1e-5)


def test_oracle_config_and_registry():
    assert METHODS["oracle"] is OracleConfig
    assert sparsekv.build_config("oracle:granularity=token", 64).granularity == "token"
    with pytest.raises(ConfigError, match="granularity"):
        OracleConfig(granularity="head")
    with pytest.raises(ConfigError, match="token_budget"):
        OracleConfig(token_budget=20, page_size=16)


def test_oracle_recall_is_at_least_quests():
    model = tiny_model("llama", layers=2, seed=3)
    ids = torch.randint(3, 259, (1, 120), generator=torch.Generator().manual_seed(0))
    recall = {}
    for name, config in [("quest", QuestConfig(token_budget=32, page_size=8, dense_layers=0)),
                         ("oracle", OracleConfig(token_budget=32, page_size=8, dense_layers=0))]:
        with sparsekv.apply(model, RecallConfig(inner=config)) as session, torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
        recall[name] = sum(session.method.recall()) / 2
    assert recall["oracle"] >= recall["quest"] - 1e-9
