"""The FP8 KV cache (``kv_dtype="fp8"``; the engine on int4 weights and an fp8 cache against ``apply`` +
``model.generate`` for every method is in ``test_quant``): a budget covering the context gives the dense fp8
tokens, the pages and bounds hold exactly the quantized keys, and the memory counts one byte per element."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsekv import DenseConfig, QuestConfig, RaaSConfig
from sparsekv.cache import PagedKVCache
from sparsekv.engine import Engine
from sparsekv.errors import ConfigError
from sparsekv.kernels import reference as ref
from test_engine import NEW, prompts


def fp8(config):
    return dataclasses.replace(config, kv_dtype="fp8")


@pytest.mark.parametrize("config", [QuestConfig(token_budget=128, dense_layers=0), RaaSConfig(token_budget=128)],
                         ids=["quest", "raas"])
def test_covering_budget_gives_the_dense_fp8_tokens(int4_model, config):
    rows = prompts((90,))
    dense = Engine(int4_model, fp8(DenseConfig()), max_context=256, weights="int4").generate(rows, NEW, stop_tokens=())
    out = Engine(int4_model, fp8(config), max_context=256, prefill_chunk=32, weights="int4").generate(
        rows, NEW, stop_tokens=())
    assert out.tokens == dense.tokens
    auto = Engine(int4_model, DenseConfig(), max_context=256, weights="int4").generate(rows, NEW, stop_tokens=())
    # Half the bytes of a float32 model's cache is a quarter: one byte per element, bounds included.
    assert dense.kv_device_bytes < auto.kv_device_bytes / 3


def test_fp8_pages_hold_the_quantized_keys_and_exact_bounds():
    """Chunks of a prompt by scatters, then decode tokens by the fused append: keys and values are the saturated
    fp8 of what came in, each page's bounds the min and max of its stored keys, and resident bytes count 1 byte per
    element."""
    torch.manual_seed(0)
    b, h, d, p = 2, 3, 8, 4
    cache = PagedKVCache(1, page_size=p, kv_dtype="fp8")
    keys, values = [], []
    for n, prompt_end in ((7, False), (6, True), (1, False), (1, False)):
        cache.begin(n, None, b, torch.device("cpu"), prompt_end=prompt_end)
        k, v = torch.randn(2, b, h, n, d) * 100  # some past fp8's 448
        keys.append(k)
        values.append(v)
        layer = cache.append(0, k, v)
    k, v = torch.cat(keys, 2), torch.cat(values, 2)  # (B, H, 15, D)
    assert layer.k.dtype == layer.kmin.dtype == ref.FP8
    stored_k = layer.k[:, :, :4].flatten(2, 3)[:, :, :15].float()
    assert torch.equal(stored_k, ref.to_cache(k, ref.FP8).float())
    assert torch.equal(layer.v[:, :, :4].flatten(2, 3)[:, :, :15].float(), ref.to_cache(v, ref.FP8).float())
    pages = torch.nn.functional.pad(stored_k, (0, 0, 0, 1), value=float("nan")).view(b, h, 4, p, d)
    assert torch.equal(layer.kmin[:, :, :4].float(), pages.nan_to_num(float("inf")).amin(3))
    assert torch.equal(layer.kmax[:, :, :4].float(), pages.nan_to_num(float("-inf")).amax(3))
    slots = layer.capacity + 1
    assert cache.resident_bytes() == b * h * slots * (2 * p * d + 2 * d + 8)


def test_kv_dtype_is_checked():
    with pytest.raises(ConfigError, match="kv_dtype must be 'auto' or 'fp8'"):
        QuestConfig(kv_dtype="int8")
    with pytest.raises(ConfigError, match="kv_dtype"):
        PagedKVCache(1, kv_dtype="float8")
