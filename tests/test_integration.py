"""sparsekv.apply on tiny random models of every supported architecture.

Runs on the CPU; set SPARSEKV_TEST_DEVICE=cuda to run the same checks on a GPU."""

import os

import pytest
import torch

import sparsekv
from sparsekv import DecodeStats, DenseConfig, QuestConfig
from sparsekv.tiny import ARCHITECTURES, tiny_config, tiny_model

PROMPT_LEN, NEW = 90, 24
DEVICE = torch.device(os.environ.get("SPARSEKV_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    m = tiny_model(request.param, seed=1).to(DEVICE)
    m.generation_config.eos_token_id = None  # random weights may emit EOS; keep every run NEW tokens long
    return m


def prompt(n=PROMPT_LEN, seed=0, batch=1):
    return torch.randint(3, 259, (batch, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def greedy(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)


def test_budget_covering_context_is_dense(model):
    ids = prompt()
    dense = greedy(model, ids)
    for config in (QuestConfig(token_budget=128, page_size=16), QuestConfig(token_budget=120, page_size=8,
                                                                           per_query_head=True), DenseConfig()):
        with sparsekv.apply(model, config) as session:
            out = greedy(model, ids)
        assert torch.equal(out.sequences, dense.sequences)
        for a, b in zip(out.logits, dense.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert session.stats.summary()["fraction"] == 1.0


def test_prefill_logits_are_dense_for_any_budget(model):
    ids = prompt()
    with torch.no_grad():
        dense = model(ids).logits
        with sparsekv.apply(model, QuestConfig(token_budget=16, page_size=16, dense_layers=0)):
            sparse = model(ids).logits
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_small_budget_changes_what_is_attended(model):
    ids = prompt()
    dense = greedy(model, ids)
    with sparsekv.apply(model, QuestConfig(token_budget=32, page_size=8, dense_layers=1)) as session:
        out = greedy(model, ids)
    stats = session.stats.summary()
    layers = model.config.num_hidden_layers
    # One dense layer reads the whole context; the others read three full pages plus the current, partial one.
    lengths = range(PROMPT_LEN + 1, PROMPT_LEN + 1 + stats["decode_steps"])
    sparse = sum(24 + (n - 1) % 8 + 1 for n in lengths) / len(lengths)
    expect = (stats["context_per_head"] + (layers - 1) * sparse) / layers
    assert stats["attended_per_head"] == pytest.approx(expect)
    assert stats["fraction"] < 0.6
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(out.logits, dense.logits))


def test_batch_with_padding_equals_each_prompt_alone(model):
    lengths = [70, 41, 90]
    prompts = [prompt(n, seed=i)[0] for i, n in enumerate(lengths)]
    config = QuestConfig(token_budget=32, page_size=8, dense_layers=1)
    alone = []
    with sparsekv.apply(model, config):
        for p in prompts:
            alone.append(greedy(model, p[None]).sequences[0, len(p):])
        width = max(lengths)
        ids = torch.zeros(3, width, dtype=torch.long, device=DEVICE)
        mask = torch.zeros(3, width, dtype=torch.long, device=DEVICE)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            batch = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for i in range(3):
        assert torch.equal(batch[i, width:], alone[i])


def test_sampling_runs_the_method(model):
    ids = prompt()
    torch.manual_seed(5)
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    with sparsekv.apply(model, QuestConfig(token_budget=1024)) as session:
        torch.manual_seed(5)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    assert torch.equal(out, dense)
    assert session.stats.steps == 7


def test_leaving_apply_restores_dense_exactly(model):
    ids = prompt()
    decoder = model.get_decoder()
    before_impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(RuntimeError, match="boom"):
        with sparsekv.apply(model, QuestConfig(token_budget=16, dense_layers=0)):
            greedy(model, ids)
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before_impl
    assert not decoder._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_dense_cache_from_outside_is_refused(model):
    ids = prompt(20)
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        with sparsekv.apply(model, DenseConfig()):
            with pytest.raises(ValueError, match="already holds tokens from another cache"):
                model(ids[:, :1], past_key_values=past)


def test_chunk_after_prompt_is_attended_densely():
    model = tiny_model("llama", seed=2).to(DEVICE)
    ids = prompt(60)
    with torch.no_grad():
        dense = model(ids).logits[:, 40:]
        with sparsekv.apply(model, QuestConfig(token_budget=16, dense_layers=0)):
            out = model(ids[:, :40], use_cache=True)
            chunk = model(ids[:, 40:], past_key_values=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(chunk, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_budget=0), "token_budget"),
    (dict(token_budget=100, page_size=16), "token_budget"),
    (dict(token_budget=8, page_size=16), "token_budget"),
    (dict(page_size=24), "page_size"),
    (dict(dense_layers=-1), "dense_layers"),
])
def test_bad_quest_configs(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuestConfig(**kwargs)


def test_dense_layers_beyond_model_is_refused():
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="dense_layers must be at most the model's 2 layers"):
        with sparsekv.apply(model, QuestConfig(dense_layers=3)):
            pass


def test_unsupported_model_is_refused():
    """By ``apply``, and by an ``Engine`` when it is made, before any generation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        with sparsekv.apply(model, QuestConfig()):
            pass
    from sparsekv.engine import Engine

    with pytest.raises(ValueError, match="model GPT2LMHeadModel is not supported"):
        Engine(model, QuestConfig())


def test_sliding_window_beyond_window_is_refused():
    from transformers import AutoModelForCausalLM

    config = tiny_config("mistral", layers=1)
    config.sliding_window = 32
    model = AutoModelForCausalLM.from_config(config).eval().to(DEVICE)
    with sparsekv.apply(model, DenseConfig()), torch.no_grad():
        model(prompt(32))  # within the window, sliding and full attention agree
        with pytest.raises(ValueError, match="exceeds the model's sliding window"):
            model(prompt(33))


def test_generate_without_a_cache_is_refused():
    """use_cache=False would prefill the whole sequence densely at every step and decode nothing sparsely."""
    model = tiny_model("llama", layers=2)
    with sparsekv.apply(model, QuestConfig(token_budget=16, dense_layers=0)) as session, torch.no_grad():
        with pytest.raises(ValueError, match="use_cache=False: sparsekv runs every pass through its cache"):
            model.generate(prompt(40).cpu(), max_new_tokens=3, do_sample=False, pad_token_id=0, use_cache=False)
        assert session.stats.steps == 0


def test_nested_apply_is_refused_at_entry():
    model = tiny_model("llama", layers=2)
    with sparsekv.apply(model, QuestConfig(token_budget=16, dense_layers=0)):
        with pytest.raises(ValueError, match="sparsekv.apply is already active on this model"):
            with sparsekv.apply(model, DenseConfig()):
                pass
        model(prompt(20).cpu())  # the outer block still runs
    assert model.config._attn_implementation != "sparsekv"


def test_config_must_be_a_method_config():
    with pytest.raises(TypeError, match="config must be a sparsekv method config"):
        with sparsekv.apply(tiny_model("llama", layers=1), {"token_budget": 64}):
            pass


def test_bfloat16_model_decodes_close_to_dense():
    model = tiny_model("qwen3", seed=3, dtype=torch.bfloat16).to(DEVICE)
    model.generation_config.eos_token_id = None
    ids = prompt(70)
    dense = greedy(model, ids)
    with sparsekv.apply(model, QuestConfig(token_budget=128)):
        out = greedy(model, ids)
    # Our decode attention accumulates in float32 where the dense bf16 path does not: close, not bitwise, so
    # greedy paths may part after a near tie. Compare the logits while the tokens agree.
    agree = 0
    while agree < NEW and torch.equal(out.sequences[:, 70 + agree], dense.sequences[:, 70 + agree]):
        agree += 1
    assert agree >= 4
    for a, b in zip(out.logits[:agree], dense.logits[:agree]):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.1)


def test_beam_search_reorders_the_paged_cache():
    model = tiny_model("llama", seed=1).to(DEVICE)
    model.generation_config.eos_token_id = None
    ids = prompt(40, batch=2)
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dense = model.generate(ids, **kwargs)
        with sparsekv.apply(model, QuestConfig(token_budget=1024)):
            assert torch.equal(model.generate(ids, **kwargs), dense)


@pytest.mark.parametrize("name", sorted(sparsekv.METHODS))
def test_finished_cache_is_freed_without_the_garbage_collector(name):
    import gc
    import weakref

    model = tiny_model("llama", layers=3)
    config = sparsekv.build_config(name, None if name == "dense" else 32)
    gc.collect()
    gc.disable()  # reference cycles would keep the cache (and its device memory) alive until a collection
    try:
        with sparsekv.apply(model, config) as session, torch.no_grad():
            model.generate(prompt(64).cpu(), max_new_tokens=3, do_sample=False, pad_token_id=0)
        cache = weakref.ref(session.cache)
        del session
        assert cache() is None
    finally:
        gc.enable()


def test_decode_stats_fold_the_sums_of_an_earlier_batch_size():
    """A batch-size change (a finished row dropped, a new batch) folds the totals so far instead of losing them."""
    stats = DecodeStats()
    for lengths in ([10, 20], [11, 21], [5]):
        seq_len = torch.tensor(lengths)
        for layer in range(2):  # layer 0 attends the whole context, layer 1 counts 3 tokens per row
            tally = stats.tally(layer, seq_len, 2, 2)
            if layer == 1:
                tally.rows(2).add_(3)
            stats.counted(layer, tally, 2)
    assert float(stats.context) == 67 * 2 * 2
    assert {layer: float(t) for layer, t in stats.per_layer.items()} == {0: 67 * 2, 1: 3 * 2 * 5}
    assert stats.summary() == {"decode_steps": 3, "attended_per_head": (134 + 30) / 20, "context_per_head": 268 / 20,
                               "fraction": pytest.approx(164 / 268, rel=1e-12)}


def test_a_context_past_the_models_positions_is_refused():
    """As the engine does: ``apply`` refuses to run a sequence past ``max_position_embeddings``."""
    small = tiny_model("llama", layers=2, max_positions=48)
    ids = torch.randint(3, 200, (1, 40))
    with sparsekv.apply(small, QuestConfig(token_budget=16, page_size=8, dense_layers=1)), torch.no_grad():
        small.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
        with pytest.raises(ValueError, match=r"max_position_embeddings \(48\)"):
            small.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, pad_token_id=0)


def test_check_context_names_the_sliding_window_and_the_option_to_change():
    from sparsekv.models import check_context

    model = tiny_model("mistral", layers=2)
    model.config.sliding_window = 64
    check_context(model, 64, "shorten it")
    with pytest.raises(ValueError, match=r"sliding window \(64.*shorten the prompt or --max-new-tokens"):
        check_context(model, 65, "shorten the prompt or --max-new-tokens")
