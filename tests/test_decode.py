"""The engine's decode step (``integrations.decode``): fused products over weights re-laid in place, the same tokens
as the modules' own forward for every architecture, and one compilation for every layer."""

import functools

import pytest
import torch
from torch import nn

import sparsekv
from sparsekv import DenseConfig, QuestConfig
from sparsekv.engine import Engine
from sparsekv.integrations.decode import DecodeModel, Parts, fuse
from sparsekv.tiny import ARCHITECTURES, tiny_model

NEW = 12


def generate(model, config, row):
    ids = torch.tensor([row])
    with sparsekv.apply(model, config), torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    return seq[0, len(row):].tolist()


def prompt(n=150):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("config", [DenseConfig(), QuestConfig(token_budget=48, page_size=8, dense_layers=1)],
                         ids=["dense", "quest"])
def test_engine_equals_generate_for_every_architecture(arch, config):
    model = tiny_model(arch, seed=2)
    model.generation_config.eos_token_id = None
    row = prompt()
    expected = generate(model, config, row)
    got = Engine(model, config, max_context=256, prefill_chunk=64).generate([row], NEW, stop_tokens=())
    assert got.tokens == [expected]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_weights_are_the_modules_weights(arch):
    model = tiny_model(arch, seed=3)
    ids = torch.tensor([prompt(40)])
    with torch.no_grad():
        before = model(ids).logits
    params = {name: p for name, p in model.named_parameters()}
    copies = {name: p.detach().clone() for name, p in params.items()}
    DecodeModel(model, Parts.make(False))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    again = DecodeModel(model, Parts.make(False))  # a second engine takes the laid-out weights as they are
    qkv, gate_up = again.products[1].qkv, again.products[1].gate_up
    assert again.products[1].o.weight.data_ptr() == attn.o_proj.weight.data_ptr()  # one block: the weight itself
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, p in model.named_parameters():
        assert torch.equal(p, copies[name]), name
    assert qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == qkv.weight[-attn.v_proj.out_features:].data_ptr()
    assert gate_up.weight.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert (qkv.bias is None) == (arch == "llama")
    if qkv.bias is not None:
        assert qkv.bias.data_ptr() == attn.q_proj.bias.data_ptr()
    x = torch.randn(2, 1, attn.q_proj.in_features)
    for got, module in zip(qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(got, module(x))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_weights_that_cannot_be_relaid_run_through_their_modules():
    plain, other = nn.Linear(8, 4), nn.Linear(6, 4)
    assert fuse((plain, other)) is None  # different inputs
    assert fuse((plain, nn.Linear(8, 4, bias=False))) is None
    assert fuse((plain, nn.Bilinear(8, 8, 4))) is None


def test_moved_weights_are_fused_again():
    model = tiny_model("llama", seed=4)
    first = DecodeModel(model, Parts.make(False)).products[0].qkv.weight
    model.to(torch.float64)
    second = DecodeModel(model, Parts.make(False)).products[0].qkv
    assert second.weight.dtype == torch.float64 and second.weight.data_ptr() != first.data_ptr()
    assert second.weight.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()


def test_compiled_decode_step_compiles_once_for_every_layer(monkeypatch):
    """Engine(compile=True) through torch.compile's eager backend (no C compiler needed): the same tokens, and one
    compilation per part of the step and of a prompt pass, whatever the number of layers and the prompt's length."""
    model = tiny_model("qwen3", seed=5, layers=6)
    model.generation_config.eos_token_id = None
    config = QuestConfig(token_budget=48, page_size=8, dense_layers=1)
    row = prompt()
    expected = generate(model, config, row)
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    engine = Engine(model, config, max_context=256, prefill_chunk=64, compile=True)
    got = engine.generate([row], NEW, stop_tokens=())
    assert got.tokens == [expected]
    frames = counts["stats"]["unique_graphs"]
    assert frames == 5, dict(counts["stats"])  # first, between, last; the prompt pass's inputs and output
    engine.generate([row[:37]], NEW, stop_tokens=())
    assert counts["stats"]["unique_graphs"] == frames
