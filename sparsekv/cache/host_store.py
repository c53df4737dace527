"""Host-memory KV of a group of layers, and a packed gather of chosen tokens to the device that needs no host work.

OmniKV keeps the prompt KV of its sparse layers here. The store is laid out token-major, ``(B, T, L, 2, Hkv, D)``:
one token's keys and values of every layer of the group are one contiguous segment, so a step's chosen tokens
are read as that many packed segments. On a GPU the store is pinned and read by the GPU itself through unified
addressing (pinned host memory is mapped into the device's address space): ``fetch`` is one gather kernel on a
side stream, started by the filter layer as soon as it has chosen and awaited by the first layer that reads the
buffer, so the transfer overlaps the layers in between (OmniKV's wait layers). No host thread, no host sync and no
allocation: the whole exchange can be captured in a CUDA graph. On the CPU the same gather runs in place.
"""

from __future__ import annotations

import copy
import os
import weakref

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: page-locked for every device, mapped into their address space.
_REGISTER_FLAGS = 3


def available_host_bytes() -> int:
    """Physical memory the host has free now (Linux; elsewhere unlimited)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class HostMemoryError(ValueError):
    """The host has too little memory free for an offloaded store."""


def require_host_bytes(need: int, what: str, remedy: str) -> None:
    """Raises HostMemoryError, "``what`` <need> GiB of host memory, the host has <free> GiB free; ``remedy``", unless
    the host has ``need`` bytes free."""
    free = available_host_bytes()
    if need > free:
        raise HostMemoryError(f"{what} {need / 2**30:.1f} GiB of host memory, the host has {free / 2**30:.1f} GiB "
                              f"free; {remedy}")


def require_host(layers: int, batch: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raises HostMemoryError, naming the context and the memory it needs, unless the host has the memory free for the
    prompt KV of ``layers`` layers at context ``tokens``."""
    require_host_bytes(batch * tokens * layers * 2 * kv_heads * head_dim * dtype.itemsize,
                       f"offload: the prompt KV of {layers} layers at context {tokens} (batch {batch}) needs",
                       "use a shorter context or keep more layers on the device")


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked and mapped for the GPU by registering its memory as it is. PyTorch's
    pinned allocator rounds a request up to a power of two (a 96 GiB store would take 128 GiB of host memory);
    registering ordinary memory costs exactly the bytes asked for. Unregistered when the tensor is freed."""
    host = torch.empty(shape, dtype=dtype)
    ptr, size = host.data_ptr(), host.numel() * host.element_size()
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(ptr, size, _REGISTER_FLAGS))
    weakref.finalize(host.untyped_storage(), cudart.cudaHostUnregister, ptr)
    return host


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the pinned host tensor ``host`` (same shape, no copy), which device kernels read
    through unified addressing: the GPU's loads cross the host link."""

    class _Interface:
        __cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                    "data": (host.data_ptr(), False), "version": 3}

    raw = torch.as_tensor(_Interface(), device=device)
    return raw.view(host.dtype).view(host.shape)


class HostKVStore:
    """host: (B, T, L, 2, Hkv, D), keys and values of L layers for token positions 0..T-1 of each sequence.
    buffer: (B, K, L, 2, Hkv, D) on the device, the tokens of the latest ``fetch`` in the order they were listed.

    ``max_tokens`` (K) is fixed at construction, so the buffer never moves."""

    def __init__(self, layers: int, batch: int, kv_heads: int, tokens: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        require_host(layers, batch, kv_heads, tokens, head_dim, dtype)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.ready = torch.cuda.Event() if cuda else None
        shape = (batch, tokens, layers, 2, kv_heads, head_dim)
        self._allocate(pinned_empty(shape, dtype) if cuda else torch.empty(shape, dtype=dtype), max_tokens)

    def _allocate(self, host: torch.Tensor, max_tokens: int) -> None:
        b, t = host.shape[:2]
        self.host = host
        # What device kernels gather from: rows of one token's segment, addressed as (B * T, segment).
        self.source = (device_view(host, self.device) if self.stream is not None else host).view(b * t, -1)
        self.buffer = torch.empty(b, max_tokens, *host.shape[2:], dtype=host.dtype, device=self.device)

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Stores layer ``layer``'s keys and values (B, Hkv, n, D) for positions start..start+n-1."""
        n = k.shape[2]
        self.host[:, start:start + n, layer, 0].copy_(k.transpose(1, 2))
        self.host[:, start:start + n, layer, 1].copy_(v.transpose(1, 2))

    def fetch(self, tokens: torch.Tensor) -> None:
        """Starts bringing the tokens at positions ``tokens`` (B, K) int64 (on the device; -1 = none, which brings
        position 0 in its place) of every layer to ``buffer``."""
        b, t = self.host.shape[:2]
        rows = (tokens.clamp(min=0) + torch.arange(b, device=tokens.device).unsqueeze(1) * t).flatten()
        if self.stream is None:
            torch.index_select(self.source, 0, rows, out=self.buffer.view(rows.shape[0], -1))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the positions are computed there
        with torch.cuda.stream(self.stream):
            torch.index_select(self.source, 0, rows, out=self.buffer.view(rows.shape[0], -1))
            rows.record_stream(self.stream)
            self.ready.record(self.stream)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s fetched keys and values, (B, Hkv, K, D) views of the buffer, once they have arrived."""
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        kv = self.buffer[:, :, layer].permute(2, 0, 3, 1, 4)  # (2, B, Hkv, K, D)
        return kv[0], kv[1]

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps the sequences ``index``; the next ``fetch`` refills the buffer."""
        index = index.cpu()
        if self.stream is not None:
            host = pinned_empty((len(index), *self.host.shape[1:]), self.host.dtype)
            torch.index_select(self.host, 0, index, out=host)
        else:
            host = self.host.index_select(0, index)
        self._allocate(host, self.buffer.shape[1])

    def rows(self, n: int) -> "HostKVStore":
        """The store of rows [0, n), a view: its host rows, gather source and buffer are this store's."""
        view = copy.copy(self)
        t = self.host.shape[1]
        view.host, view.source, view.buffer = self.host[:n], self.source[:n * t], self.buffer[:n]
        return view

    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def device_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
