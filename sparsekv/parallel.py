"""Collectives for the decisions that combine attention heads across the processes of tensor parallelism.

A model loaded with transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun
--nproc-per-node N``) holds a contiguous slice of every layer's query and KV heads in each process; its attention
function, paged cache and method see only those, so every size comes from the local tensors. Per-KV-head decisions
(Quest, RaaS, H2O, SnapKV, StreamingLLM) need nothing more. A decision over all heads of a layer (TOVA's head mean,
OmniKV's max over heads) reduces each process's part over the head group with these helpers, so that every process
takes the decision of the one-process run. With ``group=None`` (heads not split) every helper returns its input.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard

from .quant import QuantLinear


def launched() -> bool:
    """Whether this process is one of several started by torchrun (which sets WORLD_SIZE)."""
    return processes() > 1


def processes() -> int:
    """Processes of the torchrun launch (its WORLD_SIZE); 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_first() -> bool:
    """Whether this process prints: the first of a torchrun launch, or the only one."""
    return int(os.environ.get("RANK", "0")) == 0


def start() -> torch.device:
    """Starts the process group of a torchrun launch (NCCL, one GPU a process, where there are GPUs; else gloo on
    the CPU) and returns this process's device. Its timeout allows the first process to work alone for an hour
    (building a model the others then load, a long single-process reference run)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                            timeout=timedelta(hours=1))
    return device


def started() -> bool:
    """Whether this process belongs to an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def finish(wait: bool = True) -> None:
    """Ends a torchrun launch's process group once every process is done: a process that exits with the group
    still open can abort in its teardown while the others finish. ``wait=False`` (after an error) closes it at
    once, with no barrier that a process stopped elsewhere would never reach."""
    if started():
        if wait:
            dist.barrier()
        _buffers.clear()
        dist.destroy_process_group()


def gather_union(names: list[str]) -> list[str]:
    """Every process's ``names``, in process order without repeats, on every process (one collective; every
    process of the group must call it); ``names`` itself without a process group."""
    if not started():
        return names
    return list(dict.fromkeys(name for part in _gather(names) for name in part))


def _gather(obj) -> list:
    """Every process's ``obj`` (a small picklable object), in process order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def describe(value, width: int = 200) -> str:
    """A short text of ``value`` to compare across processes: its repr, or for a longer one its beginning, its
    length and a digest of the whole."""
    text = repr(value)
    if len(text) <= width:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{text[:width // 2]}... ({len(text)} characters, sha256 {digest})"


def check_agree(values: dict[str, object]) -> None:
    """Under a process group, raises ValueError on every process when any process was given another value for
    one of ``values`` (an argument's name -> its value), naming each such argument and every process's value;
    without a process group it checks nothing. Every process calls it at the same point (one collective), so none
    waits for another that stopped; values are compared by ``describe``."""
    if not started():
        return
    gathered = _gather({name: describe(value) for name, value in values.items()})
    names = list(dict.fromkeys(name for part in gathered for name in part))
    differ = [name for name in names if len({part.get(name) for part in gathered}) > 1]
    if differ:
        raise ValueError("the processes of this launch were given different arguments, which must be the same in "
                         "every process: " + "; ".join(
                             f"{name} differs: " + ", ".join(f"process {rank}: {part.get(name, '(none)')}"
                                                             for rank, part in enumerate(gathered))
                             for name in differ))


def output_rows(linear) -> torch.Tensor:
    """The tensor that carries a projection's split under tensor parallelism: its weight, or a quantized layer's
    codes (never split)."""
    return linear.codes if isinstance(linear, QuantLinear) else linear.weight


def head_group(model) -> dist.ProcessGroup | None:
    """The process group over which transformers' tensor parallelism splits ``model``'s attention heads (the mesh
    of its sharded ``q_proj`` weight), or None when the heads are not split."""
    weight = output_rows(model.get_decoder().layers[0].self_attn.q_proj)
    mesh = getattr(weight, "device_mesh", None)  # set on DTensor parameters only
    if mesh is None:
        tp_size = getattr(model, "_tp_size", None) or 1
        if tp_size > 1:
            raise ValueError(f"model: loaded with tensor parallelism of size {tp_size} but its q_proj weight is a "
                             f"{type(weight).__name__}; sparsekv supports transformers' DTensor tensor parallelism "
                             "only (from_pretrained(..., tp_plan='auto') in transformers >= 5.17)")
        return None
    if mesh.size() == 1:
        return None
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(f"model: q_proj weight must be split by output rows (heads) over a 1D mesh, got placements "
                         f"{weight.placements} over {mesh}")
    return mesh.get_group()


def row_split(linear) -> dist.ProcessGroup | None:
    """The group over whose processes a projection's inputs are split (transformers' "rowwise" plan: its weight a
    DTensor split by input columns, ``Shard(1)``, over a 1D mesh of more than one process), each holding the
    columns of its heads and giving a partial sum of the output; None for any other weight."""
    mesh = getattr(output_rows(linear), "device_mesh", None)
    if mesh is None or mesh.ndim != 1 or mesh.size() == 1 or linear.weight.placements != (Shard(1),):
        return None
    return mesh.get_group()


def column_split(linear) -> torch.Tensor | None:
    """This process's rows of a projection whose outputs tensor parallelism splits (transformers' "colwise" plan:
    a weight that is a DTensor split by output rows, ``Shard(0)``, over a 1D mesh of more than one process, no
    bias): the DTensor's own local tensor (``_local_tensor``, not the alias ``to_local()`` makes), so that a caller
    that gives it new storage (``.data``) moves the module's weight too; None for any other projection."""
    if isinstance(linear, QuantLinear) or linear.bias is not None:  # quantized layers are never split
        return None
    weight = linear.weight
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or mesh.ndim != 1 or mesh.size() == 1 or weight.placements != (Shard(0),):
        return None
    return weight._local_tensor


def local_heads(model) -> tuple[int, int]:
    """(query heads, KV heads) of one of ``model``'s attention layers held by this process: all of them, or this
    process's slice under tensor parallelism (read from the local projection weights, not the config)."""
    attn = model.get_decoder().layers[0].self_attn
    rows = [p.out_features if isinstance(p, QuantLinear) else getattr(p.weight, "to_local", lambda: p.weight)().shape[0]
            for p in (attn.q_proj, attn.k_proj)]  # quantized layers are never split
    return rows[0] // attn.head_dim, rows[1] // attn.head_dim


def size(group: dist.ProcessGroup | None) -> int:
    """Processes sharing a layer's heads: 1 for ``group=None``."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed over the group's processes, in place (any shape, the same on every process)."""
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The element-wise maximum of ``tensor`` over the group's processes, in place."""
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


ALL_REDUCES = ("nccl", "one-shot")
ONE_SHOT_BYTES = 256 * 1024
"""The largest partial output (per process) that the one-shot all-reduce sums: a decode step's rows up to batch 32
at Llama-3-8B's width in bf16. Larger ones (prompt chunks) go through NCCL, whose ring pays off there."""

_all_reduce = "nccl"
_buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # (group name, dtype) -> this process's symmetric buffer


def set_all_reduce(kind: str) -> None:
    """How ``sum_partials`` sums the partial outputs of the products that tensor parallelism splits by input, for
    the products prepared after this call (``one_shot``), process-wide and the same in every process:

    - ``"nccl"`` (the default): PyTorch's functional all-reduce over NCCL (DTensor's).
    - ``"one-shot"``: up to ``ONE_SHOT_BYTES``, each process copies its part into a buffer of symmetric memory
      that every process of the group maps, waits on a barrier of flags, and loads and adds every process's part
      itself (PyTorch's ``symm_mem.one_shot_all_reduce_copy_out``): one kernel of a few microseconds over NVLink
      peer-to-peer loads, without multicast, where NCCL's ring takes tens. Needs CUDA and PyTorch's symmetric
      memory; larger tensors still go through NCCL."""
    global _all_reduce
    if kind not in ALL_REDUCES:
        raise ValueError(f"all_reduce: must be one of {', '.join(ALL_REDUCES)}, got {kind!r}")
    _all_reduce = kind


def all_reduce() -> str:
    """The all-reduce that products prepared now get (``set_all_reduce``)."""
    return _all_reduce


@dataclass(frozen=True)
class OneShot:
    """A group's one-shot all-reduce for partial outputs of one dtype (``one_shot``'s): ``capacity`` elements of
    it fit the group's buffer."""

    group_name: str
    capacity: int


def one_shot(group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> OneShot | None:
    """With ``set_all_reduce("one-shot")``, the group's one-shot all-reduce for ``dtype``, its symmetric buffer
    allocated and exchanged at the first call (a collective: every process of the group calls it at the same
    point, outside CUDA-graph capture); None with ``"nccl"``."""
    if _all_reduce != "one-shot":
        return None
    if device.type != "cuda":
        raise ValueError(f"all_reduce: 'one-shot' sums over CUDA symmetric memory, the device is {device}; use "
                         "'nccl'")
    from torch.distributed import _symmetric_memory as symm_mem

    name = group.group_name
    capacity = ONE_SHOT_BYTES // dtype.itemsize
    if (name, dtype) not in _buffers:
        buffer = symm_mem.empty(capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, name)
        _buffers[name, dtype] = buffer
    return OneShot(name, capacity)


@torch.library.custom_op("sparsekv::one_shot_sum", mutates_args=())
def one_shot_sum(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """partial: (..., N), contiguous, at most the capacity of the group's buffer for its dtype (``one_shot``).
    Returns the sum of every process's ``partial``, the same on every process (added in process order)."""
    buffer = _buffers.get((group_name, partial.dtype))
    if buffer is None or partial.numel() > buffer.numel():
        raise RuntimeError(f"one_shot_sum: no symmetric buffer of {partial.numel()} {partial.dtype} elements for "
                           f"group {group_name!r}; parallel.one_shot prepares it")
    out = torch.empty_like(partial)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[:partial.numel()].view_as(partial), partial, "sum",
                                                    group_name, out)
    return out


@one_shot_sum.register_fake
def _(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(partial)


def sum_partials(tensor: torch.Tensor, group: dist.ProcessGroup, fast: OneShot | None = None) -> torch.Tensor:
    """The sum over the group's processes of a product's partial outputs (``row_split``): a new tensor. Through
    ``fast`` (``one_shot``) where the tensor fits its buffer (and is a whole number of 4-byte words, as its kernel
    needs), else PyTorch's functional collective (DTensor's); torch.compile traces either inside a compiled part,
    and a CUDA graph captures either."""
    if fast is not None and tensor.numel() <= fast.capacity and tensor.numel() * tensor.element_size() % 4 == 0:
        return one_shot_sum(tensor.contiguous(), fast.group_name)
    return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))
