"""Probe (H200): a prompt pass's parts of one Llama-3-8B layer (bf16, S tokens) compiled three ways: q and k rotated
as transposed (B, H, S, D) views with every dim dynamic; rotated in the products' (B, S, H, D) layout with every dim
dynamic; and that with only the token dim dynamic (``decode._by_tokens``, landed). Also the layer's output and MLP
(``layer_output``) with every dim dynamic against the token dim only. Prints ms per call (CUDA events, 10 calls
after 3). Run: PYTHONPATH=. python benchmarks/results/prompt_parts_probe.py"""
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding, apply_rotary_pos_emb

from sparsekv.integrations.decode import Products, _by_tokens, attention_inputs, layer_output

cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=131072, rope_theta=500000.0)
layer = LlamaDecoderLayer(cfg, 0).cuda().to(torch.bfloat16).eval()
rot = LlamaRotaryEmbedding(cfg).cuda()
products = Products.of(layer)


def transposed_inputs(layer, products, rotate, hidden, rotary):
    x = layer.input_layernorm(hidden)
    q, k, v = products.qkv(x)
    heads = (*x.shape[:-1], -1, layer.self_attn.head_dim)
    q, k = rotate(q.view(heads).transpose(1, 2), k.view(heads).transpose(1, 2), *rotary)
    return q, k, v.view(heads).transpose(1, 2)


variants = {"inputs, transposed, all dynamic": torch.compile(transposed_inputs, dynamic=True),
            "inputs, all dynamic": torch.compile(attention_inputs, dynamic=True),
            "inputs, tokens dynamic": _by_tokens(attention_inputs),
            "output, all dynamic": torch.compile(layer_output, dynamic=True),
            "output, tokens dynamic": _by_tokens(layer_output)}


def timed(f, *args):
    for _ in range(3):
        f(*args)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        f(*args)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 10


with torch.no_grad():
    for s in (16384, 15000, 16000):
        hidden = torch.randn(1, s, 4096, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(1, s, 32, 128, device="cuda", dtype=torch.bfloat16)
        rotary = rot(hidden, torch.arange(s, device="cuda").view(1, s))
        times = {name: timed(f, layer, products, *((apply_rotary_pos_emb, hidden, rotary) if name.startswith("inputs")
                                                   else (hidden, out)))
                 for name, f in variants.items()}
        print(f"S={s}: " + ", ".join(f"{name} {t:.3f} ms" for name, t in times.items()), flush=True)
