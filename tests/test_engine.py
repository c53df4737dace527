"""The decode engine: the same tokens as ``apply`` + ``model.generate`` for every method, chunked prefill, a
decode step that survives capture (checked on the CPU with an emulated CUDA graph), sampling, stop tokens,
streaming, and the capacity checks."""

import contextlib
import dataclasses
import enum

import pytest
import torch

import sparsekv
from graph_replay import emulated_graph
from sparsekv import (DenseConfig, H2OConfig, LowBitConfig, OmniKVConfig, OracleConfig, QuestConfig, RaaSConfig,
                      SnapKVConfig, StreamingLLMConfig, TOVAConfig)
from sparsekv import engine as engine_module
from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.engine import Engine, Sampling
from sparsekv.integrations import transformers as transformers_integration
from sparsekv.tiny import tiny_model

NEW = 24
CONFIGS = {
    "dense": DenseConfig(),
    "quest": QuestConfig(token_budget=64, page_size=16, dense_layers=1),
    "quest-per-query-head": QuestConfig(token_budget=48, page_size=8, dense_layers=0, per_query_head=True),
    "raas": RaaSConfig(token_budget=64, page_size=8),
    "raas-quest": RaaSConfig(token_budget=64, page_size=8, prefill="quest"),
    "omnikv": OmniKVConfig(token_budget=32, window=4, selector="uniform", filter_layers=(1,), wait_layers=0),
    "omnikv-offload": OmniKVConfig(token_budget=0.2, window=4, filter_layers=(0, 2), wait_layers=0, offload=True),
    "streamingllm": StreamingLLMConfig(token_budget=64),
    "h2o": H2OConfig(token_budget=64),
    "tova": TOVAConfig(token_budget=64),
    "snapkv": SnapKVConfig(token_budget=64, window=8),
    "oracle": OracleConfig(token_budget=64, page_size=16, dense_layers=1),
    "oracle-tokens": OracleConfig(token_budget=48, page_size=8, dense_layers=0, granularity="token",
                                  per_query_head=True),
    "lowbit": LowBitConfig(token_budget=64, page_size=16, dense_layers=1),
    "lowbit-1bit-per-query-head-reuse2": LowBitConfig(token_budget=48, page_size=8, dense_layers=0, bits=1,
                                                      per_query_head=True, reuse=2),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    m = tiny_model(request.param, seed=1)
    m.generation_config.eos_token_id = None  # random weights may emit EOS: keep every run NEW tokens long
    return m


def prompts(lengths=(200, 131)):
    return [torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def reference(model, config, rows):
    """``apply`` + ``model.generate``, one prompt at a time (so no padding is involved)."""
    out = []
    for row in rows:
        ids = torch.tensor([row])
        with sparsekv.apply(model, config), torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
        out.append(seq[0, len(row):].tolist())
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_equals_generate_chunked_batched_and_captured(model, name):
    config = CONFIGS[name]
    rows = prompts()
    expected = reference(model, config, rows)
    engine = Engine(model, config, max_batch=2, max_context=512, prefill_chunk=64)
    eager = engine.generate(rows, NEW, stop_tokens=())
    assert eager.tokens == expected
    assert not eager.captured and eager.decode_steps == NEW - 1
    engine.capture = emulated_graph
    replayed = engine.generate(rows, NEW, stop_tokens=())
    assert replayed.captured
    assert replayed.tokens == expected
    assert replayed.stats == eager.stats
    assert replayed.kv_device_bytes == eager.kv_device_bytes and replayed.kv_host_bytes == eager.kv_host_bytes
    if name == "omnikv-offload":
        # Measured while generating, released after: a kept result holds no host store.
        assert eager.kv_host_bytes > 0 and eager.method.offloaded_bytes() == 0


@pytest.mark.parametrize("name", ["quest", "raas", "omnikv", "h2o", "snapkv"])
def test_budget_covering_the_context_is_dense(model, name):
    rows = prompts((90,))
    dense = Engine(model, DenseConfig(), max_context=256).generate(rows, NEW, stop_tokens=())
    big = {"quest": QuestConfig(token_budget=128, dense_layers=0), "raas": RaaSConfig(token_budget=128),
           "omnikv": OmniKVConfig(token_budget=128, window=4), "h2o": H2OConfig(token_budget=128),
           "snapkv": SnapKVConfig(token_budget=128, window=8)}[name]
    out = Engine(model, big, max_context=256, prefill_chunk=32).generate(rows, NEW, stop_tokens=())
    assert out.tokens == dense.tokens
    assert out.stats["fraction"] == 1.0


@pytest.mark.parametrize("plan_step", [1, 8])
def test_chunked_prefill_gives_the_one_pass_logits(model, plan_step, monkeypatch):
    # plan step 8 (cuDNN's is 2048): the passes' earlier keys are cut at multiples of 8, their rest attended with the
    # pass's own keys in squares padded with zeros (the prompt of 150 tokens in chunks of 32 starts its passes at 22,
    # 54, ...).
    monkeypatch.setattr(transformers_integration, "_plan_step", lambda q: plan_step)
    ids = torch.randint(3, 259, (2, 150), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        dense = model(ids, attention_mask=mask).logits[:, -1]
    engine = Engine(model, QuestConfig(token_budget=16, dense_layers=0), max_batch=2, prefill_chunk=32)
    with sparsekv.apply(model, engine.config) as session, torch.no_grad():
        logits = engine._prefill(session.new_cache(None), ids, mask)
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("page_size", [2, 4])
def test_prompt_plans_are_the_shapes_prompt_attention_runs(page_size, monkeypatch):
    """Every pass of 1 to 10 tokens from every position of a 40-token prompt written into shared pages that lie in
    two runs (read where they lie, or gathered), cut at multiples of 8: the shapes of the ``attention_lse`` calls are
    exactly ``prompt_plans(10, 40, 8)``, their tensors contiguous (cuDNN keys its plans by strides too), and those
    ``build_prompt_plans`` runs ahead; it runs nothing where cuDNN does not attend."""
    from sparsekv.cache import PagedLayer, SharedPages

    monkeypatch.setattr(transformers_integration, "_plan_step", lambda q: 8)
    seen = set()
    attention_lse = transformers_integration.attention_lse

    def recorded(q, k, v, causal, scale):
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        seen.add((q.shape[2], k.shape[2], causal))
        return attention_lse(q, k, v, causal, scale)

    monkeypatch.setattr(transformers_integration, "attention_lse", recorded)
    gen, cpu, pages = torch.Generator().manual_seed(0), torch.device("cpu"), 40 // page_size
    for prev in range(40):
        for n in range(1, min(10, 40 - prev) + 1):
            shared = SharedPages(rows=2, slots=pages, pages=pages + 3, device=cpu)
            shared.assign(0, 2)
            shared.assign(1, 1)
            shared.release(0)  # the free list: row 0's 2 pages, then the rest
            table = shared.beside(1)
            table.assign(0, pages)
            cache = PagedKVCache(num_layers=1, page_size=page_size)
            cache.layers = [PagedLayer(2, 1, 4, page_size, pages, torch.float32, cpu, shared).beside(table)]
            for s in (prev, n):
                if s:
                    cache.begin(s, None, 1, cpu, prompt_end=s == n)
                    cache.append(0, *(torch.randn(1, 1, s, 4, generator=gen) for _ in range(2)))
            transformers_integration.prompt_attention(torch.randn(1, 2, n, 4, generator=gen), cache.layers[0],
                                                      cache.plan, 0.5)
    assert seen == set(transformers_integration.prompt_plans(10, 40, 8))
    seen.clear()  # built ahead: the same shapes, contiguous views of two buffers
    assert transformers_integration.build_prompt_plans(2, 1, 4, torch.float32, cpu, 0.5, 10, 40) == len(
        transformers_integration.prompt_plans(10, 40, 8))
    assert seen == set(transformers_integration.prompt_plans(10, 40, 8))
    monkeypatch.undo()
    assert transformers_integration.build_prompt_plans(2, 1, 4, torch.float32, cpu, 0.5, 10, 40) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads,queries,keys", [(4, 2, 7, 13), (3, 1, 1, 5), (6, 6, 9, 9)])
def test_attention_lse_matches_float64_softmax(causal, heads, kv_heads, queries, keys):
    keys = queries if causal else keys
    gen = torch.Generator().manual_seed(heads * keys)
    q = torch.randn(1, heads, queries, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, kv_heads, keys, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    logits = q @ k.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * 0.3
    if causal:
        logits = logits.masked_fill(torch.ones(queries, keys, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = transformers_integration.attention_lse(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, logits.softmax(-1) @ v.repeat_interleave(heads // kv_heads, 1))
    torch.testing.assert_close(lse, logits.logsumexp(-1))  # float64 queries: a float64 log-sum-exp


def test_causal_attention_lse_refuses_more_keys_than_queries():
    q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="as many keys as queries"):
        transformers_integration.attention_lse(q, k, k, True, 1.0)


def test_sampling_is_seeded_and_respects_top_k(model):
    engine = Engine(model, QuestConfig(token_budget=32, dense_layers=0))
    rows = prompts((60,))
    sampling = Sampling(temperature=1.5, top_k=1)  # top_k 1 leaves one token: greedy whatever the draw
    assert engine.generate(rows, 12, sampling=sampling, stop_tokens=()).tokens == \
        engine.generate(rows, 12, stop_tokens=()).tokens
    hot = Sampling(temperature=2.0, top_p=0.9)
    a = engine.generate(rows, 12, sampling=hot, seed=4, stop_tokens=()).tokens
    assert a == engine.generate(rows, 12, sampling=hot, seed=4, stop_tokens=()).tokens
    assert a != engine.generate(rows, 12, sampling=hot, seed=5, stop_tokens=()).tokens


class OpenAIPenalties:
    """The reference of OpenAI's presence and frequency penalties and logit bias, as a logits processor of
    ``model.generate``: counts the tokens after the prompt's ``start`` columns."""

    def __init__(self, start: int, sampling: Sampling):
        self.start, self.sampling = start, sampling

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores, dtype=torch.float64)
        counts.scatter_add_(1, input_ids[:, self.start:], torch.ones_like(input_ids[:, self.start:],
                                                                           dtype=torch.float64))
        adjusted = scores.double() - self.sampling.presence_penalty * (counts > 0) \
            - self.sampling.frequency_penalty * counts
        for token, bias in self.sampling.logit_bias:
            adjusted[:, token] += bias
        return adjusted.to(scores.dtype)


PENALIZED = {
    "frequency": Sampling(frequency_penalty=1.5),
    "presence and bias": Sampling(presence_penalty=2.0, frequency_penalty=-0.5,
                                  logit_bias={7: 3.0, 100: -100.0, 12: 0.25}),
    "repetition": Sampling(repetition_penalty=1.6),
    "repetition and presence": Sampling(repetition_penalty=0.7, presence_penalty=1.0, logit_bias={9: 1.0}),
}


# Every rule with dense; the sparse methods, whose steps draw through the same sampling, with two of them.
@pytest.mark.parametrize("name, penalties", [*(("dense", p) for p in PENALIZED), ("quest", "presence and bias"),
                                             ("raas", "repetition and presence")])
def test_penalties_and_logit_bias_equal_generates_with_openais_rule(model, name, penalties):
    """Greedy with OpenAI's penalties and bias: the tokens of ``model.generate`` with a logits processor that
    adjusts the logits from the tokens drawn so far (after transformers' own repetition penalty, which counts the
    prompt's tokens too), eager and captured, in a batch of two prompts."""
    from transformers import LogitsProcessorList

    config, sampling = CONFIGS[name], PENALIZED[penalties]
    rows = prompts()
    expected = []
    for row in rows:
        ids = torch.tensor([row])
        with sparsekv.apply(model, config), torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, repetition_penalty=sampling.repetition_penalty,
                                 logits_processor=LogitsProcessorList([OpenAIPenalties(len(row), sampling)]))
        expected.append(seq[0, len(row):].tolist())
    plain = Engine(model, config, max_batch=2, max_context=512, prefill_chunk=64).generate(rows, NEW, stop_tokens=())
    assert plain.tokens != expected  # the penalties change the answer
    engine = Engine(model, config, max_batch=2, max_context=512, prefill_chunk=64)
    assert engine.generate(rows, NEW, sampling=sampling, stop_tokens=()).tokens == expected
    engine.capture = emulated_graph
    replayed = engine.generate(rows, NEW, sampling=sampling, stop_tokens=())
    assert replayed.captured and replayed.tokens == expected


def test_a_logit_bias_of_100_forces_its_token_and_of_minus_100_bans_it(model):
    engine = Engine(model, DenseConfig(), max_batch=2)
    rows = prompts((40, 25))
    forced = engine.generate(rows, 6, sampling=Sampling(logit_bias={9: 100}), stop_tokens=()).tokens
    assert forced == [[9] * 6, [9] * 6]
    greedy = engine.generate(rows, 6, stop_tokens=()).tokens
    banned = {t for row in greedy for t in row}
    hot = Sampling(temperature=1.0, logit_bias={t: -100 for t in banned})
    out = engine.generate(rows, 6, sampling=hot, seed=0, stop_tokens=()).tokens
    assert not banned & {t for row in out for t in row}


@pytest.mark.parametrize("kwargs, match", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [(3, 1, 2)]}, "logit_bias"), ({"logit_bias": {"7": 1}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    # per-row tensors hold them: an int64, a float32 the logits are divided by
    ({"top_k": 2**63}, r"top_k must be an int from 0 \(no cut\) to 2\*\*63 - 1"),
    ({"repetition_penalty": 1e300}, "repetition_penalty must be a number from 0.01 to 100"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty must be a number from 0.01 to 100")])
def test_bad_penalties_and_biases_are_refused(kwargs, match):
    with pytest.raises(sparsekv.errors.ConfigError, match=match):
        Sampling(**kwargs)


def test_a_logit_bias_outside_the_vocabulary_is_refused(model):
    engine = Engine(model, DenseConfig())
    vocab = model.config.vocab_size
    with pytest.raises(sparsekv.errors.ConfigError, match=f"logit_bias.*{vocab}"):
        engine.generate(prompts((20,)), 2, sampling=Sampling(logit_bias={vocab: 1.0}))


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {int(Sampling(temperature=1.0, top_p=0.8)(logits)) for _ in range(200)}
    assert drawn == {0, 1}
    # a top_p that float32 holds as 0 keeps the likeliest token (not, every token masked, token 0)
    likeliest = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]))
    assert {int(Sampling(temperature=1.0, top_p=1e-46)(likeliest)) for _ in range(20)} == {1}


@pytest.mark.parametrize("min_p, kept", [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.4, {0, 1}), (1.0, {0})])
def test_min_p_keeps_the_tokens_at_least_that_share_of_the_likeliest(min_p, kept):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])) * 2  # temperature 2 gives back these probabilities
    drawn = {int(Sampling(temperature=2.0, min_p=min_p)(logits)) for _ in range(300)}
    assert drawn == kept


@pytest.mark.parametrize("vocab", [7, 20, 1024, 1025, 5000, 128256])
def test_token_logprobs_are_the_log_softmax(vocab):
    """Against the log-softmax in float64 (a float32 sum over up to 128K terms), tokens ruled out included."""
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(4, vocab, generator=gen) * 4).to(torch.bfloat16)
    x[1, : vocab // 2] = float("-inf")  # tokens the model rules out
    token = torch.randint(0, vocab // 2 + 1, (4,), generator=gen)
    token[1] = vocab - 1
    ref = x.double().log_softmax(dim=-1)
    chosen, values, ids = engine_module.token_logprobs(x, token, 20)
    assert values.shape == ids.shape == (4, min(20, vocab)) and chosen.dtype == values.dtype == torch.float32
    torch.testing.assert_close(chosen.double(), ref.gather(1, token.view(-1, 1)).squeeze(1), rtol=0, atol=1e-4)
    expected = ref.topk(min(20, vocab), dim=-1)
    torch.testing.assert_close(values.double(), expected.values, rtol=0, atol=1e-4)
    assert torch.equal(ref.gather(1, ids), expected.values)  # the same tokens (up to the order of equal ones)
    assert (ids < vocab).all()


@pytest.mark.parametrize("vocab", [7, 1024, 1025, 5000, 128256])
def test_two_pass_argmax_is_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (5, vocab), generator=gen).to(torch.bfloat16)  # many ties: the first maximum wins
    x[1] = float("-inf")
    x[2, vocab // 2] = float("nan")  # a NaN is the maximum, as in argmax
    x[3, -1] = 9
    assert torch.equal(engine_module.argmax(x), x.argmax(dim=-1))
    assert torch.equal(engine_module.argmax(x.float(), width=16), x.float().argmax(dim=-1))


def test_stop_tokens_end_each_sequence_and_streaming_sees_every_token(model):
    engine = Engine(model, DenseConfig(), max_batch=2, check_every=4)
    rows = prompts((40, 50))
    free = engine.generate(rows, 16, stop_tokens=()).tokens
    stop = free[0][5]
    seen = [[], []]
    out = engine.generate(rows, 16, stop_tokens=[stop],
                          stream=lambda new: [s.extend(n) for s, n in zip(seen, new)])
    assert out.tokens[0] == free[0][:free[0].index(stop) + 1]
    for row, got in zip(out.tokens, seen):
        assert got[:len(row)] == row


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch=0), "max_batch must be an int >= 1"),
    (dict(max_context=10**6), "max_context must be at most the model's max_position_embeddings"),
    (dict(prefill_chunk=4), "prefill_chunk must be at least 8 for snapkv"),
    (dict(cuda_graph=True), "a CUDA graph needs the model on a CUDA device"),
])
def test_bad_engine_arguments_are_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, SnapKVConfig(token_budget=64, window=8), **kwargs)


def test_capacity_is_checked_before_running(model):
    engine = Engine(model, DenseConfig(), max_batch=1, max_context=100)
    with pytest.raises(ValueError, match=r"exceeds max_context \(100\)"):
        engine.generate(prompts((90,)), 20)
    with pytest.raises(ValueError, match=r"2 prompts exceed max_batch \(1\)"):
        engine.generate(prompts((10, 10)), 5)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.generate(prompts((10,)), 0)
    with pytest.raises(ValueError, match="prompts are strings but the engine has no tokenizer"):
        engine.generate(["hello"], 5)
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number >= 0.0001"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        Sampling(top_p=2)


def test_graph_capture_shares_a_pool_while_a_graph_lives_and_starts_another_after(monkeypatch):
    """The graphs of ``GraphCapture`` share the first one's memory pool while any of them lives; once none does
    (PyTorch then frees the pool: capturing into it fails, as an engine's next ``generate`` did on the H200), the
    next capture starts a pool of its own. CUDA graphs stood in for by fakes that record the pool they capture
    into."""
    import gc

    pools = iter(range(100))
    captured_into = []

    class FakeGraph:
        def __init__(self):
            self.own = next(pools)

        def pool(self):
            return self.own

        def replay(self):
            return None

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        captured_into.append(pool)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    capture = engine_module.GraphCapture()
    first = capture(lambda: None)
    second = capture(lambda: None)
    assert captured_into == [None, 0]  # the second graph into the first's pool
    del first, second
    gc.collect()
    third = capture(lambda: None)
    assert captured_into == [None, 0, None] and capture.pool == 2  # no graph lived: a new pool
    capture(lambda: None)
    assert captured_into[-1] == 2 and third is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", CONFIGS)
def test_cuda_graph_replays_the_eager_tokens(name, kv_dtype):
    """On the GPU (bf16 model, a bf16 or fp8 cache): the captured decode step gives the eager engine's tokens,
    batched and chunked, greedy and with penalties and biases."""
    model = tiny_model("llama", seed=1, dtype=torch.bfloat16).cuda()
    model.generation_config.eos_token_id = None
    rows = prompts((300, 211))
    config = dataclasses.replace(CONFIGS[name], kv_dtype=kv_dtype)
    engine = Engine(model, config, max_batch=2, max_context=512, prefill_chunk=64, cuda_graph=False)
    penalized = PENALIZED["presence and bias"]
    eager = [engine.generate(rows, 40, stop_tokens=(), sampling=s) for s in (None, penalized)]
    assert isinstance(Engine(model, config).capture, engine_module.GraphCapture)  # the default on CUDA
    engine.capture = engine_module.GraphCapture()
    captured = [engine.generate(rows, 40, stop_tokens=(), sampling=s) for s in (None, penalized)]
    for want, got in zip(eager, captured):
        assert got.captured and got.tokens == want.tokens
        assert got.stats == pytest.approx(want.stats)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 1)])
def test_lowbit_on_the_cuda_kernel_replays_the_eager_tokens(heads, kv_heads):
    """lowbit on a model whose shapes the CUDA page-score kernel takes (head dim 64, pages of 16; two pages a
    product, and one): the captured step gives the eager tokens."""
    from sparsekv.kernels.cuda import coded as cuda_coded

    model = tiny_model("llama", seed=1, dtype=torch.bfloat16, heads=heads, kv_heads=kv_heads, head_dim=64).cuda()
    model.generation_config.eos_token_id = None
    rows = prompts((300, 211))
    config = LowBitConfig(token_budget=256, page_size=16, dense_layers=1)
    engine = Engine(model, config, max_batch=2, max_context=512, prefill_chunk=64, cuda_graph=False)
    calls = []
    with kernels.observe(lambda name, args, _: calls.append(cuda_coded.supported(
            args["q"], args["kmin"], args["codes"], args["bits"])) if name == "lowbit_select" else None):
        eager = engine.generate(rows, 40, stop_tokens=())
    assert calls and all(calls)
    engine.capture = engine_module.GraphCapture()
    captured = engine.generate(rows, 40, stop_tokens=())
    assert captured.captured and captured.tokens == eager.tokens
    assert captured.stats == pytest.approx(eager.stats)


@pytest.mark.parametrize("name", ["quest", "raas", "h2o", "omnikv", "lowbit"])
def test_forced_tokens_go_through_the_decode_path(model, name):
    """Forced tokens are fed one per decode step after the prompt (the question of a pass-key sample), as a plain
    loop of ``model`` calls inside ``apply`` does; the new tokens follow them, also captured."""
    config = CONFIGS[name]
    prompt, question = prompts((150,))[0], [5, 77, 31, 200, 9]
    expected = []
    with sparsekv.apply(model, config), torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for tok in question:
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        for _ in range(8):
            expected.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[expected[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    engine = Engine(model, config, max_context=512, prefill_chunk=64)
    assert engine.generate([prompt], 8, forced=[question], stop_tokens=()).tokens == [expected]
    engine.capture = emulated_graph
    assert engine.generate([prompt], 8, forced=[question], stop_tokens=()).tokens == [expected]


def test_forced_nll_is_the_dense_log_likelihood(model):
    rows, texts = prompts((60, 45)), [[7, 8, 9, 10], [11, 12]]
    out = Engine(model, DenseConfig(), max_batch=2, max_context=128).generate(rows, 1, forced=texts, stop_tokens=())
    for row, text, nll in zip(rows, texts, out.forced_nll):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([row + text])).logits[0].double(), -1)
        want = -sum(float(logp[len(row) - 1 + i, t]) for i, t in enumerate(text))
        assert nll == pytest.approx(want, rel=1e-4)


def test_raas_allocates_its_budget_not_the_whole_decode(model):
    """A long decode after a short prompt: RaaS's cache is planned at its row limit, so the KV it allocates stays
    at the budget (plus the prompt's pages it keeps) while dense's grows with every token."""
    rows = prompts((40,))
    raas = Engine(model, RaaSConfig(token_budget=64, page_size=8), max_context=512).generate(rows, 300,
                                                                                             stop_tokens=())
    dense = Engine(model, DenseConfig(page_size=8), max_context=512).generate(rows, 300, stop_tokens=())
    # 64 of the 340 tokens (8 of 43 pages), a page of room and the pages' stamps: under a quarter of dense's.
    assert raas.kv_device_bytes < dense.kv_device_bytes // 4
    assert raas.kv_held_bytes < dense.kv_held_bytes // 4


def test_streaming_ends_with_each_row_and_steps_count_up_to_the_last_end(model):
    engine = Engine(model, DenseConfig(), max_batch=2, check_every=16)
    rows = prompts((40, 50))
    free = engine.generate(rows, 16, stop_tokens=()).tokens
    stops = [free[0][3], free[1][6]]
    ends = [min(r.index(s) for s in stops if s in r) for r in free]  # each row's last token's place
    seen = [[], []]
    streamed = engine.generate(rows, 16, stop_tokens=stops, stream=lambda new: [s.extend(n) for s, n in zip(seen, new)])
    quiet = engine.generate(rows, 16, stop_tokens=stops)
    assert seen == streamed.tokens == quiet.tokens == [r[:e + 1] for r, e in zip(free, ends)]
    assert streamed.decode_steps == quiet.decode_steps == max(ends)
    assert streamed.stats == quiet.stats and streamed.stats["decode_steps"] == max(ends)


@pytest.mark.parametrize("name", ["dense", "quest", "h2o"])
def test_statistics_count_each_row_up_to_its_end(model, name):
    """A row that ends before the others counts its own steps only: the batch's means are those of the rows run
    alone, weighted by their steps."""
    config = CONFIGS[name]
    engine = Engine(model, config, max_batch=2, max_context=512, check_every=32)
    rows = prompts((200, 131))
    free = engine.generate(rows, 20, stop_tokens=()).tokens
    stop = free[0][4]
    assert stop not in free[1][:19]
    both = engine.generate(rows, 20, stop_tokens=[stop])
    alone = [engine.generate([row], 20, stop_tokens=[stop]) for row in rows]
    steps = [a.decode_steps for a in alone]
    assert steps == [free[0].index(stop), 19] and both.decode_steps == 19
    for key in ("attended_per_head", "context_per_head"):
        mean = sum(a.stats[key] * n for a, n in zip(alone, steps)) / sum(steps)
        assert both.stats[key] == pytest.approx(mean, rel=1e-9)


def test_tiny_temperatures_are_refused_and_the_seed_leaves_the_global_rng_alone(model):
    with pytest.raises(ValueError, match="temperature must be 0"):
        Sampling(temperature=1e-45)
    engine = Engine(model, DenseConfig())
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(prompts((30,)), 4, sampling=Sampling(temperature=0.7), seed=9, stop_tokens=())
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("bad", [[[1, 2, 3.5]], [b"abc"], [[1, 300]], [[-1, 4]], [[True, 4]], [1, 2, 3],
                                 b"abc", [[5], "text"]])
def test_prompts_must_be_token_ids_of_the_vocabulary(model, bad):
    engine = Engine(model, DenseConfig())
    with pytest.raises(ValueError, match=r"prompts(\[\d\])? must be"):
        engine.generate(bad, 2)


def test_text_stream_gives_the_texts(model):
    from sparsekv.engine import TextStream
    from sparsekv.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    engine = Engine(model, DenseConfig(), max_batch=2, tokenizer=tokenizer)
    pieces = [[], []]
    out = engine.generate(["héllo wörld ✓", "abc"], 24, stop_tokens=(),
                          stream=TextStream(tokenizer, lambda new: [p.append(t) for p, t in zip(pieces, new)]))
    assert ["".join(p) for p in pieces] == out.texts


def test_seeded_draws_follow_the_probabilities_over_seeds_and_places():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(4000, 4)
    n = torch.arange(4000)
    for seeds, places in ((n, torch.zeros_like(n)), (torch.full_like(n, 7), n)):
        drawn = Sampling(temperature=1.0)(logits, seeds, places)
        assert torch.allclose(torch.bincount(drawn, minlength=4) / 4000, probs, atol=0.03)
    again = Sampling(temperature=1.0)(logits, n, torch.zeros_like(n))
    assert torch.equal(again, Sampling(temperature=1.0)(logits, n, torch.zeros_like(n)))


@pytest.mark.parametrize("stops", [[99999], [-1], ["a"]])
def test_stop_tokens_must_be_token_ids_of_the_vocabulary(model, stops):
    with pytest.raises(sparsekv.errors.ConfigError, match="stop_tokens"):
        Engine(model, DenseConfig()).generate(prompts((20,)), 2, stop_tokens=stops)


@pytest.mark.parametrize("kwargs, match", [
    ({"sampling": {"temperature": 0.7}}, r"sampling must be None \(greedy\) or a sparsekv.engine.Sampling \(from a "
                                         r"dict of its fields: Sampling\(\*\*fields\)\), got \{'temperature': 0.7\}"),
    ({"sampling": {}}, "sampling must be None"),  # not taken as greedy
    ({"stop_tokens": 5}, r"stop_tokens must be None \(the model's EOS\) or a list, tuple or set of token ids "
                         r".*, got 5"),
    ({"forced": [5, 6]}, r"forced must be None or a list of one list of token ids per prompt \(1 prompt"),
    ({"forced": [5]}, r"forced\[0\] must be a list or tuple of token ids \(ints from 0 to \d+, the vocabulary\), "
                      r"got 5"),
    ({"forced": 5}, "forced must be None or a list of one list of token ids per prompt"),
    ({"stream": 5}, "stream must be None or a callable"),
    ({"prefill": "yes"}, "prefill must be None or a callable"),
    ({"time_steps": "yes"}, "time_steps must be True or False"),
    ({"seed": 1 << 62}, r"seed must be None or an int in \[0, 2\*\*62\)"),
])
def test_arguments_of_the_wrong_form_are_refused_naming_them(model, kwargs, match):
    """Each argument of ``generate`` says what it takes, before anything runs."""
    with pytest.raises(sparsekv.errors.ConfigError, match=match):
        Engine(model, DenseConfig()).generate(prompts((20,)), 2, **kwargs)


class _Id(enum.IntEnum):
    THREE = 3


@pytest.mark.parametrize("ids, vocab, want", [
    ([], None, True), ([1, 2], None, True), ((1, 4), 5, True), ([1, 5], 5, False), ([-1, 2], None, False),
    ([True, 2], None, False), ([1, 2.0], None, False), ([_Id.THREE], None, True), ([_Id.THREE], 3, False),
    ([_Id.THREE, False], None, False),
])
def test_token_ids_are_ints_not_bools_in_range(ids, vocab, want):
    """Plain ints go through builtins' checks, anything else item by item; both answer alike."""
    assert engine_module.is_token_ids(ids, vocab) is want
