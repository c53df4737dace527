"""Helpers shared by the OmniKV and RaaS tests: greedy generation inside ``sparsekv.apply``."""

from __future__ import annotations

import os

import torch

import sparsekv

# SPARSEKV_TEST_DEVICE=cuda runs the device-sensitive tests (offload) on a GPU.
DEVICE = torch.device(os.environ.get("SPARSEKV_TEST_DEVICE", "cpu"))


def generate(model, config, ids: torch.Tensor, new_tokens: int, mask: torch.Tensor | None = None):
    """Greedy ``new_tokens`` tokens under ``config``. Returns (generated ids (B, new_tokens), scores (steps, B, V),
    session)."""
    ids, mask = ids.to(model.device), None if mask is None else mask.to(model.device)
    with sparsekv.apply(model, config) as session:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores), session


def assert_dense(dense: tuple[torch.Tensor, torch.Tensor], model, config, ids: torch.Tensor,
                 mask: torch.Tensor) -> None:
    """``config`` generates the tokens of ``dense`` = (ids, scores) from ``generate``, attending every token."""
    out, scores, session = generate(model, config, ids, dense[0].shape[1], mask)
    assert torch.equal(out, dense[0]), config
    torch.testing.assert_close(scores, dense[1], rtol=1e-4, atol=1e-4)
    assert session.stats.summary()["fraction"] == 1.0


def beam_search(model, config, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, beams: int = 3):
    """Beam search under ``config``: the cache and the method's state are reordered between steps."""
    with sparsekv.apply(model, config):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              num_beams=beams, do_sample=False, pad_token_id=0)


def padded_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte-token prompts of the given lengths, left padded. Returns (ids, attention_mask), (B, max length)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 259, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask
