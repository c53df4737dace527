"""Continuous batching changes no result: every request's tokens equal those of the same request run alone through
``Engine.generate``, for every method, with requests arriving at different steps, with different prompt lengths,
finishing early (stop token, max_tokens) or cancelled; rows are freed and reused; admission and refusals."""

import re
from collections import Counter

import pytest
import torch
from graph_replay import emulated_graph

from sparsekv import (DenseConfig, H2OConfig, LowBitConfig, OmniKVConfig, OracleConfig, QuestConfig, RaaSConfig,
                      SnapKVConfig, StreamingLLMConfig, TOVAConfig)
from sparsekv.engine import Engine, Sampling
from sparsekv.errors import ConfigError
from sparsekv.methods import LandmarkConfig, SpreadConfig
from sparsekv.serve import PrefillPacer, QueueFull, Request, RequestError, ServingEngine
from sparsekv.serve.runner import row_bytes
from sparsekv.serve.scheduler import ContextTooLong
from sparsekv.tiny import tiny_model

CONFIGS = {
    "dense": DenseConfig(page_size=8),
    "quest": QuestConfig(token_budget=32, page_size=8, dense_layers=1),
    "omnikv": OmniKVConfig(token_budget=24, window=4, selector="uniform", filter_layers=(1,), wait_layers=0,
                           page_size=8),
    "omnikv-offload": OmniKVConfig(token_budget=0.3, window=4, filter_layers=(0, 2), wait_layers=0, offload=True,
                                   page_size=8),
    "raas": RaaSConfig(token_budget=32, page_size=8),
    "raas-quest": RaaSConfig(token_budget=32, page_size=8, prefill="quest"),
    "quest-per-query-head": QuestConfig(token_budget=24, page_size=4, dense_layers=0, per_query_head=True),
    "streamingllm": StreamingLLMConfig(token_budget=40),
    "h2o": H2OConfig(token_budget=40),
    "tova": TOVAConfig(token_budget=40),
    "snapkv": SnapKVConfig(token_budget=40, window=8),
    "lowbit": LowBitConfig(token_budget=32, page_size=8, dense_layers=1),
    "lowbit-reuse4": LowBitConfig(token_budget=32, page_size=8, dense_layers=1, reuse=4),
    "oracle": OracleConfig(token_budget=32, page_size=8, dense_layers=1),
    "landmark": LandmarkConfig(token_budget=32, page_size=8, dense_layers=1),
    "spread": SpreadConfig(token_budget=32, page_size=8, dense_layers=1),
    "quest-kv-fp8": QuestConfig(token_budget=32, page_size=8, dense_layers=1, kv_dtype="fp8"),
}
CONTEXT = 160
CHUNK = 32
# (arrival step, prompt length, max_tokens, how it ends): "stop" ends at its third token's id, "cancel" is
# cancelled after its fourth step
PLAN = [(0, 70, 12, "length"), (0, 23, 9, "stop"), (2, 101, 10, "length"), (3, 9, 14, "cancel"),
        (5, 44, 6, "length"), (5, 15, 1, "length"), (9, 60, 8, "stop")]


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", seed=1, layers=3)
    m.generation_config.eos_token_id = None
    return m


def prompt(n: int) -> list[int]:
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def run(engine: ServingEngine, requests: list[tuple[int, Request]], cancel_after: dict[int, int] | None = None,
        logprobs: dict | None = None):
    """Submits each request at its arrival step and steps until done; returns each request's tokens (by index) and
    its final event. ``logprobs``: filled with each request's events' log-probabilities (by index)."""
    cancel_after = cancel_after or {}
    logprobs = {} if logprobs is None else logprobs
    ids, tokens, final, steps = {}, {}, {}, 0
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    while pending or engine.has_work():
        while pending and requests[pending[0]][0] <= steps:
            i = pending.pop(0)
            ids[engine.submit(requests[i][1])] = i
            tokens[i] = []
        for event in engine.step():
            i = ids[event.request_id]
            tokens[i] += event.tokens
            assert event.completion_tokens == len(tokens[i])
            if event.logprobs is not None:
                assert len(event.logprobs) == len(event.tokens)
                logprobs.setdefault(i, []).extend(event.logprobs)
            if event.finished:
                final[i] = event
        for i, after in cancel_after.items():
            if i in tokens and len(tokens[i]) == after and i not in final:
                engine.cancel(next(r for r, j in ids.items() if j == i))
        steps += 1
    return tokens, final


@pytest.mark.parametrize("name", CONFIGS)
def test_batching_changes_no_result(model, name):
    config = CONFIGS[name]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    requests = []
    for (arrival, n, new, end), want in zip(PLAN, expected):
        stops = (want[2],) if end == "stop" else ()
        requests.append((arrival, Request(prompt=prompt(n), max_tokens=new, stop_tokens=stops)))
    cancel = {i: 4 for i, plan in enumerate(PLAN) if plan[3] == "cancel"}
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    tokens, final = run(engine, requests, cancel)
    for i, ((_, _, new, end), want) in enumerate(zip(PLAN, expected)):
        if end == "stop":
            assert tokens[i] == want[:want.index(want[2]) + 1]
            assert final[i].finish_reason == "stop"
        elif end == "cancel":
            assert final[i].finish_reason == "cancelled"
            assert 4 <= len(tokens[i]) < new and tokens[i] == want[:len(tokens[i])]
        else:
            assert tokens[i] == want and final[i].finish_reason == "length"
    metrics = engine.metrics()
    assert metrics["free_rows"] == 3 and metrics["kv_bytes_in_use"] == 0 and metrics["running"] == 0
    shared = engine.runner.shared
    assert (shared is not None) == (name in ("dense", "quest", "quest-per-query-head", "quest-kv-fp8"))
    assert shared is None or sorted(shared.free) == list(range(shared.pages))  # every page came back
    ends = [end if end != "cancel" else "cancelled" for *_, end in PLAN]
    assert metrics["finished_requests"] == {end: ends.count(end) for end in ends}
    assert metrics["generated_tokens"] == sum(len(t) for t in tokens.values())


def test_snapkv_rows_hold_the_budget_and_the_new_tokens(model):
    """SnapKV keeps at most its budget of each prompt and every decode token: with max_new_tokens its rows are that
    long, not max_context, and every request still gets its alone-tokens."""
    config = CONFIGS["snapkv"]
    room = max(new for _, _, new, _ in PLAN)
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK, max_new_tokens=room)
    assert [layer.capacity for layer in engine.runner.pool.pages.layers] == [config.token_budget + room] * 3
    tokens, _ = run(engine, requests)
    assert [tokens[i] for i in range(len(PLAN))] == expected


@pytest.mark.parametrize("name", ["dense", "quest"])
def test_shared_pages_hold_each_running_request_and_come_back(model, name):
    """In shared pages each running row holds store pages of its own, as many as its prompt and max_tokens take;
    with fewer pages than the rows' slots, what fits is admitted and the rest waits; every request gets its alone
    tokens and every page comes back when it ends."""
    config = CONFIGS[name]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    page_bytes = ServingEngine(model, config, max_batch=1, max_context=CONTEXT).runner.page_store_bytes
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                           kv_memory_bytes=26 * page_bytes)  # the two longest requests: 14 and 11 pages
    runner, shared = engine.runner, engine.runner.shared
    assert shared.pages == 26
    ids = {engine.submit(Request(prompt=prompt(n), max_tokens=new, stop_tokens=())): i
           for i, (_, n, new, _) in enumerate(PLAN)}
    tokens = {i: [] for i in ids.values()}
    waited = False
    while engine.has_work():
        for event in engine.step():
            tokens[ids[event.request_id]] += event.tokens
        held = [shared.held[row] for row in range(len(runner.keys))]
        want = [-(-(n + m) // config.page_size) for n, m in zip(runner.prompt_lens, runner.max_tokens)]
        assert [len(h) for h in held] == want
        # A prompt being prefilled holds its prompt's pages, in a table of its own.
        jobs = {id(live.prefill): live.prefill for live in engine._prefilling if live.prefill.table is not None}
        prompts = [job.table.held[0] for job in jobs.values()]
        assert [len(h) for h in prompts] == [-(-job.prompt_len // config.page_size) for job in jobs.values()]
        taken = {p for h in held + prompts for p in h}
        assert len(taken) == sum(want) + sum(map(len, prompts)) == shared.pages - len(shared.free)
        for row, h in enumerate(held):
            assert shared.table[row, :len(h)].tolist() == h
        m = engine.metrics()
        waited = waited or (m["queued"] and m["running"] + m["prefilling"] < 3)
    assert waited  # the store, not the rows, held requests back
    assert [tokens[i] for i in range(len(PLAN))] == expected
    assert sorted(shared.free) == list(range(shared.pages))
    assert bool((shared.table == shared.pages).all())


@pytest.mark.parametrize("name", ["dense", "quest", "raas", "h2o", "snapkv", "lowbit", "landmark", "spread"])
def test_the_pool_holds_what_its_size_counted(model, name):
    """The bytes a pool is checked against before it allocates (its rows of ``Method.pool_pages`` slots and the
    method's per-slot state) bound what it holds once requests ran through it, and every row can be given a request
    of max_context tokens; lowbit's codes, landmark's means and spread's stats are taken with the pool, not at a
    request's join."""
    config = CONFIGS[name]
    engine = ServingEngine(model, config, max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    runner = engine.runner
    before = runner.capacity_bytes()
    run(engine, [(0, Request(prompt=prompt(70), max_tokens=5)), (0, Request(prompt=prompt(20), max_tokens=3))])
    head_dim = model.get_decoder().layers[0].self_attn.head_dim
    counted = 2 * row_bytes(runner.method.pool_pages(CONTEXT, CONTEXT, CONTEXT - 1), config.page_size,
                            runner.token_bytes, runner.page_bytes, model.config.num_key_value_heads,
                            runner.method.slot_state_bytes(head_dim, runner.pool.pages.layers[0].k.element_size()))
    assert runner.capacity_bytes() <= counted
    # every row can take a request of max_context tokens: admission by memory never leaves a row idle
    assert 2 * runner.kv_bytes(CONTEXT - 9, CONTEXT) <= engine.kv_memory_bytes
    if name in ("lowbit", "landmark", "spread"):
        assert before == runner.capacity_bytes()
        # the codes (an eighth of the keys), the means and the stats (two keys a page) are counted
        assert counted - runner.capacity_bytes() < counted / 50


@pytest.mark.parametrize("name", ["raas", "raas-quest", "dense"])
def test_rows_sized_by_the_longest_prompt_give_the_alone_tokens(model, name):
    """With max_prompt_tokens, RaaS's rows hold the longest prompt's limit (its pages and the budget's), not
    max_context, and a dense pool's page tables the longest prompt and max_new_tokens: every request still gets its
    alone-tokens, and a longer prompt is refused at submit, naming the option."""
    config = CONFIGS[name]
    longest, room = max(n for _, n, _, _ in PLAN), max(new for _, _, new, _ in PLAN)
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    wide = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                           max_new_tokens=room, max_prompt_tokens=longest)
    page = config.page_size
    if name == "dense":
        rows = -(-(longest + room) // page)
    else:
        rows = engine.runner.method._limits([longest])[1][0]
    assert rows < -(-CONTEXT // page)
    assert [layer.capacity for layer in engine.runner.pool.pages.layers] == [rows] * 3
    assert engine.runner.capacity_bytes() < wide.runner.capacity_bytes()
    tokens, _ = run(engine, requests)
    assert [tokens[i] for i in range(len(PLAN))] == expected
    with pytest.raises(ContextTooLong, match=rf"prompt must be at most {longest} tokens \(max_prompt_tokens\)"):
        engine.submit(Request(prompt=prompt(longest + 1), max_tokens=1))


@pytest.mark.parametrize("name", ["raas", "h2o"])
def test_rows_of_their_own_are_as_many_as_kv_memory_admits(model, name):
    """A method whose rows hold their own pages gets as many rows as kv_memory_bytes admits of the longest request,
    not max_batch rows that admission would leave empty; the requests beyond them wait and get their alone tokens."""
    config = CONFIGS[name]
    longest, room = max(n for _, n, _, _ in PLAN), max(new for _, _, new, _ in PLAN)
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    sizes = dict(max_context=CONTEXT, prefill_chunk=CHUNK, max_new_tokens=room, max_prompt_tokens=longest)
    wide = ServingEngine(model, config, max_batch=4, **sizes)
    largest = wide.runner.kv_bytes(longest, longest + room)
    engine = ServingEngine(model, config, max_batch=4, kv_memory_bytes=2 * largest + largest // 2, **sizes)
    assert engine.runner.max_batch == 2 and all(layer.k.shape[0] == 2 for layer in engine.runner.pool.pages.layers)
    assert 2 * engine.runner.capacity_bytes() == wide.runner.capacity_bytes()
    tokens, _ = run(engine, [(0, Request(prompt=prompt(n), max_tokens=new)) for _, n, new, _ in PLAN])
    assert [tokens[i] for i in range(len(PLAN))] == expected
    one = ServingEngine(model, config, max_batch=4, kv_memory_bytes=largest - 1, **sizes)
    assert one.runner.max_batch == 1  # less than the longest request: one row, for the requests that fit


# (arrival step, prompt, max_tokens): prompts within RaaS's budget, so that a context past it holds no more
SLICED = [(0, 18, 24), (0, 21, 24), (0, 23, 24), (0, 15, 24), (1, 20, 24)]


@pytest.mark.parametrize("name, options", [("raas", {}), ("h2o", {}), ("snapkv", {}), ("landmark", {}),
                                           ("quest", {"admission": "grow"}),
                                           ("dense", {"admission": "grow", "preemption": "swap"})])
def test_time_slicing_gives_the_alone_tokens(model, name, options):
    """Time slicing, 5 requests on 2 rows: a running request that has drawn 6 tokens more than the queue's front
    yields its row (to host memory) and waits at the back. Every request gets its tokens alone, each draws its first
    token before any ends (without slicing, the last wait for the first to end), no row stays free while a request
    waits, one cancelled while it waits for its row back ends "cancelled" with the tokens it had, and every row and
    byte comes back. The rows' host copies are kept and used again: fewer are made than rows go there, at most one
    more than wait there at once, or as host memory was set aside for at the start (``swap_space_bytes``)."""
    config = CONFIGS[name]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new in SLICED]
    # KV memory for the 2 longest requests: rows of their own are as many as it admits of them (no row to spare)
    sizes = dict(max_context=CONTEXT, prefill_chunk=CHUNK, max_new_tokens=24, max_prompt_tokens=23, **options)
    largest = ServingEngine(model, config, max_batch=1, **sizes).runner.kv_bytes(23, 23 + 24)
    for cancel, swap_space in ((None, 1), (4, 0)):
        engine = ServingEngine(model, config, max_batch=2, kv_memory_bytes=2 * largest, time_slice=6,
                               swap_space_bytes=swap_space, **sizes)
        set_aside = len(engine.runner._spare)
        ids, tokens, final, started_before_an_end, steps, idle, out = {}, {}, {}, True, 0, 0, 0
        while len(final) < len(SLICED):
            for i, (arrival, n, new) in enumerate(SLICED):
                if arrival == steps:
                    ids[engine.submit(Request(prompt=prompt(n), max_tokens=new))] = i
                    tokens[i] = []
            for event in engine.step():
                i = ids[event.request_id]
                tokens[i] += event.tokens
                if event.finished:
                    started_before_an_end &= bool(final) or all(tokens.values())
                    final[i] = event
            metrics = engine.metrics()
            idle += metrics["queued"] > 0 and metrics["free_rows"] > 0
            out = max(out, sum(live.swapped is not None for live in engine._queue))
            waiting = [live for live in engine._queue if live.swapped is not None and ids[live.id] == cancel]
            if waiting:
                engine.cancel(waiting[0].id)
            steps += 1
        metrics = engine.metrics()
        # a row is left free while a request waits only after a step in which a request ended: a row that comes
        # back is counted as it was admitted (the row of its prompt), so it fits where it ran
        assert started_before_an_end and metrics["yielded"] >= 3 and idle <= len(final) and metrics["swap_seconds"] > 0
        if cancel is None:
            assert [tokens[i] for i in range(len(SLICED))] == expected
        else:
            assert final[cancel].finish_reason == "cancelled" and 0 < len(tokens[cancel]) < SLICED[cancel][2]
            assert tokens[cancel] == expected[cancel][:len(tokens[cancel])]
            assert [tokens[i] for i in range(cancel)] == expected[:cancel]
        assert metrics["kv_bytes_in_use"] == 0 and metrics["free_rows"] == 2 and not engine.runner.keys
        # a row goes out before the one it yields to comes back: one copy more than wait between steps
        assert set_aside == (swap_space > 0) and len(engine.runner._spare) <= max(out + 1, set_aside)
        assert len(engine.runner._spare) < metrics["yielded"]


@pytest.mark.parametrize("name, options, says", [
    ("dense", {}, 'time_slice must be None for dense unless preemption is "swap"'),
    ("lowbit", {}, "time_slice must be None for lowbit: its rows cannot go to host memory and back unchanged"),
    ("raas", {"time_slice": 0}, "time_slice must be None (no time slicing) or an int >= 1, got 0"),
    ("raas", {"swap_space_bytes": -1}, "swap_space_bytes must be a number >= 0, got -1"),
    ("dense", {"time_slice": None, "admission": "grow", "swap_space_bytes": 2**20},
     "swap_space_bytes must be 0 for dense here: no row goes to host memory"),
    ("raas", {"time_slice": None, "admission": "grow", "swap_space_bytes": 2**20},
     "swap_space_bytes must be 0 for raas here"),
])
def test_time_slicing_or_swap_space_that_cannot_apply_is_refused(model, name, options, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        ServingEngine(model, CONFIGS[name], max_batch=2, max_context=CONTEXT, **{"time_slice": 4, **options})


@pytest.mark.parametrize("value", [0, CONTEXT, 2.5, True])
def test_bad_max_prompt_tokens_is_refused(model, value):
    with pytest.raises(ConfigError, match="max_prompt_tokens must be None"):
        ServingEngine(model, CONFIGS["raas"], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                      max_prompt_tokens=value)


def test_offloaded_rows_sized_by_new_tokens_give_the_alone_tokens(model):
    """With max_new_tokens, OmniKV's offloaded layers hold rows of the prompt's last partial page and the decode
    tokens only: every request still gets its alone-tokens, the pool's device bytes shrink by those layers' rows,
    and a request of more new tokens is refused at submit."""
    config = CONFIGS["omnikv-offload"]
    room = max(new for _, _, new, _ in PLAN)
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    wide = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK, max_new_tokens=room)
    tokens, _ = run(engine, requests)
    assert [tokens[i] for i in range(len(PLAN))] == expected
    page, offloaded = config.page_size, engine.runner.method.offloaded
    narrow, full = -(-(page - 1 + room) // page), -(-CONTEXT // page)
    assert offloaded and [layer.capacity for layer in engine.runner.pool.pages.layers] == \
        [narrow if i in offloaded else full for i in range(3)]
    b, h, _, p, d = engine.runner.pool.pages.layers[0].k.shape
    per_slot = 2 * p * d * 4 + 2 * d * 4 + 8  # keys, values, key bounds (float32), page table
    assert wide.runner.capacity_bytes() - engine.runner.capacity_bytes() == \
        len(offloaded) * b * h * (full - narrow) * per_slot
    assert engine.runner.host_bytes() == wide.runner.host_bytes()  # the prompt's home stays
    with pytest.raises(RequestError, match=rf"max_tokens must be at most max_new_tokens \({room}\)"):
        engine.submit(Request(prompt=prompt(10), max_tokens=room + 1))


def test_the_pool_keeps_on_the_device_the_offloaded_layers_its_free_memory_holds(model, monkeypatch):
    """OmniKV with offload and device_layers=None: the pool keeps a sparse layer on the device when its rows fit the
    device budget (``runner.device_budget``), and offloads it when they do not; with the device's memory unknown
    (here, the CPU) it offloads. The tokens are the alone-tokens either way."""
    from sparsekv.serve import runner

    config = CONFIGS["omnikv-offload"]  # 3 layers, filters 0 and 2: layer 1 is the one sparse layer
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new, _ in PLAN]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    offloaded = {}
    for free in (None, 10_000_000, 500_000):
        monkeypatch.setattr(runner, "device_budget", lambda device, utilization, profile, free=free: free)
        # The offloaded layer's rows hold 16 decode tokens on the device, against CONTEXT on the device layer's.
        engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                               max_new_tokens=16)
        offloaded[free] = engine.runner.method.offloaded
        assert engine.runner.config.device_layers == 1 - len(offloaded[free])
        assert (engine.runner.host_bytes() > 0) == bool(offloaded[free])
        tokens, _ = run(engine, requests)
        assert [tokens[i] for i in range(len(PLAN))] == expected
    assert offloaded == {None: {1}, 10_000_000: set(), 500_000: {1}}


def test_a_pool_whose_host_store_does_not_fit_is_refused_before_allocating(model, monkeypatch):
    """The host must hold the pool's store and one prompt's own store while it is prefilled."""
    from sparsekv.cache import host_store
    from sparsekv.cache.host_store import HostMemoryError

    config = CONFIGS["omnikv-offload"]
    row = CONTEXT * 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # one offloaded layer, float32
    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 4 * row - 1)
    with pytest.raises(HostMemoryError, match="max_batch: the host store of 3 rows and one prompt's own store"):
        ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    ServingEngine(model, CONFIGS["dense"], max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 4 * row)
    ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)


@pytest.mark.parametrize("value", [0, CONTEXT + 1, 2.5, True])
def test_bad_max_new_tokens_is_refused(model, value):
    with pytest.raises(ConfigError, match="max_new_tokens must be None"):
        ServingEngine(model, CONFIGS["dense"], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                      max_new_tokens=value)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, float("nan"), "0.9"])
def test_bad_gpu_memory_utilization_is_refused(model, value):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        ServingEngine(model, CONFIGS["dense"], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                      gpu_memory_utilization=value)


@pytest.mark.parametrize("name", CONFIGS)
def test_captured_steps_give_the_eager_tokens(model, name):
    """Each batch size's step is captured once (an emulated CUDA graph on the CPU) and replayed, over rows that
    join, move and leave between replays."""
    config = CONFIGS[name]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    eager, _ = run(ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK), requests)
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    engine.runner.engine.capture = emulated_graph
    replayed, _ = run(engine, requests)
    assert replayed == eager
    runs: dict[int, int] = {}  # per batch size, its most replayed step (a method may keep several: step_slots)
    for (n, *_), (_, step, _) in engine.runner.steps.items():
        if step.replay is not None:
            runs[n] = max(runs.get(n, 0), step.runs)
    assert {2, 3} <= set(runs) and all(r > 2 for r in runs.values())
    if isinstance(config, RaaSConfig):  # the rows' limits (4 to 15 pages) are below the pool's 20 slots a row
        assert {slots for *_, slots in engine.runner.steps} <= {4, 8, 16}


@pytest.mark.parametrize("name", CONFIGS)
def test_admission_counts_at_least_the_kv_a_request_holds(model, name):
    """A request's admitted bytes cover the KV it holds at its end, run alone (device and host), and a method that
    caps its rows is admitted for its cap, not for the whole context."""
    config = CONFIGS[name]
    runner = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK).runner
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    for n, new in ((101, 20), (12, 30)):
        out = alone.generate([prompt(n)], new, stop_tokens=())
        assert out.kv_held_bytes + out.kv_host_bytes <= runner.kv_bytes(n, n + new)
    if name in ("streamingllm", "h2o", "tova"):
        assert runner.kv_bytes(100, 150) == runner.kv_bytes(30, 40)  # the budget of 40 tokens


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model):
    config = CONFIGS["quest"]
    hot = Sampling(temperature=1.5, top_p=0.95, top_k=50)
    requests = [(0, Request(prompt=prompt(n), max_tokens=10, sampling=hot if n % 2 else Sampling(), seed=n))
                for n in (31, 40, 57)]
    # Alone: through Engine.generate with the same seed (its prompt i draws with seed + i, here i = 0)
    engine = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    alone = [engine.generate([r.prompt], r.max_tokens, sampling=r.sampling, seed=r.seed, stop_tokens=()).tokens[0]
             for _, r in requests]
    for capture in (None, emulated_graph):
        engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
        engine.runner.engine.capture = capture
        batched, _ = run(engine, requests)
        assert [batched[i] for i in range(3)] == alone
    other = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK)
    reseeded = Request(prompt=prompt(31), max_tokens=10, sampling=hot, seed=32)
    assert run(other, [(0, reseeded)])[0][0] != alone[0]


@pytest.mark.parametrize("name", ["dense", "quest", "raas", "snapkv"])
def test_penalties_and_biases_are_the_same_alone_and_in_a_batch(model, name):
    """Requests with penalties and logit biases, greedy and sampled, share steps with plain requests, join rows
    that penalized requests left and move rows: each gives its tokens alone (``Engine.generate``), eager and
    captured."""
    config = CONFIGS[name]
    penalized = Sampling(presence_penalty=1.5, frequency_penalty=0.75, logit_bias={17: 2.0, 30: -100.0},
                         repetition_penalty=1.3)
    hot = Sampling(temperature=1.2, top_p=0.9, frequency_penalty=2.0, min_p=0.05)
    samplings = [penalized, Sampling(), hot, Sampling(temperature=0.9), penalized, Sampling(), Sampling()]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new, sampling=sampling, seed=i))
                for i, ((arrival, n, new, _), sampling) in enumerate(zip(PLAN, samplings))]
    engine = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    alone = [engine.generate([r.prompt], r.max_tokens, sampling=r.sampling, seed=r.seed, stop_tokens=()).tokens[0]
             for _, r in requests]
    assert alone[0] != engine.generate([requests[0][1].prompt], PLAN[0][2], stop_tokens=()).tokens[0]
    for capture in (None, emulated_graph):
        serving = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
        serving.runner.engine.capture = capture
        batched, _ = run(serving, requests)
        assert [batched[i] for i in range(len(requests))] == alone
    steps = serving.runner.steps
    assert any(key[3] for key in steps) and any(not key[3] for key in steps)  # steps with and without penalties


@pytest.mark.parametrize("config", [CONFIGS["dense"], QuestConfig(token_budget=CONTEXT, page_size=8, dense_layers=1)],
                         ids=["dense", "quest-whole-budget"])
def test_logprobs_are_the_models_log_softmax(model, config):
    """A request that asks for log-probabilities gets, for each of its tokens, the log-softmax of the model's logits
    at that position (the model run over the prompt and the tokens, float32: a budget that covers the context
    attends everything) and the likeliest tokens', greedy or sampled, eager or captured; the others get none, and
    their tokens do not change."""
    hot = Sampling(temperature=1.2, top_p=0.9)
    asks = [(0, 40, 7, 3, Sampling()), (1, 23, 9, None, Sampling()), (2, 61, 6, 0, hot), (2, 11, 8, 5, Sampling())]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new, sampling=s, seed=i, logprobs=k))
                for i, (arrival, n, new, k, s) in enumerate(asks)]
    plain = [(arrival, Request(prompt=r.prompt, max_tokens=r.max_tokens, sampling=r.sampling, seed=r.seed))
             for arrival, r in requests]
    alone, _ = run(ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK), plain)
    found = []
    for capture in (None, emulated_graph):
        engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
        engine.runner.engine.capture = capture
        found.append({})
        tokens, _ = run(engine, requests, logprobs=found[-1])
        assert tokens == alone
    assert found[0] == found[1] and set(found[0]) == {0, 2, 3}
    for i, listed in found[0].items():
        ids = torch.tensor([requests[i][1].prompt + alone[i]])
        with torch.no_grad():
            ref = model(ids).logits[0, len(requests[i][1].prompt) - 1:-1].float().log_softmax(-1)
        k = requests[i][1].logprobs
        for step, (token, lp) in enumerate(zip(alone[i], listed)):
            assert lp.logprob == pytest.approx(float(ref[step, token]), abs=1e-4)
            top = ref[step].topk(k)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("name", ["dense", "quest", "omnikv-offload", "raas", "snapkv", "h2o", "lowbit"])
def test_requests_of_one_prompt_share_its_prefill(model, name):
    """Requests of one prompt admitted while it is prefilled (a client's n choices) share that prefill: the prompt
    is prefilled once, each request draws its own tokens (its sampling, seed, length, log-probabilities) and gets
    those it gets alone; one cancelled while the prefill runs leaves the others theirs; a request of the same
    prompt that comes after the prefill ended has one of its own."""
    config = CONFIGS[name]
    shared, other = prompt(70), prompt(33)
    hot = Sampling(temperature=1.1, top_p=0.9)
    requests = [(0, Request(prompt=shared, max_tokens=6)),  # the first of the prompt, cancelled while it prefills
                (0, Request(prompt=shared, max_tokens=9, sampling=hot, seed=3, logprobs=2)),
                (0, Request(prompt=other, max_tokens=5)),
                (1, Request(prompt=shared, max_tokens=1, sampling=hot, seed=9)),  # ends at its first token
                (1, Request(prompt=shared, max_tokens=7)),  # joins the prefill the first started
                (12, Request(prompt=shared, max_tokens=4, seed=5))]  # after the prefill ended
    alone, work = [], []  # each request's tokens and prefill work (token-layers) alone
    for _, r in requests:
        engine = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK)
        alone.append(run(engine, [(0, r)])[0][0])
        work.append(engine.metrics()["prefill_work"])
    engine = ServingEngine(model, config, max_batch=6, max_context=CONTEXT, prefill_chunk=CHUNK)
    tokens, final = run(engine, requests, cancel_after={0: 0})
    assert engine.metrics()["prefill_work"] == 2 * work[0] + work[2]
    assert [tokens[i] for i in (1, 2, 3, 4, 5)] == [alone[i] for i in (1, 2, 3, 4, 5)]
    assert tokens[0] == [] and final[0].finish_reason == "cancelled"
    assert engine.metrics()["free_rows"] == 6 and engine.metrics()["kv_bytes_in_use"] == 0


PREFIX_METHODS = ["dense", "quest", "omnikv", "raas", "raas-quest", "lowbit", "oracle", "quest-per-query-head",
                  "landmark"]


@pytest.mark.parametrize("name, step_tokens", [*((name, None) for name in PREFIX_METHODS), ("dense", 40),
                                               ("quest", 40)])
def test_prompts_that_begin_like_a_kept_one_start_from_its_pages(model, name, step_tokens):
    """With a prefix cache: a conversation's next turn (the last prompt, its answer and more), another question on
    the same document, the same prompt again, and a prompt shorter than a page in common, each after the prompts
    before it have run; each request gives its tokens alone, and the prefill runs only what no kept prompt gave.
    Where the method keeps its decode pages, an ended request's answer is kept with its prompt. Also in mixed
    steps (``step_tokens``)."""
    config = CONFIGS[name]
    page = config.page_size
    document = prompt(70)
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    first = alone.generate([document], 6, stop_tokens=()).tokens[0]
    turns = [document, document + first + prompt(11), document[:50] + prompt(23), document, prompt(30)]
    engine = ServingEngine(model, config, max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK,
                           prefix_cache_bytes=1 << 30, step_tokens=step_tokens)
    layers = model.config.num_hidden_layers
    for i, turn in enumerate(turns):
        want = alone.generate([turn], 6, stop_tokens=()).tokens[0]
        kept = dict(engine.runner.prefixes.entries)
        shared = max((next((i for i, (a, b) in enumerate(zip(k, turn)) if a != b), min(len(k), len(turn)))
                      for k in kept), default=0)
        before = engine.metrics()["prefill_work"]
        tokens, final = run(engine, [(0, Request(prompt=turn, max_tokens=6))])
        assert tokens[0] == want
        cached = final[0].cached_tokens
        assert cached % page == 0 and cached <= shared and cached > shared - page - CHUNK
        work = engine.metrics()["prefill_work"] - before  # token-layers (the call that ends a prefill counts 1)
        assert (len(turn) - cached) * layers <= work <= (len(turn) - cached) * layers + 2
        if i == 0:  # the row held the document and 5 of its 6 new tokens
            longest = max(len(k) for k in engine.runner.prefixes.entries)
            answer_reuse = engine.runner.method.answer_reuse
            assert longest == ((len(turn) + 5) // page * page if answer_reuse else len(turn))
    metrics = engine.metrics()
    assert metrics["prefix_hits"] == 3 and metrics["prefix_tokens_reused"] > 0
    assert 0 < metrics["prefix_cache_bytes"] == engine.runner.prefixes.bytes <= 1 << 30


def test_the_prefix_cache_keeps_what_its_budget_holds_and_refuses_methods_that_drop_the_prompt(model):
    config = CONFIGS["quest"]
    engine = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                           prefix_cache_bytes=1 << 30)
    run(engine, [(0, Request(prompt=prompt(41), max_tokens=2))])
    one = engine.metrics()["prefix_cache_bytes"]  # a prompt of 5 whole pages (shared pages keep whole pages)
    small = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                          prefix_cache_bytes=3 * one)
    for n in (41, 42, 43, 44):  # different prompts of 5 whole pages: the oldest goes
        run(small, [(0, Request(prompt=prompt(n), max_tokens=2))])
    kept = small.runner.prefixes.entries
    assert list(kept) == [tuple(prompt(n)[:40]) for n in (42, 43, 44)]
    assert small.metrics()["prefix_cache_bytes"] == 3 * one
    longer = prompt(44) + prompt(20)  # a prompt that begins with a kept one takes its place, and more room
    run(small, [(0, Request(prompt=longer, max_tokens=2))])
    assert [len(k) for k in kept] == [40, 64] and small.metrics()["prefix_cache_bytes"] <= 3 * one
    tiny = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                         prefix_cache_bytes=one // 4)  # neither the prompt nor its answer fits
    run(tiny, [(0, Request(prompt=prompt(41), max_tokens=2))])
    assert not tiny.runner.prefixes.entries and tiny.metrics()["prefix_cache_bytes"] == 0
    for name in ("snapkv", "h2o", "streamingllm", "omnikv-offload"):
        with pytest.raises(ConfigError, match="prefix_cache_bytes"):
            ServingEngine(model, CONFIGS[name], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                          prefix_cache_bytes=1 << 20)


@pytest.mark.parametrize("name", ["quest", "lowbit"])
def test_requests_on_one_document_arriving_together_prefill_it_once(model, name):
    """Prefills run one after another and look the prefix cache up at their first pass: requests admitted together
    take the document from the first one's prefill, and give their tokens alone; one cancelled while it waits takes
    nothing."""
    config = CONFIGS[name]
    document = prompt(64)
    prompts = [document + prompt(n) for n in (9, 12, 15, 18)]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    want = [alone.generate([p], 3, stop_tokens=()).tokens[0] for p in prompts]
    engine = ServingEngine(model, config, max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK,
                           prefix_cache_bytes=1 << 30)
    tokens, final = run(engine, [(0, Request(prompt=p, max_tokens=3)) for p in prompts], cancel_after={3: 0})
    assert [final[i].cached_tokens for i in range(3)] == [0, 64, 64] and final[3].finish_reason == "cancelled"
    assert [tokens[i] for i in range(3)] == want[:3]
    assert engine.metrics()["prefix_hits"] == 2


@pytest.mark.parametrize("name", ["dense", "quest"])
def test_a_prompt_is_prefilled_into_the_shared_pages_its_row_then_holds(model, name):
    """In shared pages a prompt's passes write store pages it takes at its first pass, and the first request's row
    takes them with nothing copied: the row holds the prompt's pages, then those of its new tokens; a second request
    of the prompt copies them into pages of its own."""
    config = CONFIGS[name]
    engine = ServingEngine(model, config, max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    shared = engine.runner.shared
    text = prompt(70)  # 9 pages of 8, in 3 passes a layer
    first, second = (engine.submit(Request(prompt=text, max_tokens=n)) for n in (12, 3))
    written = None
    while not engine.metrics()["running"]:
        engine.step()
        job = engine._prefilling[0].prefill if engine._prefilling else None
        if job is not None and job.table is not None and job.table.held[0]:
            written = list(job.table.held[0])
            assert len(written) == 9 and shared.free_pages == shared.pages - 9
    rows = {key: shared.held[row] for row, key in enumerate(engine.runner.keys)}
    assert rows[first][:9] == written and len(rows[first]) == -(-(70 + 12) // 8)
    assert len(rows[second]) == -(-(70 + 3) // 8) and not set(rows[second]) & set(written)
    assert shared.free_pages == shared.pages - len(rows[first]) - len(rows[second])


def test_a_long_prompt_is_prefilled_between_decode_steps(model, monkeypatch):
    """A running request decodes at every step while a long prompt comes in, its prefill's passes queued behind
    the step (the step launched, not yet collected)."""
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    first = engine.submit(Request(prompt=prompt(20), max_tokens=30))
    while not engine.metrics()["running"]:
        engine.step()
    engine.submit(Request(prompt=prompt(128), max_tokens=5))
    prefill, in_flight = engine.runner.prefill, []

    def seen(job, budget):
        in_flight.append(len(engine.runner.in_flight) == 1)
        return prefill(job, budget)

    monkeypatch.setattr(engine.runner, "prefill", seen)
    produced = 0
    for _ in range(3):  # 128 tokens in chunks of 32: the running request decodes at every step meanwhile
        events = engine.step()
        produced += sum(len(e.tokens) for e in events if e.request_id == first)
        assert engine.metrics()["prefilling"] == 1
    assert produced == 3 and in_flight == [True] * 3


@pytest.mark.parametrize("raise_errors", [True, False])
def test_a_failing_prefill_ends_its_request_with_error(model, monkeypatch, caplog, raise_errors):
    """With nothing running, one prefill ends (its request draws its first token and joins) and the next raises in
    the same step: the failing request ends with "error" (saying what failed), and the step raises (its events,
    the other's first token among them, come with the next step's) or, told not to, logs the failure and returns
    them; the other request then runs to the tokens it gets alone."""
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    kept = engine.submit(Request(prompt=prompt(20), max_tokens=3))
    dropped = engine.submit(Request(prompt=prompt(30), max_tokens=3))
    prefill = engine.runner.prefill

    def broken(job, budget):
        if job.prompt_len == 30:
            raise MemoryError("no room")
        return prefill(job, budget)

    monkeypatch.setattr(engine.runner, "prefill", broken)
    if raise_errors:
        with pytest.raises(MemoryError, match="no room") as err:
            engine.step()
        assert f"while prefilling request(s) [{dropped}], which end with \"error\"" in err.value.__notes__
        monkeypatch.setattr(engine.runner, "prefill", prefill)
        events = engine.step()
    else:
        events = engine.step(raise_errors=False)
        assert "a serving step failed" in caplog.text and "MemoryError: no room" in caplog.text
        monkeypatch.setattr(engine.runner, "prefill", prefill)
    assert [(e.finish_reason, e.error) for e in events if e.request_id == dropped] == \
        [("error", "MemoryError: no room")]
    assert any(e.tokens for e in events if e.request_id == kept)
    while engine.has_work():
        events += engine.step()
    alone = Engine(model, CONFIGS["dense"], max_context=CONTEXT, prefill_chunk=CHUNK)
    assert [t for e in events if e.request_id == kept for t in e.tokens] == \
        alone.generate([prompt(20)], 3, stop_tokens=()).tokens[0]
    assert {e.request_id: e.finish_reason for e in events if e.finished} == {kept: "length", dropped: "error"}
    assert engine.metrics()["finished_requests"] == {"length": 1, "error": 1}


def test_a_prefill_whose_copy_into_the_prefix_cache_fails_gives_its_shared_pages_back(model, monkeypatch, caplog):
    """A request that ends at its first token leaves its prompt's shared pages to the prefill, which copies them
    into the prefix cache and gives them back: when the copy raises, the request has ended well all the same (the
    failure is logged), the pages still come back, and the next request is served."""
    engine = ServingEngine(model, CONFIGS["quest"], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                           prefix_cache_bytes=1 << 30)
    shared = engine.runner.shared

    def broken(*args):
        raise MemoryError("no room to copy")

    monkeypatch.setattr(engine.runner, "_keep", broken)
    first = engine.submit(Request(prompt=prompt(40), max_tokens=1))
    events = []
    while engine.has_work():
        events += engine.step()
    assert [(e.request_id, e.finish_reason, len(e.tokens)) for e in events] == [(first, "length", 1)]
    assert "could not be kept in the prefix cache" in caplog.text and "no room to copy" in caplog.text
    assert shared.free_pages == shared.pages and engine.metrics()["kv_bytes_in_use"] == 0
    monkeypatch.undo()
    tokens, final = run(engine, [(0, Request(prompt=prompt(50), max_tokens=4))])
    assert len(tokens[0]) == 4 and final[0].finish_reason == "length" and shared.free_pages == shared.pages


def test_a_launched_step_is_collected_before_rows_are_released_or_stepped_again(model):
    """``Runner.launch`` queues a step that ``collect`` reads: a row joining in between is not in it, no release may
    come before it is collected, and at most two steps are in flight, collected in order, each with its own
    tokens."""
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    first = engine.submit(Request(prompt=prompt(20), max_tokens=30))
    drawn = []
    while not engine.metrics()["running"]:
        drawn += [t for e in engine.step() for t in e.tokens]
    runner = engine.runner
    alone = Engine(model, CONFIGS["dense"], max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = alone.generate([prompt(20)], 4, stop_tokens=()).tokens[0]
    launched = runner.launch()
    with pytest.raises(RuntimeError, match="in flight"):
        runner.release(first)
    job = runner.start(prompt(9))
    while job.logits is None:
        runner.prefill(job, runner.prefill_budget)
    runner.join("late", job, 5, Sampling(), 0, 4)
    ahead = runner.launch()
    with pytest.raises(RuntimeError, match="2 steps are in flight"):
        runner.launch()
    with pytest.raises(RuntimeError, match="not the oldest step in flight"):
        runner.collect(ahead)
    second = runner.collect(launched)
    assert list(second) == [first] and runner.in_flight == [ahead]
    third = runner.collect(ahead)
    assert list(third) == [first, "late"] and runner.in_flight == []
    assert drawn + [second[first][0], third[first][0]] == expected[:len(drawn) + 2]


@pytest.mark.parametrize("name", ["dense", "quest", "raas"])
def test_the_next_step_is_queued_before_the_last_is_read(model, name):
    """In steady decoding a call queues the rows' next step before it reads the last one's tokens (so that the
    device decodes while the host emits events): a step stays in flight between calls. A request that ends on a stop
    token meanwhile gives its alone tokens (its row's extra token dropped) and its row and pages come back once that
    step is read; one that ends by length is never stepped past its max_tokens; a cancellation waits for no step."""
    config = CONFIGS[name]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    want = [alone.generate([prompt(n)], 14, stop_tokens=()).tokens[0] for n in (20, 30, 40)]
    stop = next(want[0][i] for i in range(12, 0, -1) if want[0][i] not in want[0][:i])  # late: rows run ahead then
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    lengths = engine.runner.pool.pages
    ahead = []
    launch = engine.runner.launch

    def launched():  # no row's KV may outgrow its prompt and max_tokens (a step past a request's end)
        step = launch()
        assert all(lengths.lengths[row] <= ids[key] + 13 for row, key in enumerate(step.keys))  # not the last token
        return step

    engine.runner.launch = launched
    tokens, final = {}, {}
    ids = {engine.submit(Request(prompt=prompt(n), max_tokens=14, stop_tokens=(stop,) if n == 20 else ())): n
           for n in (20, 30, 40)}
    while engine.has_work():
        for event in engine.step():
            tokens.setdefault(ids[event.request_id], []).extend(event.tokens)
            if event.finished:
                final[ids[event.request_id]] = event.finish_reason
        ahead.append(len(engine.runner.in_flight))
        if len(tokens.get(40, [])) == 10 and 40 not in final:
            engine.cancel(next(r for r, n in ids.items() if n == 40))
    assert 1 in ahead and max(ahead) == 1
    assert tokens[20] == want[0][:want[0].index(stop) + 1] and final[20] == "stop"
    assert tokens[30] == want[1] and final[30] == "length"
    assert tokens[40][:10] == want[2][:10] and final[40] == "cancelled"
    assert engine.runner.in_flight == [] and engine.metrics()["free_rows"] == 3
    shared = engine.runner.shared
    assert shared is None or sorted(shared.free) == list(range(shared.pages))


def test_a_row_that_moves_keeps_its_choice_of_pages(model):
    """lowbit with reuse 4 attends the pages it chose at the steps between its choices: a row that moves down the
    pool when the request before it ends, between two choices, still gives its tokens alone."""
    config = CONFIGS["lowbit-reuse4"]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    for first_tokens in range(2, 9):
        for n in (60, 101):
            want = alone.generate([prompt(n)], 12, stop_tokens=()).tokens[0]
            engine = ServingEngine(model, config, max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
            tokens, _ = run(engine, [(0, Request(prompt=prompt(44), max_tokens=first_tokens)),
                                     (0, Request(prompt=prompt(n), max_tokens=12))])
            assert tokens[1] == want, (first_tokens, n)


def test_the_pacer_spends_on_prefill_a_share_of_the_decode_time():
    """A credit in seconds: a quarter of each 10 ms decode step; an 8.192 ms pass (8192 token-layers) overdraws it,
    and is paid back before the next pass; the allowance is what the credit pays for at the last measured rate."""
    pacer = PrefillPacer(0.25)
    assert pacer.budget() == 0  # nothing decoded yet: nothing paid for
    pacer.decoded(0.010)
    assert pacer.budget() == 1  # no rate measured yet: one pass
    pacer.prefilled(0.008192, 8192, decoding=True)
    assert pacer.credit == pytest.approx(0.0025 - 0.008192)
    allowed = []
    for _ in range(4):
        pacer.decoded(0.010)
        allowed.append(pacer.budget())
    assert allowed[:2] == [0, 0] and abs(allowed[2] - 1808) <= 1 and abs(allowed[3] - 2500) <= 1
    pacer.prefilled(1.0, 8192, decoding=False)  # no row decoding: the prefill costs no credit
    assert abs(pacer.budget() - 0.0025 * 8192) <= 1
    for bad in (0, -0.5, float("nan"), float("inf"), True, "0.2"):
        with pytest.raises(ConfigError, match="prefill_share"):
            PrefillPacer(bad)


@pytest.mark.parametrize("name", ["dense", "quest", "omnikv-offload", "raas", "snapkv"])
def test_decode_priority_changes_no_result(model, name):
    config = CONFIGS[name]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    chunked, _ = run(ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK), requests)
    for share in (0.05, 1e-9):
        engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                               prefill_share=share)
        assert run(engine, requests)[0] == chunked


def test_decode_priority_bounds_the_prefill_run_while_rows_decode(model):
    """With a vanishing share, a prompt that arrives while a request decodes runs one pass (one chunk through one
    layer: the first credit) and then waits until the decoding request ends; with no row decoding it runs a chunk
    through every layer per step."""
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK,
                           prefill_share=1e-9)
    first = engine.submit(Request(prompt=prompt(20), max_tokens=30))
    engine.step()
    assert engine.metrics()["running"] == 1 and engine.metrics()["prefill_work"] == 20 * 3
    engine.submit(Request(prompt=prompt(128), max_tokens=5))
    work, done = [], False
    while not done:
        before = engine.metrics()["prefill_work"]
        done = any(e.finished for e in engine.step() if e.request_id == first)
        work.append(engine.metrics()["prefill_work"] - before)
    assert len(work) == 28 and sorted(work) == [0] * 27 + [CHUNK]  # the first decoded its last 28 tokens meanwhile
    assert engine.metrics()["prefilling"] == 1 and engine.metrics()["running"] == 0
    before = engine.metrics()["prefill_work"]
    engine.step()
    assert engine.metrics()["prefill_work"] - before == CHUNK * 3


def test_cancelled_requests_free_their_rows_wherever_they_are(model):
    engine = ServingEngine(model, CONFIGS["quest"], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    ids = [engine.submit(Request(prompt=prompt(20), max_tokens=50))]
    engine.step()
    ids += [engine.submit(Request(prompt=prompt(n), max_tokens=20)) for n in (128, 30, 40)]
    engine.step()  # the second request's 128 tokens take 4 steps of 32
    metrics = engine.metrics()
    assert (metrics["running"], metrics["prefilling"], metrics["queued"], metrics["free_rows"]) == (1, 1, 2, 0)
    for rid in ids:
        engine.cancel(rid)
    engine.cancel(12345)  # unknown: nothing happens
    events = engine.step()
    assert sorted(e.request_id for e in events) == ids
    assert all(e.finished and e.finish_reason == "cancelled" for e in events)
    metrics = engine.metrics()
    assert metrics["free_rows"] == 2 and metrics["kv_bytes_in_use"] == 0 and not engine.has_work()
    assert engine.runner.free_rows == 2  # the pool's rows
    engine.cancel(ids[0])  # finished: nothing happens
    assert engine.step() == []
    engine.submit(Request(prompt=prompt(30), max_tokens=3))  # the freed rows serve again
    while engine.has_work():
        engine.step()
    assert engine.metrics()["finished_requests"] == {"cancelled": 4, "length": 1}


def test_queue_full_and_requests_that_never_fit(model):
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                           max_queue=2)
    for _ in range(2):
        engine.submit(Request(prompt=prompt(10), max_tokens=4))
    with pytest.raises(QueueFull, match="max_queue"):
        engine.submit(Request(prompt=prompt(10), max_tokens=4))
    with pytest.raises(RequestError, match=r"max_tokens must be at most max_context \(160\)"):
        engine.submit(Request(prompt=prompt(100), max_tokens=61))
    too_long = r"prompt must be at most 159 tokens \(max_context, 160, less one new token\), got 160"
    with pytest.raises(RequestError, match=too_long):
        engine.submit(Request(prompt=prompt(160), max_tokens=1))
    small = ServingEngine(model, CONFIGS["dense"], max_context=CONTEXT, prefill_chunk=CHUNK,
                          kv_memory_bytes=50_000)
    # Dense keeps its rows' keys and values in shared pages: kv_memory_bytes sizes them, in whole pages.
    assert small.kv_memory_bytes == 50_000 // small.runner.page_store_bytes * small.runner.page_store_bytes
    with pytest.raises(RequestError, match=rf"at most kv_memory_bytes \({small.kv_memory_bytes}\)"):
        small.submit(Request(prompt=prompt(100), max_tokens=20))
    with pytest.raises(RequestError, match="prompt must be token ids below the vocabulary size"):
        small.submit(Request(prompt=[5, 10**6], max_tokens=2))


def test_a_pool_that_does_not_fit_the_device_is_refused_before_allocating(model, monkeypatch):
    from sparsekv.serve import runner

    monkeypatch.setattr(runner, "device_budget", lambda device, utilization, profile: 100_000)
    with pytest.raises(ValueError, match=r"max_batch and max_context must be small enough that the pool of rows.* "
                                         r"fit in the 0.00 GiB that gpu_memory_utilization \(0.5\) leaves"):
        ServingEngine(model, CONFIGS["raas"], max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK,
                      gpu_memory_utilization=0.5)
    monkeypatch.setattr(runner, "device_budget", lambda device, utilization, profile: 10_000_000)
    ServingEngine(model, CONFIGS["raas"], max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK)


def test_shared_pages_take_the_memory_the_rows_leave(model, monkeypatch):
    """Dense and Quest keep their rows' keys and values in shared pages: as many as the device budget
    (``runner.device_budget``) leaves beside the rows and one prompt's prefill, at most every row's; none left is
    refused."""
    from sparsekv.serve import runner

    def pool(free: int):
        monkeypatch.setattr(runner, "device_budget", lambda device, utilization, profile: free)
        return ServingEngine(model, CONFIGS["quest"], max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK)

    rows = 4 * -(-CONTEXT // CONFIGS["quest"].page_size)
    page = pool(10**9).runner.page_store_bytes
    assert pool(10**9).runner.shared.pages == rows
    least = 0  # the rows and the prefill: found page by page
    while True:
        try:
            engine = pool(least)
            break
        except ValueError as err:
            assert "must be small enough that the rows" in str(err) and "leave room for a page of KV" in str(err)
            least += page
    assert engine.runner.shared.pages == 1 and engine.kv_memory_bytes == page
    assert pool(least + 6 * page).runner.shared.pages == 7


def test_kv_memory_below_the_smallest_request_is_refused_at_construction(model):
    with pytest.raises(ConfigError, match="kv_memory_bytes"):
        ServingEngine(model, CONFIGS["dense"], max_batch=2, max_context=CONTEXT, kv_memory_bytes=100)


def test_memory_admits_what_fits_and_the_rest_waits(model):
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK)
    need = engine.runner.kv_bytes(60, 70)
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK,
                           kv_memory_bytes=2 * need + 1)
    for _ in range(3):
        engine.submit(Request(prompt=prompt(60), max_tokens=10))
    engine.step()
    metrics = engine.metrics()
    assert metrics["queued"] == 1 and metrics["kv_bytes_in_use"] == 2 * need
    while engine.has_work():
        engine.step()
    assert engine.metrics()["finished_requests"] == {"length": 3}


@pytest.mark.parametrize("fields,match", [
    (dict(prompt=[1, 2.5], max_tokens=3), "prompt must be a non-empty list of token ids"),
    (dict(prompt=b"abc", max_tokens=3), "prompt must be a non-empty list of token ids"),
    (dict(prompt=[True, 2], max_tokens=3), "prompt must be a non-empty list of token ids"),
    (dict(prompt=[3, -1], max_tokens=3), "prompt must be a non-empty list of token ids"),
    (dict(prompt=[], max_tokens=3), "prompt must be a non-empty list of token ids"),
    (dict(prompt=[1], max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(prompt=[1], max_tokens=2, stop_tokens=(-1,)), "stop_tokens must be a list or tuple of token ids"),
    (dict(prompt=[1], max_tokens=2, stop_tokens=5), "stop_tokens must be a list or tuple of token ids"),
    (dict(prompt=5, max_tokens=2), "prompt must be a non-empty list of token ids"),
    (dict(prompt=[1], max_tokens=2, seed=-3), "seed must be None or an int"),
    (dict(prompt=[1], max_tokens=2, seed=1 << 62), "seed must be None or an int"),
    (dict(prompt=[1], max_tokens=2, sampling=0.5), "sampling must be a sparsekv.engine.Sampling"),
    (dict(prompt=[1], max_tokens=2, sampling={"temperature": 1.0}),
     r"sampling must be a sparsekv.engine.Sampling \(from a dict of its fields: Sampling\(\*\*fields\)\)"),
    (dict(prompt=[1], max_tokens=2, logprobs=21), "logprobs must be None or an int from 0 to 20"),
    (dict(prompt=[1], max_tokens=2, logprobs=True), "logprobs must be None or an int from 0 to 20"),
])
def test_bad_requests_are_refused(fields, match):
    with pytest.raises(RequestError, match=match):
        Request(**fields)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, weights, rows", [*((name, "float", 3) for name in CONFIGS), ("dense", "int4", 7),
                                                 ("quest", "int4", 7), ("quest", "int4", 12), ("dense-fp8", "float", 5),
                                                 ("quest-fp8", "float", 5)])
def test_cuda_graphs_serve_the_eager_tokens(name, weights, rows):
    """On the GPU (bf16): steps captured once per batch size (CUDA graphs, the default on CUDA) give the eager
    steps' tokens, greedy and sampled, with and without penalties, over rows that join, move and leave; on int4
    weights (laid out for the CUDA kernel: its products of one B operand up to 8 rows, two up to 16), with up to 7
    and 12 rows; over fp8 caches of pages of 16 at head dim 64, whose dense layers take the CUDA attention kernel."""
    from sparsekv.kernels.cuda import available
    from sparsekv.kernels.reference import tiled
    from sparsekv.quant import QuantLinear, quantize_model

    fp8 = {"dense-fp8": DenseConfig(page_size=16, kv_dtype="fp8"),
           "quest-fp8": QuestConfig(token_budget=48, page_size=16, dense_layers=1, kv_dtype="fp8")}
    config = fp8.get(name) or CONFIGS[name]
    model = tiny_model("llama", seed=1, layers=3, dtype=torch.bfloat16, **({"head_dim": 64} if name in fp8 else {}))
    model = model.cuda()
    quantize_model(model, weights)
    if weights == "int4" and available(torch.device("cuda"), "quant"):
        assert all(tiled(m.codes) for m in model.modules() if isinstance(m, QuantLinear))
    hot = Sampling(temperature=0.8, top_p=0.9, frequency_penalty=0.5, min_p=0.1)
    penalized = Sampling(presence_penalty=1.0, logit_bias={17: 1.5}, repetition_penalty=1.2)
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new, sampling=[penalized, hot, Sampling(), hot][i % 4],
                                  seed=i, logprobs=2 if i % 3 == 0 else None))
                for i, (arrival, n, new, _) in enumerate(PLAN)]
    tokens, logprobs = [], []
    for cuda_graph in (False, None):
        engine = ServingEngine(model, config, max_batch=rows, max_context=CONTEXT, prefill_chunk=CHUNK,
                               cuda_graph=cuda_graph)
        logprobs.append({})
        tokens.append(run(engine, requests, logprobs=logprobs[-1])[0])
        assert any(step.replay is not None for _, step, _ in engine.runner.steps.values()) == (cuda_graph is None)
    assert tokens[0] == tokens[1] and logprobs[0] == logprobs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["dense", "quest", "raas"])
def test_the_process_stays_within_gpu_memory_utilization(name):
    """On the GPU: a pool sized by gpu_memory_utilization to leave about 256 MiB of KV fits it, and the process's
    peak device memory over a run (PyTorch's peak reserved memory plus what the process holds outside it), with the
    profile step, every batch size's captured step and the prefills, stays within that share of the device, with
    64 MiB to spare for what the allocator rounds."""
    from sparsekv.bench.serve import device_memory

    model = tiny_model("llama", seed=1, layers=3, dtype=torch.bfloat16).cuda()
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    utilization = (total - free + (256 << 20)) / total
    engine = ServingEngine(model, CONFIGS[name], max_batch=32, max_context=CONTEXT, prefill_chunk=CHUNK,
                           gpu_memory_utilization=utilization)
    hot = Sampling(temperature=0.8, top_p=0.9, presence_penalty=0.5)
    requests = [(i // 4, Request(prompt=prompt(20 + 2 * i), max_tokens=8 + i % 5, sampling=hot if i % 2 else
                                 Sampling(), seed=i, logprobs=2 if i % 7 == 0 else None)) for i in range(48)]
    run(engine, requests)
    memory = device_memory(device, utilization)
    assert engine.runner.profile_bytes > 0
    assert memory["peak_device_gib"] * 2**30 <= utilization * total + (64 << 20), memory


def test_requests_submitted_from_other_threads_while_stepping(model):
    import threading

    engine = ServingEngine(model, CONFIGS["quest"], max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK)
    ids = []

    def client(n):
        ids.append(engine.submit(Request(prompt=prompt(n), max_tokens=3)))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(10, 22)]
    for t in threads:
        t.start()
    finished = set()
    while any(t.is_alive() for t in threads) or engine.has_work():
        finished |= {e.request_id for e in engine.step() if e.finished}
    assert finished == set(ids) and len(ids) == 12


def test_another_architecture():
    """Qwen3 (query and key norms) batched as alone."""
    qwen = tiny_model("qwen3", seed=2, layers=2)
    config = CONFIGS["quest"]
    alone = Engine(qwen, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    expected = [alone.generate([r.prompt], r.max_tokens, stop_tokens=()).tokens[0] for _, r in requests]
    tokens, _ = run(ServingEngine(qwen, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK), requests)
    assert [tokens[i] for i in range(len(PLAN))] == expected


def test_a_failing_prefill_drops_its_request_and_leaves_the_others_running(model, monkeypatch):
    """The step raises; the next one returns what it made before: the running request's token of the step
    launched before the prefill, and the failing request's final event ("error")."""
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    first = engine.submit(Request(prompt=prompt(20), max_tokens=6))
    tokens = [t for e in engine.step() for t in e.tokens]
    dropped = engine.submit(Request(prompt=prompt(30), max_tokens=6))
    prefill = engine.runner.prefill

    def broken(job, budget):
        raise MemoryError("no room")

    monkeypatch.setattr(engine.runner, "prefill", broken)
    with pytest.raises(MemoryError, match="no room"):
        engine.step()
    monkeypatch.setattr(engine.runner, "prefill", prefill)
    metrics = engine.metrics()
    assert (metrics["running"], metrics["prefilling"], metrics["queued"]) == (1, 0, 0)
    ends = {}
    while engine.has_work():
        events = engine.step()
        tokens += [t for e in events if e.request_id == first for t in e.tokens]
        ends.update((e.request_id, e.finish_reason) for e in events if e.finished)
    alone = Engine(model, CONFIGS["dense"], max_context=CONTEXT, prefill_chunk=CHUNK)
    assert tokens == alone.generate([prompt(20)], 6, stop_tokens=()).tokens[0]
    assert ends == {dropped: "error", first: "length"}
    assert engine.metrics()["kv_bytes_in_use"] == 0


@pytest.mark.parametrize("raise_errors", [True, False])
@pytest.mark.parametrize("name", ["dense", "quest"])
def test_a_failing_decode_step_ends_the_running_requests_with_error_and_the_engine_serves_on(model, monkeypatch,
                                                                                            name, raise_errors):
    """A decode step that raises cannot be laid to one row: the running and prefilling requests end with "error"
    (their events returned, or with the next step's where the step raises), the rows and their pages come back, a
    waiting request stays queued, and the requests after it get the tokens they get alone."""
    engine = ServingEngine(model, CONFIGS[name], max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK)
    running = [engine.submit(Request(prompt=prompt(n), max_tokens=8)) for n in (20, 25)]
    while engine.metrics()["running"] < 2:
        engine.step()
    waiting = engine.submit(Request(prompt=prompt(30), max_tokens=5))
    launch = engine.runner.launch

    def broken():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", broken)
    if raise_errors:
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    else:
        events = engine.step(raise_errors=False)
    metrics = engine.metrics()
    assert (metrics["running"], metrics["prefilling"], metrics["queued"]) == (0, 0, 1)
    assert metrics["kv_bytes_in_use"] == 0 and engine.runner.keys == []
    if engine.runner.shared is not None:
        assert engine.runner.shared.free_pages == engine.runner.shared.pages
    monkeypatch.setattr(engine.runner, "launch", launch)
    if raise_errors:
        events = engine.step()  # the failed step's events, and this one's
    assert {e.request_id: (e.finish_reason, e.error) for e in events if e.finished} == \
        {rid: ("error", "RuntimeError: device lost") for rid in running}
    later = engine.submit(Request(prompt=prompt(40), max_tokens=6))
    while engine.has_work():
        events += engine.step()
    alone = Engine(model, CONFIGS[name], max_context=CONTEXT, prefill_chunk=CHUNK)
    for rid, n, new in ((waiting, 30, 5), (later, 40, 6)):
        assert [t for e in events if e.request_id == rid for t in e.tokens] == \
            alone.generate([prompt(n)], new, stop_tokens=()).tokens[0]
    assert engine.metrics()["finished_requests"] == {"error": 2, "length": 2}


@pytest.mark.parametrize("step_tokens", [None, 120])
def test_a_failing_join_or_admission_ends_only_its_request(model, monkeypatch, step_tokens):
    """A request whose row cannot be set (its join) or whose prefill cannot start ends with "error"; the others
    get their tokens alone, and the pages come back. With mixed steps of 120 tokens the prompts run in one step,
    and the prefill ending there after the failing join joins at the next."""
    engine = ServingEngine(model, CONFIGS["quest"], max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                           step_tokens=step_tokens)
    runner = engine.runner
    set_sampling, start = runner._set_sampling, runner.start

    def broken_join(row, job, first, sampling, seed, earlier):
        if job.prompt_len == 30:
            raise OverflowError("int too big to convert")
        return set_sampling(row, job, first, sampling, seed, earlier)

    def broken_start(prompt, replay):
        if len(prompt) == 35:
            raise MemoryError("no room")
        return start(prompt, replay)

    monkeypatch.setattr(runner, "_set_sampling", broken_join)
    monkeypatch.setattr(runner, "start", broken_start)
    ids = [engine.submit(Request(prompt=prompt(n), max_tokens=5)) for n in (20, 30, 35, 22)]
    events = []
    while engine.has_work():
        events += engine.step(raise_errors=False)
    final = {e.request_id: (e.finish_reason, e.error) for e in events if e.finished}
    assert [final[rid] for rid in ids] == [
        ("length", None), ("error", "OverflowError: int too big to convert"), ("error", "MemoryError: no room"),
        ("length", None)]
    alone = Engine(model, CONFIGS["quest"], max_context=CONTEXT, prefill_chunk=CHUNK)
    for rid, n in ((ids[0], 20), (ids[3], 22)):
        assert [t for e in events if e.request_id == rid for t in e.tokens] == \
            alone.generate([prompt(n)], 5, stop_tokens=()).tokens[0]
    assert runner.shared.free_pages == runner.shared.pages and engine.metrics()["kv_bytes_in_use"] == 0


def test_a_request_ended_by_its_caller_with_stop_counts_as_stopped(model):
    """``cancel(id, "stop")``: a server's stop string ends the request with finish reason "stop"."""
    engine = ServingEngine(model, CONFIGS["dense"], max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK)
    rid = engine.submit(Request(prompt=prompt(20), max_tokens=50))
    engine.step()
    engine.cancel(rid, "stop")
    engine.cancel(rid)  # the first reason stands
    events = engine.step()
    assert [(e.finish_reason, e.finished) for e in events] == [("stop", True)]
    assert engine.metrics()["finished_requests"] == {"stop": 1}
    with pytest.raises(ConfigError, match="reason must be 'cancelled' or 'stop'"):
        engine.cancel(rid, "length")
    with pytest.raises(ConfigError, match="request_id must be an id that submit returned"):
        engine.cancel("0")


GROW_PLAN = [(0, 60, 70), (0, 30, 4), (0, 50, 40), (1, 20, 30), (6, 33, 12)]  # (arrival step, prompt, max_tokens)


def grown(model, config, samplings, kv_tokens: int, cancel_preempted: int | None = None,
          step_tokens: int | None = None, preemption: str | None = None):
    """Runs GROW_PLAN's requests (with ``samplings``, seeded by index) under admission "grow" in the pages of
    ``kv_tokens`` tokens, cancelling request ``cancel_preempted`` while it waits preempted (``step_tokens``: mixed
    steps; ``preemption``: the engine's). Returns each request's tokens, its final event, the (request index, tokens
    drawn) of each preemption and the engine."""
    page = ServingEngine(model, config, max_batch=1, max_context=CONTEXT).runner.page_store_bytes
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                           kv_memory_bytes=kv_tokens // config.page_size * page, admission="grow",
                           step_tokens=step_tokens, preemption=preemption)
    ids, tokens, final, preempted = {}, {}, {}, []
    preempt = engine._preempt

    def recorded(live, events):
        preempted.append((ids[live.id], len(live.tokens)))
        assert live.held > 0
        preempt(live, events)

    engine._preempt = recorded
    pending, steps = list(range(len(GROW_PLAN))), 0
    while pending or engine.has_work():
        while pending and GROW_PLAN[pending[0]][0] <= steps:
            i = pending.pop(0)
            _, n, new = GROW_PLAN[i]
            ids[engine.submit(Request(prompt=prompt(n), max_tokens=new, sampling=samplings[i], seed=i))] = i
            tokens[i] = []
        for event in engine.step():
            i = ids[event.request_id]
            tokens[i] += event.tokens
            assert event.completion_tokens == len(tokens[i])
            final[i] = event
        waiting = [live for live in engine._queue if live.tokens and ids[live.id] == cancel_preempted]
        if waiting:
            engine.cancel(waiting[0].id)
        steps += 1
    return tokens, final, preempted, engine


def cancelled_while_preempted(model, config, samplings, expected, preempted, step_tokens: int | None = None,
                              preemption: str | None = None):
    """Runs ``grown`` again, cancelling a request (not the first two) that ``preempted`` (a first run's
    preemptions) shows preempted: it ends "cancelled" with the tokens it had drawn, every other request gets
    ``expected`` (its tokens alone), and every page comes back."""
    cancelled = next(i for i, _ in preempted if i not in (0, 1))
    tokens, final, preempted, engine = grown(model, config, samplings, 160, cancel_preempted=cancelled,
                                             step_tokens=step_tokens, preemption=preemption)
    drawn = max(n for i, n in preempted if i == cancelled)
    assert final[cancelled].finish_reason == "cancelled" and tokens[cancelled] == expected[cancelled][:drawn]
    assert [tokens[i] for i in range(len(GROW_PLAN)) if i != cancelled] == \
        [want for i, want in enumerate(expected) if i != cancelled]
    shared = engine.runner.shared
    assert engine.metrics()["kv_bytes_in_use"] == 0 and sorted(shared.free) == list(range(shared.pages))


@pytest.mark.parametrize("name, preemption, way", [("dense", None, "prefill"), ("dense", "recompute", "prefill"),
                                                   ("dense", "swap", "swap"), ("quest", None, "swap"),
                                                   ("quest", "swap", "swap")])
def test_requests_preempted_under_grow_give_their_alone_tokens(model, name, preemption, way):
    """Admission "grow" in 20 pages of 8 tokens: rows take pages as they reach them; where the store cannot give the
    running rows their next pages, the newest admitted request gives its own back, and later comes back: dense's
    prompt and drawn tokens prefilled again (``preemption`` "recompute", its default), or its row copied to host
    memory at the preemption and back at the admission ("swap"; Quest's only way). Every request gets its tokens
    alone, one of them preempted twice; one cancelled while preempted ends "cancelled" with the tokens it had; every
    page comes back."""
    from sparsekv.serve.runner import Runner

    config = CONFIGS[name]
    samplings = [Sampling()] * len(GROW_PLAN)
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new in GROW_PLAN]
    came_back = []  # "prefill" or "swap", for each preempted request that drew tokens
    start, swap_out = Runner.start, Runner.swap_out

    def started(runner, prompt, drawn=()):
        came_back.extend(["prefill"] if drawn else [])
        return start(runner, prompt, drawn)

    def swapped(runner, key, prompt):
        came_back.append("swap")
        return swap_out(runner, key, prompt)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Runner, "start", started)
        patch.setattr(Runner, "swap_out", swapped)
        tokens, final, preempted, engine = grown(model, config, samplings, 160, preemption=preemption)
    assert [tokens[i] for i in range(len(GROW_PLAN))] == expected
    assert came_back and set(came_back) == {way}
    assert max(Counter(i for i, _ in preempted).values()) >= 2
    assert engine.metrics()["preempted"] == len(preempted)
    cancelled_while_preempted(model, config, samplings, expected, preempted, preemption=preemption)


@pytest.mark.parametrize("name, options, says", [
    ("dense", {"preemption": "drop"}, "preemption must be 'recompute' or 'swap', got 'drop'"),
    ("dense", {"preemption": "swap"}, 'preemption must be given only with admission "grow"'),
    ("quest", {"preemption": "recompute", "admission": "grow"}, "preemption must be 'swap' for quest (or not given)"),
])
def test_a_preemption_that_cannot_apply_is_refused(model, name, options, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        ServingEngine(model, CONFIGS[name], max_batch=2, max_context=CONTEXT, **options)


@pytest.mark.parametrize("name", ["dense", "quest", "quest-per-query-head", "quest-kv-fp8"])
def test_preempted_sampled_and_penalized_requests_draw_on_where_they_were(model, name):
    """Seeded sampling, penalties and biases under "grow" preemption: a request prefilled again goes on with its
    draws' index and its counts of the tokens it drew, so it gives its tokens alone."""
    config = CONFIGS[name]
    penalized = Sampling(presence_penalty=1.5, frequency_penalty=0.75, logit_bias={17: 2.0}, repetition_penalty=1.3)
    hot = Sampling(temperature=1.2, top_p=0.9, frequency_penalty=2.0)
    samplings = [hot, Sampling(), penalized, hot, penalized]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, sampling=s, seed=i, stop_tokens=()).tokens[0]
                for i, ((_, n, new), s) in enumerate(zip(GROW_PLAN, samplings))]
    tokens, _, preempted, _ = grown(model, config, samplings, 160)
    assert preempted and [tokens[i] for i in range(len(GROW_PLAN))] == expected


def test_admission_grow_counts_the_pages_a_request_holds(model):
    """Under "grow" a running request is counted for the pages its row holds, which it takes as it reaches them;
    "reserve" counts its prompt's and max_tokens' from its admission."""
    config = CONFIGS["quest"]

    def pages(tokens):
        return -(-tokens // config.page_size)

    for admission in ("grow", "reserve"):
        engine = ServingEngine(model, config, max_batch=1, max_context=CONTEXT, prefill_chunk=CHUNK,
                               admission=admission)
        engine.submit(Request(prompt=prompt(48), max_tokens=40))
        drawn = 0
        while engine.has_work():
            drawn += sum(len(e.tokens) for e in engine.step())
            if engine._running:
                live = next(iter(engine._running.values()))
                held = len(engine.runner.shared.held[0])
                assert live.held == held * engine.runner.page_store_bytes
                # The row holds the KV of the prompt and of every token drawn but the last, its next input.
                if admission == "grow":
                    assert pages(48 + drawn - 1) <= held <= pages(48 + drawn)
                else:
                    assert held == pages(48 + 40)
    with pytest.raises(ConfigError, match="admission"):
        ServingEngine(model, config, admission="lazy")


def mixed_forwards(engine: ServingEngine) -> list[tuple[int, list[int]]]:
    """Records (decode rows, each prompt chunk's tokens) of each of ``engine``'s mixed forwards."""
    forwards = []
    mixed = engine.runner.decoder.mixed

    def recorded(token, position, cache, chunks):
        forwards.append((token.shape[0], [chunk.ids.shape[1] for chunk in chunks]))
        return mixed(token, position, cache, chunks)

    engine.runner.decoder.mixed = recorded
    return forwards


@pytest.mark.parametrize("name", ["dense", "quest", "quest-per-query-head", "quest-kv-fp8"])
def test_mixed_steps_give_the_alone_tokens(model, name):
    """Mixed steps (``step_tokens``): the running rows' decode tokens and the next prompt tokens of the oldest
    prefills in one forward, at most 20 tokens in all; requests greedy, sampled, penalized and asking for
    log-probabilities, ended by stop tokens, length and cancellation, eager and captured: each gives its tokens
    alone, and its log-probabilities those of a run without mixed steps."""
    config = CONFIGS[name]
    penalized = Sampling(presence_penalty=1.5, frequency_penalty=0.75, logit_bias={17: 2.0}, repetition_penalty=1.3)
    hot = Sampling(temperature=1.2, top_p=0.9, frequency_penalty=2.0, min_p=0.05)
    samplings = [penalized, Sampling(), hot, Sampling(temperature=0.9), penalized, Sampling(), Sampling()]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, sampling=s, seed=i, stop_tokens=()).tokens[0]
                for i, ((_, n, new, _), s) in enumerate(zip(PLAN, samplings))]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new, sampling=s, seed=i,
                                  stop_tokens=(want[2],) if end == "stop" else (), logprobs=2 if i % 3 == 0 else None))
                for i, ((arrival, n, new, end), s, want) in enumerate(zip(PLAN, samplings, expected))]
    cancel = {i: 4 for i, plan in enumerate(PLAN) if plan[3] == "cancel"}
    found = [{}, {}, {}]
    run(ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK), requests, cancel,
        logprobs=found[0])
    for capture, logprobs in zip((None, emulated_graph), found[1:]):
        engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK, step_tokens=20)
        engine.runner.engine.capture = capture
        forwards = mixed_forwards(engine)
        tokens, final = run(engine, requests, cancel, logprobs=logprobs)
        for i, ((_, _, new, end), want) in enumerate(zip(PLAN, expected)):
            if end == "stop":
                assert tokens[i] == want[:want.index(want[2]) + 1] and final[i].finish_reason == "stop"
            elif end == "cancel":
                assert final[i].finish_reason == "cancelled" and tokens[i] == want[:len(tokens[i])]
            else:
                assert tokens[i] == want and final[i].finish_reason == "length"
        # Forwards with rows decoding, the prompts' tokens filling the rest of the 20; prompts alone; a prompt's
        # last chunk and the next prompt's first in one forward.
        assert any(rows and rows + sum(chunks) == 20 for rows, chunks in forwards)
        assert any(not rows for rows, _ in forwards)
        assert any(len(chunks) > 1 and sum(chunks) + rows == 20 for rows, chunks in forwards)
        assert sum(sum(chunks) for _, chunks in forwards) == sum(n for _, n, _, _ in PLAN)
        shared = engine.runner.shared
        assert engine.metrics()["kv_bytes_in_use"] == 0 and sorted(shared.free) == list(range(shared.pages))
    assert found[1] == found[2] and set(found[1]) == set(found[0])
    for i in found[0]:
        assert [lp.top[0][0] for lp in found[1][i]] == [lp.top[0][0] for lp in found[0][i]]
        assert [lp.logprob for lp in found[1][i]] == pytest.approx([lp.logprob for lp in found[0][i]], abs=1e-4)


@pytest.mark.parametrize("name, preemption", [("dense", None), ("dense", "swap"), ("quest", None)])
def test_mixed_steps_under_preemption_give_the_alone_tokens(model, name, preemption):
    """Mixed steps with admission "grow": requests preempted (one of them twice) and one cancelled while preempted
    give their tokens alone, recomputed or swapped; every page comes back."""
    config = CONFIGS[name]
    penalized = Sampling(presence_penalty=1.5, logit_bias={17: 2.0}, repetition_penalty=1.3)
    samplings = [Sampling(), Sampling(temperature=1.1, top_p=0.9), penalized, Sampling(), Sampling()]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, sampling=s, seed=i, stop_tokens=()).tokens[0]
                for i, ((_, n, new), s) in enumerate(zip(GROW_PLAN, samplings))]
    tokens, _, preempted, engine = grown(model, config, samplings, 160, step_tokens=16, preemption=preemption)
    assert [tokens[i] for i in range(len(GROW_PLAN))] == expected
    assert max(Counter(i for i, _ in preempted).values()) >= 2
    cancelled_while_preempted(model, config, samplings, expected, preempted, step_tokens=16, preemption=preemption)


def test_mixed_steps_at_a_covering_budget_give_dense_tokens(model):
    quest = QuestConfig(token_budget=CONTEXT, page_size=8, dense_layers=1)
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN]
    tokens = [run(ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK, step_tokens=24),
                  requests)[0] for config in (CONFIGS["dense"], quest)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("name, fields, match", [
    ("dense", dict(step_tokens=3), r"step_tokens must be None \(no mixed steps\) or an int > max_batch \(3\)"),
    ("dense", dict(step_tokens=True), "step_tokens must be None"),
    ("raas", dict(step_tokens=64), "step_tokens must be None for raas: mixed steps serve the methods in shared pages"),
    ("dense", dict(step_tokens=64, prefill_share=0.25), "prefill_share must be None with step_tokens"),
])
def test_bad_step_tokens_are_refused(model, name, fields, match):
    with pytest.raises(ConfigError, match=match):
        ServingEngine(model, CONFIGS[name], max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK, **fields)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["dense", "quest", "quest-kv-fp8"])
def test_mixed_steps_on_the_gpu_give_the_tokens_of_steps_apart(name):
    """On the GPU, float32 (fp8 KV for Quest's fp8 case): mixed steps, eager with the compiled parts, give the
    tokens of the captured decode steps with the prompts' chunks apart."""
    model = tiny_model("llama", seed=1, layers=3, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new, sampling=Sampling(temperature=0.9), seed=i))
                for i, (arrival, n, new, _) in enumerate(PLAN)]
    tokens = [run(ServingEngine(model, CONFIGS[name], max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                                compile=True, step_tokens=step_tokens), requests)[0] for step_tokens in (None, 20)]
    assert tokens[0] == tokens[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, options", [("raas", {}), ("quest", {"admission": "grow"})])
def test_rows_swapped_on_the_gpu_go_through_page_locked_memory(name, options):
    """On the GPU, float32: a row that yields its row (time slicing) is copied to page-locked host memory
    asynchronously and back, its copy kept for the next (one set aside at the start), and every request gets the
    tokens it gets without time slicing."""
    from sparsekv.serve.runner import Runner

    model = tiny_model("llama", seed=1, layers=3, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    config = CONFIGS[name]
    requests = [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new in SLICED]
    plain = ServingEngine(model, config, max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK, **options)
    expected = run(plain, requests)[0]
    pinned, swap_out = [], Runner.swap_out

    def swapped(runner, key, prompt):
        job = swap_out(runner, key, prompt)
        pinned.extend(layer.k.is_pinned() and layer.v.is_pinned() for layer in job.cache.pages.layers)
        return job

    engine = ServingEngine(model, config, max_batch=2, max_context=CONTEXT, prefill_chunk=CHUNK, time_slice=6,
                           swap_space_bytes=1, **options)
    set_aside = engine.runner._spare[0][1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Runner, "swap_out", swapped)
        tokens, _ = run(engine, requests)
    assert tokens == expected and engine.metrics()["yielded"] >= 3
    assert pinned and all(pinned)
    kept = [layers for _, layers in engine.runner._spare]
    assert any(layers is set_aside for layers in kept) and len(kept) < engine.metrics()["yielded"]


def test_a_row_that_cannot_go_to_host_memory_fails_alone(model):
    """Quest under "grow": where a preempted request's row cannot be copied to host memory, that request ends with
    "error" and every other request gets its tokens alone; every page comes back."""
    from sparsekv.serve.runner import Runner

    config = CONFIGS["quest"]
    alone = Engine(model, config, max_context=CONTEXT, prefill_chunk=CHUNK)
    expected = [alone.generate([prompt(n)], new, stop_tokens=()).tokens[0] for _, n, new in GROW_PLAN]
    page = ServingEngine(model, config, max_batch=1, max_context=CONTEXT).runner.page_store_bytes
    engine = ServingEngine(model, config, max_batch=3, max_context=CONTEXT, prefill_chunk=CHUNK,
                           kv_memory_bytes=160 // config.page_size * page, admission="grow")

    def no_host_memory(runner, key, prompt):
        raise RuntimeError("no host memory for the row")

    ids, tokens, final = {}, {}, {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Runner, "swap_out", no_host_memory)
        for i, (_, n, new) in enumerate(GROW_PLAN):
            ids[engine.submit(Request(prompt=prompt(n), max_tokens=new))] = i
            tokens[i] = []
        while engine.has_work():
            for event in engine.step(raise_errors=False):
                tokens[ids[event.request_id]] += event.tokens
                if event.finished:
                    final[ids[event.request_id]] = event
    failed = [i for i, event in final.items() if event.finish_reason == "error"]
    assert failed and all("no host memory for the row" in final[i].error for i in failed)
    assert all(tokens[i] == expected[i] for i in final if i not in failed)
    assert all(final[i].finish_reason == "length" for i in final if i not in failed) and len(final) == len(GROW_PLAN)
    shared = engine.runner.shared
    assert engine.metrics()["kv_bytes_in_use"] == 0 and sorted(shared.free) == list(range(shared.pages))


@pytest.mark.parametrize("name", ["dense", "quest", "raas", "lowbit", "quest-kv-fp8", "snapkv", "h2o", "omnikv"])
def test_the_pool_allocates_what_its_accounting_says(model, name):
    """After a run, the bytes of the pool's tensors (its layers' keys, values, bounds, page tables, per-slot state
    made as it ran, and the shared store's table) are within 1% above the ``Runner.pool_bytes`` that sizing counted
    (it leaves out per-row indices such as each layer's current slot, a few KiB here and nothing to speak of on a
    real model) and 10% below it (it counts a method's per-slot state for every slot)."""
    engine = ServingEngine(model, CONFIGS[name], max_batch=4, max_context=CONTEXT, prefill_chunk=CHUNK)
    run(engine, [(arrival, Request(prompt=prompt(n), max_tokens=new)) for arrival, n, new, _ in PLAN])
    runner = engine.runner
    tensors = {}
    for layer in runner.pool.pages.layers:
        for t in (layer.k, layer.v, getattr(layer, "_kmin", None), getattr(layer, "_kmax", None), layer.slot_page,
                  layer.cur_slot, *layer.slot_state.values()):
            if t is not None:
                tensors[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    if runner.shared is not None:
        tensors[runner.shared.table.untyped_storage().data_ptr()] = runner.shared.table.untyped_storage().nbytes()
    allocated = sum(tensors.values())
    assert 0.9 * runner.pool_bytes <= allocated <= 1.01 * runner.pool_bytes


@pytest.mark.parametrize("compile", [False, True])
def test_prepare_builds_the_prompt_plans_of_its_passes_under_compile(model, compile, monkeypatch):
    """``Runner.prepare`` builds cuDNN's prompt attention plans only under ``compile``, for the heads, head dim,
    dtype and scale of the model, passes of the larger of prefill_chunk and step_tokens, and the max context."""
    from sparsekv.serve import runner as runner_module

    calls = []
    monkeypatch.setattr(runner_module, "build_prompt_plans", lambda *args: calls.append(args) or 7)
    engine = ServingEngine(model, QuestConfig(token_budget=32, dense_layers=0), max_batch=2, max_context=CONTEXT,
                           prefill_chunk=CHUNK, step_tokens=48, compile=compile)
    attn = model.get_decoder().layers[0].self_attn
    assert engine.runner.prepare() == (7 if compile else 0)
    assert calls == ([(model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim,
                       torch.float32, torch.device("cpu"), attn.scaling, 48, CONTEXT)] if compile else [])
