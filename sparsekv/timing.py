"""One timer for the library and its benchmarks: CUDA events on the GPU, the host clock on the CPU."""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass
class Elapsed:
    seconds: float = math.nan


class Timer:
    """Times on the device: CUDA events on the GPU, the host clock on the CPU. ``region`` times one block;
    ``eager`` and ``graph`` give the median milliseconds of a callable over ``reps`` runs after ``warmup``."""

    def __init__(self, device: torch.device, reps: int = 30, warmup: int = 3):
        self.cuda = device.type == "cuda"
        self.reps, self.warmup = reps, warmup

    @contextmanager
    def region(self) -> Iterator[Elapsed]:
        """``with timer.region() as t: ...`` sets ``t.seconds`` when the block and its device work are done."""
        elapsed = Elapsed()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield elapsed
            end.record()
            end.synchronize()
            elapsed.seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            yield elapsed
            elapsed.seconds = time.perf_counter() - t0

    def eager(self, fn: Callable[[], object], reps: int | None = None) -> float:
        for _ in range(self.warmup):
            fn()
        return self._median(fn, reps or self.reps)

    def graph(self, fn: Callable[[], object], reps: int | None = None) -> float:
        """Median of CUDA-graph replays of ``fn`` (NaN on the CPU)."""
        if not self.cuda:
            return math.nan
        for _ in range(2):  # compiles and autotunes outside the capture
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        ms = self._median(graph.replay, reps or self.reps)
        del graph
        return ms

    def _median(self, fn, reps: int) -> float:
        if not self.cuda:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)
