"""A small paged cache for the selection tests."""

import torch

from sparsekv.cache import PagedKVCache


def one_layer(prompt: int, batch: int, kv_heads: int, head_dim: int, page_size: int, lengths=None, seed: int = 0,
              dtype: torch.dtype = torch.float32):
    """A one-layer cache holding ``prompt`` random keys (scaled by 2) and values per row (``lengths``: fewer for
    some rows, left padded) plus one decode token; returns the layer and seq_len (B,)."""
    torch.manual_seed(seed)
    pages = PagedKVCache(1, page_size)
    valid = None
    if lengths is not None:
        valid = torch.arange(prompt).view(1, -1) >= (prompt - torch.tensor(lengths)).view(-1, 1)
    pages.begin(prompt, valid, batch, torch.device("cpu"))
    shape = (batch, kv_heads, prompt, head_dim)
    pages.append(0, torch.randn(*shape, dtype=dtype) * 2, torch.randn(*shape, dtype=dtype))
    pages.begin(1, None, batch, torch.device("cpu"))
    shape = (batch, kv_heads, 1, head_dim)
    layer = pages.append(0, torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype))
    return layer, pages.seq_len
