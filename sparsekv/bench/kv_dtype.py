"""The decode ops that read the KV cache, with bf16 and fp8 caches, at one model's shape and batch 1: dense attention
over the whole context (``sparse_decode`` over every slot, as the dense method runs it), attention over a budget of
selected pages (as Quest's step), and Quest's page scores; each at every ``TUNING`` override of ``--variants``.

    python -m sparsekv.bench.kv_dtype                          # Llama-3-8B, 128K / 512K / 1M, the default variants
    python -m sparsekv.bench.kv_dtype --contexts 4096 --device cpu --reps 1   # a smoke run (interpreter)

Per row: the median microseconds of a CUDA-graph replay (after warm-up) per op call, GB/s of the bytes the op must
read (keys, values and bounds at their cache's bytes per element, page table, selection, query and output) and
the ratio to their floor at the copy bandwidth measured in the same run. Sparse attention rotates over enough
random selections, page scores over enough copies of the bounds, that a sweep reads at least 4x the L2. Before
timing, each variant's outputs on a small cache are checked against float64 on the same cache values
(``rel_err``). Writes ``TAG.json`` and ``TAG.md`` under ``--out`` (results there from another device or other options
are kept unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from .. import kernels
from ..kernels import reference as ref
from .attention import L2_BYTES
from .common import (SHAPES, Timer, claim_results, copy_bandwidth, device_name, int_arg, markdown_table,
                     memory_problem, output_args, refuse, run_setting, write_results)

DTYPES = {"bf16": torch.bfloat16, "fp8": ref.FP8}
# Each variant: a name, the ops it is timed on and its TUNING overrides (applied to fp8 caches only; bf16 runs
# the defaults): the CUDA attention kernel's launch (``cuda_fp8_*`` keys) against its neighbours and the Triton
# kernel, and the page scores' blocks.
VARIANTS = [
    {"name": "current", "ops": ["dense", "sparse", "scores"], "tuning": {}},
    {"name": "triton", "ops": ["dense"], "tuning": {"cuda_fp8_attn": False}},
    *({"name": f"cuda blocks {n}", "ops": ["dense"], "tuning": {"cuda_fp8_blocks_per_sm": n}} for n in (1, 3, 4)),
    *({"name": f"scores b{b}", "ops": ["scores"], "tuning": {"fp8_page_block": b}} for b in (64, 256)),
]


def cache(kv_heads: int, head_dim: int, context: int, page_size: int, dtype: torch.dtype, device):
    """A full batch-1 cache of ``context`` tokens plus the scratch slot: k, v (1, Hkv, C + 1, P, D), kmin, kmax
    (1, Hkv, C + 1, D) in ``dtype`` (random values, fp8 from bf16 draws), slot_page (1, Hkv, C + 1), seq_len (1,)."""
    pages = context // page_size
    k = ref.to_cache(torch.randn(1, kv_heads, pages + 1, page_size, head_dim, device=device,
                                 dtype=torch.bfloat16) * 2, dtype)
    v = ref.to_cache(torch.randn_like(k, dtype=torch.bfloat16) * 2, dtype)
    kmin, kmax = (ref.to_cache(t, dtype) for t in (k.float().amin(3), k.float().amax(3)))
    slot_page = torch.full((1, kv_heads, pages + 1), -1, dtype=torch.long, device=device)
    slot_page[:, :, :pages] = torch.arange(pages, device=device)
    return k, v, kmin, kmax, slot_page, torch.tensor([context], device=device)


def random_slots(kv_heads: int, pages: int, k: int, device) -> torch.Tensor:
    """(1, Hkv, k) distinct random slots per KV head, the last page always among them."""
    return torch.cat([torch.rand(1, kv_heads, pages - 1, device=device).argsort(-1)[..., :k - 1],
                      torch.full((1, kv_heads, 1), pages - 1, device=device)], -1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def check(shape, dtype, tokens: int, budget: int, page_size: int, device) -> dict:
    """Relative errors against float64 on the same cache values, on a cache of ``tokens`` tokens: dense attention,
    attention over ``budget`` tokens of random pages, page scores."""
    heads, kv_heads, head_dim = shape
    k, v, kmin, kmax, slot_page, seq_len = cache(kv_heads, head_dim, tokens, page_size, dtype, device)
    q = torch.randn(1, heads, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    up = [t.double() for t in (q, k, v, kmin, kmax)]
    every = torch.arange(slot_page.shape[2], device=device).expand(1, kv_heads, -1)
    sel = random_slots(kv_heads, slot_page.shape[2] - 1, budget // page_size, device)
    errs = {}
    for name, slots in (("dense", every), ("sparse", sel)):
        got = kernels.sparse_decode(q, k, v, slot_page, slots, seq_len, scale)
        errs[name] = rel_err(got, ref.sparse_decode(*up[:3], slot_page, slots, seq_len, scale))
    got = kernels.page_scores(q, kmin, kmax, slot_page, False)
    want = ref.page_scores(up[0], up[3], up[4], slot_page, False)
    fin = want.isfinite()
    errs["scores"] = rel_err(got[fin], want[fin])
    return errs


def cache_bytes(kv_heads: int, head_dim: int, contexts: list[int], page_size: int) -> int:
    """About the most memory the caches take at once: the largest context's bf16 keys and values, with its fp8 cache
    drawn while they are still held (its bf16 draws, then the fp8 values): 2.5 times the bf16 cache."""
    bf16 = 2 * kv_heads * (max(contexts) // page_size + 1) * page_size * head_dim * 2
    return bf16 * 5 // 2


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sparsekv.bench.kv_dtype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int_arg(), default=[131072, 524288, 1048576])
    ap.add_argument("--budget", type=int_arg(), default=2048, help="selected tokens of the sparse attention")
    ap.add_argument("--page-size", type=int_arg(), default=16)
    ap.add_argument("--variants", type=json.loads, metavar="JSON", help="a JSON list of {name, ops, tuning} "
                    "(ops among dense, sparse, scores) instead of the built-in list")
    ap.add_argument("--check-tokens", type=int_arg(), default=16384, help="context of the float64 checks (dense "
                    "rows of at least TUNING's attn_long_tokens take the launch of long rows)")
    ap.add_argument("--reps", type=int_arg(), default=30, help="timed repetitions per measurement (median)")
    output_args(ap, "kv_dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    setting = run_setting("kv_dtype", args)
    from ..kernels.triton import TUNING

    device = torch.device(args.device)
    claim_results(args.out / f"{args.tag}.json", device_name(device), setting, args.overwrite)
    _, kv_heads, head_dim = SHAPES[args.shape].attention
    problem = memory_problem({"KV caches": cache_bytes(kv_heads, head_dim, args.contexts, args.page_size)}, device)
    if problem:
        raise SystemExit(refuse("sparsekv.bench.kv_dtype", f"--contexts up to {max(args.contexts)} of --shape "
                               f"{args.shape} {problem}; use smaller --contexts or a smaller --shape (e.g. tiny)"))
    torch.manual_seed(0)
    timer = Timer(device, args.reps)
    variants = args.variants or VARIANTS
    shape = SHAPES[args.shape].attention
    heads, kv_heads, head_dim = shape
    p = args.page_size
    meta = {"device": device_name(device), "shape": args.shape, "budget": args.budget, "page_size": p,
            "check_tokens": args.check_tokens, "setting": setting,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tuning": dict(TUNING),
            "command": " ".join(["python -m sparsekv.bench.kv_dtype", *(sys.argv[1:] if argv is None else argv)])}
    copy_bps = copy_bandwidth(device, timer)
    meta["copy_tbps"] = copy_bps / 1e12
    print(f"{meta['device']}: copy {meta['copy_tbps']:.2f} TB/s", flush=True)
    base = dict(TUNING)
    rows = []

    def tune(overrides: dict) -> None:
        TUNING.clear()
        TUNING.update(base, **overrides)

    def rotations(touched: int) -> int:
        """Inputs to rotate through so that a timed call does not find the last one's bytes in the GPU's L2 cache;
        one on the CPU, where the times are a smoke test (tens of thousands of copies of a small shape's inputs
        made one run take minutes)."""
        return max(1, math.ceil(4 * L2_BYTES / touched)) if device.type == "cuda" else 1

    def timed(fn, calls: int) -> float:
        return 1e3 * (timer.graph(fn) if device.type == "cuda" else timer.eager(fn)) / calls

    for kv in DTYPES:
        dtype = DTYPES[kv]
        for var in variants if kv == "fp8" else variants[:1]:
            tune(var["tuning"])
            errs = check(shape, dtype, args.check_tokens, args.budget, p, device)
            print(f"{kv} {var['name']}: rel_err vs float64 {errs}", flush=True)
            rows.append({"kv": kv, "variant": var["name"], "op": "check", **{f"err_{k}": e for k, e in errs.items()}})
        tune({})
    for context in args.contexts:
        for kv, dtype in DTYPES.items():
            size = dtype.itemsize
            k, v, kmin, kmax, slot_page, seq_len = cache(kv_heads, head_dim, context, p, dtype, device)
            pages = context // p
            q = torch.randn(1, heads, head_dim, device=device, dtype=torch.bfloat16)
            scale = head_dim ** -0.5
            every = torch.arange(pages + 1, device=device).expand(1, kv_heads, -1)
            qo = 2 * heads * head_dim * 2
            n_sel = args.budget // p
            sel_bytes = kv_heads * n_sel * (2 * p * head_dim * size + 8 + 8) + qo
            n_rot = rotations(sel_bytes)
            sels = [random_slots(kv_heads, pages, n_sel, device) for _ in range(n_rot)]
            score_bytes = kv_heads * (pages + 1) * (2 * head_dim * size + 8 + 4) + heads * head_dim * 2
            n_copies = rotations(score_bytes)
            bounds = [(kmin.clone(), kmax.clone()) for _ in range(n_copies)]
            ops = {
                "dense": (lambda: kernels.sparse_decode(q, k, v, slot_page, every, seq_len, scale), 1,  # noqa: E731
                          kv_heads * (pages + 1) * (2 * p * head_dim * size + 16) + qo),
                "sparse": (lambda: [kernels.sparse_decode(q, k, v, slot_page, s, seq_len, scale)  # noqa: E731
                                    for s in sels], n_rot, sel_bytes),
                "scores": (lambda: [kernels.page_scores(q, lo, hi, slot_page, False)  # noqa: E731
                                    for lo, hi in bounds], n_copies, score_bytes),
            }
            fresh = True
            for var in variants if kv == "fp8" else variants[:1]:
                tune(var["tuning"])
                for op in var["ops"]:
                    fn, calls, nbytes = ops[op]
                    try:
                        if fresh:  # the first timing over a new cache read ~12% slow at 1M (H200): not kept
                            timed(fn, calls)
                            fresh = False
                        us = timed(fn, calls)
                    except Exception as e:  # a launch that does not compile or fit: reported, not fatal
                        print(f"{context} {kv} {op} {var['name']}: FAILED {type(e).__name__}: {e}"[:300], flush=True)
                        continue
                    floor_us = nbytes / copy_bps * 1e6
                    rows.append({"context": context, "kv": kv, "op": op, "variant": var["name"], **var["tuning"],
                                 "us": us, "gbps": nbytes / (us * 1e-6) / 1e9, "x_floor": us / floor_us,
                                 "floor_us": floor_us, "bytes": nbytes})
                    print(f"{context} {kv} {op} {var['name']}: {us:.1f} us, {rows[-1]['gbps']:.0f} GB/s, "
                          f"{rows[-1]['x_floor']:.2f}x floor", flush=True)
            tune({})
        write_results(args.out, args.tag, meta, rows, markdown(meta, rows), overwrite=args.overwrite)
    write_results(args.out, args.tag, meta, rows, markdown(meta, rows), overwrite=args.overwrite)
    print("\n".join(summary(rows)))


def summary(rows: list[dict]) -> list[str]:
    """Per context and op: bf16, fp8 current and the best fp8 variant."""
    lines = ["| context | op | bf16 us (x floor) | fp8 current us (x floor) | best fp8 variant | us (x floor) |",
             "| --- | --- | --- | --- | --- | --- |"]
    timed = [r for r in rows if r["op"] != "check"]
    for context in sorted({r["context"] for r in timed}):
        for op in ("dense", "sparse", "scores"):
            sel = [r for r in timed if r["context"] == context and r["op"] == op]
            bf = [r for r in sel if r["kv"] == "bf16"]
            f8 = [r for r in sel if r["kv"] == "fp8"]
            cur = [r for r in f8 if r["variant"] == "current"]
            if not (bf and f8 and cur):
                continue
            best = min(f8, key=lambda r: r["us"])
            lines.append(f"| {context} | {op} | {bf[0]['us']:.1f} ({bf[0]['x_floor']:.2f}) | {cur[0]['us']:.1f} "
                         f"({cur[0]['x_floor']:.2f}) | {best['variant']} | {best['us']:.1f} ({best['x_floor']:.2f}) |")
    return lines


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# KV-cache ops by cache dtype: {meta['shape']}, batch 1, budget {meta['budget']}", "",
             f"`{meta['command']}` on {meta['device']}, {meta['date']}; copy bandwidth "
             f"{meta['copy_tbps']:.2f} TB/s (the floor); CUDA-graph replay, median per op call.", "",
             *summary(rows), "", f"## Checks against float64 (relative error, {meta['check_tokens']}-token cache)", ""]
    checks = [r for r in rows if r["op"] == "check"]
    lines += markdown_table([("kv", "kv", "{}"), ("variant", "variant", "{}"), ("dense", "err_dense", "{:.2e}"),
                             ("sparse", "err_sparse", "{:.2e}"), ("scores", "err_scores", "{:.2e}")], checks)
    lines += ["", "## All rows", ""]
    lines += markdown_table([("context", "context", "{}"), ("kv", "kv", "{}"), ("op", "op", "{}"),
                             ("variant", "variant", "{}"), ("us", "us", "{:.1f}"), ("GB/s", "gbps", "{:.0f}"),
                             ("x floor", "x_floor", "{:.2f}")], [r for r in rows if r["op"] != "check"])
    return lines


if __name__ == "__main__":
    main()
