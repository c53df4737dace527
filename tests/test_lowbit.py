"""Low-bit key codes: the packing, the reference page scores against a brute-force estimate, the method's codes
kept up to date through decoding, its config, and that it finds what the true attention finds where Quest's bound
does not."""

import pytest
import torch

import sparsekv
from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.errors import ConfigError
from sparsekv.kernels import reference as ref
from sparsekv.methods import METHODS, LowBitConfig, QuestConfig
from sparsekv.methods.base import Tally
from sparsekv.methods.lowbit import codes_entry

F64 = torch.float64


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_codes_round_trip_within_half_a_step(bits):
    k = torch.randn(2, 3, 5, 4, 16, dtype=F64)
    lo, hi = k.amin(-2), k.amax(-2)
    codes = ref.key_codes(k, lo, hi, bits)
    assert codes.shape == (2, 3, 5, 4, 16 * bits // 8) and codes.dtype == torch.uint8
    levels = ref.unpack_codes(codes, bits)
    assert int(levels.max()) <= (1 << bits) - 1
    step = ((hi - lo) / ((1 << bits) - 1)).unsqueeze(-2)
    assert ((lo.unsqueeze(-2) + step * levels - k).abs() <= step / 2 + 1e-9).all()
    with pytest.raises(ValueError, match="head_dim 6 must be a multiple of 4"):
        ref.key_codes(k[..., :6], lo[..., :6], hi[..., :6], 2)
    with pytest.raises(ValueError, match="bits must be 1, 2 or 4"):
        ref.key_codes(k, lo, hi, 3)


@pytest.mark.parametrize("heads,per_query_head", [(2, False), (6, False), (6, True)])
def test_coded_scores_are_the_estimated_attention_share(heads, per_query_head):
    torch.manual_seed(0)
    b, hkv, c, p, d, bits = 2, 2, 5, 4, 8, 2
    k = torch.randn(b, hkv, c, p, d, dtype=F64)
    slot_page = torch.tensor([[[0, 1, 2, 3, -1]] * hkv, [[1, 0, -1, -1, -1]] * hkv])
    seq_len = torch.tensor([14, 6])
    kmin, kmax = k.amin(-2), k.amax(-2)
    codes = ref.key_codes(k, kmin, kmax, bits)
    q = torch.randn(b, heads, d, dtype=F64)
    scores = ref.coded_scores(q, kmin, kmax, codes, slot_page, seq_len, 0.5, bits, per_query_head)
    g = heads // hkv
    for bi in range(b):
        share = torch.full((heads, c), float("-inf"), dtype=F64)
        for h in range(heads):
            logits = {}
            for s in range(c):
                for j in range(p):
                    page = int(slot_page[bi, h // g, s])
                    if page >= 0 and page * p + j < seq_len[bi]:
                        lev = ref.unpack_codes(codes[bi, h // g, s, j], bits).double()
                        key = kmin[bi, h // g, s] + lev * (kmax[bi, h // g, s] - kmin[bi, h // g, s]) / 3
                        logits.setdefault(s, []).append(float(q[bi, h] @ key) * 0.5)
            total = torch.tensor(sum(logits.values(), []), dtype=F64).logsumexp(0)
            for s, x in logits.items():
                share[h, s] = torch.tensor(x, dtype=F64).logsumexp(0) - total
        expected = share if per_query_head else share.view(hkv, g, c).logsumexp(1)
        torch.testing.assert_close(scores[bi], expected)


def _cache(prompt, keys, values):
    pages = PagedKVCache(1, 4)
    pages.begin(prompt, None, keys.shape[0], torch.device("cpu"))
    layer = pages.append(0, keys[:, :, :prompt], values[:, :, :prompt])
    return pages, layer


def test_method_codes_every_page_it_holds_through_decoding():
    """After each decode step the codes equal those of the whole cache coded at once (full pages final, the
    current page on its current range), and the step attends what the scores select."""
    torch.manual_seed(1)
    b, hkv, h, d, n = 2, 2, 4, 8, 30
    keys, values = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    config = LowBitConfig(token_budget=8, page_size=4, dense_layers=0)
    method = config.build(1)
    pages, layer = _cache(11, keys, values)
    method.prefill(0, torch.randn(b, h, 11, d), layer, pages.plan, d ** -0.5)
    for t in range(11, n):
        pages.begin(1, None, b, torch.device("cpu"))
        layer = pages.append(0, keys[:, :, t:t + 1], values[:, :, t:t + 1])
        calls = []
        with kernels.observe(lambda name, a, r: calls.append(a["slots"]) if name == "sparse_decode" else 0):
            method.decode(0, torch.randn(b, h, d), layer, pages.seq_len, d ** -0.5, Tally(b, keys.device))
        codes = layer.slot_state[codes_entry(2)]
        held = layer.slot_page >= 0
        assert torch.equal(codes[held], ref.key_codes(layer.k, layer.kmin, layer.kmax, 2)[held])
        assert calls[0].shape == (b, hkv, 2) and (calls[0] == layer.cur_slot.unsqueeze(-1)).any(-1).all()


@pytest.mark.parametrize("reuse", [2, 4])
def test_reuse_keeps_each_rows_choice_between_its_choosing_steps(reuse):
    """With ``reuse``, a row chooses as every step would (the top pages of that step's coded scores) at its first
    decode step and at positions that are multiples of reuse, attends the same slots in between, and never a choice
    without its current page; rows of different prompt lengths keep their own phases."""
    torch.manual_seed(3)
    b, hkv, h, d, n, lengths = 2, 2, 4, 8, 40, [11, 6]
    keys, values = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    s = max(lengths)
    valid = torch.arange(s).unsqueeze(0) >= (s - torch.tensor(lengths)).unsqueeze(1)
    pages = PagedKVCache(1, 4)
    pages.begin(s, valid, b, torch.device("cpu"))
    layer = pages.append(0, keys[:, :, :s], values[:, :, :s])
    method = LowBitConfig(token_budget=8, page_size=4, dense_layers=0, reuse=reuse).build(1)
    method.prefill(0, torch.randn(b, h, s, d), layer, pages.plan, d ** -0.5)
    previous, kinds = None, set()
    for t in range(s, n):
        pages.begin(1, None, b, torch.device("cpu"))
        layer = pages.append(0, keys[:, :, t:t + 1], values[:, :, t:t + 1])
        calls = {}
        with kernels.observe(lambda name, a, r: calls.setdefault(name, dict(a))):
            method.decode(0, torch.randn(b, h, d), layer, pages.seq_len, d ** -0.5, Tally(b, keys.device))
        a = calls["lowbit_select"]
        chosen = a["chosen"]
        assert calls["sparse_decode"]["slots"] is chosen
        fresh = ref.select_pages(ref.coded_scores(a["q"], a["kmin"], a["kmax"], a["codes"], a["slot_page"],
                                                  a["seq_len"], a["scale"], 2), a["cur_slot"], 2)
        for row in range(b):
            pos = int(pages.seq_len[row]) - 1
            due = pos % reuse == 0 or pos == lengths[row]
            kinds.add(due)
            if due:
                assert torch.equal(chosen[row].sort(-1).values, fresh[row].sort(-1).values), (t, row)
            else:
                assert torch.equal(chosen[row], previous[row]), (t, row)
            assert (chosen[row] == layer.cur_slot[row].unsqueeze(-1)).any(-1).all(), (t, row)
        previous = chosen.clone()
    assert kinds == {True, False}


def test_lowbit_config_registry_and_bytes():
    assert METHODS["lowbit"] is LowBitConfig
    config = sparsekv.build_config("lowbit:bits=1", 64)
    assert config.bits == 1 and config.token_budget == 64
    with pytest.raises(ConfigError, match="bits"):
        LowBitConfig(bits=3)
    assert sparsekv.build_config("lowbit:reuse=4", 64).reuse == 4
    for reuse in (0, 3, 32):  # a power of two dividing the page size (16)
        with pytest.raises(ConfigError, match="reuse"):
            LowBitConfig(reuse=reuse)
    # Llama-3-8B's head dim in bf16: Quest reads 512 bytes per page, 2-bit codes of 16 tokens 512 more.
    assert LowBitConfig(bits=2).metadata_bytes(128, 2) == 1024 and LowBitConfig(bits=1).metadata_bytes(128, 2) == 768
    assert LowBitConfig(reuse=4).metadata_bytes(128, 2) == 256  # one step in four reads them


def test_finds_the_aligned_key_on_a_page_of_alike_keys_where_quests_bound_fails():
    """The failure Quest shows on real noise haystacks: pages of keys that vary widely in a few large channels get
    wide ranges and high bounds, while the page whose keys are alike and point along the query ranks low. The
    coded estimate ranks that page first, as the true attention does."""
    torch.manual_seed(2)
    b, hkv, d, p, n_pages = 1, 1, 16, 4, 12
    keys = torch.zeros(b, hkv, n_pages * p, d)
    keys[..., 8:] = 6 * torch.randn(b, hkv, n_pages * p, d - 8)  # noise: large, varied channels
    needle = 5
    keys[:, :, needle * p:(needle + 1) * p] = 0.0
    keys[:, :, needle * p:(needle + 1) * p, :8] = 1.5  # alike keys along the query
    q = torch.zeros(b, 1, d)
    q[..., :8] = 1.0
    q[..., 8:] = 0.3 * torch.randn(d - 8)
    pages, layer = _cache(n_pages * p, keys, torch.randn_like(keys))
    scale = d ** -0.5
    quest = QuestConfig(token_budget=8, page_size=p, dense_layers=0).build(1)
    low = LowBitConfig(token_budget=8, page_size=p, dense_layers=0).build(1)
    low.prefill(0, q.unsqueeze(2), layer, pages.plan, scale)
    mass = sparsekv.OracleConfig(token_budget=8, page_size=p, dense_layers=0).build(1).page_scores(
        0, q, layer, pages.seq_len, scale)
    assert int(mass[0, 0].argmax()) == needle
    assert int(low.page_scores(0, q, layer, pages.seq_len, scale)[0, 0, :n_pages].argmax()) == needle
    assert int(quest.page_scores(0, q, layer, pages.seq_len, scale)[0, 0, :n_pages].argmax()) != needle
