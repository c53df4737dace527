"""The weights' products of a decode step at Llama-3-8B's shapes: group-quantized int4 (``linear_quantized``: on
codes laid out for the CUDA kernel as a model on the GPU has them, the kernel up to ``cuda_int4_rows`` rows; on codes
in rows of groups, our Triton kernel and torch's tinygemm up to ``tinygemm_rows`` rows) against bf16 (``linear``),
per product and input rows, with the fraction of the copy bandwidth each reaches.

    python -m sparsekv.bench.linear                 # rows 1 4 8 16, the tuned launch parameters
    python -m sparsekv.bench.linear --tune          # sweeps the Triton kernel's launch parameters first

Each product runs on enough copies of its weight in rotation (at least 1 GB) that none is read from the L2 cache,
captured in a CUDA graph; times are per product (median of the graph's replays / copies). A product's bytes are
its weight's: codes, scales and minima for int4 (0.625 bytes a weight), 2 bytes a weight for bf16. The fraction is
of the copy bandwidth measured in the same run (bytes read plus written). The read ceiling is the time of a
kernel that only reads the int4 weight's bytes (in rotation, in a graph, like the products): what one launch of
that size can reach, since a small read does not reach the copy bandwidth. Writes ``<tag>.json`` and ``<tag>.md``
under ``--out`` (results there from another device or other options are kept unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from .. import kernels
from ..quant import quantize_int4
from ..timing import Timer
from .common import (claim_results, copy_bandwidth, device_name, markdown_table, memory_problem, output_args, refuse,
                     run_setting, write_results)

# Llama-3-8B's products: (out, in).
SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
ROTATION_BYTES = 2**30
# The Triton kernel's launch parameters swept, at 16 rows (its time hardly depends on the rows).
SWEEP = {"qmm_block_n": (64, 128), "qmm_block_g": (2, 4, 8), "qmm_split": (1, 2, 4), "qmm_warps": (4, 8),
         "qmm_stages": (2, 3)}
SWEEP_ROWS = 16


@triton.jit
def _read_kernel(words_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """Sums (as integers) the words of program i's stripe: rows of BLOCK words i, i + programs, ...; writes it so
    that nothing is left out."""
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in tl.range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        at = start + tl.arange(0, BLOCK)
        acc += tl.load(words_ptr + at, mask=at < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_ceiling(timer: Timer, nbytes: int, copies: int, device: torch.device) -> float:
    """Microseconds to read nbytes with one launch, over ``copies`` buffers in rotation: the best of a few
    launches (4, 8 or 16 programs per multiprocessor striding over the words, or one program per slice; slices of
    1024-4096 words)."""
    buffers = [torch.zeros(nbytes // 4, dtype=torch.int32, device=device) for _ in range(copies)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    best = math.inf
    for per_sm, block in itertools.product((4, 8, 16, None), (1024, 2048, 4096)):
        programs = per_sm * sms if per_sm else triton.cdiv(buffers[0].numel(), block)
        out = torch.empty(programs, dtype=torch.int32, device=device)

        def run():
            for b in buffers:
                _read_kernel[(programs,)](b, out, b.numel(), BLOCK=block, num_warps=4)
        best = min(best, timer.graph(run) * 1e3 / copies)
    return best


def product_bytes(n: int, k: int) -> int:
    """About the most memory one (n, k) product takes at once: the bf16 weight and its int4 one, the int4 copies
    in rotation twice (``weights``: in tiles and in rows of groups) and the read ceiling's buffers of their size,
    and the bf16 copies."""
    w, q = 2 * n * k, n * k * 5 // 8  # int4: 0.625 bytes a weight
    return w + q + 3 * max(2, math.ceil(ROTATION_BYTES / q)) * q + max(2, math.ceil(ROTATION_BYTES / w)) * w


def weights(n: int, k: int, device: torch.device) -> tuple[list, list, list]:
    """Copies of a random (n, k) weight in rotation: int4 (codes, scale, minimum) in the CUDA kernel's tiles
    (``reference.to_tiles``) and in rows of groups, and bf16 ones."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
    quantized = quantize_int4(w)
    copies = max(2, math.ceil(ROTATION_BYTES / sum(t.numel() * t.element_size() for t in quantized)))
    int4 = [tuple(t.clone() for t in quantized) for _ in range(copies)]
    tiles = [kernels.reference.to_tiles(*c, k) for c in int4]
    bf16 = [w.clone() for _ in range(max(2, math.ceil(ROTATION_BYTES / (w.numel() * 2))))]
    return tiles, int4, bf16


@contextmanager
def tuned(**values):
    """``TUNING`` with ``values`` within the block (the paths the op takes), restored after."""
    from ..kernels.triton import TUNING

    kept = {name: TUNING[name] for name in values}
    TUNING.update(values)
    try:
        yield
    finally:
        TUNING.update(kept)


def time_products(timer: Timer, x: torch.Tensor, copies: list, quantized: bool) -> float:
    """Microseconds per product over the copies."""
    def run():
        for c in copies:
            kernels.linear_quantized(x, *c) if quantized else kernels.linear(x, c)
    return timer.graph(run) * 1e3 / len(copies)


def error(x: torch.Tensor, codes, scale, minimum) -> float:
    """The kernel's relative error against the float64 reference."""
    exact = kernels.reference.linear_quantized(x.double(), codes, scale, minimum)
    return ((kernels.linear_quantized(x, codes, scale, minimum).double() - exact).norm() / exact.norm()).item()


def tune(device: torch.device, timer: Timer, log) -> dict:
    """The Triton kernel's launch parameters with the least summed time over a layer's products (the head left
    out); sets and returns them."""
    from ..kernels.triton import TUNING

    sets = {name: weights(n, k, device)[1][:8] for name, (n, k) in SHAPES.items() if name != "head"}  # enough to rank
    xs = {k: torch.randn(SWEEP_ROWS, k, device=device, dtype=torch.bfloat16) for _, k in SHAPES.values()}
    results = []
    for values in itertools.product(*SWEEP.values()):
        TUNING.update(dict(zip(SWEEP, values)))
        try:
            with tuned(tinygemm_rows=0):  # the Triton kernel at any rows
                times = {name: time_products(timer, xs[SHAPES[name][1]], c, True) for name, c in sets.items()}
        except Exception as err:  # a launch the device refuses (registers, shared memory)
            log(f"{values}: {type(err).__name__}")
            continue
        results.append((sum(times.values()), values, times))
        log(f"{values}: " + ", ".join(f"{n} {t:.1f}" for n, t in times.items()))
    results.sort(key=lambda r: r[0])
    best = dict(zip(SWEEP, results[0][1]))
    TUNING.update(best)
    log(f"best: {best}")
    return {"rows": SWEEP_ROWS, "best": best,
            "top": [{"params": dict(zip(SWEEP, v)), "us": t} for _, v, t in results[:10]]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.linear", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--tune", action="store_true")
    output_args(parser, "linear_int4")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setting = run_setting("linear", args)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    claim_results(args.out / f"{args.tag}.json", device_name(device), setting, args.overwrite)
    name, (n, k) = max(SHAPES.items(), key=lambda item: product_bytes(*item[1]))
    problem = memory_problem({f"copies of the {name} product's weights": product_bytes(n, k)}, device)
    if problem:
        return refuse("sparsekv.bench.linear", f"{problem} (a GPU with more free memory is needed)")
    timer = Timer(device, reps=20)
    log = print
    tuning = tune(device, timer, log) if args.tune else None
    from ..kernels.triton import TUNING

    bandwidth = copy_bandwidth(device, timer)
    rows = []
    for name, (n, k) in SHAPES.items():
        tiles, int4, bf16 = weights(n, k, device)
        q_bytes = sum(t.numel() * t.element_size() for t in int4[0])
        read_us = read_ceiling(timer, q_bytes, len(int4), device)
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            q_us = time_products(timer, x, tiles, True)
            with tuned(tinygemm_rows=0):
                t_us = time_products(timer, x, int4, True)
            g_us = time_products(timer, x, int4, True) if m <= TUNING["tinygemm_rows"] else math.nan
            b_us = time_products(timer, x, bf16, False)
            row = {"product": name, "n": n, "k": k, "rows": m, "int4_us": q_us, "triton_us": t_us,
                   "tinygemm_us": g_us, "bf16_us": b_us,
                   "int4_floor_us": q_bytes / bandwidth * 1e6, "bf16_floor_us": n * k * 2 / bandwidth * 1e6,
                   "read_us": read_us,
                   "int4_bandwidth": q_bytes / (q_us * 1e-6) / bandwidth, "error": error(x, *tiles[0])}
            rows.append(row)
            log(f"{name} rows {m}: int4 {q_us:.1f} us ({row['int4_bandwidth']:.0%} of copy bandwidth, floor "
                f"{row['int4_floor_us']:.1f}; Triton {t_us:.1f}, tinygemm {g_us:.1f}), bf16 {b_us:.1f} us; error "
                f"{row['error']:.1e}")
        del tiles, int4, bf16
        torch.cuda.empty_cache()
    meta = {"device": device_name(device), "copy_bandwidth_GBs": bandwidth / 1e9,
            "tuning": {k: v for k, v in TUNING.items() if k.startswith(("qmm", "tinygemm", "cuda"))},
            "torch": torch.__version__, "setting": setting,
            "command": " ".join(["python -m sparsekv.bench.linear", *argv])}
    columns = [("product", "product", "{}"), ("out x in", lambda r: f"{r['n']} x {r['k']}", "{}"),
               ("rows", "rows", "{}"), ("int4 us", "int4_us", "{:.1f}"), ("int4 floor us", "int4_floor_us", "{:.1f}"),
               ("of copy bandwidth", "int4_bandwidth", "{:.0%}"), ("read ceiling us", "read_us", "{:.1f}"),
               ("of read ceiling", lambda r: r["read_us"] / r["int4_us"], "{:.0%}"),
               ("Triton kernel us", "triton_us", "{:.1f}"), ("tinygemm us", "tinygemm_us", "{:.1f}"),
               ("bf16 us", "bf16_us", "{:.1f}"),
               ("bf16 / int4", lambda r: r["bf16_us"] / r["int4_us"], "{:.2f}"), ("rel. error", "error", "{:.1e}")]
    lines = [f"# int4 products at Llama-3-8B's shapes ({meta['device']}, copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s)", "", f"int4: the op on codes laid out for the CUDA kernel (the kernel "
             f"up to {TUNING['cuda_int4_rows']} rows); Triton kernel and tinygemm: on codes in rows of groups. "
             f"Launch parameters: {meta['tuning']}", "",
             *markdown_table(columns, rows)]
    write_results(args.out, args.tag, meta, rows, lines, overwrite=args.overwrite, tuning=tuning)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
