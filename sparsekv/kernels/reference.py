"""Plain PyTorch versions of every op on the decode path: the definition the fast kernels are tested against.

Shapes use B batch, H query heads, Hkv KV heads (G = H / Hkv query heads per KV head), C page slots, P page size,
D head dim, K selected slots. ``Hs`` is the number of selection rows: Hkv when pages are chosen per KV head (each
page read once for its whole group) or H when chosen per query head (as the official Quest evaluation does).
Accumulation is in float32, or float64 for float64 inputs.
"""

from __future__ import annotations

import math

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in a cache of ``dtype``; into fp8 (e4m3fn: no infinity, and a cast past its range may give NaN)
    saturated at +-448, unscaled: keys and values are stored as they are, like a unit per-tensor scale."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype) if dtype == FP8 else x.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` for moving data only: fp8 as its bytes, since torch has no fp8 scatter or gather on the CPU."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``t.gather(dim, index)`` for a cache tensor of any dtype (fp8 gathered as its bytes)."""
    return raw(t).gather(dim, index).view(t.dtype)


def current_pages(cur_slot: torch.Tensor, table: torch.Tensor | None = None) -> tuple:
    """Indices (row, head, page) that pick each row's current page (slot ``cur_slot`` (B, Hkv), slot 0 for a row
    without pages) out of a cache tensor (B, Hkv, C, ...), or with ``table`` (B, C) int64 out of a store of shared
    pages (1, Hkv, N, ...): ``t[current_pages(...)]`` is (B, Hkv, ...)."""
    slot = cur_slot.clamp(min=0)
    row = torch.arange(slot.shape[0], device=slot.device).view(-1, 1) if table is None else 0
    page = slot if table is None else table.gather(1, slot)
    return row, torch.arange(slot.shape[1], device=slot.device).expand_as(page), page


def row_index(batch: int, rows: int, kv_heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcastable (B, 1, 1) batch and (1, Hs, 1) KV-head indices of the ``rows`` selection rows."""
    bi = torch.arange(batch, device=device).view(batch, 1, 1)
    hi = (torch.arange(rows, device=device) // (rows // kv_heads)).view(1, rows, 1)
    return bi, hi


def per_row(t: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """Pages (or bounds) as each row's own: ``t`` as it is without ``table``, else a pool's store of shared pages
    (1, Hkv, N, ...) gathered through the rows' page table (B, C) into (B, Hkv, C, ...)."""
    return t if table is None else t[0][:, table].transpose(0, 1)


def stored_tokens(slot_page: torch.Tensor, seq_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """(B, Hkv, C, P) bool: which token of each slot is stored (its slot holds a page and its position is below
    the row's length). slot_page: (B, Hkv, C); seq_len: (B,)."""
    position = slot_page.unsqueeze(-1) * page_size + torch.arange(page_size, device=slot_page.device)
    return (slot_page.unsqueeze(-1) >= 0) & (position < seq_len.view(-1, 1, 1, 1))


def mask_free(scores: torch.Tensor, slot_page: torch.Tensor) -> torch.Tensor:
    """Selection rows' page scores (B, Hs, C), Hs a multiple of Hkv, with -inf where the row's slot is free
    (slot_page (B, Hkv, C) < 0)."""
    free = (slot_page < 0).repeat_interleave(scores.shape[1] // slot_page.shape[1], dim=1)
    return scores.masked_fill(free, float("-inf"))


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's upper bound of ``q . k`` over each page: ``sum_i max(q_i * max_i, q_i * min_i)``.

    q: (B, H, D); kmin, kmax: (B, Hkv, C, D), or with ``table`` (B, C) int64 a pool's shared pages (1, Hkv, N, D),
    slot s of row b's bounds in page ``table[b, s]``; slot_page: (B, Hkv, C), -1 for free slots.
    Returns (B, Hkv, C), the max over each group's query heads, or (B, H, C) with ``per_query_head``;
    free slots score -inf.
    """
    kmin, kmax = per_row(kmin, table), per_row(kmax, table)
    b, h, d = q.shape
    hkv = kmin.shape[1]
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).view(b, hkv, h // hkv, 1, d)
    bound = torch.maximum(qg * kmax.to(acc).unsqueeze(2), qg * kmin.to(acc).unsqueeze(2)).sum(-1)  # (B,Hkv,G,C)
    return mask_free(bound.flatten(1, 2) if per_query_head else bound.amax(dim=2), slot_page)


def page_spreads(k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
    """Each slot's channel-wise mean and standard deviation of its stored keys (``stored_tokens``), 0 for a slot
    without one.

    k: (B, Hkv, C, P, D); slot_page: (B, Hkv, C), -1 for free slots; seq_len: (B,) tokens stored per row (a page's
    positions from it on are not written yet). Returns (B, Hkv, C, 2, D) float32 (float64 for float64 keys): the
    mean at index 0 of dimension 3, the deviation at index 1."""
    stored = stored_tokens(slot_page, seq_len, k.shape[3]).unsqueeze(-1)
    count = stored.sum(3).clamp(min=1)
    keys = torch.where(stored, k.to(acc_dtype(k.dtype)), 0.0)
    mean = keys.sum(3) / count
    var = torch.where(stored, keys - mean.unsqueeze(3), 0.0).square().sum(3) / count
    return torch.stack((mean, var.sqrt()), dim=3)


def spread_page_scores(q: torch.Tensor, stats: torch.Tensor, slot_page: torch.Tensor, spread: float,
                       per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """Pages scored by the mean and spread of their keys: ``q . mu + spread * sqrt(sum_i q_i^2 sigma_i^2)``, mu and
    sigma a page's channel-wise mean and standard deviation (``page_spreads``; taking its keys as Gaussian with
    independent channels, the mean of its logits ``q . k`` and ``spread`` times their standard deviation).

    q: (B, H, D); stats: (B, Hkv, C, 2, D) each slot's mean and deviation, or with ``table`` (B, C) int64 a store
    of shared pages (1, Hkv, N, 2, D) read through it (``per_row``); slot_page: (B, Hkv, C), -1 for free slots.
    Returns (B, Hkv, C), the max over each group's query heads, or (B, H, C) with ``per_query_head``, float32
    (float64 for float64 q); free slots score -inf."""
    stats = per_row(stats, table)
    b, h, d = q.shape
    hkv = stats.shape[1]
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).view(b, hkv, h // hkv, 1, d)
    mean, dev = stats.to(acc).unsqueeze(2).unbind(4)  # (B, Hkv, 1, C, D) each
    score = (qg * mean).sum(-1) + spread * (qg.square() * dev.square()).sum(-1).sqrt()
    return mask_free(score.flatten(1, 2) if per_query_head else score.amax(dim=2), slot_page)


def spread_scores(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor, spread: float,
                  per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """``spread_page_scores`` of the means and deviations ``page_spreads`` makes from every stored key, unrounded.

    q: (B, H, D); k: (B, Hkv, C, P, D), or with ``table`` (B, C) int64 a pool's shared pages (1, Hkv, N, P, D);
    slot_page: (B, Hkv, C), -1 for free slots; seq_len: (B,) tokens stored per row. Returns (B, Hkv, C) or
    (B, H, C) with ``per_query_head``; free slots score -inf.
    """
    return spread_page_scores(q, page_spreads(per_row(k, table), slot_page, seq_len), slot_page, spread,
                              per_query_head)


def channel_scores(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor, channels: int,
                   scale: float, per_query_head: bool = False, table: torch.Tensor | None = None,
                   by_keys: bool = False) -> torch.Tensor:
    """Pages scored by the attention mass that the query's largest channels estimate (SparQ, Ribar et al., 2024):
    each row keeps the ``channels`` channels where |q| is largest (summed over a KV head's query heads, so a row
    reads the same channels of every key), takes ``q_r . k_r`` over them as each stored token's logit, at the scale
    ``scale / sqrt(|q_r|_1 / |q|_1)`` (the part of q kept), and sums the softmax of those logits over each page's
    tokens, per query head (summed over a KV head's query heads unless ``per_query_head``). ``by_keys``: the
    channels where the row's stored keys are largest on average instead, whatever the query (the same channels
    step after step, as a store of those channels of every key would hold).

    q: (B, H, D); k: (B, Hkv, C, P, D), or with ``table`` (B, C) int64 a pool's shared pages (1, Hkv, N, P, D);
    slot_page: (B, Hkv, C), -1 for free slots; seq_len: (B,) tokens stored per row. Returns (B, Hkv, C) or
    (B, H, C) with ``per_query_head``; free slots score -inf. With every channel kept it is the true attention mass.
    """
    k = per_row(k, table)
    b, h, d = q.shape
    hkv, p = k.shape[1], k.shape[3]
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).view(b, hkv, h // hkv, d)
    stored = stored_tokens(slot_page, seq_len, p)
    if by_keys:
        weight = (k.to(acc).abs() * stored.unsqueeze(-1)).sum((2, 3)).unsqueeze(2).expand_as(qg)
    else:
        weight = qg.abs() if per_query_head else qg.abs().sum(2, keepdim=True).expand_as(qg)
    kept = torch.zeros_like(qg).scatter_(-1, weight.topk(min(channels, d), dim=-1).indices, 1.0)
    q_r = qg * kept
    share = q_r.abs().sum(-1) / qg.abs().sum(-1).clamp(min=torch.finfo(acc).tiny)
    logits = torch.einsum("bngd,bncpd->bngcp", q_r, k.to(acc))
    logits = logits * (scale / share.clamp(min=torch.finfo(acc).tiny).sqrt()).view(b, hkv, -1, 1, 1)
    return logit_mass(logits, stored, slot_page, per_query_head)


def logit_mass(logits: torch.Tensor, stored: torch.Tensor, slot_page: torch.Tensor,
               per_query_head: bool) -> torch.Tensor:
    """Pages scored by the softmax mass of estimated logits: logits (B, Hkv, G, C, P) of each query head of a KV
    head's group over its tokens, stored (B, Hkv, C, P) which tokens exist (``stored_tokens``), the softmax over
    each row's stored tokens summed over each page's. Returns (B, Hkv, C), summed over the group, or (B, H, C) with
    ``per_query_head``; free slots score -inf."""
    b, hkv, c, p = stored.shape
    logits = logits.masked_fill(~stored.unsqueeze(2), float("-inf"))
    mass = torch.softmax(logits.flatten(3), dim=-1).nan_to_num(0.0).view(b, hkv, -1, c, p).sum(-1)
    return mask_free(mass.flatten(1, 2) if per_query_head else mass.sum(2), slot_page)


def lowrank_scores(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor, rank: int,
                   scale: float, per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """Pages scored by the attention mass that a low-rank sketch of the keys estimates (Loki, Singhania et al.,
    2024, at page granularity): per row (sequence, KV head) the ``rank`` principal directions B of its stored keys
    (the top eigenvectors of their second moment ``k^T k``), each stored token's logit ``(q B) . (k B)`` at
    ``scale``, the softmax of those logits summed over each page's tokens, per query head (summed over a KV head's
    query heads unless ``per_query_head``). With rank = D it is the true attention mass.

    q: (B, H, D); k: (B, Hkv, C, P, D), or with ``table`` (B, C) int64 a pool's shared pages (1, Hkv, N, P, D);
    slot_page: (B, Hkv, C), -1 for free slots; seq_len: (B,) tokens stored per row. Returns (B, Hkv, C) or
    (B, H, C) with ``per_query_head``; free slots score -inf.
    """
    k = per_row(k, table)
    b, h, d = q.shape
    hkv = k.shape[1]
    acc = acc_dtype(q.dtype)
    stored = stored_tokens(slot_page, seq_len, k.shape[3])
    keys = torch.where(stored.unsqueeze(-1), k.to(acc), 0.0)
    basis = torch.linalg.eigh(torch.einsum("bncpd,bncpe->bnde", keys, keys)).eigenvectors[..., d - min(rank, d):]
    q_r = torch.einsum("bngd,bndr->bngr", q.to(acc).view(b, hkv, h // hkv, d), basis)
    logits = torch.einsum("bngr,bncpr->bngcp", q_r, torch.einsum("bncpd,bndr->bncpr", keys, basis)) * scale
    return logit_mass(logits, stored, slot_page, per_query_head)


def check_landmarks(landmarks: int, page_size: int) -> None:
    if landmarks < 1 or page_size % landmarks:
        raise ValueError(f"landmarks must be a divisor of the page size ({page_size}), got {landmarks}")


def page_landmarks(k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor, landmarks: int) -> torch.Tensor:
    """Each slot's landmarks: the mean of the stored keys (``stored_tokens``) of each of its ``landmarks`` runs of
    P / landmarks tokens (as ShadowKV's per chunk), 0 for a run without one.

    k: (B, Hkv, C, P, D); slot_page: (B, Hkv, C), -1 for free slots; seq_len: (B,) tokens stored per row (a page's
    positions from it on are not written yet); ``landmarks`` divides P. Returns (B, Hkv, C, landmarks, D) float32
    (float64 for float64 keys)."""
    b, hkv, c, p, d = k.shape
    check_landmarks(landmarks, p)
    stored = stored_tokens(slot_page, seq_len, p).view(b, hkv, c, landmarks, p // landmarks, 1)
    keys = torch.where(stored, k.to(acc_dtype(k.dtype)).view(b, hkv, c, landmarks, p // landmarks, d), 0.0)
    return keys.sum(4) / stored.sum(4).clamp(min=1)


def write_current(k: torch.Tensor, state: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                  seq_len: torch.Tensor, table: torch.Tensor | None, summary) -> None:
    """Writes ``summary(keys, slot_page, seq_len)`` of each row's current page into ``state[b, h, cur_slot[b, h]]``
    in place, in state's dtype (slot 0 for a row without pages, cur_slot -1): what ``landmark_means`` and
    ``spread_stats`` keep of the page that gains a token every step. summary maps keys (B, Hkv, 1, P, D) to
    (B, Hkv, 1, R, D), state is (B, Hkv, C, R, D) (with ``table``, a store (1, Hkv, N, R, D) as k's)."""
    at = current_pages(cur_slot, table)
    keys = raw(k)[at].view(k.dtype).unsqueeze(2)  # (B, Hkv, 1, P, D)
    new = summary(keys, slot_page.gather(2, cur_slot.clamp(min=0).unsqueeze(-1)), seq_len)
    raw(state)[at] = raw(to_cache(new.squeeze(2), state.dtype))


def landmark_means(k: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                   seq_len: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """Writes the landmarks (``page_landmarks``) of each row's current page, in place, in means' dtype:
    ``means[b, h, cur_slot[b, h]]``, slot 0 for a row without pages (cur_slot -1).

    k: (B, Hkv, C, P, D); means: (B, Hkv, C, L, D), L dividing P; or with ``table`` (B, C) int64 a store of shared
    pages, k (1, Hkv, N, P, D) and means (1, Hkv, N, L, D), slot s of row b in page ``table[b, s]``; slot_page:
    (B, Hkv, C); cur_slot: (B, Hkv) int64; seq_len: (B,)."""
    write_current(k, means, slot_page, cur_slot, seq_len, table,
                  lambda keys, pages, n: page_landmarks(keys, pages, n, means.shape[3]))


def spread_stats(k: torch.Tensor, stats: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor,
                 seq_len: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """Writes the mean and deviation (``page_spreads``) of each row's current page, in place, in stats' dtype:
    ``stats[b, h, cur_slot[b, h]]``, slot 0 for a row without pages (cur_slot -1).

    k: (B, Hkv, C, P, D); stats: (B, Hkv, C, 2, D); or with ``table`` (B, C) int64 a store of shared pages, k
    (1, Hkv, N, P, D) and stats (1, Hkv, N, 2, D); slot_page: (B, Hkv, C); cur_slot: (B, Hkv) int64; seq_len:
    (B,)."""
    write_current(k, stats, slot_page, cur_slot, seq_len, table, page_spreads)


def landmark_page_lse(q: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor,
                      page_size: int, scale: float, table: torch.Tensor | None = None) -> torch.Tensor:
    """Per query head and page, the log-sum-exp of its runs' logits ``scale * q . mean + log(n)``: a run of n stored
    tokens (``stored_tokens``, from the page table and the row's length) taken as n keys equal to its landmark; a
    run without a stored token is left out, whatever its mean.

    q: (B, H, D); means: (B, Hkv, C, L, D) each slot's landmarks (``page_landmarks``), or with ``table`` (B, C)
    int64 a store of shared pages (1, Hkv, N, L, D) read through it (``per_row``); slot_page: (B, Hkv, C), -1 for
    free slots; seq_len: (B,); L divides page_size. Returns (B, H, C) float32 (float64 for float64 q), -inf for free
    slots."""
    means = per_row(means, table)
    b, h, d = q.shape
    hkv, c, landmarks = means.shape[1], means.shape[2], means.shape[3]
    check_landmarks(landmarks, page_size)
    acc = acc_dtype(q.dtype)
    count = stored_tokens(slot_page, seq_len, page_size).view(b, hkv, c, landmarks, -1).sum(-1).to(acc)
    qg = q.to(acc).view(b, hkv, h // hkv, d)
    logits = torch.einsum("bngd,bncld->bngcl", qg, means.to(acc)) * scale + count.log().unsqueeze(2)
    return logits.masked_fill((count == 0).unsqueeze(2), float("-inf")).logsumexp(-1).view(b, h, c)


def landmark_page_scores(q: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor,
                         page_size: int, scale: float, per_query_head: bool = False,
                         table: torch.Tensor | None = None) -> torch.Tensor:
    """Pages scored by the attention their landmarks estimate: the log of each page's share of the softmax over
    every run of the row, ``page_mass(landmark_page_lse(...))`` (shapes there; per query head, or the shares summed
    over a KV head's query heads unless ``per_query_head``). Returns (B, Hkv, C) or (B, H, C), free slots -inf."""
    return page_mass(landmark_page_lse(q, means, slot_page, seq_len, page_size, scale, table), means.shape[1],
                     per_query_head)


def with_sinks(scores: torch.Tensor, slot_page: torch.Tensor, sink_pages: int) -> torch.Tensor:
    """Selection rows' page scores (B, Hs, C), Hs a multiple of Hkv, with +inf for the slots holding the first
    ``sink_pages`` pages of their row (slot_page (B, Hkv, C) in [0, sink_pages)): always selected."""
    sinks = (slot_page >= 0) & (slot_page < sink_pages)
    return scores.masked_fill(sinks.repeat_interleave(scores.shape[1] // sinks.shape[1], dim=1), float("inf"))


def landmark_scores(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, seq_len: torch.Tensor,
                    landmarks: int, scale: float, per_query_head: bool = False,
                    table: torch.Tensor | None = None) -> torch.Tensor:
    """``landmark_page_scores`` of the landmarks ``page_landmarks`` makes from every stored key, unrounded: each
    page's tokens in ``landmarks`` runs of P / landmarks, each run's stored keys taken as their mean (its landmark,
    as ShadowKV's per chunk). With a landmark per token it is the log of the true attention mass.

    q: (B, H, D); k: (B, Hkv, C, P, D), or with ``table`` (B, C) int64 a pool's shared pages (1, Hkv, N, P, D);
    slot_page: (B, Hkv, C), -1 for free slots; seq_len: (B,) tokens stored per row; ``landmarks`` divides P.
    Returns (B, Hkv, C) or (B, H, C) with ``per_query_head``; free slots score -inf.
    """
    k = per_row(k, table)
    return landmark_page_scores(q, page_landmarks(k, slot_page, seq_len, landmarks), slot_page, seq_len, k.shape[3],
                                scale, per_query_head)


def check_num_pages(num_pages: int) -> None:
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")


def select_pages(scores: torch.Tensor, cur_slot: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Top ``num_pages`` slots by score, the current page always among them.

    scores: (B, Hs, C); cur_slot: (B, Hkv). Returns (B, Hs, min(num_pages, C)) int64 slots, -1 where a row has
    fewer valid slots than that.
    """
    check_num_pages(num_pages)
    rows = scores.shape[1] // cur_slot.shape[1]
    cur = cur_slot.clamp(min=0).repeat_interleave(rows, dim=1).unsqueeze(-1)
    forced = scores.scatter(2, cur, float("inf"))
    top, idx = forced.topk(min(num_pages, scores.shape[2]), dim=2)
    return torch.where(top > float("-inf"), idx, -1)


def quest_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                 cur_slot: torch.Tensor, num_pages: int, per_query_head: bool = False,
                 in_order: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's page choice in one op: ``select_pages(page_scores(...), cur_slot, num_pages)`` (shapes there), so
    that a fused kernel may score and start the selection in one pass. ``in_order``: the caller's promise that
    slot j holds page j or is free (``check_in_order``), so that a kernel reads the bounds of each row's slots up
    to its current one only; the result is the same. Returns (B, Hs, min(num_pages, C)) int64."""
    if in_order:
        check_in_order("quest_select", slot_page)
    return select_pages(page_scores(q, kmin, kmax, slot_page, per_query_head, table), cur_slot, num_pages)


def raas_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                cur_slot: torch.Tensor, prompt_pages: torch.Tensor,
                num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RaaS's page choice in one op: Quest's bounds (``page_scores``, one row per KV head) and the top
    ``num_pages`` slots with every decode page (page >= the row's ``prompt_pages``, (B,) int64) taken whatever its
    score (``select_pages`` of the bounds with those at +inf). Returns the bounds (B, Hkv, C) float32, unchanged, for
    RaaS's stamps (``raas_update``), and the slots (B, Hkv, min(num_pages, C)) int64."""
    scores = page_scores(q, kmin, kmax, slot_page)
    ranked = torch.where(slot_page < prompt_pages.view(-1, 1, 1), scores, float("inf"))
    return scores, select_pages(ranked, cur_slot, num_pages)


def landmark_select(q: torch.Tensor, k: torch.Tensor, means: torch.Tensor, slot_page: torch.Tensor,
                    cur_slot: torch.Tensor, seq_len: torch.Tensor, scale: float, num_pages: int, sink_pages: int = 0,
                    per_query_head: bool = False, in_order: bool = False,
                    table: torch.Tensor | None = None) -> torch.Tensor:
    """landmark's step in one op: the landmarks of each row's current page (``landmark_means``, in means), then
    ``select_pages`` of the pages' scores (``landmark_page_scores``) with the first ``sink_pages`` pages of each row
    always in (``with_sinks``); shapes as there, k (B, Hkv, C, P, D) or with ``table`` a store (1, Hkv, N, P, D).
    ``in_order`` as ``quest_select``'s: a kernel then reads no landmarks past each row's last page. Returns (B, Hs,
    min(num_pages, C)) int64."""
    if in_order:
        check_in_order("landmark_select", slot_page)
    landmark_means(k, means, slot_page, cur_slot, seq_len, table)
    scores = landmark_page_scores(q, means, slot_page, seq_len, k.shape[3], scale, per_query_head, table)
    return select_pages(with_sinks(scores, slot_page, sink_pages), cur_slot, num_pages)


def spread_select(q: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, slot_page: torch.Tensor,
                  cur_slot: torch.Tensor, seq_len: torch.Tensor, spread: float, num_pages: int, sink_pages: int = 0,
                  per_query_head: bool = False, in_order: bool = False,
                  table: torch.Tensor | None = None) -> torch.Tensor:
    """spread's step in one op: the mean and deviation of each row's current page (``spread_stats``, in stats),
    then ``select_pages`` of the pages' scores (``spread_page_scores``) with the first ``sink_pages`` pages of each
    row always in (``with_sinks``); shapes as there, k (B, Hkv, C, P, D) or with ``table`` a store (1, Hkv, N, P,
    D). ``in_order`` as ``quest_select``'s. Returns (B, Hs, min(num_pages, C)) int64."""
    if in_order:
        check_in_order("spread_select", slot_page)
    spread_stats(k, stats, slot_page, cur_slot, seq_len, table)
    scores = spread_page_scores(q, stats, slot_page, spread, per_query_head, table)
    return select_pages(with_sinks(scores, slot_page, sink_pages), cur_slot, num_pages)


def _weights(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor, q_pos: torch.Tensor,
             scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax weights of ``attend_with_weights``, (B, Hs, H / Hs, S, K * P) in the accumulation dtype; with
    ``lse`` (B, H, S) the queries' log-sum-exps, ``exp(logit - lse)`` in place of the softmax."""
    b, h, s, d = q.shape
    hkv, p = k.shape[1], k.shape[3]
    hs, kk = slots.shape[1], slots.shape[2]
    acc = acc_dtype(q.dtype)
    bi, hi = row_index(b, hs, hkv, q.device)
    si = slots.clamp(min=0)
    keys = k[bi, hi, si].reshape(b, hs, kk * p, d).to(acc)  # (B, Hs, K*P, D)
    page = torch.where(slots >= 0, slot_page[bi, hi, si], -1)  # (B, Hs, K)
    kpos = (page.unsqueeze(-1) * p + torch.arange(p, device=q.device)).masked_fill(page.unsqueeze(-1) < 0, -1)
    kpos = kpos.reshape(b, hs, 1, 1, kk * p)
    qpos = q_pos.view(b, 1, 1, s, 1)
    ok = (kpos >= 0) & (kpos <= qpos)  # (B, Hs, 1, S, K*P)
    qg = q.to(acc).view(b, hs, h // hs, s, d) * scale  # scaled before the product: one pass fewer over the logits
    logits = torch.einsum("bngsd,bnkd->bngsk", qg, keys).masked_fill_(~ok, float("-inf"))
    if lse is not None:
        return torch.exp(logits - lse.to(acc).view(b, hs, h // hs, s, 1)).masked_fill_(~ok, 0.0)
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0)


def attend_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor,
                        slots: torch.Tensor, q_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` that also returns its attention weights, for methods that score tokens by attention (H2O, TOVA,
    SnapKV).

    Returns the output (B, H, S, D) in q's dtype and the softmax weights (B, H, S, K * P) in the accumulation
    dtype, where column ``i * P + j`` is token ``j`` of ``slots[..., i]`` (zero for tokens not attended).
    """
    b, h, s, d = q.shape
    hkv, p = k.shape[1], k.shape[3]
    hs, kk = slots.shape[1], slots.shape[2]
    bi, hi = row_index(b, hs, hkv, q.device)
    weights = _weights(q, k, slot_page, slots, q_pos, scale)
    vals = v[bi, hi, slots.clamp(min=0)].reshape(b, hs, kk * p, d).to(weights.dtype)
    out = torch.einsum("bngsk,bnkd->bngsd", weights, vals)
    return out.reshape(b, h, s, d).to(q.dtype), weights.reshape(b, h, s, kk * p)


# Attention weights ``attention_mass`` materialises at once: queries are taken in chunks of this many weights.
MASS_CHUNK_WEIGHTS = 1 << 24


def attention_mass(q: torch.Tensor, k: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
                   q_pos: torch.Tensor, scale: float, in_order: bool = False,
                   lse: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of ``attend_with_weights`` summed over the queries: the attention each token receives from all
    of them (H2O's prompt scores).

    q: (B, H, S, D) with positions q_pos (B, S) (-1: a query that sees nothing); k, slot_page, slots as in
    ``attend``. Returns (B, H, K * P) in the accumulation dtype, column ``i * P + j`` token ``j`` of
    ``slots[..., i]``. ``in_order``: the caller's promise that slots lists every slot in order and slot j holds
    page j or is free (``check_in_order``; a prompt's layer), so that a kernel takes token t at position t and
    reads no token past the queries; the result is the same. ``lse``: None, or (B, H, S) each query's
    log-sum-exp over the tokens it sees (natural log; a prompt's own attention computes it), which the weights then
    divide by in place of their own sum (a kernel skips the pass that would compute it). Queries are taken in chunks
    of at most about ``MASS_CHUNK_WEIGHTS`` weights at once.
    """
    if in_order:
        check_in_order("attention_mass", slot_page, slots)
    b, h, s, _ = q.shape
    hs, kk, p = slots.shape[1], slots.shape[2], k.shape[3]
    chunk = max(1, MASS_CHUNK_WEIGHTS // max(1, b * h * kk * p))
    total = torch.zeros(b, h, kk, p, dtype=acc_dtype(q.dtype), device=q.device)
    bi, hi = row_index(b, hs, k.shape[1], q.device)
    first = torch.where(slots >= 0, slot_page[bi, hi, slots.clamp(min=0)] * p, -1)  # (B, Hs, K) first positions
    for start in range(0, s, chunk):
        q_chunk = q_pos[:, start:start + chunk]
        # Only the slots holding a token at or before the chunk's last query get weight (a prompt's causal half).
        kept = ((first >= 0) & (first <= q_chunk.max())).flatten(0, 1).any(0).nonzero().squeeze(1)
        if kept.numel():
            w = _weights(q[:, :, start:start + chunk], k, slot_page, slots[:, :, kept], q_chunk, scale,
                         None if lse is None else lse[:, :, start:start + chunk])
            total[:, :, kept] += w.sum(dim=3).reshape(b, h, kept.numel(), p)
    return total.view(b, h, kk * p)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
           q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of queries over the tokens of the given slots.

    q: (B, H, S, D); k, v: (B, Hkv, C, P, D); slot_page: (B, Hkv, C); slots: (B, Hs, K), -1 = none;
    q_pos: (B, S) position of each query, -1 for padding. A query attends to the tokens of its row's slots whose
    position is <= its own. Returns (B, H, S, D) in q's dtype; queries with nothing to attend give zeros.
    """
    return attend_with_weights(q, k, v, slot_page, slots, q_pos, scale)[0]


def check_attended(attended: torch.Tensor, slots: torch.Tensor) -> None:
    """``sparse_decode``'s running totals: (B, Hs) int64 for slots (B, Hs, K)."""
    if attended.shape != slots.shape[:2] or attended.dtype != torch.int64:
        raise ValueError(f"sparse_decode: attended must be {tuple(slots.shape[:2])} int64 (one total per selection "
                         f"row), got {tuple(attended.shape)} {attended.dtype}")


def check_in_order(name: str, slot_page: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """The ``in_order`` promise of op ``name``: slot j holds page j or is free (a layer without holes, so that a
    row's pages are its first slots), and slots (B, Hkv, C), when given, lists every slot in order (so that a
    kernel need not read it)."""
    c = slot_page.shape[2]
    ids = torch.arange(c, device=slot_page.device)
    if slots is not None and (slots.shape != slot_page.shape or not torch.equal(slots, ids.expand_as(slots))):
        raise ValueError(f"{name}: in_order needs slots listing all {c} slots of every row in order, got shape "
                         f"{tuple(slots.shape)}")
    if bool(((slot_page >= 0) & (slot_page != ids)).any()):
        raise ValueError(f"{name}: in_order needs slot j to hold page j or be free (a layer without holes)")


def sparse_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
                  seq_len: torch.Tensor, scale: float, attended: torch.Tensor | None = None,
                  in_order: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step over the selected slots.

    q: (B, H, D); k, v: (B, Hkv, C, P, D), or with ``table`` (B, C) int64 a pool's shared pages (1, Hkv, N, P, D),
    slot s of row b's keys and values in page ``table[b, s]``; slot_page: (B, Hkv, C); slots: (B, Hs, K); seq_len:
    (B,) tokens per sequence including the current one; attended: None, or (B, Hs) int64 running totals to which
    each selection row's attended tokens (``count_attended``) are added in place. ``in_order``: the caller's promise
    that slots lists every slot of every row in order and slot j holds page j or is free (``check_in_order``; with
    ``table``, of the rows' own slots), so that a kernel reads each row only up to its length (a pool's rows are
    sized for its longest request) and takes slot j for entry j without reading it; the result is the same.
    Returns (B, H, D).
    """
    if in_order:
        check_in_order("sparse_decode", slot_page, slots)
    if attended is not None:
        check_attended(attended, slots)
        attended.add_(count_attended(slot_page, slots, seq_len, k.shape[3]))
    if table is not None:
        k, v, slot_page, slots = selected_pages(k, v, slot_page, slots, table)
    return attend(q.unsqueeze(2), k, v, slot_page, slots, (seq_len - 1).unsqueeze(1), scale).squeeze(2)


def selected_pages(k: torch.Tensor, v: torch.Tensor, slot_page: torch.Tensor, slots: torch.Tensor,
                   table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The pages that ``slots`` (B, Hs, K) select in a store of shared pages k, v (1, Hkv, N, P, D), which row b's
    ``table`` (B, C) maps its slots into, as caches of their own with a row per selection row: keys and values
    (B, Hs, K, P, D), their pages (B, Hs, K) and the slots selecting them (entry j: slot j, or -1), so that
    ``attend`` over them is ``attend`` over the rows' slots (only the selection is copied)."""
    b, hs, n = slots.shape
    c = slot_page.shape[2]
    if k.shape[0] != 1 or table.shape != (b, c) or table.dtype != torch.int64:
        raise ValueError(f"sparse_decode: table must be ({b}, {c}) int64 over a store of one row, got "
                         f"{tuple(table.shape)} {table.dtype} and a store of {k.shape[0]} rows")
    picked = slots >= 0
    at = slots.clamp(min=0)
    head = (torch.arange(hs, device=slots.device) // (hs // k.shape[1])).view(1, hs, 1)  # each row's KV head
    store = table.gather(1, at.flatten(1)).view(b, hs, n)
    pages = torch.where(picked, slot_page[:, head.view(-1)].gather(2, at), -1)
    ids = torch.where(picked, torch.arange(n, device=slots.device), -1)
    return k[0][head, store], v[0][head, store], pages, ids


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A weight's product in a decode step: x (..., K), weight (N, K), bias (N,) or None. Returns (..., N) in x's
    dtype, as ``torch.nn.functional.linear``, always as one matrix product: x's leading dims are folded first,
    since ``F.linear`` runs a 3-D x whose size-1 dim has a stride other than K (as torch.compile lays out the
    attention output (B, 1, H * D)) as a batch of matrix-vector products, each reading the whole weight (the
    output projection of Llama-3-8B at 9 rows on the H200: 58.9 us against 11.2)."""
    return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


# Weights in groups of GROUP along the input: w = scale * q + minimum, q an unsigned code of 4 or 8 bits.
GROUP = 32


# The CUDA kernel's layout of 4-bit codes (``to_tiles``): tiles of TILE_N outputs, chunks of CHUNK_K inputs.
TILE_N, CHUNK_K = 16, 64


def tiled(codes: torch.Tensor) -> bool:
    """Whether ``codes`` are in ``to_tiles``' layout (else in ``dequantize``'s rows of groups)."""
    return codes.dim() == 4


def quantized_outputs(codes: torch.Tensor, scale: torch.Tensor) -> int:
    """N, the outputs of a quantized weight's codes and scale, in either layout."""
    return codes.shape[1] * TILE_N if tiled(codes) else scale.shape[0]


def to_tiles(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
             k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes (N, K / 2) uint8, scale and minimum (N, K / 32) fp16 (``dequantize``'s layout; N a multiple of
    TILE_N, K = k a multiple of CHUNK_K) in the layout of the CUDA kernel's operands, where each lane of a warp finds
    the codes of its A fragment of an m16n8k16 product in one 32-bit word.

    Returns words (K / 64, N / 16, 32, 4) int32: for each chunk of 64 inputs and tile of 16 outputs, lane l's four
    words for the chunk's four steps of 16 inputs; a word holds the 8 codes of the lane's fragment (rows g and g + 8,
    g = l // 4; inputs 2t, 2t + 1, 2t + 8, 2t + 9 of the step, t = l % 4), pair j (fragment register j: rows g, g + 8,
    g, g + 8 for j = 0..3, the inputs + 8 for j >= 2) in nibble j (first input) and nibble 4 + j (second). And scale
    and minimum (K / 64, N / 16, 8, 2, 2) fp16: per chunk, tile and g, the chunk's first group's values of rows g and
    g + 8, then its second group's. A chunk's tiles lie next to each other, so that the kernel reads one stretch of
    memory at a time; the tiles of stacked weights (dim 1) are the stacked weights' tiles."""
    n = scale.shape[0]
    if n % TILE_N or k % CHUNK_K or codes.shape != (n, k // 2) or scale.shape != (n, k // GROUP):
        raise ValueError(f"to_tiles: 4-bit codes of N x K = {n} x {k} with N a multiple of {TILE_N} and K of "
                         f"{CHUNK_K}, got codes {tuple(codes.shape)} and scales {tuple(scale.shape)}")
    q = code_values(codes, scale, k)
    # (tile, row half p, g, chunk, step j, input half h, t, e) to (chunk, tile, g, t, j, e, h, p): nibble 4e + 2h + p.
    q = q.view(n // TILE_N, 2, 8, k // CHUNK_K, 4, 2, 4, 2).permute(3, 0, 2, 6, 4, 7, 5, 1)
    q = q.reshape(k // CHUNK_K, n // TILE_N, 32, 4, 8)
    words = torch.zeros(q.shape[:-1], dtype=torch.int32, device=q.device)
    for nibble in range(8):
        words |= q[..., nibble] << (4 * nibble)

    def groups(v: torch.Tensor) -> torch.Tensor:  # (tile, p, g, chunk, group) to (chunk, tile, g, group, p)
        return v.view(n // TILE_N, 2, 8, k // CHUNK_K, 2).permute(3, 0, 2, 4, 1).contiguous()

    return words, groups(scale), groups(minimum)


def from_tiles(words: torch.Tensor, scale: torch.Tensor,
               minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``to_tiles``' operands back to the codes' values q (N, K) int32 and scale and minimum (N, K / 32)."""
    chunks, tiles = words.shape[:2]
    if words.shape[2:] != (32, 4) or scale.shape != (chunks, tiles, 8, 2, 2) or minimum.shape != scale.shape:
        raise ValueError(f"from_tiles: words (K / 64, N / 16, 32, 4) and scales (K / 64, N / 16, 8, 2, 2), got "
                         f"{tuple(words.shape)} and {tuple(scale.shape)}")
    n, k = tiles * TILE_N, chunks * CHUNK_K
    q = torch.stack([(words >> (4 * nibble)) & 15 for nibble in range(8)], dim=-1)
    q = q.view(chunks, tiles, 8, 4, 4, 2, 2, 2).permute(1, 7, 2, 0, 4, 6, 3, 5).reshape(n, k)

    def groups(v: torch.Tensor) -> torch.Tensor:
        return v.permute(1, 4, 2, 0, 3).reshape(n, k // GROUP)

    return q, groups(scale), groups(minimum)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, k) weight of group-quantized codes: codes (N, G * 16) uint8 of 4 bits (``quant.pack_nibbles``'s
    layout: each little-endian 32-bit word holds 8 inputs, the even ones in nibbles 0-3, the odd ones in 4-7) or
    (N, G * 32) of 8 bits (one byte per input); scale, minimum (N, G), G = ceil(k / GROUP) (the codes of a last
    group's inputs past k are ignored). Or 4-bit codes in ``to_tiles``' layout, K = k.
    ``scale * q + minimum`` is computed in float32 (float64 for ``dtype`` float64), then cast to ``dtype``."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    if tiled(codes):
        q, scale, minimum = from_tiles(codes, scale, minimum)
        if q.shape[1] != k:
            raise ValueError(f"tiled codes of {q.shape[1]} inputs do not hold {k} inputs")
        n, groups = scale.shape
        q = q.view(n, groups, GROUP)
    else:
        n, groups = scale.shape
        per_group = codes.shape[1] // groups
        if per_group * groups != codes.shape[1] or per_group not in (GROUP // 2, GROUP) or -(-k // GROUP) != groups:
            raise ValueError(f"codes of shape {tuple(codes.shape)} and scales of shape {tuple(scale.shape)} do not "
                             f"hold {k} inputs in groups of {GROUP} of 4 or 8 bits")
        q = codes.view(n, groups, per_group)
        if per_group == GROUP // 2:
            # (N, G, word, half, byte, nibble): input 2 * (2 * byte + nibble) + half of the word (little-endian)
            q = torch.stack([q & 15, q >> 4], dim=3).view(n, groups, 4, 2, 2, 2)
            q = q.permute(0, 1, 2, 4, 5, 3).reshape(n, groups, GROUP)
    w = q.to(exact) * scale.to(exact).unsqueeze(2) + minimum.to(exact).unsqueeze(2)
    return w.view(n, groups * GROUP)[:, :k].to(dtype)


def code_values(codes: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k) int32: the codes q themselves (``dequantize`` with scale 1 and minimum 0), for kernels that repack
    them in their own layout."""
    return dequantize(codes, torch.ones_like(scale), torch.zeros_like(scale), k).to(torch.int32)


def linear_quantized(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear`` of a group-quantized weight (``dequantize``'s codes, scale, minimum, in either layout): x (..., K).
    Returns (..., N) in x's dtype."""
    weight = dequantize(codes, scale, minimum, x.shape[-1], torch.float64 if x.dtype == torch.float64 else x.dtype)
    return linear(x, weight, bias)


def count_attended(slot_page: torch.Tensor, slots: torch.Tensor, seq_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Tokens each selection row attends in a decode step. slots: (B, Hs, K). Returns (B, Hs) int64."""
    b, hs, _ = slots.shape
    bi, hi = row_index(b, hs, slot_page.shape[1], slots.device)
    page = torch.where(slots >= 0, slot_page[bi, hi, slots.clamp(min=0)], -1)
    start = page * page_size
    n = (seq_len.view(b, 1, 1) - start).clamp(min=0, max=page_size)
    return torch.where(page >= 0, n, 0).sum(-1)


def window_token_maxima(q: torch.Tensor, k: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor,
                        limit: torch.Tensor, scale: float) -> torch.Tensor:
    """OmniKV's per-query token scores: for each window query and stored token, the max over query heads of the
    query's softmax attention probability (``weigh_window`` sums them into the token scores; heads split over
    processes take the max over all of them first).

    q: (B, H, W, D) window queries; k: (B, Hkv, N, D) a flat token store (a paged layer's ``k.flatten(2, 3)``);
    key_pos: (B, N) position of each stored token, -1 where none (the same for every KV head: layers that never
    evict); q_pos: (B, W) position of each window query, -1 for an empty entry; limit: (B,) the candidates are the
    tokens at positions < limit (the prompt). A query's softmax runs over the candidates at positions <= its own.
    Returns (B, W, N) float32 (float64 for float64 inputs), -inf for tokens that are not candidates.
    """
    b, h, w, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    logits = torch.einsum("bngwd,bnkd->bngwk", q.to(acc).view(b, hkv, h // hkv, w, d), k.to(acc)) * scale
    cand = (key_pos >= 0) & (key_pos < limit.view(b, 1))  # (B, N)
    ok = cand.view(b, 1, 1, 1, n) & (key_pos.view(b, 1, 1, 1, n) <= q_pos.view(b, 1, 1, w, 1))
    probs = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs.flatten(1, 2).amax(dim=1).masked_fill(~cand.view(b, 1, n), float("-inf"))


def weigh_window(maxima: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """OmniKV's token scores from the window maxima (B, W, N) of ``window_token_maxima``: the sum over the window
    of ``weight`` (W,) (positive) times each query's maxima. Returns (B, N), -inf for tokens that are not
    candidates."""
    return (maxima * weight.to(maxima.dtype).view(1, -1, 1)).sum(dim=1)


def sparse_decode_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over chosen tokens of a flat token store, with the log-sum-exp that lets partial results
    over disjoint token sets be merged (``merge_attention``).

    q: (B, H, D); k, v: (B, Hkv, N, D) (a paged layer's ``k.flatten(2, 3)``, or any packed buffer); tokens:
    (B, Hs, K) int64 indices into N, -1 = none, with Hs = 1 (one set for all heads), Hkv or H. Every listed token is
    attended (the caller lists only tokens the query may see). Returns out (B, H, D) and lse (B, H), both float32
    (float64 for float64 inputs); a row with no token gives out 0 and lse -inf.
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    hs, kk = tokens.shape[1], tokens.shape[2]
    rows = max(hs, hkv)
    acc = acc_dtype(q.dtype)
    idx = tokens.expand(b, rows, kk) if hs == 1 else tokens
    bi, head = row_index(b, rows, hkv, q.device)
    keys = k[bi, head, idx.clamp(min=0)].to(acc)  # (B, rows, K, D)
    vals = v[bi, head, idx.clamp(min=0)].to(acc)
    logits = torch.einsum("bngd,bnkd->bngk", q.to(acc).view(b, rows, h // rows, d), keys) * scale
    logits = logits.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # (B, rows, G)
    weights = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bngk,bnkd->bngd", weights, vals)
    return out.reshape(b, h, d), lse.reshape(b, h)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Combines attention results over disjoint token sets into the attention over their union.

    parts: [(out (B, H, D), lse (B, H))] as ``sparse_decode_tokens`` returns them. Returns (B, H, D) in ``dtype``.
    """
    lse = torch.stack([p[1] for p in parts])  # (n, B, H)
    total = torch.logsumexp(lse, dim=0)
    share = torch.exp(lse - total).nan_to_num(0.0)
    out = sum(s.unsqueeze(-1) * p[0] for s, p in zip(share, parts))
    return out.to(dtype)


def merge_lse(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets combined into the attention over their union (a prompt pass's parts,
    ``integrations.transformers.prompt_attention``): a, b (B, H, S, D), any strides, with their log-sum-exp lse_a,
    lse_b (B, H, S) float32 (-inf: no key). Returns out (B, H, S, D) in a's dtype (0 where neither part has a key)
    and lse (B, H, S) float32, so that further parts merge into it."""
    acc = acc_dtype(a.dtype)
    lse = torch.logaddexp(lse_a.to(acc), lse_b.to(acc))
    share_a = torch.exp(lse_a.to(acc) - lse).nan_to_num(0.0).unsqueeze(-1)
    share_b = torch.exp(lse_b.to(acc) - lse).nan_to_num(0.0).unsqueeze(-1)
    return (share_a * a.to(acc) + share_b * b.to(acc)).to(a.dtype), lse.to(lse_a.dtype)


def append_pages(k: torch.Tensor, v: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                 cur_slot: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, start: int, row: int,
                 table: torch.Tensor | None = None) -> None:
    """Stores a prompt pass of real tokens in place: k_new, v_new (R, Hkv, S, D) at positions ``start .. start + S -
    1`` of rows ``row .. row + R - 1``, in a layer whose slot j holds page j (no slot freed); updates the bounds of
    the pages the tokens reach (merged with the bound so far on the page the rows were filling, fresh on the
    others), those slots' ``slot_page`` entries and the rows' ``cur_slot`` (the last page's slot).

    Layouts as ``append_token``'s: k, v (B, Hkv, C, P, D), kmin, kmax (B, Hkv, C, D); or with ``table`` (B, C)
    int64 a pool's shared pages, k, v (1, Hkv, N, P, D) and kmin, kmax (1, Hkv, N, D), slot s of row b in page
    ``table[b, s]``; slot_page (B, Hkv, C); cur_slot (B, Hkv) int64. With one token per page the bounds are views
    of the keys and only the keys are written.
    """
    r, h, s, d = k_new.shape
    p = k.shape[3]
    end = start + s
    first, last = start // p, (end - 1) // p
    n, at = last - first + 1, start - first * p  # pages reached; the first token's offset in them
    pages = torch.arange(first, last + 1, device=k.device)
    wide = acc_dtype(k.dtype)
    for i, b in enumerate(range(row, row + r)):
        slots, kb = (pages, b) if table is None else (table[b, first:last + 1], 0)
        kn = to_cache(k_new[i], k.dtype)
        for cache, new in ((k, kn), (v, to_cache(v_new[i], v.dtype))):
            block = raw(cache)[kb].index_select(1, slots)  # (Hkv, n, P, D)
            block.view(h, n * p, d)[:, at:at + s] = raw(new)
            raw(cache)[kb].index_copy_(1, slots, block)
        if p == 1:
            continue
        # Reduced in the accumulation dtype, which holds every cache dtype exactly (torch has no fp8 reductions on
        # the CPU); the page the row was filling (one that starts before the pass) keeps its tokens' bounds.
        keys = kn.to(wide)
        for bound, reduce, merge, empty in ((kmin, torch.amin, torch.minimum, math.inf),
                                            (kmax, torch.amax, torch.maximum, -math.inf)):
            grid = torch.full((h, n * p, d), empty, dtype=wide, device=k.device)
            grid[:, at:at + s] = keys
            new = reduce(grid.view(h, n, p, d), dim=2)  # (Hkv, n, D)
            if at:
                new[:, 0] = merge(new[:, 0], raw(bound)[kb, :, slots[0]].view(bound.dtype).to(wide))
            raw(bound)[kb].index_copy_(1, slots, raw(new.to(bound.dtype)))
    slot_page[row:row + r, :, first:last + 1] = pages
    cur_slot[row:row + r] = last


def written_pages(slot_mapping: torch.Tensor, page_size: int, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages of a store of ``num_pages`` that a pass wrote by slot numbers (``page * page_size + offset`` of
    each token, slot_mapping (T,) int64, -1 for none), in increasing order (n,) int64, and the last offset written
    in each (n,) int64."""
    slots = slot_mapping[slot_mapping >= 0]
    last = torch.full((num_pages,), -1, dtype=torch.long, device=slot_mapping.device)
    last.scatter_reduce_(0, slots // page_size, slots % page_size, "amax")
    pages = (last >= 0).nonzero().squeeze(1)
    return pages, last[pages]


def page_bounds(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The key bounds of the pages a pass wrote into a store of pages by slot numbers (as vLLM writes its blocks):
    each page written gets the channel-wise min and max of its keys at offsets 0 to the last one written, so a
    page that starts over (a freed block taken by another request) loses its old bounds.

    k: (1, Hkv, N, P, D) the store's keys, the pass's already written; kmin, kmax: (1, Hkv, N, D), set in place;
    slot_mapping: (T,) int64, ``page * P + offset`` of each token written, -1 for none (padding). A page's tokens
    are consecutive entries, in order of their offsets.
    """
    p = k.shape[3]
    pages, last = written_pages(slot_mapping, p, k.shape[2])
    acc = acc_dtype(k.dtype) if k.dtype != FP8 else torch.float32
    keys = k[0][:, pages].to(acc)  # (Hkv, n, P, D)
    written = (torch.arange(p, device=k.device) <= last.unsqueeze(1)).view(1, -1, p, 1)
    kmin[0][:, pages] = keys.masked_fill(~written, float("inf")).amin(2).to(kmin.dtype)
    kmax[0][:, pages] = keys.masked_fill(~written, float("-inf")).amax(2).to(kmax.dtype)


def append_token(k: torch.Tensor, v: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slot_page: torch.Tensor,
                 cur_slot: torch.Tensor, position: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 has_holes: bool, table: torch.Tensor | None = None) -> None:
    """Stores one decode token per sequence in place, updates its page's key bounds and the current slots.

    k, v: (B, Hkv, C, P, D), slot C - 1 the cache's scratch slot; kmin, kmax: (B, Hkv, C, D); or with ``table``
    (B, C) int64 a pool's shared pages, k, v (1, Hkv, N, P, D) and kmin, kmax (1, Hkv, N, D), where slot s of row b
    keeps its keys, values and bounds in page ``table[b, s]``; slot_page: (B, Hkv, C); cur_slot: (B, Hkv) int64 slot
    of each row's current page, updated in place; position: (B,) int64 the token's position in the sequence (-1: no
    token for that sequence); k_new, v_new: (B, Hkv, D). The token goes to offset ``position % P`` of the current
    page's slot; at offset 0 it starts a page in a fresh slot: the lowest free one of the first C - 1
    (``has_holes``), else slot ``position // P`` (while no slot was ever freed, slot j holds page j). The caller
    keeps a free slot for it. The slot then holds page ``position // P``, its bounds restart from this key.
    """
    b, h, c = slot_page.shape
    p = k.shape[3]
    ok = (position >= 0).view(b, 1, 1)
    pos = position.clamp(min=0).view(b, 1).expand(b, h)
    off = pos % p
    if has_holes:
        fresh_slot = (slot_page[:, :, :c - 1] < 0).to(torch.int8).argmax(dim=2)
    else:
        fresh_slot = pos // p
    si = torch.where(off == 0, fresh_slot, cur_slot).clamp(min=0)
    bi = torch.arange(b, device=k.device).view(b, 1)
    hd = torch.arange(h, device=k.device).view(1, h)
    kb, ks = (bi, si) if table is None else (0, table.gather(1, si))
    # Compared and selected in the accumulation dtype, which holds every cache dtype exactly (torch has no fp8
    # comparisons on the CPU). Rows without a token write back what they read: fixed shapes, no host sync.
    wide = acc_dtype(k.dtype)
    kn = torch.where(ok, to_cache(k_new, k.dtype).to(wide), k[kb, hd, ks, off].to(wide))
    k[kb, hd, ks, off] = kn.to(k.dtype)
    v[kb, hd, ks, off] = torch.where(ok, to_cache(v_new, v.dtype).to(wide), v[kb, hd, ks, off].to(wide)).to(v.dtype)
    starts = (off == 0).unsqueeze(-1)
    lo, up = kmin[kb, hd, ks].to(wide), kmax[kb, hd, ks].to(wide)
    kmin[kb, hd, ks] = torch.where(ok, torch.where(starts, kn, torch.minimum(lo, kn)), lo).to(kmin.dtype)
    kmax[kb, hd, ks] = torch.where(ok, torch.where(starts, kn, torch.maximum(up, kn)), up).to(kmax.dtype)
    slot_page[bi, hd, si] = torch.where(ok.view(b, 1), pos // p, slot_page[bi, hd, si])
    cur_slot.copy_(torch.where(ok.view(b, 1), si, cur_slot))


def raas_update(scores: torch.Tensor, slot_page: torch.Tensor, cur_slot: torch.Tensor, stamp: torch.Tensor,
                seq_len: torch.Tensor, limit: torch.Tensor, prompt_pages: torch.Tensor,
                page_size: int, capacity: int, decode_pages: int, top_fraction: float | None, alpha: float | None,
                scale: float) -> None:
    """RaaS's book-keeping of one layer's decode step, in place: the decode pages' timestamps, then at most one
    eviction per row.

    scores: (B, Hkv, C + 1) float32 the step's Quest bounds, -inf for free slots; slot_page, stamp: (B, Hkv, C + 1)
    int64 (slot C the cache's scratch slot, always free); cur_slot: (B, Hkv); seq_len, limit, prompt_pages: (B,)
    int64; ``capacity`` = C. A stamp is the row's ``seq_len`` at the step that refreshed it: stamps are compared
    within a row only, where its length orders its steps as a step count would. The candidates of a row are the
    decode pages (page >= ``prompt_pages``) in its slots ``[prompt_pages, limit)``, where the cache puts them (the
    prompt fills the first slots, and a new page takes the lowest free slot), and at most ``decode_pages`` of them
    (the most any row holds). Exactly one of ``top_fraction`` / ``alpha`` is set. A candidate is refreshed (its
    stamp becomes ``seq_len``) when its score is among the top ``top_fraction`` of the row's valid pages (ceil of the
    fraction, at least one; every page tied with the last one too), or its softmax probability over the row (scores
    times ``scale``) is at least ``alpha``, or it is the page being written. Only candidates carry stamps: prompt
    pages are never evicted. Then in each row whose next token starts a page while it holds ``limit`` pages, the
    candidate with the oldest stamp (ties: the older page) is freed: its ``slot_page`` becomes -1.
    """
    valid = slot_page >= 0
    if alpha is not None:
        used = valid & (torch.softmax(scores.float() * scale, dim=-1) >= alpha)
    else:
        count = valid.sum(dim=-1, keepdim=True)
        take = (count * top_fraction).ceil().long().clamp(min=1)
        kth = scores.sort(dim=-1, descending=True).values.gather(-1, take - 1)
        used = valid & (scores >= kth)
    slot_ids = torch.arange(stamp.shape[2], device=stamp.device)
    first = prompt_pages.view(-1, 1, 1)
    last = torch.minimum(limit.clamp(max=capacity), prompt_pages + decode_pages).view(-1, 1, 1)
    candidate = (slot_ids >= first) & (slot_ids < last) & (slot_page >= first)
    stamp.copy_(torch.where(candidate & (used | (slot_ids == cur_slot.unsqueeze(-1))), seq_len.view(-1, 1, 1),
                            stamp))

    starts_page = (seq_len % page_size == 0).view(-1, 1)
    full = (slot_page[:, :, :capacity] >= 0).sum(dim=-1) >= limit.view(-1, 1)
    # Oldest stamp first; among equal stamps the older page (stamps and pages both fit in 31 bits).
    key = torch.where(candidate, stamp * (1 << 31) + slot_page, torch.iinfo(torch.long).max)
    victim = key.argmin(dim=-1, keepdim=True)
    evict = (starts_page & full & candidate.any(dim=-1)).unsqueeze(-1)
    slot_page.scatter_(2, torch.where(evict, victim, capacity), -1)


def check_code_bits(bits: int, head_dim: int) -> None:
    """Key codes of ``bits`` bits (1, 2 or 4) packed 8 // bits to a byte along the head dim, which must divide."""
    if bits not in (1, 2, 4):
        raise ValueError(f"bits must be 1, 2 or 4, got {bits}")
    if head_dim % (8 // bits):
        raise ValueError(f"{bits}-bit key codes pack {8 // bits} channels per byte: head_dim {head_dim} must be a "
                         f"multiple of {8 // bits}")


def key_codes(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """Each key quantized to ``bits`` bits per channel on its page's range: ``round((k - min) / (max - min) * L)``
    with L = 2^bits - 1 (0 where the range is empty or the slot free), packed along the head dim, channel d in bits
    ``(d % n) * bits`` of byte ``d // n`` (n = 8 // bits).

    k: (..., P, D); kmin, kmax: (..., D) the page bounds. Returns (..., P, D * bits / 8) uint8."""
    check_code_bits(bits, k.shape[-1])
    levels = (1 << bits) - 1
    lo, width = kmin.float().unsqueeze(-2), (kmax.float() - kmin.float()).unsqueeze(-2)
    x = torch.where(width > 0, (k.float() - lo) / width * levels, 0.0)
    code = x.nan_to_num(0.0).round().clamp(0, levels).to(torch.uint8)
    n = 8 // bits
    shifts = torch.arange(n, device=k.device, dtype=torch.uint8) * bits
    return (code.view(*code.shape[:-1], -1, n) << shifts).sum(-1, dtype=torch.uint8)


def code_page(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor, cur_slot: torch.Tensor,
              bits: int, table: torch.Tensor | None = None) -> None:
    """Writes the codes (``key_codes``) of each row's current page on its current range, in place: ``codes[b, h,
    cur_slot[b, h]]``, slot 0 for a row without pages (cur_slot -1).

    k: (B, Hkv, C, P, D); kmin, kmax: (B, Hkv, C, D); codes: (B, Hkv, C, P, D * bits / 8) uint8; or with ``table``
    (B, C) int64 a store of shared pages, k (1, Hkv, N, P, D), kmin, kmax (1, Hkv, N, D) and codes
    (1, Hkv, N, P, D * bits / 8), slot s of row b in page ``table[b, s]``; cur_slot: (B, Hkv) int64."""
    at = current_pages(cur_slot, table)
    codes[at] = key_codes(*(raw(t)[at].view(t.dtype) for t in (k, kmin, kmax)), bits)


def page_codes(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
               slot_mapping: torch.Tensor, bits: int) -> None:
    """The codes (``key_codes``) of every token of each page a pass wrote into a store of pages by slot numbers (as
    vLLM writes its blocks), on the page's bounds (``page_bounds``, already set), in place.

    k: (1, Hkv, N, P, D); kmin, kmax: (1, Hkv, N, D); codes: (1, Hkv, N, P, D * bits / 8) uint8; slot_mapping: (T,)
    int64, ``page * P + offset`` of each token written, -1 for none."""
    pages = written_pages(slot_mapping, k.shape[3], k.shape[2])[0]
    codes[0][:, pages] = key_codes(k[0][:, pages], kmin[0][:, pages], kmax[0][:, pages], bits)


def write_pages(k: torch.Tensor, state: torch.Tensor, slot_mapping: torch.Tensor, summary) -> None:
    """Writes ``summary(keys, slot_page, seq_len)`` of each page a pass wrote into a store of pages by slot numbers
    (as vLLM writes its blocks), from its keys at offsets 0 to the last one written, in place, in state's dtype:
    what ``page_means`` and ``page_stats`` keep. k: (1, Hkv, N, P, D); state: (1, Hkv, N, R, D); slot_mapping:
    (T,) int64, ``page * P + offset`` of each token written, -1 for none."""
    pages, last = written_pages(slot_mapping, k.shape[3], k.shape[2])
    keys = raw(k)[0][:, pages].view(k.dtype).transpose(0, 1).unsqueeze(2)  # (n, Hkv, 1, P, D): a page per row
    first = torch.zeros(keys.shape[:3], dtype=torch.long, device=k.device)  # each row's page 0, its length last + 1
    new = summary(keys, first, last + 1).squeeze(2).transpose(0, 1)
    raw(state)[0][:, pages] = raw(to_cache(new, state.dtype))


def page_means(k: torch.Tensor, means: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The landmarks (``page_landmarks``) of each page a pass wrote into a store of pages by slot numbers (as vLLM
    writes its blocks), from its keys at offsets 0 to the last one written, in place, in means' dtype.

    k: (1, Hkv, N, P, D); means: (1, Hkv, N, L, D), L dividing P; slot_mapping: (T,) int64, ``page * P + offset``
    of each token written, -1 for none."""
    write_pages(k, means, slot_mapping, lambda keys, pages, n: page_landmarks(keys, pages, n, means.shape[3]))


def page_stats(k: torch.Tensor, stats: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The mean and deviation (``page_spreads``) of each page a pass wrote into a store of pages by slot numbers,
    as ``page_means`` writes landmarks. k: (1, Hkv, N, P, D); stats: (1, Hkv, N, 2, D); slot_mapping: (T,)
    int64."""
    write_pages(k, stats, slot_mapping, page_spreads)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``key_codes``' packed codes (..., D * bits / 8) uint8 back to (..., D) integer levels (uint8)."""
    n = 8 // bits
    shifts = torch.arange(n, device=codes.device, dtype=torch.uint8) * bits
    return ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def coded_page_lse(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                   slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                   table: torch.Tensor | None = None) -> torch.Tensor:
    """Per query head and page, the log-sum-exp of the estimated logits ``scale * q . k~`` of its tokens, k~ the
    dequantized key ``min + code * (max - min) / L``.

    q: (B, H, D); kmin, kmax: (B, Hkv, C, D); codes: (B, Hkv, C, P, D * bits / 8) uint8 (``key_codes``); or with
    ``table`` (B, C) int64 a store of shared pages (1, Hkv, N, ...) read through it (``per_row``); slot_page:
    (B, Hkv, C); seq_len: (B,). Tokens at positions >= seq_len and free slots are left out.
    Returns (B, H, C) float32 (float64 for float64 inputs), -inf for free slots."""
    kmin, kmax, codes = per_row(kmin, table), per_row(kmax, table), per_row(codes, table)
    b, h, d = q.shape
    hkv, c, p = codes.shape[1], codes.shape[2], codes.shape[3]
    check_code_bits(bits, d)
    acc = acc_dtype(q.dtype)
    used = (slot_page >= 0).unsqueeze(-1)
    lo = torch.where(used, kmin.to(acc), 0.0)
    step = torch.where(used, (kmax.to(acc) - kmin.to(acc)) / ((1 << bits) - 1), 0.0)
    keys = lo.unsqueeze(-2) + step.unsqueeze(-2) * unpack_codes(codes, bits).to(acc)  # (B, Hkv, C, P, D)
    logits = torch.einsum("bngd,bncpd->bngcp", q.to(acc).view(b, hkv, h // hkv, d), keys) * scale
    pos = slot_page.unsqueeze(-1) * p + torch.arange(p, device=q.device)
    ok = (slot_page.unsqueeze(-1) >= 0) & (pos < seq_len.view(b, 1, 1, 1))  # (B, Hkv, C, P)
    return logits.masked_fill(~ok.unsqueeze(2), float("-inf")).logsumexp(-1).view(b, h, c)


def page_mass(page_lse: torch.Tensor, kv_heads: int, per_query_head: bool = False) -> torch.Tensor:
    """Log of each page's share of a head's attention from per-head page log-sum-exps (B, H, C): the page's minus
    the head's total; per KV head (``per_query_head`` False), the log of the shares summed over the group.
    Returns (B, Hs, C) in page_lse's dtype, -inf for pages without tokens."""
    b, h, c = page_lse.shape
    share = page_lse - page_lse.logsumexp(-1, keepdim=True).nan_to_num(neginf=0.0)
    return share if per_query_head else share.view(b, kv_heads, h // kv_heads, c).logsumexp(2)


def coded_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                 slot_page: torch.Tensor, seq_len: torch.Tensor, scale: float, bits: int,
                 per_query_head: bool = False, table: torch.Tensor | None = None) -> torch.Tensor:
    """Page scores from low-bit key codes: the log of each page's estimated share of the attention,
    ``page_mass(coded_page_lse(...))`` (shapes there). Returns (B, Hs, C), -inf for free slots."""
    return page_mass(coded_page_lse(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, table), kmin.shape[1],
                     per_query_head)


def check_reuse(reuse: int) -> None:
    if reuse < 1 or reuse & (reuse - 1):
        raise ValueError(f"reuse must be a power of two >= 1, got {reuse}")


def due_rows(seq_len: torch.Tensor, first: torch.Tensor, reuse: int) -> torch.Tensor:
    """(B,) bool: the rows whose step chooses pages anew when a choice serves ``reuse`` decode steps: those whose
    current position (seq_len - 1) is a multiple of reuse or is their first decode position ``first`` (B,)."""
    pos = seq_len - 1
    return (pos % reuse == 0) | (pos == first)


def lowbit_select(q: torch.Tensor, k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                  slot_page: torch.Tensor, cur_slot: torch.Tensor, seq_len: torch.Tensor, first: torch.Tensor,
                  chosen: torch.Tensor, scale: float, bits: int, num_pages: int, reuse: int = 1,
                  per_query_head: bool = False, table: torch.Tensor | None = None, in_order: bool = False) -> None:
    """lowbit's step in one op: the codes of each row's current page (``code_page(k, ...)``, in codes, for every
    row), then ``select_pages(coded_scores(...), cur_slot, num_pages)`` (shapes there; ``table`` as there) written
    into ``chosen`` (B, Hs, min(num_pages, C)) int64 for the rows ``due_rows(seq_len, first, reuse)``; the other
    rows keep the pages they chose last, so that a kernel skips their scores and selection. A choice then serves
    ``reuse`` steps; with reuse dividing the page size no step outlives the current page it chose. ``in_order`` as
    ``quest_select``'s."""
    check_reuse(reuse)
    if in_order:
        check_in_order("lowbit_select", slot_page)
    code_page(k, kmin, kmax, codes, cur_slot, bits, table)
    new = select_pages(coded_scores(q, kmin, kmax, codes, slot_page, seq_len, scale, bits, per_query_head, table),
                       cur_slot, num_pages)
    if chosen.shape != new.shape:
        raise ValueError(f"chosen must have shape {tuple(new.shape)} (B, Hs, min(num_pages, C)), got "
                         f"{tuple(chosen.shape)}")
    chosen.copy_(torch.where(due_rows(seq_len, first, reuse).view(-1, 1, 1), new, chosen))
