"""What the benchmarks share: published model shapes, one timer, and the JSON + markdown writer of their results."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..timing import Timer


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: all a random-weight stand-in needs (speed does not depend on the weights)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def attention(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim)."""
        return self.heads, self.kv_heads, self.head_dim

    @property
    def parameters(self) -> int:
        """Parameters of ``shape_model``'s model: embedding and output head (not tied), each layer's projections
        and norms, the final norm."""
        layer = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * self.vocab * self.hidden + self.layers * (layer + 3 * self.hidden * self.mlp + 2 * self.hidden) \
            + self.hidden


SHAPES = {"llama3-8b": ModelShape(4096, 32, 32, 8, 14336, 128256, 500000.0),
          "llama2-7b": ModelShape(4096, 32, 32, 32, 11008, 32000, 10000.0),
          "tiny": ModelShape(256, 2, 4, 2, 512, 512, 10000.0)}


def model_shape(name: str) -> ModelShape:
    """``SHAPES[name]``; an unknown name is a ``ValueError`` naming the shapes there are."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    return SHAPES[name]


def shape_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int, layers: int | None = None):
    """A random-weight ``LlamaForCausalLM`` of ``SHAPES[name]`` (its first ``layers`` layers only, if given), built
    directly on ``device``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = model_shape(name)
    config = LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.layers if layers is None else layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, intermediate_size=s.mlp,
                         vocab_size=s.vocab, max_position_embeddings=max_positions, rope_theta=s.rope_theta)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def fill_rows(runner, rows: int, prompt_len: int, max_tokens: int, seed: int = 0) -> None:
    """Joins ``rows`` requests of ``prompt_len`` random token ids (from ``seed``) into ``runner`` (a
    ``serve.runner.Runner``), each prefilled by the model in one call and greedy, of at most ``max_tokens`` new
    tokens."""
    from ..engine import Sampling

    g = torch.Generator().manual_seed(seed)
    for i in range(rows):
        job = runner.start(torch.randint(0, runner.vocab_size, (prompt_len,), generator=g).tolist())
        while job.logits is None:
            runner.prefill(job, 1 << 30)
        runner.join(i, job, runner.first_token(job, Sampling(), 0)[0], Sampling(), 0, max_tokens)
        runner.discard(job)


@contextmanager
def shared_folder(build: Callable[[Path], None]) -> Iterator[Path]:
    """Under torchrun (process group started): a temporary folder that the first process fills with
    ``build(folder)`` (a random-weight model saved for every process to load with tensor parallelism), removed on
    leaving once every process is past the block."""
    name = [tempfile.mkdtemp(prefix="sparsekv-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    folder = Path(name[0])
    try:
        if dist.get_rank() == 0:
            build(folder)
        dist.barrier()
        yield folder
        dist.barrier()  # every process has read the folder
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


def load_sharded(folder: Path, dtype: torch.dtype):
    """The model saved in ``folder``, loaded with transformers' tensor parallelism over the torchrun processes
    (each holds 1/N of every layer's heads), in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                distributed_config=DistributedConfig(tp_plan="auto")).eval()


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = 2**30 if device.type == "cuda" else 2**22
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timer.eager(lambda: dst.copy_(src), reps=30)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def int_arg(least: int = 1) -> Callable[[str], int]:
    """An argparse ``type=`` for integers >= ``least``: anything else is a usage error saying what is allowed."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return value

    return parse


def available_bytes(device: torch.device) -> int:
    """Memory a run may still allocate on ``device``: the GPU's free memory, or the host's available memory
    (``MemAvailable``, bounded by the cgroup's limit where one is set)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def memory_problem(parts: dict[str, int], device: torch.device) -> str | None:
    """None if ``parts`` (bytes a run will allocate, by what for) fit in ``available_bytes(device)``, else what they
    need against what is available, in words."""
    need, free = sum(parts.values()), available_bytes(device)
    if need <= free:
        return None
    detail = ", ".join(f"{what} {n / 2**30:.1f} GiB" for what, n in parts.items() if n)
    where = "the GPU" if device.type == "cuda" else "the host"
    return f"needs about {need / 2**30:.1f} GiB ({detail}) but {where} has {free / 2**30:.1f} GiB available"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


# A markdown column: header, the row's key or a function of the row, and the format of a value (None prints "-").
Column = tuple[str, "str | Callable[[dict], object]", str]


def markdown_table(columns: list[Column], rows: list[dict]) -> list[str]:
    """The lines of a markdown table of ``rows``; a missing key or a None value prints "-"."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        cells = []
        for _, get, fmt in columns:
            value = get(r) if callable(get) else r.get(get)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_args(parser, tag: str) -> None:
    """The options every benchmark run has: --device, --dtype, --seed, and where its results go (--out, --tag)."""
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default=tag)


def weights_arg(parser) -> None:
    """--weights, as ``load_model``'s for a benchmark's model: float, or int4 after it is built or loaded."""
    parser.add_argument("--weights", default="float", choices=["float", "int4"],
                        help="int4: the layers' linear weights quantized to group-wise int4 after loading")


def pyplot():
    """matplotlib's pyplot for writing files (the Agg backend), or None without matplotlib (the ``eval`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def out_of_memory_lines(runs: list[str]) -> list[str]:
    """The markdown note on the runs that ran out of device memory (none: no lines)."""
    return ["", "Out of device memory: " + "; ".join(runs) + "."] if runs else []


def write_results(out: Path, tag: str, meta: dict, rows: list[dict], markdown: list[str] | None = None,
                  **extra) -> None:
    """Writes ``out/tag.json`` ({"meta", "rows", **extra}) and, given its lines, ``out/tag.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows, **extra}, indent=1))
    if markdown is not None:
        (out / f"{tag}.md").write_text("\n".join(markdown) + "\n")


def kernel_table(prof, steps: int, show: int = 40) -> dict:
    """The GPU kernels a torch.profiler run recorded over ``steps`` steps: per kernel name, launches and mean
    microseconds per step; per step, the summed kernel time (busy) and the span from the first kernel's start to the
    last one's end (span - busy: the gaps between dependent kernels). Prints the ``show`` costliest kernels."""
    run = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    per_name: dict[str, list[float]] = {}
    for e in run:
        per_name.setdefault(e.name[:80], []).append(e.time_range.end - e.time_range.start)
    span = (run[-1].time_range.end - run[0].time_range.start) if run else float("nan")
    kernels = {n: {"per_step": len(t) / steps, "us": sum(t) / len(t), "us_per_step": sum(t) / steps}
               for n, t in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))}
    out = {"kernels": kernels, "launches_per_step": len(run) / steps,
           "busy_us": sum(sum(t) for t in per_name.values()) / steps, "span_us": span / steps}
    for n, k in list(kernels.items())[:show]:
        print(f"  profile {k['us_per_step']:8.1f} us/step = {k['per_step']:5.1f} x {k['us']:7.2f} us  {n}", flush=True)
    print(f"  profile: {out['launches_per_step']:.0f} kernels, busy {out['busy_us']:.1f} us, span "
          f"{out['span_us']:.1f} us per step", flush=True)
    return out
