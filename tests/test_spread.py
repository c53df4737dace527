"""Pages ranked by the mean and spread of their keys (``spread``): the scores against a brute force in float64, a
needle page that Quest's bound misses, and its config checks (what it shares with sparq and landmark:
``test_reranked.py``)."""

import math

import pytest
import torch
from paged_util import one_layer

from sparsekv.cache import PagedKVCache
from sparsekv.errors import ConfigError
from sparsekv.kernels import reference
from sparsekv.methods import SpreadConfig

B, HKV, D, P = 2, 2, 8, 4


def _layer(prompt: int, lengths=None):
    """``paged_util.one_layer`` of this file's shapes, in float64."""
    return one_layer(prompt, B, HKV, D, P, lengths, dtype=torch.float64)


def _brute(q, layer, seq_len, spread, per_query_head):
    """(B, Hs, C + 1) float64: each page's mean and spread score from its stored keys, one at a time."""
    b, h = q.shape[:2]
    g = h // HKV
    slots = layer.k.shape[2]
    out = torch.full((b, h, slots), float("-inf"), dtype=torch.float64)
    pos = layer.token_position()
    for bi in range(b):
        for hi in range(h):
            for s in range(slots):
                keys = [layer.k[bi, hi // g, s, j].double() for j in range(P)
                        if 0 <= pos[bi, hi // g, s, j] < int(seq_len[bi])]
                if layer.slot_page[bi, hi // g, s] < 0:
                    continue
                keys = torch.stack(keys)
                mu, var = keys.mean(0), keys.var(0, unbiased=False)
                qq = q[bi, hi].double()
                out[bi, hi, s] = qq @ mu + spread * math.sqrt(float((qq * qq * var).sum()))
    if per_query_head:
        return out
    return out.view(b, HKV, g, slots).amax(2)


@pytest.mark.parametrize("h, per_query_head, lengths", [(2, False, None), (6, False, [37, 29]), (6, True, [37, 30])])
def test_scores_equal_a_brute_force_over_each_pages_stored_keys(h, per_query_head, lengths):
    """Random GQA shapes, a partial last page, left padding (rows of different lengths), free slots: float64."""
    layer, seq_len = _layer(37, lengths)
    q = torch.randn(B, h, D, dtype=torch.float64)
    got = reference.spread_scores(q, layer.k, layer.slot_page, seq_len, 1.7, per_query_head)
    want = _brute(q, layer, seq_len, 1.7, per_query_head)
    assert got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_a_needle_page_of_alike_keys_ranks_first_where_the_bound_ranks_it_low():
    """Pages of noisy keys around zero and one page of alike keys whose logits are three of the noise's standard
    deviations up, the page of the largest logit: the bound ranks most noisy pages above it (every channel's
    extreme adds up), the mean and spread rank it first."""
    torch.manual_seed(3)
    d, pages_n = 64, 12
    q = torch.randn(1, 1, d, dtype=torch.float64)
    pages = PagedKVCache(1, P)
    keys = torch.randn(1, 1, pages_n * P, d, dtype=torch.float64) * 3
    needle = 5
    logit = 3 * 3 * float(q.norm())  # three standard deviations of a noisy key's logit
    keys[0, 0, needle * P:(needle + 1) * P] = logit * q[0, 0] / q.norm() ** 2 + \
        0.01 * torch.randn(P, d, dtype=torch.float64)
    pages.begin(pages_n * P, None, 1, torch.device("cpu"))
    layer = pages.append(0, keys, keys)
    bound = reference.page_scores(q, layer.kmin, layer.kmax, layer.slot_page)[0, 0, :pages_n]
    spread = reference.spread_scores(q, layer.k, layer.slot_page, pages.seq_len, math.sqrt(2 * math.log(P)))
    logits = (keys[0, 0] @ q[0, 0]).view(pages_n, P)
    assert int(logits.amax(1).argmax()) == needle
    assert int(spread[0, 0, :pages_n].argmax()) == needle
    assert int((bound > bound[needle]).sum()) >= pages_n // 2  # the bound puts half the pages or more above it


@pytest.mark.parametrize("fields, match", [
    (dict(spread=-1.0), r"spread must be None \(sqrt\(2 ln page_size\)\) or a number from 0 to 100"),
    (dict(spread=101), "spread must be None"),
    (dict(spread=float("nan")), "spread must be None"),
    (dict(spread=True), "spread must be None"),
])
def test_bad_fields_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        SpreadConfig(token_budget=64, page_size=16, **fields)


def test_the_default_spread_is_the_largest_of_a_pages_logits():
    assert SpreadConfig(page_size=16).spread_weight == pytest.approx(math.sqrt(2 * math.log(16)))
    assert SpreadConfig(page_size=16, spread=0.5).spread_weight == 0.5
