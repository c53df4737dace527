"""Group-quantized weights: the op's Triton kernel against the float64 reference on awkward shapes (in Triton's CPU
interpreter without a GPU), int4 quantization, GGUF's Q4_0 / Q4_1 / Q8_0 blocks bit-exact against gguf's own
dequantization, a GGUF file written here run on its own blocks, and the engine on int4 weights against ``apply`` +
``model.generate`` of the same quantized model."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparsekv import DenseConfig, QuantLinear, QuestConfig, models
from sparsekv.engine import Engine
from sparsekv.errors import ConfigError
from sparsekv.integrations.decode import fuse
from sparsekv.kernels import reference as ref
from sparsekv.kernels.cuda import quant as cuda_int4
from sparsekv.quant import gguf_blocks, layer_linears, quantize_int4, quantize_model
from sparsekv.tiny import tiny_model
from test_engine import CONFIGS, NEW, prompts, reference

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")
F64 = torch.float64


def random_codes(n, k, bits, seed):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 32)
    codes = torch.randint(0, 256, (n, groups * 4 * bits), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=g) * 0.1 / k ** 0.5).half()
    minimum = (-torch.rand(n, groups, generator=g) * 0.1 * 2 ** bits / k ** 0.5).half()
    return codes.to(DEV), scale.to(DEV), minimum.to(DEV)


@pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and no interpreter")
@pytest.mark.parametrize("bits, rows, n, k, bias, dtype", [
    (4, 1, 5, 96, False, torch.bfloat16), (4, 3, 33, 1000, True, torch.float32),
    (4, 16, 7, 32 * 7, True, torch.bfloat16), (4, 9, 33, 1000, False, torch.bfloat16),
    (4, 5, 33, 1000, True, torch.float16),
    (8, 1, 33, 1000, True, torch.bfloat16),
    (8, 16, 5, 96, False, torch.float32), (8, 3, 7, 32 * 7, True, torch.bfloat16)])
@pytest.mark.parametrize("split", [1, 2])
def test_kernel_matches_float64_reference(bits, rows, n, k, bias, dtype, split, monkeypatch):
    from sparsekv.kernels import triton as tops

    monkeypatch.setitem(tops.TUNING, "cuda_int4_rows", 0)  # the Triton kernel, also where the CUDA one runs
    # Slices of 2 groups: an odd group count (3, 7) leaves a partial slice, k=1000 a partial group; blocks of 16
    # output rows leave a partial block for n=5, 33, 7.
    monkeypatch.setitem(tops.TUNING, "qmm_block_g", 2)
    monkeypatch.setitem(tops.TUNING, "qmm_block_n", 16)
    monkeypatch.setitem(tops.TUNING, "qmm_split", split)
    monkeypatch.setitem(tops.TUNING, "qmm_programs", 10**6)
    codes, scale, minimum = random_codes(n, k, bits, seed=n * k + rows)
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, k, generator=g, device=DEV).to(dtype)
    b = torch.randn(n, generator=g, device=DEV).to(dtype) if bias else None
    exact = ref.linear_quantized(x.to(F64), codes, scale, minimum, None if b is None else b.to(F64))
    out = tops.linear_quantized(x, codes, scale, minimum, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch_err = (ref.linear_quantized(x.float(), codes, scale, minimum, None if b is None else b.float())
                 .to(dtype).to(F64) - exact).norm() / exact.norm()
    assert ((out.to(F64) - exact).norm() / exact.norm()).item() <= 2 * torch_err.item() + 1e-6
    if split > 1:  # the counts are back to zero: a second launch (as a CUDA graph's replay) adds up the same
        assert torch.equal(tops.linear_quantized(x, codes, scale, minimum, b), out)


def test_split_k_fills_the_programs_it_is_tuned_for(monkeypatch):
    pytest.importorskip("triton")
    from sparsekv.kernels import triton as tops

    monkeypatch.setitem(tops.TUNING, "qmm_programs", 256)
    monkeypatch.setitem(tops.TUNING, "qmm_split", 4)
    # Llama-3-8B's q/k/v (96 blocks of 64 rows), gate/up (448), down (64 blocks, 448 groups): up to 4 ranges.
    assert [tops.quant.split_for(blocks, 128, 8) for blocks in (96, 448, 64, 3000)] == [4, 1, 4, 1]
    assert tops.quant.split_for(100, 128, 8) == 4 and tops.quant.split_for(200, 128, 8) == 2
    assert tops.quant.split_for(1, 10, 8) == 2  # no more ranges than slices


@pytest.mark.skipif(not ON_GPU, reason="tinygemm runs on CUDA only")
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_tinygemm_path_matches_float64_reference(rows, monkeypatch):
    from sparsekv.kernels import triton as tops

    monkeypatch.setitem(tops.TUNING, "cuda_int4_rows", 0)  # tinygemm serves where the CUDA kernel is not built
    n, k = 264, 1152  # tinygemm's multiples: n of 8, k of 128
    codes, scale, minimum = random_codes(n, k, 4, seed=rows)
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, k, generator=g, device=DEV).bfloat16()
    b = torch.randn(n, generator=g, device=DEV).bfloat16()
    exact = ref.linear_quantized(x.to(F64), codes, scale, minimum, b.to(F64))
    out = tops.linear_quantized(x, codes, scale, minimum, b)
    key = (codes.data_ptr(), (n, k // 2), scale.data_ptr(), minimum.data_ptr())
    packed = tops.quant._TINYGEMM[key][1]
    # Another tensor object over the same storage (the decode step's fused weights, rebuilt per generate) finds it.
    assert torch.equal(tops.linear_quantized(x, codes.view(n, k // 2), scale, minimum, b), out)
    assert tops.quant._TINYGEMM[key][1] is packed
    assert out.shape == (rows, n)
    torch_err = (ref.linear_quantized(x, codes, scale, minimum, b).to(F64) - exact).norm() / exact.norm()
    assert ((out.to(F64) - exact).norm() / exact.norm()).item() <= 2 * torch_err.item()


@pytest.mark.parametrize("n, k", [(16, 64), (48, 192)])
def test_tiles_are_the_mma_fragment_layout(n, k):
    """Each lane's word holds the codes of its A fragment of an m16n8k16 product (PTX ISA: registers j = 0..3 hold
    rows g, g + 8, g, g + 8 and inputs 2t, 2t + 1 (+ 8 for j >= 2) of the step), and its scales and minima those of
    rows g and g + 8: read so, they rebuild the weight the reference dequantizes, and ``from_tiles`` undoes it."""
    codes, scale, minimum = (t.cpu() for t in random_codes(n, k, 4, seed=n + k))
    words, s, m = ref.to_tiles(codes, scale, minimum, k)
    assert words.shape == (k // 64, n // 16, 32, 4) and s.shape == m.shape == (k // 64, n // 16, 8, 2, 2)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    w = words.permute(1, 0, 3, 2).reshape(n // 16, k // 16, 32)  # tile, step, lane
    q = torch.full((n // 16, k // 16, 16, 16), -1, dtype=torch.int32)
    for j in range(4):
        row, col = g + 8 * (j % 2), 2 * t + 8 * (j // 2)
        q[:, :, row, col] = (w >> (4 * j)) & 15
        q[:, :, row, col + 1] = (w >> (16 + 4 * j)) & 15
    q = q.transpose(1, 2).reshape(n, k)
    def rows(v):  # (chunk, tile, g, group, half) to (row, group)
        return v.permute(1, 4, 2, 0, 3).reshape(n, k // 32)
    assert torch.equal(rows(s), scale) and torch.equal(rows(m), minimum)
    weight = q.to(F64).view(n, k // 32, 32) * scale.to(F64).unsqueeze(2) + minimum.to(F64).unsqueeze(2)
    assert torch.equal(weight.view(n, k), ref.dequantize(codes, scale, minimum, k, F64))
    assert torch.equal(ref.dequantize(words, s, m, k, F64), weight.view(n, k))
    back = ref.from_tiles(words, s, m)
    assert torch.equal(back[0], q) and torch.equal(back[1], scale) and torch.equal(back[2], minimum)
    with pytest.raises(ValueError, match="multiple of 16"):
        ref.to_tiles(codes[:8], scale[:8], minimum[:8], k)


@pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and no interpreter")
@pytest.mark.parametrize("n, k, dtype", [(16, 64, torch.bfloat16), (48, 320, torch.float16), (32, 576, torch.float32)])
def test_untile_kernel_matches_reference(n, k, dtype):
    """The prefill's dequantization of tiled codes (one tile, a partial last block of chunks) equals the
    reference's."""
    from sparsekv.kernels import triton as tops

    tiles = ref.to_tiles(*random_codes(n, k, 4, seed=n * k), k)
    assert torch.equal(tops.quant.untile(*tiles, dtype), ref.dequantize(*tiles, k, dtype))
    view = [t[:, 1:2] for t in tiles]  # the second tile of the rows, as a stacked weight's view
    assert torch.equal(tops.quant.untile(*view, dtype), ref.dequantize(*tiles, k, dtype)[16:32])


@pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and no interpreter")
@pytest.mark.parametrize("rows", [1, 17])
def test_tiled_products_match_float64_reference(rows):
    """Tiled codes: a few rows take the CUDA kernel where it is built (else the dequantized weight), more rows the
    dequantized weight's product."""
    from sparsekv.kernels import triton as tops

    n, k = 48, 192
    codes, scale, minimum = random_codes(n, k, 4, seed=rows)
    tiles = ref.to_tiles(codes, scale, minimum, k)
    g = torch.Generator(device=DEV).manual_seed(rows)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x = torch.randn(2, rows, k, generator=g, device=DEV).to(dtype)
    b = torch.randn(n, generator=g, device=DEV).to(dtype)
    exact = ref.linear_quantized(x.to(F64), codes, scale, minimum, b.to(F64))
    out = tops.linear_quantized(x, *tiles, b)
    assert out.shape == (2, rows, n) and out.dtype == dtype
    torch_err = (ref.linear_quantized(x, codes, scale, minimum, b).to(F64) - exact).norm() / exact.norm()
    assert ((out.to(F64) - exact).norm() / exact.norm()).item() <= 2 * torch_err.item() + 1e-6


@pytest.mark.skipif(not ON_GPU, reason="the CUDA kernel runs on CUDA only")
@pytest.mark.parametrize("rows", [1, 3, 8, 12, 16])
@pytest.mark.parametrize("n, k, dtype, bias", [
    (16, 64, torch.bfloat16, False), (48, 192, torch.float16, True), (512, 128, torch.bfloat16, True),
    (6144, 256, torch.bfloat16, False), (24576, 64, torch.float16, False)])
def test_cuda_int4_kernel_matches_float64_reference(rows, n, k, dtype, bias):
    """The op on tiled codes: one block launch per shape (1, 2, 4 and 8 tiles a block), bf16 and fp16, with and
    without bias."""
    from sparsekv.kernels import cuda, triton as tops

    if not cuda.available(DEV, "quant"):
        pytest.skip("the CUDA kernel cannot be built here")
    codes, scale, minimum = random_codes(n, k, 4, seed=n + rows)
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, k, generator=g, device=DEV).to(dtype)
    b = torch.randn(n, generator=g, device=DEV).to(dtype) if bias else None
    exact = ref.linear_quantized(x.to(F64), codes, scale, minimum, None if b is None else b.to(F64))
    tiles = ref.to_tiles(codes, scale, minimum, k)
    out = tops.linear_quantized(x, *tiles, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch_err = (ref.linear_quantized(x.float(), codes, scale, minimum, None if b is None else b.float())
                 .to(dtype).to(F64) - exact).norm() / exact.norm()
    assert ((out.to(F64) - exact).norm() / exact.norm()).item() <= 2 * torch_err.item() + 1e-6
    # a view of x at an odd offset is read as well
    wide = torch.cat([torch.zeros(rows, 1, device=DEV, dtype=dtype), x], dim=1)[:, 1:]
    assert torch.equal(tops.linear_quantized(wide, *tiles, b), out)
    # and the weight's tiles as a view of tiles stacked after another weight's (fused q/k/v)
    first = ref.to_tiles(*random_codes(32, k, 4, seed=7), k)
    view = [torch.cat([a, t], dim=1)[:, 2:] for a, t in zip(first, tiles)]
    assert torch.equal(tops.linear_quantized(x, *view, b), out)


@pytest.mark.skipif(not ON_GPU, reason="the CUDA kernel runs on CUDA only")
@pytest.mark.parametrize("launch", cuda_int4.LAUNCHES)
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16])
@pytest.mark.parametrize("k", [64, 192, 1088])
def test_cuda_int4_every_launch_matches_float64_reference(launch, rows, k):
    """Every launch built, on 3 blocks: one chunk (most warps without a step), 3, and 17 (more steps than stages,
    uneven over the warps); bf16 and fp16, the one-row path, one B operand and two, with bias."""
    from sparsekv.kernels import cuda

    if not cuda.available(DEV, "quant"):
        pytest.skip("the CUDA kernel cannot be built here")
    n = 3 * 16 * launch[1]
    codes, scale, minimum = random_codes(n, k, 4, seed=n + k + rows)
    tiles = ref.to_tiles(codes, scale, minimum, k)
    g = torch.Generator(device=DEV).manual_seed(rows)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(rows, k, generator=g, device=DEV).to(dtype)
        b = torch.randn(n, generator=g, device=DEV).to(dtype)
        out = torch.full((rows, n), float("nan"), device=DEV, dtype=dtype)
        cuda.module("quant").int4_products(x, *tiles, b, out, *launch, False)
        exact = ref.linear_quantized(x.to(F64), codes, scale, minimum, b.to(F64))
        torch_err = (ref.linear_quantized(x.float(), codes, scale, minimum, b.float()).to(dtype).to(F64)
                     - exact).norm() / exact.norm()
        assert ((out.to(F64) - exact).norm() / exact.norm()).item() <= 2 * torch_err.item() + 1e-6, (dtype, launch)


def test_cuda_int4_launches_are_those_built():
    """``launch_for`` picks only launches that quant.cu builds, for any outputs, rows and GPU size."""
    source = Path(cuda_int4.__file__).with_name("quant.cu").read_text()
    built = source.split("#define SPARSEKV_LAUNCHES", 1)[1].split("#endif", 1)[0]
    assert tuple(tuple(map(int, m)) for m in re.findall(r"SPARSEKV_LAUNCH\((\d+), (\d+), (\d+)\)", built)) \
        == cuda_int4.LAUNCHES
    for n in range(16, 140_000, 16 * 7):
        for rows in (1, 2, 8, 16):
            for sms in (16, 108, 132):
                warps, tiles, stages = cuda_int4.launch_for(n, rows, sms)
                assert (warps, tiles, stages) in cuda_int4.LAUNCHES and (n // 16) % tiles == 0


def test_repacked_operands_are_refreshed_in_place():
    """A kernel's repacked copy of a weight is made once per storage and, when the weight changes in place, rewritten
    in the same tensors: a CUDA graph captured before still reads them."""
    pytest.importorskip("triton")
    from sparsekv.kernels import triton as tops

    codes, scale, minimum = (t.cpu() for t in random_codes(16, 64, 4, seed=3))
    table, made, weight = {}, [], {"codes": codes}

    def make():
        made.append(1)
        return (weight["codes"].to(torch.int32) * 2,)

    first = tops.quant._kept(table, codes, scale, minimum, make)
    assert tops.quant._kept(table, codes.view(16, 32), scale, minimum, make)[0] is first[0] and len(made) == 1
    codes.add_(1)
    again = tops.quant._kept(table, codes, scale, minimum, make)
    assert again[0] is first[0] and torch.equal(again[0], codes.to(torch.int32) * 2) and len(made) == 2
    del codes, again, first, weight["codes"]
    assert not table  # dropped with the storage


def test_more_rows_than_the_kernel_takes_run_the_reference():
    pytest.importorskip("triton")
    from sparsekv.kernels import triton as tops

    codes, scale, minimum = random_codes(6, 64, 4, seed=1)
    x = torch.randn(2, 17, 64, device=DEV)
    assert torch.equal(tops.linear_quantized(x, codes, scale, minimum), ref.linear_quantized(x, codes, scale, minimum))


@pytest.mark.parametrize("k", [64, 100])
def test_int4_round_trip(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(9, k, generator=g)
    w[0, :32] = 0.25  # a constant group: scale 0, exact
    codes, scale, minimum = quantize_int4(w)
    assert codes.shape == (9, -(-k // 32) * 16) and codes.dtype == torch.uint8
    back = ref.dequantize(codes, scale, minimum, k)
    assert torch.equal(back[0, :32], w[0, :32])
    step = scale.float().repeat_interleave(32, dim=1)[:, :k]
    assert ((back - w).abs() <= step * 0.5 + 1e-3).all()  # half a step, plus fp16's rounding of the minimum
    assert ((back - w).abs().mean() / w.abs().mean()) < 0.1


def test_dequantize_refuses_mismatched_shapes():
    codes, scale, minimum = random_codes(4, 64, 4, seed=0)
    with pytest.raises(ValueError, match="do not hold 100 inputs in groups of 32"):
        ref.dequantize(codes, scale, minimum, 100)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_bit_exact(kind):
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = (np.random.default_rng(0).standard_normal((12, 32 * 5)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(data, qtype)
    codes, scale, minimum = gguf_blocks(blocks, kind)
    ours = ref.dequantize(codes, scale, minimum, data.shape[1])
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy()))


def test_fused_quantized_products_are_views_and_equal_the_modules():
    torch.manual_seed(0)
    linears = [QuantLinear(*quantize_int4(torch.randn(n, 64)), None, 64) for n in (32, 16, 16)]
    x = torch.randn(1, 1, 64)
    separate = [m(x) for m in linears]
    fused = fuse(linears)
    assert fused is not None and fused.weight.shape == (64, 32) and fused.scale.shape == (64, 2)
    assert linears[1].codes.data_ptr() == fused.weight[32].data_ptr()  # the modules' codes are views
    for a, b in zip(fused(x), separate):
        torch.testing.assert_close(a, b)
    eight = QuantLinear(torch.zeros(16, 64, dtype=torch.uint8), *torch.zeros(2, 16, 2).half(), None, 64)
    assert fuse([linears[0], eight]) is None  # different code widths
    assert fuse([linears[0], nn.Linear(64, 8)]) is None
    tiles = [QuantLinear(*ref.to_tiles(m.codes, m.scale, m.minimum, 64), None, 64) for m in linears]
    assert [m.out_features for m in tiles] == [32, 16, 16] and tiles[0].bits == 4
    assert fuse([linears[0], tiles[1]]) is None  # different layouts
    fused = fuse(tiles)
    assert fused is not None and fused.weight.shape == (1, 4, 32, 4) and fused.scale.shape == (1, 4, 8, 2, 2)
    assert tiles[1].codes.data_ptr() == fused.weight[:, 2].data_ptr()  # the tiles of its rows: views as well
    assert fuse(tiles).weight.data_ptr() == fused.weight.data_ptr()  # taken as it is the next time
    for a, b in zip(fused(x), separate):
        torch.testing.assert_close(a, b)
    assert torch.equal(tiles[2].dequantized(), linears[2].dequantized())


def test_a_model_on_tiled_codes_runs_as_on_rows_of_groups():
    """A model whose 4-bit layers are in the CUDA kernel's layout (as ``fit_kernels`` leaves it on a GPU) keeps its
    shapes (``parallel.local_heads``) and logits."""
    from sparsekv import parallel

    model = tiny_model("llama", seed=1)
    quantize_model(model, "int4")
    ids = torch.randint(0, 200, (1, 40))
    with torch.no_grad():
        want = model(ids).logits
        for _, m in layer_linears(model):
            m.codes, m.scale, m.minimum = ref.to_tiles(m.codes, m.scale, m.minimum, m.in_features)
        assert parallel.local_heads(model) == (4, 2)
        torch.testing.assert_close(model(ids).logits, want)


# Every method on an fp8 cache; in the model's dtype, dense and Quest (the int4 products do not depend on the
# method, and tests/test_engine.py runs every method on that cache).
@pytest.mark.parametrize("name, kv_dtype", [*((name, "fp8") for name in CONFIGS), ("dense", "auto"), ("quest", "auto")])
def test_engine_on_int4_weights_equals_generate(int4_model, name, kv_dtype):
    """The engine on int4 weights, with a cache in the model's dtype or in fp8, gives apply + generate's tokens
    with the same quantized model and cache."""
    config = dataclasses.replace(CONFIGS[name], kv_dtype=kv_dtype)
    rows = prompts()
    expected = reference(int4_model, config, rows)
    engine = Engine(int4_model, config, max_batch=2, max_context=512, prefill_chunk=64, weights="int4")
    assert engine.generate(rows, NEW, stop_tokens=()).tokens == expected


def test_engine_quantizes_and_a_covering_budget_is_dense():
    model = tiny_model("qwen3", seed=2)
    model.generation_config.eos_token_id = None
    rows = prompts((90,))
    engine = Engine(model, DenseConfig(), max_context=256, weights="int4")
    mlp = model.model.layers[0].mlp
    assert {type(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)} == {QuantLinear}
    assert not any(type(m) is nn.Linear for m in model.model.layers.modules())
    dense = engine.generate(rows, NEW, stop_tokens=()).tokens
    quest = Engine(model, QuestConfig(token_budget=128, dense_layers=0), max_context=256, weights="int4")
    assert quest.generate(rows, NEW, stop_tokens=()).tokens == dense


def test_weights_option_is_checked():
    model = tiny_model("llama", seed=1)
    with pytest.raises(ConfigError, match="weights"):
        Engine(model, DenseConfig(), max_context=256, weights="int8")
    with pytest.raises(ConfigError, match="gguf: GGUF files only"):
        models.load_model("tiny:llama", "cpu", weights="gguf")
    loaded = models.load_model("tiny:llama", "cpu", weights="int4")
    assert type(loaded.model.model.layers[0].self_attn.q_proj) is QuantLinear


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """The tiny GGUF Llama of test_models_gguf with its attention weights in Q4_0 (q, o), Q4_1 (k, v) and its MLP
    in Q8_0 (gate, up) and Q4_1 (down)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from test_models_gguf import write_tiny_gguf

    kinds = {"attn_q": "Q4_0", "attn_output": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_1", "ffn_gate": "Q8_0",
             "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf", kinds=kinds)


def test_gguf_blocks_run_as_the_dequantized_model(quantized_gguf):
    floats = models.load_model(str(quantized_gguf), "cpu")
    blocks = models.load_model(str(quantized_gguf), "cpu", weights="gguf")
    layer = blocks.model.model.layers[1]
    assert {type(m) for m in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj)} == {QuantLinear}
    assert (layer.self_attn.q_proj.bits, layer.self_attn.k_proj.bits, layer.mlp.up_proj.bits) == (4, 4, 8)
    quantized = dict(layer_linears(blocks.model))
    for name, linear in layer_linears(floats.model):
        assert torch.equal(quantized[name].dequantized(), linear.weight)  # bit-exact, q and k rows permuted
    ids = blocks.tokenizer("The grass is green. " * 10, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(blocks.model(ids).logits, floats.model(ids).logits, rtol=1e-5, atol=1e-5)
    config = QuestConfig(token_budget=64, page_size=16, dense_layers=0)
    want = Engine(floats.model, config, max_context=512).generate([ids[0].tolist()], 8, stop_tokens=()).tokens
    assert Engine(blocks.model, config, max_context=512).generate([ids[0].tolist()], 8, stop_tokens=()).tokens == want


def test_gguf_weights_need_quantized_blocks(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from test_models_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "float.gguf")
    with pytest.raises(ConfigError, match="no Q4_0, Q4_1 or Q8_0 layer weights"):
        models.load_model(str(path), "cpu", weights="gguf")


def test_cli_and_eval_take_weights(quantized_gguf, tmp_path, capsys):
    from sparsekv.cli import main
    from sparsekv.eval import EvalSpec, TaskOptions, run_eval

    assert main(["generate", "--model", str(quantized_gguf), "--weights", "gguf", "--method", "quest", "--budget",
                 "32", "--opt", "dense_layers=0", "--prompt", "The grass is green. " * 8, "--max-new-tokens", "4"]) == 0
    assert "4 new tokens, decode" in capsys.readouterr().err
    out = run_eval(EvalSpec(task="passkey", methods=["dense"], lengths=[320], depths=[0.5], limit=1,
                            model="tiny:llama", weights="int4", out=str(tmp_path / "out"), plots=False,
                            options=TaskOptions(max_new_tokens=2)), log=lambda *_: None, progress=False)
    record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert record["settings"]["weights"] == "int4"
    with pytest.raises(ConfigError, match="weights"):
        EvalSpec(task="passkey", weights="int8")
