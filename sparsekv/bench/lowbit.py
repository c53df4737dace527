"""The pieces of a lowbit selecting layer's step against Quest's, timed alone at one shape.

Per layer and step: Quest's page choice (``quest_select``; its page-score kernel alone too), lowbit's coding of the
current page (``code_page``), its page scores (``coded_scores``; the log-sum-exp kernel alone too), and its whole
choice (``lowbit_select``: the coding, the scores and the top-k), at each code width. Each piece is captured in a
CUDA graph over enough cache copies to exceed the L2 several times, and timed as the median replay (CUDA events)
per copy; the floor is the bytes the piece must read at the measured copy bandwidth. ``--variants`` times the
scores again under each set of ``TUNING`` overrides; ``--baseline`` times a ``coded_scores`` from another file (an
earlier kernel). The float64 reference checks the scores at the shape first (relative error, and the overlap of the
top pages). Writes ``TAG.json`` and ``TAG.md`` under ``--out`` (results there from another device or other options
are kept unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from .. import kernels
from ..kernels import reference
from ..timing import Timer
from .attention import L2_BYTES, copy_bytes, make_copy
from .common import (SHAPES, claim_results, copy_bandwidth, device_name, int_arg, markdown_table, memory_problem,
                     output_args, refuse, run_setting, write_results)


def coded_copies(shape: str, context: int, page_size: int, bits: tuple[int, ...], device, copies: int):
    """Batch-1 bf16 cache copies (``make_copy``) with their codes of each width and a query."""
    heads, kv_heads, head_dim = SHAPES[shape].attention
    out = []
    for _ in range(copies):
        k, _, kmin, kmax, slot_page, cur_slot, seq_len = make_copy(1, kv_heads, head_dim, context, page_size, 1,
                                                                   torch.bfloat16, device)
        codes = {w: reference.key_codes(k, kmin, kmax, w) for w in bits}
        q = torch.randn(1, heads, head_dim, dtype=torch.bfloat16, device=device)
        out.append(dict(k=k, kmin=kmin, kmax=kmax, slot_page=slot_page, cur_slot=cur_slot, seq_len=seq_len,
                        codes=codes, q=q, scores=torch.zeros(1, kv_heads, kmin.shape[2], device=device)))
    return out


def copies_bytes(shape: str, context: int, page_size: int, bits: tuple[int, ...], copies: int) -> int:
    """About the most memory ``coded_copies`` takes: each copy's cache (``make_copy``) and its codes of each width,
    and the float32 temporaries of coding one copy's keys."""
    _, kv_heads, head_dim = SHAPES[shape].attention
    keys = kv_heads * (context // page_size + 2) * page_size * head_dim  # a copy's key elements, free slots too
    return copies * (copy_bytes(1, kv_heads, head_dim, context, page_size, 1) + keys * sum(bits) // 8) + 10 * keys


def check(copy: dict, bits: int, num_pages: int) -> dict:
    """The kernel's scores against the float64 reference on the same codes."""
    c = copy
    scale = c["q"].shape[-1] ** -0.5
    got = kernels.coded_scores(c["q"], c["kmin"], c["kmax"], c["codes"][bits], c["slot_page"], c["seq_len"], scale,
                               bits)
    exact = reference.coded_scores(c["q"].double(), c["kmin"].double(), c["kmax"].double(), c["codes"][bits],
                                   c["slot_page"], c["seq_len"], scale, bits)
    fin = exact.isfinite()
    err = float((got[fin].double() - exact[fin]).norm() / exact[fin].norm())
    top = kernels.select_pages(got, c["cur_slot"], num_pages)
    want = reference.select_pages(exact.float(), c["cur_slot"], num_pages)
    overlap = float((top.unsqueeze(-1) == want.unsqueeze(-2)).any(-1).float().mean())
    return {"bits": bits, "rel_err": err, "inf_match": bool(torch.equal(got.isinf(), exact.isinf())),
            "top_overlap": overlap}


def pieces(copies: list[dict], bits: tuple[int, ...], num_pages: int, baseline) -> dict:
    """name -> (a function of one copy, bytes it must read)."""
    def meta_bytes(c):
        return 2 * c["kmin"].numel() * c["kmin"].element_size() + c["slot_page"].numel() * 8

    c0 = copies[0]
    scale = c0["q"].shape[-1] ** -0.5
    for c in copies:
        c["first"] = c["seq_len"] - 1
        c["chosen"] = torch.empty(*c["kmin"].shape[:2], min(num_pages, c["kmin"].shape[2]), dtype=torch.long,
                                  device=c["kmin"].device)
    out = {"quest_select": (lambda c: kernels.quest_select(c["q"], c["kmin"], c["kmax"], c["slot_page"],
                                                           c["cur_slot"], num_pages), meta_bytes(c0)),
           "quest_page_scores": (lambda c: kernels.page_scores(c["q"], c["kmin"], c["kmax"], c["slot_page"]),
                                 meta_bytes(c0)),
           "select_pages": (lambda c: kernels.select_pages(c["scores"], c["cur_slot"], num_pages),
                            c0["scores"].numel() * 4)}
    for w in bits:
        codes_bytes = c0["codes"][w].numel()

        def coding(c, w=w):
            kernels.code_page(c["k"], c["kmin"], c["kmax"], c["codes"][w], c["cur_slot"], w)

        def scores(c, w=w, fn=kernels.coded_scores):
            return fn(c["q"], c["kmin"], c["kmax"], c["codes"][w], c["slot_page"], c["seq_len"], scale, w)

        def lse(c, w=w):
            from ..kernels.triton.coded import coded_lse_parts
            return coded_lse_parts(c["q"], c["kmin"], c["kmax"], c["codes"][w], c["slot_page"], c["seq_len"], scale,
                                  w)

        def step(c, w=w):
            kernels.lowbit_select(c["q"], c["k"], c["kmin"], c["kmax"], c["codes"][w], c["slot_page"], c["cur_slot"],
                                  c["seq_len"], c["first"], c["chosen"], scale, w, num_pages)

        out[f"code_page b{w}"] = (coding, 0)
        out[f"coded_scores b{w}"] = (scores, meta_bytes(c0) + codes_bytes)
        out[f"coded_page_lse b{w}"] = (lse, meta_bytes(c0) + codes_bytes)
        out[f"lowbit_select b{w}"] = (step, meta_bytes(c0) + codes_bytes)
        if baseline is not None:
            out[f"baseline coded_scores b{w}"] = (lambda c, w=w: scores(c, w, baseline), meta_bytes(c0) + codes_bytes)
    return out


def time_piece(timer: Timer, fn, copies: list[dict]) -> float:
    """Microseconds per copy of a CUDA-graph replay of ``fn`` over every copy."""
    return timer.graph(lambda: [fn(c) for c in copies]) * 1e3 / len(copies)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sparsekv.bench.lowbit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int_arg(), default=131072)
    ap.add_argument("--page-size", type=int_arg(), default=16)
    ap.add_argument("--budget", type=int_arg(), default=2048)
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4])
    ap.add_argument("--reps", type=int_arg(), default=50)
    ap.add_argument("--variants", type=json.loads, default=[], metavar="JSON",
                    help="a JSON list of TUNING overrides under which to time coded_scores again")
    ap.add_argument("--variant-bits", type=int, nargs="+", default=[2], choices=[1, 2, 4],
                    help="the code widths timed under each of --variants")
    ap.add_argument("--baseline", type=Path, help="a Python file whose coded_scores (the op's signature) to time too")
    output_args(ap, "lowbit_pieces")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no timings)")
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    setting = run_setting("lowbit", args)
    device = torch.device(args.device)
    from ..kernels.triton import TUNING

    claim_results(args.out / f"{args.tag}.json", device_name(device), setting, args.overwrite)
    bits = tuple(args.bits)
    per_copy = 4 * SHAPES[args.shape].kv_heads * (args.context // args.page_size) * SHAPES[args.shape].head_dim
    n_copies = max(2, min(48, math.ceil(4 * L2_BYTES / per_copy)))
    problem = memory_problem({f"{n_copies} cache copies with their codes": copies_bytes(
        args.shape, args.context, args.page_size, bits, n_copies)}, device)
    if problem:
        raise SystemExit(refuse("sparsekv.bench.lowbit", f"--context {args.context} of --shape {args.shape} "
                                f"{problem}; use a smaller --context or --shape (e.g. tiny)"))
    timer = Timer(device, reps=args.reps)
    bw = copy_bandwidth(device, timer)
    copies = coded_copies(args.shape, args.context, args.page_size, bits, device, n_copies)
    num_pages = args.budget // args.page_size
    checks = [check(copies[0], w, num_pages) for w in bits]
    for row in checks:
        print("check", row)
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_coded", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        baseline = module.coded_scores
    rows = []
    for name, (fn, nbytes) in pieces(copies, bits, num_pages, baseline).items():
        us = time_piece(timer, fn, copies)
        floor = nbytes / bw * 1e6
        rows.append({"piece": name, "tuning": "", "us": us, "floor_us": floor,
                     "x_floor": us / floor if nbytes else None, "MiB": nbytes / 2**20})
        print(f"{name:32s} {us:8.1f} us  floor {floor:6.1f}", flush=True)
    base = dict(TUNING)
    scale = SHAPES[args.shape].head_dim ** -0.5
    for override in args.variants:
        TUNING.update(override)
        for w in args.variant_bits:
            def fn(c, w=w):
                kernels.coded_scores(c["q"], c["kmin"], c["kmax"], c["codes"][w], c["slot_page"], c["seq_len"],
                                     scale, w)
            nbytes = 2 * copies[0]["kmin"].numel() * 2 + copies[0]["codes"][w].numel()
            us = time_piece(timer, fn, copies)
            err = check(copies[0], w, num_pages)
            rows.append({"piece": f"coded_scores b{w}", "tuning": json.dumps(override), "us": us,
                         "rel_err": err["rel_err"], "top_overlap": err["top_overlap"],
                         "floor_us": nbytes / bw * 1e6, "x_floor": us * bw / 1e6 / nbytes, "MiB": nbytes / 2**20})
            print(f"coded_scores b{w} {override}: {us:.1f} us {err}", flush=True)
        us = time_piece(timer, lambda c: kernels.select_pages(c["scores"], c["cur_slot"], num_pages), copies)
        rows.append({"piece": "select_pages", "tuning": json.dumps(override), "us": us})
        print(f"select_pages {override}: {us:.1f} us", flush=True)
        TUNING.clear()
        TUNING.update(base)
    meta = {"device": device_name(device), "shape": args.shape, "context": args.context, "page_size":
            args.page_size, "budget": args.budget, "copies": len(copies), "copy_bw_TBps": bw / 1e12,
            "checks": checks, "setting": setting,
            "command": " ".join(["python -m sparsekv.bench.lowbit", *argv])}
    cols = [("piece", "piece", "{}"), ("TUNING overrides", "tuning", "{}"), ("us per layer", "us", "{:.1f}"),
            ("floor us", "floor_us", "{:.1f}"), ("x floor", "x_floor", "{:.2f}"), ("MiB read", "MiB", "{:.1f}"),
            ("rel. error", "rel_err", "{:.1e}"), ("top overlap", "top_overlap", "{:.3f}")]
    lines = [f"# lowbit's selection pieces ({args.shape}, batch 1, {args.context} tokens, {device_name(device)})",
             "", f"Copy bandwidth {bw / 1e12:.2f} TB/s; {len(copies)} cache copies rotated; budget {args.budget}.", "",
             *markdown_table(cols, rows), "", "Checks against float64: " + json.dumps(checks)]
    write_results(args.out, args.tag, meta, rows, lines, overwrite=args.overwrite)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
