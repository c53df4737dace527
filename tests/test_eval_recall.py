"""The attention-recall probe against a brute-force computation, including a method that evicts."""

import pytest
import torch

from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.eval.recall import RecallConfig
from sparsekv.methods import METHODS, QuestConfig
from sparsekv.methods.base import Method, Tally, all_slots

B, H, HKV, D, P = 2, 4, 2, 8, 4


class _DropFirstPage(Method):
    """Toy evicting policy: frees page 0 of every row at its first decode step, then attends all it keeps."""

    def select(self, layer_idx, q, layer, seq_len):
        first = (layer.slot_page == 0).long().argmax(-1, keepdim=True)  # (B, Hkv, 1)
        layer.free(first, layer.slot_page.gather(2, first) == 0)
        return all_slots(layer)


class _DropConfig(QuestConfig):
    def method_class(self):
        return _DropFirstPage


def _brute_recall(q, keys, positions_per_row, scale):
    """q: (B, H, D); keys: (B, Hkv, T, D) the whole history; positions_per_row[b][row]: attended positions."""
    g, total = H // HKV, 0.0
    rows = len(positions_per_row[0])
    for b in range(B):
        for h in range(H):
            w = torch.softmax((keys[b, h // g].double() @ q[b, h].double()) * scale, -1)
            total += float(w[sorted(positions_per_row[b][h // (H // rows)])].sum())
    return total / (B * H)


def _run(config, prompt=21, steps=3, seed=0):
    """Prefill ``prompt`` random tokens, then ``steps`` decode steps through the probe; returns the probe, the
    brute-force recall per step, and the inner method's selected positions."""
    torch.manual_seed(seed)
    probe = RecallConfig(inner=config).build(1)
    pages = PagedKVCache(1, P)
    keys = torch.randn(B, HKV, prompt + steps, D)
    pages.begin(prompt, None, B, torch.device("cpu"))
    layer = pages.append(0, keys[:, :, :prompt], torch.randn(B, HKV, prompt, D))
    probe.prefill(0, torch.randn(B, H, prompt, D), layer, pages.plan, D ** -0.5)
    expected = []
    for t in range(steps):
        pages.begin(1, None, B, torch.device("cpu"))
        layer = pages.append(0, keys[:, :, prompt + t:prompt + t + 1], torch.randn(B, HKV, 1, D))
        q = torch.randn(B, H, D)
        seen = []
        select = probe.inner.select

        def spy(*args):
            slots = select(*args)
            seen.append((slots.clone(), layer.slot_page.clone()))
            return slots

        probe.inner.select = spy
        probe.decode(0, q, layer, pages.seq_len, D ** -0.5, Tally(B, q.device))
        del probe.inner.select
        slots, slot_page = seen[0]
        n = prompt + t + 1
        rows = slots.shape[1]
        positions = [[[int(slot_page[b, r // (rows // HKV), s]) * P + o for s in slots[b, r].tolist() if s >= 0
                       and slot_page[b, r // (rows // HKV), s] >= 0 for o in range(P)
                       if int(slot_page[b, r // (rows // HKV), s]) * P + o < n] for r in range(rows)]
                     for b in range(B)]
        expected.append(_brute_recall(q, keys[:, :, :n], positions, D ** -0.5))
    return probe, expected


def test_recall_matches_brute_force_for_quest():
    for per_query_head in (False, True):
        probe, expected = _run(QuestConfig(page_size=P, token_budget=8, dense_layers=0,
                                           per_query_head=per_query_head))
        recall = probe.recall()[0]
        assert abs(recall - sum(expected) / len(expected)) < 1e-9
        assert 0.0 < recall < 1.0


def test_recall_is_one_when_everything_is_attended():
    probe, _ = _run(QuestConfig(page_size=P, token_budget=64, dense_layers=0))
    assert abs(probe.recall()[0] - 1.0) < 1e-12


def test_evicted_tokens_count_as_missed_mass():
    probe, expected = _run(_DropConfig(page_size=P, token_budget=64, dense_layers=0), steps=2)
    recall = probe.recall()[0]
    assert abs(recall - sum(expected) / len(expected)) < 1e-9
    assert recall < 1.0  # the method attends all it keeps, but page 0 is gone



class _AttendAll(Method):
    """Toy policy that decodes through ``kernels.attend``, an attention op the probe does not read."""

    def decode(self, layer_idx, q, layer, seq_len, scale, tally):
        slots = all_slots(layer)
        tally.rows(slots.shape[1]).add_(kernels.count_attended(layer.slot_page, slots, seq_len, layer.page_size))
        return kernels.attend(q.unsqueeze(2), layer.k, layer.v, layer.slot_page, slots, (seq_len - 1).unsqueeze(1),
                              scale).squeeze(2)


class _AttendAllConfig(QuestConfig):
    def build(self, num_layers):
        return _AttendAll(self, num_layers)


def test_attention_the_probe_cannot_read_is_refused():
    with pytest.raises(ValueError, match="cannot observe kernels.attend;"):
        _run(_AttendAllConfig(page_size=P, token_budget=64, dense_layers=0), steps=1)

def test_the_probe_knows_every_registered_op():
    """Each ``sparsekv::`` op is either an attention the probe reads or one it knows attends nothing, so that no
    method's decode step is refused for an op added later."""
    from sparsekv.eval.recall import NOT_ATTENTION, OBSERVED

    ops = {name for name in kernels.__all__ if hasattr(torch.ops.sparsekv, name)}
    assert ops and ops <= {*OBSERVED, *NOT_ATTENTION} | {"attend"}  # attend: refused, above


SPARSE = [n for n, cls in METHODS.items() if "token_budget" in cls.__dataclass_fields__]


@pytest.mark.parametrize("name", SPARSE)
def test_recall_of_every_registered_method(name):
    """Recall through the integration on a tiny model, whatever the method's decode path (select, eviction after
    attention, token ops): 1 where the budget holds the context; where it does not, the probe changes nothing the
    method does and every layer's recall lies in (0, 1], below 1 in some layer (evicted or skipped tokens count as
    missed)."""
    from sparsekv.eval.base import Sample
    from sparsekv.eval.engine import Engine
    from sparsekv.models import LoadedModel
    from sparsekv.tiny import byte_tokenizer, tiny_model

    # 8 layers so that OmniKV has sparse layers; 40 new tokens for RaaS, so that its decode tokens outgrow the
    # budget (the others' prompts already do).
    loaded = LoadedModel(tiny_model("llama", layers=8, heads=4, kv_heads=2, head_dim=16), byte_tokenizer(), "t")
    sample = Sample("The grass is green. The sky is blue. " * 8, " The pass key is", None, 40 if name == "raas" else 10)
    full = Engine(loaded, METHODS[name](token_budget=1024), recall=True).generate(sample)
    assert full["recall"] == pytest.approx([1.0] * 8)
    config = METHODS[name](token_budget=32)
    plain = Engine(loaded, config).generate(sample)
    probed = Engine(loaded, config, recall=True).generate(sample)
    assert probed["prediction"] == plain["prediction"] and probed["kv"] == plain["kv"]
    assert all(0.0 < r <= 1.0 + 1e-9 for r in probed["recall"])
    assert plain["kv"]["fraction"] < 1.0 and min(probed["recall"]) < 1.0


def test_probe_hands_every_method_hook_to_the_inner_method():
    """The probe is a Method built like any other (config.build); every hook of Method is its own, so that none
    falls back to Method's default instead of reaching the inner method."""
    from sparsekv.eval.recall import RecallProbe

    hooks = [n for n, v in vars(Method).items() if callable(v) and not n.startswith("_")]
    assert hooks and all(n in vars(RecallProbe) for n in hooks), [n for n in hooks if n not in vars(RecallProbe)]
    probe = RecallConfig(inner=METHODS["omnikv"](token_budget=8)).build(8)
    assert isinstance(probe, Method) and probe.accepts_chunks is False
    with pytest.raises(ValueError, match="filter_layers must be layer indices below the model's 2 layers"):
        RecallConfig(inner=METHODS["omnikv"](filter_layers=(1, 4))).build(2)


def test_the_probe_is_not_served():
    from sparsekv.serve import ServingEngine
    from sparsekv.tiny import tiny_model

    with pytest.raises(ValueError, match="not the attention-recall probe"):
        ServingEngine(tiny_model("llama", layers=2), RecallConfig(inner=METHODS["quest"](token_budget=32)),
                      max_batch=2, max_context=64)
