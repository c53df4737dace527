"""Attention micro-benchmark of one decode step of one layer: dense PyTorch SDPA vs the fused Quest kernels vs naive
torch Quest (the reference ops), on paged caches of random bf16 keys and values.

    python -m sparsekv.bench.attention                  # the full grid (H200: about 3 minutes)
    python -m sparsekv.bench.attention --quick          # Llama-3-8B shape, batch 1, budget 2048, 32K and 128K
    python -m sparsekv.bench.attention --shapes llama2-7b --contexts 32768 --budgets 2048 --batches 1
    python -m sparsekv.bench.attention --tune           # launch-parameter sweep of the two main kernels

Per row: median microseconds per layer (CUDA events, after warm-up) in eager mode and as CUDA-graph replay, the
breakdown estimate / top-k / attention (graph replay of each op alone; "estimate + top-k" is the fused
``quest_select`` the step uses), the whole step including the token append
(graph), achieved TB/s and the ratio to the bandwidth floor (bytes that must be read / 4.2 TB/s). Inputs rotate over
enough copies of the cache ("layers") that one sweep reads several times the L2 cache. Writes
``attention.json``, ``attention.md`` and ``attention.png`` under ``--out`` (default benchmarks/results/; results there
from another device or other options are kept unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import reference
from .common import (SHAPES, Timer, available_bytes, claim_results, copy_bandwidth, device_name, int_arg,
                     kernel_table, markdown_table, memory_problem, output_args, pyplot, refuse, run_setting,
                     write_results)

CEILING = 4.2e12  # bytes/s: the H200's nominal bandwidth, for the floor; the measured copy bandwidth is reported too
L2_BYTES = 60 * 2**20
TARGETS = [  # (shape, context, minimum speedup over dense) at budget 2048, batch 1
    ("llama3-8b", 32768, 1.5), ("llama3-8b", 131072, 4.0), ("llama3-8b", 524288, 8.0), ("llama2-7b", 32768, 5.0)]
FLOOR_TARGET = 2.0  # within this factor of the bandwidth floor from 128K up


class QuestStep:
    """A Quest decode step of one layer over fixed buffers, so that it can be captured in a CUDA graph.

    k, v: (B, Hkv, C, P, D) with the scratch slot last and at least one free slot whenever a new page starts;
    kmin, kmax: (B, Hkv, C, D); slot_page: (B, Hkv, C); cur_slot: (B, Hkv); seq_len: (B,). ``run`` appends the
    token (updating these in place) and attends; ``attention`` only scores, selects and attends. The last results
    stay in ``slots`` (B, Hs, K) and ``out`` (B, H, D).
    """

    def __init__(self, k, v, kmin, kmax, slot_page, cur_slot, seq_len, *, heads: int, num_pages: int,
                 per_query_head: bool):
        self.k, self.v, self.kmin, self.kmax = k, v, kmin, kmax
        self.slot_page, self.cur_slot, self.seq_len = slot_page, cur_slot, seq_len
        self.heads, self.num_pages, self.per_query_head = heads, num_pages, per_query_head
        self.scale = k.shape[-1] ** -0.5
        self.slots: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def attention(self, q: torch.Tensor) -> torch.Tensor:
        """q: (B, H, D) -> (B, H, D)."""
        self.slots = kernels.quest_select(q, self.kmin, self.kmax, self.slot_page, self.cur_slot, self.num_pages,
                                          self.per_query_head)
        self.out = kernels.sparse_decode(q, self.k, self.v, self.slot_page, self.slots, self.seq_len, self.scale)
        return self.out

    def run(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """q: (B, H, D); k_new, v_new: (B, Hkv, D). A new page takes the lowest free slot, as PagedLayer does."""
        kernels.append_token(self.k, self.v, self.kmin, self.kmax, self.slot_page, self.cur_slot, self.seq_len, k_new,
                             v_new, True)
        self.seq_len.add_(1)
        return self.attention(q)

    def capture(self, q, k_new=None, v_new=None) -> torch.cuda.CUDAGraph:
        """Records ``run`` (or ``attention`` without k_new) on these buffers; call ``replay()`` to run it."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            if k_new is None:
                self.attention(q)
            else:
                self.run(q, k_new, v_new)
        return graph


def make_copy(batch, kv_heads, head_dim, context, page_size, spare, dtype, device):
    """A full cache of ``context`` tokens (all pages full) plus ``spare`` free slots and the scratch slot.
    Returns k, v, kmin, kmax, slot_page, cur_slot, seq_len."""
    pages = context // page_size
    slots = pages + spare + 1
    k = torch.randn(batch, kv_heads, slots, page_size, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slot_page = torch.full((batch, kv_heads, slots), -1, dtype=torch.long, device=device)
    slot_page[:, :, :pages] = torch.arange(pages, device=device)
    kmin, kmax = k.amin(dim=3), k.amax(dim=3)
    kmin[:, :, pages:], kmax[:, :, pages:] = float("inf"), float("-inf")
    cur_slot = torch.full((batch, kv_heads), pages - 1, dtype=torch.long, device=device)
    seq_len = torch.full((batch,), context, dtype=torch.long, device=device)
    return k, v, kmin, kmax, slot_page, cur_slot, seq_len


def dense_attention(caches, qs, context: int) -> Callable[[], None]:
    """Dense SDPA decode over the first ``context`` tokens of each cache copy (make_copy's tuples) with its query
    q: (B, H, D)."""
    def sweep():
        for (k, v, *_), q in zip(caches, qs):
            F.scaled_dot_product_attention(q.unsqueeze(2), k.flatten(2, 3)[:, :, :context],
                                           v.flatten(2, 3)[:, :, :context], scale=q.shape[-1] ** -0.5,
                                           enable_gqa=q.shape[1] != k.shape[1])
    return sweep


def quest_bytes(batch, kv_heads, rows, head_dim, context, page_size, budget, itemsize) -> int:
    """Bytes a Quest step must read: key bounds and page table of every page, the selected pages' keys and values
    (per selection row), the query and the output."""
    pages = context // page_size
    meta = batch * kv_heads * pages * (2 * head_dim * itemsize + 8)
    kv = batch * rows * min(budget, context) * head_dim * 2 * itemsize
    return meta + kv + 2 * batch * rows * head_dim * itemsize


def dense_bytes(batch, kv_heads, head_dim, context, itemsize) -> int:
    return batch * kv_heads * context * head_dim * 2 * itemsize


def copy_bytes(batch, kv_heads, head_dim, context, page_size, spare, itemsize=2) -> int:
    """Bytes of one ``make_copy`` cache: keys and values of every slot (the pages, ``spare`` free ones and the
    scratch slot), their bounds and the page table."""
    slots = context // page_size + spare + 1
    return (dense_bytes(batch, kv_heads, head_dim, slots * page_size, itemsize)
            + batch * kv_heads * slots * (2 * head_dim * itemsize + 8))


def bench_config(shape, batch, context, budgets, args, timer, device, notes) -> list[dict]:
    heads, kv_heads, head_dim = SHAPES[shape].attention
    p, dtype, itemsize = args.page_size, torch.bfloat16, 2
    rows = heads if args.per_query_head else kv_heads
    spare = -(-(args.reps + 8) // p) + 1
    one_copy = copy_bytes(batch, kv_heads, head_dim, context, p, spare, itemsize)
    need_once = one_copy + (batch * heads * (context // p) * head_dim * 4 * 3 if args.naive else 0)
    free = available_bytes(device)
    if need_once > 0.85 * free:
        notes.append(f"skipped {shape} batch {batch} context {context}: needs {need_once / 2**30:.1f} GiB, "
                     f"{free / 2**30:.1f} GiB free")
        print(notes[-1], flush=True)
        return []
    touched = quest_bytes(batch, kv_heads, rows, head_dim, context, p, min(budgets), itemsize)
    copies = max(1, min(args.max_copies, math.ceil(4 * L2_BYTES / touched),
                        int((0.85 * free - (need_once - one_copy)) // one_copy)))
    caches = [make_copy(batch, kv_heads, head_dim, context, p, spare, dtype, device) for _ in range(copies)]
    qs = [torch.randn(batch, heads, head_dim, dtype=dtype, device=device) for _ in range(copies)]
    scale = head_dim ** -0.5

    dense_sweep = dense_attention(caches, qs, context)
    dense = {"dense_eager_us": 1e3 * timer.eager(dense_sweep) / copies,
             "dense_graph_us": 1e3 * timer.graph(dense_sweep) / copies}
    out = []
    for budget in budgets:
        n_pages = budget // p
        steps = [QuestStep(*c, heads=heads, num_pages=n_pages, per_query_head=args.per_query_head) for c in caches]
        row = {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": batch,
               "context": context, "budget": budget, "page_size": p, "copies": copies, **dense}

        def sweep(fn):
            return lambda: [fn(s, q) for s, q in zip(steps, qs)]

        row["quest_eager_us"] = 1e3 * timer.eager(sweep(QuestStep.attention)) / copies
        row["quest_graph_us"] = 1e3 * timer.graph(sweep(QuestStep.attention)) / copies
        scores = [kernels.page_scores(q, s.kmin, s.kmax, s.slot_page, args.per_query_head) for s, q in zip(steps, qs)]
        slots = [kernels.select_pages(sc, s.cur_slot, n_pages) for sc, s in zip(scores, steps)]
        # The same tokens as rows of the flat store, for the token-index variant (OmniKV's sparse layers).
        tokens = [torch.where(sl.unsqueeze(-1) >= 0, sl.unsqueeze(-1) * p + torch.arange(p, device=device), -1)
                  .flatten(2) for sl in slots]
        row["estimate_us"] = 1e3 * timer.graph(sweep(lambda s, q: kernels.page_scores(
            q, s.kmin, s.kmax, s.slot_page, args.per_query_head))) / copies
        row["topk_us"] = 1e3 * timer.graph(
            lambda: [kernels.select_pages(sc, s.cur_slot, n_pages) for sc, s in zip(scores, steps)]) / copies
        row["select_us"] = 1e3 * timer.graph(sweep(lambda s, q: kernels.quest_select(
            q, s.kmin, s.kmax, s.slot_page, s.cur_slot, n_pages, args.per_query_head))) / copies
        row["attention_us"] = 1e3 * timer.graph(lambda: [kernels.sparse_decode(
            q, s.k, s.v, s.slot_page, sl, s.seq_len, scale) for s, q, sl in zip(steps, qs, slots)]) / copies
        row["token_attention_us"] = 1e3 * timer.graph(lambda: [kernels.sparse_decode_tokens(
            q, s.k.flatten(2, 3), s.v.flatten(2, 3), t, scale) for s, q, t in zip(steps, qs, tokens)]) / copies
        if args.profile and device.type == "cuda":
            try:  # the profiler's view of graph replays depends on the CUPTI build: a failure is a note, not a row
                row["profile"] = profile_graph(sweep(QuestStep.attention), copies)
            except Exception as err:  # noqa: BLE001
                notes.append(f"profile of {shape} batch {batch} context {context}: {type(err).__name__}: {err}")
                print(notes[-1], flush=True)
        if args.naive:
            def naive(s, q):
                sc = reference.page_scores(q, s.kmin, s.kmax, s.slot_page, args.per_query_head)
                sel = reference.select_pages(sc, s.cur_slot, n_pages)
                return reference.sparse_decode(q, s.k, s.v, s.slot_page, sel, s.seq_len, scale)
            row["naive_eager_us"] = 1e3 * timer.eager(sweep(naive), reps=max(3, args.reps // 6)) / copies
        if device.type == "cuda":
            saved = [(s.slot_page.clone(), s.cur_slot.clone(), s.seq_len.clone()) for s in steps]
            k_new = torch.randn(batch, kv_heads, head_dim, dtype=dtype, device=device)
            row["step_graph_us"] = 1e3 * timer.graph(sweep(lambda s, q: s.run(q, k_new, k_new))) / copies
            for s, (sp, cs, sl) in zip(steps, saved):  # the appended tokens are forgotten
                s.slot_page.copy_(sp)
                s.cur_slot.copy_(cs)
                s.seq_len.copy_(sl)
        floor = quest_bytes(batch, kv_heads, rows, head_dim, context, p, budget, itemsize)
        best = row["quest_graph_us"] if device.type == "cuda" else row["quest_eager_us"]
        gpu = device.type == "cuda"  # the floor is the H200's (CEILING): none on the CPU
        row.update(quest_floor_bytes=floor, quest_floor_us=floor / CEILING * 1e6 if gpu else None,
                   quest_tbps=floor / (best * 1e-6) / 1e12,
                   quest_floor_ratio=best / (floor / CEILING * 1e6) if gpu else None,
                   dense_tbps=dense_bytes(batch, kv_heads, head_dim, context, itemsize)
                   / (row["dense_graph_us" if device.type == "cuda" else "dense_eager_us"] * 1e-6) / 1e12,
                   speedup_eager=row["dense_eager_us"] / row["quest_eager_us"],
                   speedup_graph=row["dense_graph_us"] / row["quest_graph_us"])
        print(format_row(row), flush=True)
        out.append(row)
        for held in (steps, scores, slots, tokens):  # frees this budget's tensors before the next
            held.clear()
    caches.clear()
    qs.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def profile_graph(fn: Callable[[], object], copies: int, reps: int = 20) -> dict:
    """Kernels of a CUDA-graph replay of ``fn`` (``copies`` steps) under torch.profiler (``kernel_table``)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    del graph
    return kernel_table(prof, reps * copies)


def format_row(r: dict) -> str:
    f = lambda x: f"{x:8.1f}" if x == x else "     n/a"  # noqa: E731
    return (f"{r['shape']:10s} B={r['batch']:<3d} ctx={r['context']:<7d} budget={r['budget']:<5d} "
            f"dense {f(r['dense_graph_us'])} | quest eager {f(r['quest_eager_us'])} graph {f(r['quest_graph_us'])} "
            f"(est {f(r['estimate_us'])} topk {f(r['topk_us'])} fused {f(r['select_us'])} attn {f(r['attention_us'])}) "
            f"naive {f(r.get('naive_eager_us', float('nan')))} | x{r['speedup_graph']:.2f} "
            f"{r['quest_tbps']:.2f} TB/s" + ("" if r["quest_floor_ratio"] is None else
                                              f" floor x{r['quest_floor_ratio']:.2f}"))


def check_targets(rows: list[dict]) -> list[dict]:
    found = []
    for shape, context, want in TARGETS:
        match = [r for r in rows if (r["shape"], r["context"], r["budget"], r["batch"]) == (shape, context, 2048, 1)]
        if match:
            r = match[0]
            found.append({"target": f"{shape} {context // 1024}K: >= {want}x dense", "measured":
                          f"{r['speedup_graph']:.2f}x (graph), {r['speedup_eager']:.2f}x (eager)",
                          "met": r["speedup_graph"] >= want})
    for r in rows:
        if r["budget"] == 2048 and r["batch"] == 1 and r["context"] >= 131072 and r["quest_floor_ratio"] is not None:
            found.append({"target": f"{r['shape']} {r['context'] // 1024}K: within {FLOOR_TARGET}x of the floor",
                          "measured": f"{r['quest_floor_ratio']:.2f}x", "met": r["quest_floor_ratio"] <= FLOOR_TARGET})
    return found


def markdown(meta: dict, rows: list[dict], targets: list[dict], notes: list[str]) -> list[str]:
    gpu = meta.get("gpu", True)
    timing = (f"Measured copy bandwidth {meta['copy_tbps']:.2f} TB/s; floor = bytes that must be read / "
              f"{CEILING / 1e12:.1f} TB/s. Times are medians per layer in microseconds (CUDA events); speedup and "
              "TB/s use CUDA-graph replay of dense and Quest alike." if gpu else
              "Times are medians per layer in microseconds (host clock), eager only: graph replays (nan) are a "
              "GPU's.")
    lines = ["# Attention benchmark: one decode step of one layer", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, bf16, page size "
             f"{meta['page_size']}, {'per query head' if meta['per_query_head'] else 'per KV head'} selection. "
             f"{timing} Command: `" + meta["command"] + "`", "",
             "## Targets (budget 2048, batch 1)", "",
             "| target | measured | met |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO'} |" for t in targets]
    cols = [("shape", "shape", "{}"), ("B", "batch", "{}"), ("context", "context", "{}"), ("budget", "budget", "{}"),
            ("dense eager", "dense_eager_us", "{:.1f}"), ("dense graph", "dense_graph_us", "{:.1f}"),
            ("naive torch Quest", "naive_eager_us", "{:.1f}"), ("Quest eager", "quest_eager_us", "{:.1f}"),
            ("Quest graph", "quest_graph_us", "{:.1f}"), ("estimate", "estimate_us", "{:.1f}"),
            ("top-k", "topk_us", "{:.1f}"), ("estimate + top-k (fused op)", "select_us", "{:.1f}"),
            ("attention", "attention_us", "{:.1f}"),
            ("token-index attention", "token_attention_us", "{:.1f}"), ("step incl. append", "step_graph_us", "{:.1f}"),
            ("speedup", "speedup_graph", "{:.2f}x"), ("Quest TB/s", "quest_tbps", "{:.2f}")]
    cols += [("floor us", "quest_floor_us", "{:.1f}"), ("x floor", "quest_floor_ratio", "{:.2f}")] if gpu else []
    lines += ["", "## All rows", "", *markdown_table(cols, rows)]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return lines


def plot(rows: list[dict]):
    """Microseconds per layer against context, per shape and batch: a figure for ``write_results`` (None without
    matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    shapes = sorted({r["shape"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(batches), len(shapes), figsize=(6 * len(shapes), 4.5 * len(batches)), squeeze=False,
                             dpi=110)
    for i, b in enumerate(batches):
        for j, s in enumerate(shapes):
            ax = axes[i][j]
            sel = [r for r in rows if r["shape"] == s and r["batch"] == b]
            budget = 2048 if any(r["budget"] == 2048 for r in sel) else max((r["budget"] for r in sel), default=0)
            sel = sorted((r for r in sel if r["budget"] == budget), key=lambda r: r["context"])
            if not sel:
                ax.set_visible(False)
                continue
            x = [r["context"] for r in sel]
            for key, label in [("dense_graph_us", "dense SDPA"), ("naive_eager_us", "naive torch Quest"),
                               ("quest_eager_us", "Quest kernels, eager"), ("quest_graph_us", "Quest kernels, graph"),
                               ("quest_floor_us", "Quest bandwidth floor")]:
                if all(key in r for r in sel):
                    ax.plot(x, [r[key] for r in sel], marker="o", label=label,
                            linestyle="--" if "floor" in key else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{s}, batch {b}, budget {budget}")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("us per layer")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def rotation(shape: str, batch: int, context: int, page_size: int, max_copies: int) -> int:
    """How many cache copies ``rotated_copies`` makes: enough (at most max_copies) that a sweep of Quest steps at
    budget 2048 reads 4x the L2."""
    _, kv_heads, head_dim = SHAPES[shape].attention
    touched = quest_bytes(batch, kv_heads, kv_heads, head_dim, context, page_size, 2048, 2)
    return max(1, min(max_copies, math.ceil(4 * L2_BYTES / touched)))


def rotated_copies(shape: str, batch: int, context: int, page_size: int, max_copies: int, device):
    """bf16 cache copies (``make_copy``, one spare slot; ``rotation`` of them) and a query (B, H, D) for each.
    Returns (caches, qs)."""
    heads, kv_heads, head_dim = SHAPES[shape].attention
    caches = [make_copy(batch, kv_heads, head_dim, context, page_size, 1, torch.bfloat16, device)
              for _ in range(rotation(shape, batch, context, page_size, max_copies))]
    return caches, [torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device) for _ in caches]


def rotation_problem(cases, page_size: int, max_copies: int, device) -> str | None:
    """``memory_problem`` of the largest of ``cases`` ((shape, batch, context), one at a time) as
    ``rotated_copies``."""
    def need(shape, batch, context):
        _, kv_heads, head_dim = SHAPES[shape].attention
        return rotation(shape, batch, context, page_size, max_copies) * copy_bytes(batch, kv_heads, head_dim,
                                                                                   context, page_size, 1)

    shape, batch, context = max(cases, key=lambda case: need(*case))
    problem = memory_problem({"cache copies": need(shape, batch, context)}, device)
    return problem and f"{shape} at batch {batch} and context {context} {problem}"


TUNE_CASES = [("llama3-8b", 1, 131072), ("llama3-8b", 1, 524288), ("llama2-7b", 1, 32768), ("llama3-8b", 16, 32768)]


def tune(args, timer, device) -> list[dict]:
    """Times launch-parameter variants of the page-score and attention kernels on a few shapes."""
    from ..kernels.triton import TUNING

    base = dict(TUNING)
    page_variants = [dict(page_block=b, page_chunks=ch, page_warps=w, page_stages=st)
                     for b, ch, w, st in [(64, 1, 4, 2), (64, 2, 4, 2), (64, 4, 4, 2), (64, 4, 4, 3), (64, 8, 4, 3),
                                          (32, 4, 4, 3), (128, 2, 8, 3), (128, 4, 8, 3)]]
    # select_max_slots=0 sends every selection to the reference (torch.topk): the baseline the kernel must beat.
    select_variants = [dict(select_one_program=o, select_block=b, select_warps=w, select_digit_bits=d,
                            select_max_slots=m)
                       for o, b, w, d, m in [(4096, 512, 8, 5, 65536), (4096, 512, 8, 8, 65536),
                                             (4096, 1024, 8, 5, 65536), (65536, 512, 16, 5, 65536),
                                             (4096, 512, 8, 5, 0)]]
    attn_variants = [dict(attn_block_n=n, attn_warps=w, attn_stages=st, programs_per_sm=pp)
                     for n, w, st, pp in [(64, 4, 2, 4), (128, 4, 2, 4), (64, 4, 2, 8), (32, 4, 2, 8), (64, 4, 2, 2)]]
    out = []
    for shape, batch, context in TUNE_CASES:
        heads, kv_heads, head_dim = SHAPES[shape].attention
        p = args.page_size
        caches, qs = rotated_copies(shape, batch, context, p, args.max_copies, device)
        copies = len(caches)
        scores = [kernels.page_scores(q, c[2], c[3], c[4]) for c, q in zip(caches, qs)]
        slots = [kernels.select_pages(s, c[5], 2048 // p) for s, c in zip(scores, caches)]
        for kind, variants in (("estimate", page_variants), ("top-k", select_variants), ("attention", attn_variants)):
            for var in variants:
                TUNING.update(base, **var)
                if kind == "estimate":
                    fn = lambda: [kernels.page_scores(q, c[2], c[3], c[4]) for c, q in zip(caches, qs)]  # noqa: E731
                    floor = batch * kv_heads * (context // p) * (2 * head_dim * 2 + 8)
                elif kind == "top-k":
                    fn = lambda: [kernels.select_pages(s, c[5], 2048 // p)  # noqa: E731
                                  for s, c in zip(scores, caches)]
                    floor = sum(s.numel() * 4 for s in scores[:1])
                else:
                    fn = lambda: [kernels.sparse_decode(q, c[0], c[1], c[4], s, c[6], 0.1)  # noqa: E731
                                  for c, q, s in zip(caches, qs, slots)]
                    floor = batch * kv_heads * 2048 * head_dim * 4
                us = 1e3 * timer.graph(fn) / copies
                out.append({"shape": shape, "batch": batch, "context": context, "kernel": kind, **var, "us": us,
                            "tbps": floor / (us * 1e-6) / 1e12})
                print(f"tune {shape} B={batch} ctx={context} {kind} {var}: {us:.1f} us, {out[-1]['tbps']:.2f} TB/s",
                      flush=True)
        for held in (caches, qs, scores, slots):
            held.clear()
        torch.cuda.empty_cache()
    TUNING.update(base)
    return out


def variants(args, timer, device, overrides: list[dict]) -> list[dict]:
    """The Quest step (graph replay; eager on the CPU; budget 2048) at each ``TUNING`` override of ``overrides``
    (the first is the baseline) on the --shapes / --batches / --contexts grid, against dense SDPA in the same run.
    Each variant's slots must be the baseline's (as sets) and its output within bf16 rounding of it; a mismatch is
    reported without a time."""
    from ..kernels.triton import TUNING

    base = dict(TUNING)
    out = []
    for batch in args.batches:
        for shape in args.shapes:
            for context in args.contexts:
                p = args.page_size
                caches, qs = rotated_copies(shape, batch, context, p, args.max_copies, device)
                copies = len(caches)
                steps = [QuestStep(*c, heads=SHAPES[shape].heads, num_pages=2048 // p, per_query_head=False)
                         for c in caches]
                dense = 1e3 * timer.graph(dense_attention(caches, qs, context)) / copies
                sweep = lambda: [s.attention(q) for s, q in zip(steps, qs)]  # noqa: E731
                expected = None
                for i, var in enumerate(overrides):
                    TUNING.update(base, **var)
                    # leaves the last run's slots and output (on the GPU: of the graph replay)
                    us = 1e3 * (timer.graph(sweep) if device.type == "cuda" else timer.eager(sweep)) / copies
                    got = (steps[0].slots.sort(-1).values, steps[0].out.float())
                    expected = expected or got
                    same = bool(torch.equal(got[0], expected[0])
                                and (got[1] - expected[1]).norm() <= 1e-2 * expected[1].norm())
                    out.append({"shape": shape, "batch": batch, "context": context, "variant": i, **var,
                                "quest_us": us if same else None, "dense_us": dense,
                                "speedup": dense / us if same else None, "same_as_baseline": same})
                    print(f"variant {i} {shape} B={batch} ctx={context} {var}: {us:.1f} us (dense {dense:.1f}, "
                          f"x{dense / us:.2f}){'' if same else ' MISMATCH with the baseline'}", flush=True)
                for held in (caches, qs, steps):
                    held.clear()
                torch.cuda.empty_cache()
    TUNING.update(base)
    return out


def best_tuning(rows: list[dict]) -> dict:
    """Per kernel, the launch parameters with the least total time over the tuned shapes."""
    best = {}
    for kind in sorted({r["kernel"] for r in rows}):
        totals: dict[tuple, float] = {}
        for r in rows:
            if r["kernel"] == kind:
                key = tuple((k, v) for k, v in r.items() if k not in ("shape", "batch", "context", "kernel", "us",
                                                                      "tbps"))
                totals[key] = totals.get(key, 0.0) + r["us"]
        best.update(dict(min(totals, key=totals.get)))
    return best


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sparsekv.bench.attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b", "llama2-7b"], choices=sorted(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int_arg(), default=[8192, 32768, 131072, 524288])
    ap.add_argument("--budgets", nargs="+", type=int_arg(), default=[512, 1024, 2048, 4096])
    ap.add_argument("--batches", nargs="+", type=int_arg(), default=[1, 16])
    ap.add_argument("--page-size", type=int_arg(), default=16)
    ap.add_argument("--per-query-head", action="store_true", help="select pages per query head (Hs = H)")
    ap.add_argument("--reps", type=int_arg(), default=30, help="timed repetitions per measurement (median)")
    ap.add_argument("--max-copies", type=int_arg(), default=48, help="cap on cache copies rotated through per sweep")
    ap.add_argument("--no-naive", dest="naive", action="store_false", help="skip naive torch Quest")
    ap.add_argument("--quick", action="store_true", help="llama3-8b, batch 1, budget 2048, contexts 32K and 128K")
    ap.add_argument("--tune", action="store_true", help="sweep kernel launch parameters instead (writes the best)")
    ap.add_argument("--tuning", type=Path, help="launch parameters from a --tune run's JSON ('best')")
    ap.add_argument("--variants", type=json.loads, metavar="JSON", help="a JSON list of TUNING overrides: time the "
                    "Quest step (budget 2048) at each on the grid instead (writes TAG_variants.json)")
    ap.add_argument("--profile", action="store_true", help="also list the kernels of the Quest graph replay "
                    "(torch.profiler): per-kernel times, busy time and span per step")
    output_args(ap, "attention", "output file stem")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    setting = run_setting("attention", args)
    if args.quick:
        args.shapes, args.batches, args.budgets, args.contexts = ["llama3-8b"], [1], [2048], [32768, 131072]
    for ctx in args.contexts:
        if ctx % args.page_size:
            ap.error(f"--contexts: {ctx} is not a multiple of --page-size {args.page_size}")
    for b in args.budgets:
        if b % args.page_size or b < args.page_size:
            ap.error(f"--budgets: {b} is not a positive multiple of --page-size {args.page_size}")
    device = torch.device(args.device)
    tag = f"{args.tag}_tune" if args.tune else f"{args.tag}_variants" if args.variants else args.tag
    claim_results(args.out / f"{tag}.json", device_name(device), setting, args.overwrite)
    cases = TUNE_CASES if args.tune else [(s, b, c) for s in args.shapes for b in args.batches for c in args.contexts]
    problem = (args.tune or args.variants) and rotation_problem(cases, args.page_size, args.max_copies, device)
    if problem:
        shrink = ("--tune's cases need a device with more memory" if args.tune else
                  "use smaller --contexts or --batches, fewer --max-copies, or a device with more memory")
        raise SystemExit(refuse("sparsekv.bench.attention", f"{problem}; {shrink}"))
    torch.manual_seed(0)
    timer = Timer(device, args.reps)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    meta = {"device": device_name(device), "gpu": device.type == "cuda", "torch": torch.__version__,
            "triton": triton_version,
            "page_size": args.page_size, "per_query_head": args.per_query_head, "setting": setting,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python -m sparsekv.bench.attention", *(sys.argv[1:] if argv is None else argv)])}
    meta["copy_tbps"] = copy_bandwidth(device, timer) / 1e12
    print(f"{meta['device']}: copy {meta['copy_tbps']:.2f} TB/s", flush=True)
    if args.tune:
        rows = tune(args, timer, device)
        best = best_tuning(rows)
        print(f"best: {best}")
        write_results(args.out, tag, meta, rows, overwrite=args.overwrite, best=best)
        return
    if args.tuning:
        from ..kernels.triton import TUNING

        TUNING.update(json.loads(args.tuning.read_text())["best"])
    if device.type == "cuda":
        from ..kernels.triton import TUNING

        meta["tuning"] = dict(TUNING)
    if args.variants:
        rows = variants(args, timer, device, args.variants)
        write_results(args.out, tag, meta, rows, overwrite=args.overwrite)
        return
    rows, notes, targets = [], [], []
    for batch in args.batches:  # batch 1 of every shape first: the targets' rows
        for shape in args.shapes:
            for context in args.contexts:
                rows += bench_config(shape, batch, context, sorted(args.budgets), args, timer, device, notes)
                targets = check_targets(rows)  # written after every configuration, so a cut-short run keeps its rows
                write_results(args.out, tag, meta, rows, markdown(meta, rows, targets, notes), targets=targets,
                              notes=notes, overwrite=args.overwrite)
    if rows:
        write_results(args.out, tag, meta, rows, markdown(meta, rows, targets, notes), targets=targets, notes=notes,
                      overwrite=args.overwrite, figure=plot(rows))
    for t in targets:
        print(f"{'met ' if t['met'] else 'MISS'} {t['target']}: {t['measured']}")


if __name__ == "__main__":
    main()
