"""Small random-weight models of each supported architecture and an offline byte-level tokenizer.

Nothing can be downloaded where the tests run, so tests, the demo (until a trained model ships) and the examples
build their models here. Random weights attend almost uniformly: good for checking that code paths agree, not for
judging accuracy.
"""

from __future__ import annotations

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + pad, bos, eos) that needs no files; loads and saves like any
    ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i, ch in enumerate(_byte_alphabet()):
        vocab[ch] = len(SPECIAL_TOKENS) + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2 style byte-level BPE uses for bytes, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def tiny_config(arch: str = "llama", *, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                vocab_size: int = len(SPECIAL_TOKENS) + 256, max_positions: int = 8192):
    """A small config of ``arch`` (one of ARCHITECTURES) with GQA; no sliding window."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    kwargs = dict(vocab_size=vocab_size, hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if arch in ("mistral", "qwen2", "qwen3"):
        kwargs["sliding_window"] = None
    return classes[arch](**kwargs)


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A random-weight causal LM of ``arch`` in eval mode. Weights are scaled up so that attention is less
    uniform than at initialisation, which makes sparse selection actually matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_kwargs), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model.eval()
