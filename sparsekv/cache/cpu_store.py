"""Host-memory KV of a group of layers, and a packed asynchronous gather of chosen tokens back to the device.

OmniKV keeps the prompt KV of its sparse layers here (pinned, when the device is a GPU). Once per decode step the
filter layer of a group chooses token positions; ``fetch`` then, on a worker thread: copies the positions to the
host on a side stream once the device has computed them, gathers those tokens of every layer of the group into one
packed host buffer, and copies it to the device in a single asynchronous copy on the side stream. The calling thread
goes on queueing the layers in between (OmniKV's wait layers) and collects the buffer with ``wait`` at the first
layer that needs it. Without a GPU the same path runs with a CPU "device": gather, then one CPU-to-CPU copy.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

_worker: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    """One worker for all stores: the gathers of one decode step follow each other anyway."""
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsekv-offload")
    return _worker


class CPUKVStore:
    """host: (L, 2, B, Hkv, T, D), keys and values of L layers for token positions 0..T-1 of each sequence.
    buffer: (L, 2, B, Hkv, K, D) on the device, the tokens of the latest ``fetch`` in the order they were listed."""

    def __init__(self, layers: int, batch: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.zeros(layers, 2, batch, kv_heads, tokens, head_dim, dtype=dtype, pin_memory=self.pinned)
        self.stream = torch.cuda.Stream(device) if self.pinned else None
        self.buffer: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._pending: Future | None = None

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores layer ``layer``'s keys and values (B, Hkv, T', D), T' <= T, for positions 0..T'-1."""
        n = k.shape[2]
        self.host[layer, 0, :, :, :n].copy_(k)
        self.host[layer, 1, :, :, :n].copy_(v)

    def fetch(self, tokens: torch.Tensor) -> None:
        """Starts bringing the tokens at positions ``tokens`` (B, K) int64 (on the device; -1 = none, which brings
        position 0 in its place) of every layer to ``buffer``."""
        self.wait()
        lay, _, b, h, _, d = self.host.shape
        k = tokens.shape[1]
        if self.buffer is None or self.buffer.shape[4] != k:
            self.buffer = torch.empty(lay, 2, b, h, k, d, dtype=self.host.dtype, device=self.device)
            self._staging = torch.empty(lay, 2, b, h, k, d, dtype=self.host.dtype, pin_memory=self.pinned)
            self._index = torch.empty(b, k, dtype=torch.long, pin_memory=self.pinned)
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the positions are computed on the caller's current stream
        self._pending = _executor().submit(self._gather, tokens, ready)

    def _gather(self, tokens: torch.Tensor, ready) -> None:
        lay, _, b, h, _, d = self.host.shape
        k = tokens.shape[1]
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                self._index.copy_(tokens, non_blocking=True)
                self.stream.synchronize()
        else:
            self._index.copy_(tokens)
        index = self._index.clamp(min=0).view(1, 1, b, 1, k, 1).expand(lay, 2, b, h, k, d)
        torch.gather(self.host, 4, index, out=self._staging)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.buffer.copy_(self._staging, non_blocking=True)
                self.stream.synchronize()
        else:
            self.buffer.copy_(self._staging)

    def wait(self) -> torch.Tensor | None:
        """The buffer of the latest ``fetch``, once it has arrived (None before any fetch)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        return self.buffer

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps the sequences ``index``; the next ``fetch`` refills the buffer."""
        self.wait()
        self.host = self.host.index_select(2, index.cpu())
        if self.pinned:
            self.host = self.host.pin_memory()
        self.buffer = None

    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def device_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()
