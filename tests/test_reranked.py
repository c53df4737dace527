"""What spread, sparq, landmark and lowrank share as Quest's choice ranked by another estimate
(``quest.Reranked``): a pool's shared pages score as the rows' own, the sink pages and the current page are always
attended, a bad sink_pages is refused, through the engine a covering budget gives dense's tokens while a small one
attends fewer, and sparq with every channel, landmark with a landmark per token and lowrank with every direction
score the true page mass."""

import pytest
import torch
from paged_util import one_layer

from sparsekv.engine import Engine
from sparsekv.errors import ConfigError
from sparsekv.kernels import reference
from sparsekv.methods import LandmarkConfig, LowRankConfig, OracleConfig, QuestConfig, SparQConfig, SpreadConfig
from sparsekv.methods.quest import Summarized
from sparsekv.tiny import tiny_model

B, HKV, D, P = 2, 2, 8, 4
CONFIGS = [SpreadConfig, SparQConfig, LandmarkConfig, LowRankConfig]
# Each estimate's reference with fixed fields, over a layer's pages (``table``: a pool's store).
ESTIMATES = {
    "spread": lambda q, k, sp, n, table=None: reference.spread_scores(q, k, sp, n, 2.0, table=table),
    "sparq": lambda q, k, sp, n, table=None: reference.channel_scores(q, k, sp, n, 2, 0.3, table=table),
    "landmark": lambda q, k, sp, n, table=None: reference.landmark_scores(q, k, sp, n, 2, 0.3, table=table),
    "lowrank": lambda q, k, sp, n, table=None: reference.lowrank_scores(q, k, sp, n, 2, 0.3, table=table),
}
# The estimates whose limit is the true page mass: sparq keeping every channel, a landmark per token (its log),
# lowrank keeping every direction.
EXACT = {
    "sparq": lambda q, k, sp, n, per_query_head: reference.channel_scores(q, k, sp, n, D, 0.3, per_query_head),
    "landmark": lambda q, k, sp, n, per_query_head: as_mass(reference.landmark_scores(q, k, sp, n, P, 0.3,
                                                                                       per_query_head)),
    "lowrank": lambda q, k, sp, n, per_query_head: reference.lowrank_scores(q, k, sp, n, D, 0.3, per_query_head),
}


def as_mass(log_scores: torch.Tensor) -> torch.Tensor:
    """Page masses from their logs, free slots (-inf) staying -inf as the oracle scores them."""
    return log_scores.exp().masked_fill(log_scores == float("-inf"), float("-inf"))


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("h, per_query_head, lengths", [(2, False, None), (6, False, [37, 29]), (6, True, [37, 30])])
def test_the_exact_limit_is_the_true_page_mass(name, h, per_query_head, lengths):
    layer, seq_len = one_layer(37, B, HKV, D, P, lengths, dtype=torch.float64)
    q = torch.randn(B, h, D, dtype=torch.float64)
    got = EXACT[name](q, layer.k, layer.slot_page, seq_len, per_query_head)
    oracle = OracleConfig(token_budget=8, page_size=P, dense_layers=0, per_query_head=per_query_head).build(1)
    want = oracle.page_scores(0, q, layer, seq_len, 0.3)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ESTIMATES)
def test_shared_pages_score_as_a_rows_own(name):
    """A pool's store of pages read through a page table (``table``) gives the scores of the rows' own pages."""
    layer, seq_len = one_layer(23, B, HKV, D, P, dtype=torch.float64)
    q = torch.randn(B, 4, D, dtype=torch.float64)
    slots = layer.k.shape[2]
    table = torch.randperm(B * slots).view(B, slots)  # each row's slots in pages of one store, shuffled
    store = torch.zeros(1, HKV, B * slots, P, D, dtype=torch.float64)
    for bi in range(B):
        store[0, :, table[bi]] = layer.k[bi]
    score = ESTIMATES[name]
    # within float64's rounding: a reduction over the gathered rows may be summed in another order (seen with
    # torch 2.11 on 16 cores)
    torch.testing.assert_close(score(q, store, layer.slot_page, seq_len, table),
                               score(q, layer.k, layer.slot_page, seq_len), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", CONFIGS)
def test_the_sink_pages_and_the_current_page_are_attended(cls):
    layer, seq_len = one_layer(40, B, HKV, D, P, dtype=torch.float64)
    method = cls(token_budget=3 * P, page_size=P, dense_layers=0, sink_pages=2).build(1)
    if isinstance(method, Summarized):  # the means (landmark) or stats (spread) its prefill keeps
        layer.slot_state[method.summary_entry] = method.summarize(layer.k, layer.slot_page, seq_len)
    q = torch.randn(B, 4, D, dtype=torch.float64)
    slots = method.select(0, q, layer, seq_len)
    pages = layer.slot_page.gather(2, slots.clamp(min=0))
    for page in (0, 1):
        assert bool((pages == page).any(-1).all())
    assert bool((slots == layer.cur_slot.unsqueeze(-1)).any(-1).all())


@pytest.mark.parametrize("cls", CONFIGS)
@pytest.mark.parametrize("sink_pages, match", [
    (-1, "sink_pages must be an int >= 0"),
    (4, r"sink_pages must be an int >= 0 leaving the current page room in token_budget \(4 pages\)"),
    (1.0, "sink_pages must be an int >= 0"),
])
def test_a_bad_sink_pages_is_refused(cls, sink_pages, match):
    with pytest.raises(ConfigError, match=match):
        cls(token_budget=64, page_size=16, sink_pages=sink_pages)


@pytest.mark.parametrize("cls", CONFIGS)
def test_a_covering_budget_gives_dense_tokens_and_a_small_one_runs(cls):
    """Through the engine (batched, chunked prefill, captured decode where it applies): a budget that covers the
    context attends every page, so the tokens are dense's; a small budget attends fewer tokens."""
    model = tiny_model("llama", seed=2, layers=3)
    model.generation_config.eos_token_id = None
    prompts = [[(7 * i + 3) % 250 for i in range(90)], [(5 * i + 1) % 250 for i in range(61)]]
    dense = Engine(model, QuestConfig(token_budget=256, page_size=8, dense_layers=3), max_batch=2,
                   prefill_chunk=32).generate(prompts, 12, stop_tokens=())
    whole = Engine(model, cls(token_budget=256, page_size=8, dense_layers=1), max_batch=2,
                   prefill_chunk=32).generate(prompts, 12, stop_tokens=())
    assert whole.tokens == dense.tokens
    small = Engine(model, cls(token_budget=24, page_size=8, dense_layers=1), max_batch=2,
                   prefill_chunk=32).generate(prompts, 12, stop_tokens=())
    assert small.stats["attended_per_head"] < whole.stats["attended_per_head"]
