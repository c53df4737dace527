"""A prompt pass's write into a serving pool's shared pages (Llama-3-8B layer: 8 KV heads, head dim 128, pages of 16,
bf16; one row; noise keys and values as the random fill makes them): ``kernels.append_pages`` (one Triton kernel)
against the torch path it replaced (per run of consecutive store pages, a slice copy of the keys and of the values,
and the bounds as reductions of the keys over a reshape, merged into the page the row was filling), which this
script keeps as it was. Passes of 8192 and 32768 tokens from a page's start and from its middle, into the row's
pages in one run and in four. Device time: the median CUDA-graph replay; host time: the mean eager call. The floor
is the bytes read and written (the keys and values twice) at 4.25 TB/s. Both paths leave the same pages (checked).

    PYTHONPATH=$PWD python benchmarks/results/serve/append_pages.py OUT_DIR
"""
import json
import sys
import time
from pathlib import Path

import torch

from sparsekv import kernels
from sparsekv.bench.e2e import noise
from sparsekv.cache import PagedLayer, SharedPages
from sparsekv.timing import Timer


def torch_write(pages, k_new, v_new, start, p):
    """The replaced path's write of real tokens at token offsets start.. of the n pages ``pages`` (views)."""
    r, h, s, d = k_new.shape
    end = start + s
    pages["k"].view(r, h, -1, d)[:, :, start:end] = k_new
    pages["v"].view(r, h, -1, d)[:, :, start:end] = v_new
    first, whole, full = start // p, -(-start // p), end // p
    for bound, reduce, merge in ((pages["_kmin"], torch.amin, torch.minimum),
                                 (pages["_kmax"], torch.amax, torch.maximum)):
        if start % p:
            bound[:, :, first] = merge(bound[:, :, first], reduce(k_new[:, :, :min(whole * p, end) - start], dim=2))
        if full > whole:
            span = k_new[:, :, whole * p - start:full * p - start].reshape(r, h, full - whole, p, d)
            bound[:, :, whole:full] = reduce(span, dim=3)
        if end % p and full >= whole:
            bound[:, :, full] = reduce(k_new[:, :, full * p - start:], dim=2)


def torch_append(layer, shared, k_new, v_new, start):
    p, end = layer.page_size, start + k_new.shape[2]
    last = (end - 1) // p
    for slot, page, n in shared.runs(0, last + 1):
        lo, hi = max(start, slot * p), min(end, (slot + n) * p)
        if lo < hi:
            torch_write({name: getattr(layer, name)[:, :, page:page + n] for name in layer.paged},
                        k_new[:, :, lo - start:hi - start], v_new[:, :, lo - start:hi - start], lo - slot * p, p)
    layer.slot_page[0:1, :, start // p:last + 1] = layer.slot_ids[start // p:last + 1]
    layer.cur_slot[0:1] = last


def main(out: Path):
    dev = torch.device("cuda")
    timer = Timer(dev, reps=50)
    rows = []
    for runs in (1, 4):
        shared = SharedPages(rows=1, slots=8192, pages=2 * 8192, device=dev)
        if runs > 1:  # the free pages in runs with gaps between them
            size = 8192 // runs
            shared.free = sorted((pg for i in range(runs) for pg in range(2 * i * size, (2 * i + 1) * size)),
                                 reverse=True)
        layer = PagedLayer(1, 8, 128, 16, 8192, torch.bfloat16, dev, shared)
        shared.assign(0, 8192)
        for tokens in (8192, 32768):
            for start in (0, 40):
                k_new, v_new = (noise(1, 8, tokens, 128, torch.bfloat16, dev) for _ in range(2))
                paths = {"torch": lambda: torch_append(layer, shared, k_new, v_new, start),
                         "append_pages": lambda: kernels.append_pages(layer.k, layer.v, layer.kmin, layer.kmax,
                                                                      layer.slot_page, layer.cur_slot, k_new, v_new,
                                                                      start, 0, layer.table)}
                states = []
                for name, fn in paths.items():
                    fn()
                    states.append([t.clone() for t in (layer.k, layer.v, layer.kmin, layer.kmax, layer.slot_page,
                                                       layer.cur_slot)])
                    device_ms = timer.graph(fn)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(20):
                        fn()
                    host_ms = (time.perf_counter() - t) / 20 * 1e3
                    torch.cuda.synchronize()
                    floor_ms = 4 * 8 * tokens * 128 * 2 / 4.25e12 * 1e3
                    rows.append({"runs": len(shared.runs(0, 8192)), "tokens": tokens, "start": start, "path": name,
                                 "device_ms": device_ms, "host_ms": host_ms, "floor_ms": floor_ms,
                                 "x_floor": device_ms / floor_ms})
                    print(rows[-1], flush=True)
                assert all(torch.equal(a, b) for a, b in zip(*states)), "the paths left different pages"
    out.mkdir(parents=True, exist_ok=True)
    (out / "append_pages.json").write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "rows": rows},
                                                      indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
