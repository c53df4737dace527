"""Pages ranked by the attention mass the query's largest channels estimate (``sparq``): a few channels against
a brute force in float64; its config checks (what it shares with spread and landmark, every channel kept scoring
the true page mass among it: ``test_reranked.py``)."""

import math

import pytest
import torch
from paged_util import one_layer

from sparsekv.errors import ConfigError
from sparsekv.kernels import reference
from sparsekv.methods import QuestConfig, SparQConfig

B, HKV, D, P = 2, 2, 8, 4


def _layer(prompt: int, lengths=None):
    return one_layer(prompt, B, HKV, D, P, lengths, dtype=torch.float64)


def _brute(q, layer, seq_len, channels, scale, by_keys=False):
    """(B, Hkv, C + 1): per KV head, the channels of the largest summed |q| of its query heads (``by_keys``: of
    the largest summed |k| of its stored keys), each head's softmax of the rescaled partial logits over the stored
    tokens, summed over the heads and each page's tokens."""
    b, h = q.shape[:2]
    g = h // HKV
    slots = layer.k.shape[2]
    out = torch.full((b, HKV, slots), float("-inf"), dtype=torch.float64)
    pos = layer.token_position()
    for bi in range(b):
        for kv in range(HKV):
            heads = q[bi, kv * g:(kv + 1) * g]
            tokens = [(s, j) for s in range(slots) for j in range(P)
                      if layer.slot_page[bi, kv, s] >= 0 and 0 <= pos[bi, kv, s, j] < int(seq_len[bi])]
            keys = torch.stack([layer.k[bi, kv, s, j] for s, j in tokens])
            keep = (keys.abs().sum(0) if by_keys else heads.abs().sum(0)).topk(channels).indices
            keys = keys[:, keep]
            mass = torch.zeros(slots, dtype=torch.float64)
            for head in heads:
                share = float(head[keep].abs().sum() / head.abs().sum())
                weights = torch.softmax(keys @ head[keep] * scale / math.sqrt(share), 0)
                for (s, _), w in zip(tokens, weights):
                    mass[s] += w
            for s in range(slots):
                if layer.slot_page[bi, kv, s] >= 0:
                    out[bi, kv, s] = mass[s]
    return out


@pytest.mark.parametrize("by_keys", [False, True])
def test_fewer_channels_equal_a_brute_force(by_keys):
    layer, seq_len = _layer(30, [30, 21])
    q = torch.randn(B, 6, D, dtype=torch.float64)
    got = reference.channel_scores(q, layer.k, layer.slot_page, seq_len, 3, 0.4, by_keys=by_keys)
    want = _brute(q, layer, seq_len, 3, 0.4, by_keys)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_default_channels_read_quests_bytes():
    cfg = SparQConfig(page_size=16)
    assert cfg.channels_for(128) == 16 and cfg.channels_for(64) == 8
    assert cfg.metadata_bytes(128, 2) == QuestConfig(page_size=16).metadata_bytes(128, 2)


@pytest.mark.parametrize("fields, match", [
    (dict(channels=0), r"channels must be None \(2 \* head_dim / page_size\) or an int >= 1"),
    (dict(channels=2.0), "channels must be None"),
    (dict(channels=True), "channels must be None"),
    (dict(by_keys=1), "by_keys must be true or false"),
])
def test_bad_fields_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        SparQConfig(token_budget=64, page_size=16, **fields)
