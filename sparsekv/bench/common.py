"""What the benchmarks share: published model shapes, one timer, the memory check of a run before it allocates, and
the writer of their results (JSON, markdown, figure), which never replaces another device's or setting's results
unless asked (``--overwrite``)."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .. import kernels, parallel
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
        return self.parameters_of(self.layers)

    def parameters_of(self, layers: int) -> int:
        """``parameters`` of the model's first ``layers`` layers only (``shape_model(..., layers=...)``)."""
        layer = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * self.vocab * self.hidden + layers * (layer + 3 * self.hidden * self.mlp + 2 * self.hidden) \
            + self.hidden


SHAPES = {"llama3-8b": ModelShape(4096, 32, 32, 8, 14336, 128256, 500000.0),
          "llama2-7b": ModelShape(4096, 32, 32, 32, 11008, 32000, 10000.0),
          "tiny": ModelShape(256, 2, 4, 2, 512, 512, 10000.0)}


def named_shape(name: str) -> ModelShape:
    """``SHAPES[name]``; an unknown name is a ``ValueError`` naming the shapes there are."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    return SHAPES[name]


def shape_config(name: str, max_positions: int, layers: int | None = None):
    """The ``LlamaConfig`` of ``SHAPES[name]`` (its first ``layers`` layers only, if given)."""
    from transformers import LlamaConfig

    s = named_shape(name)
    return LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.layers if layers is None else layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, intermediate_size=s.mlp,
                       vocab_size=s.vocab, max_position_embeddings=max_positions, rope_theta=s.rope_theta)


def shape_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int, layers: int | None = None):
    """A random-weight ``LlamaForCausalLM`` of ``shape_config``, built directly on ``device``, in eval mode."""
    from transformers import LlamaForCausalLM

    config = shape_config(name, max_positions, layers)
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


def shape_weights(spec: str, dtype: torch.dtype, layers: int | None = None) -> tuple[int, int] | None:
    """Bytes ``shape_model`` allocates for the weights of a ``shape:<name>`` model (its first ``layers`` layers, if
    given): at most while building it (in float32, then cast parameter by parameter), and once built; None for any
    other model (loaded, checked once there)."""
    if not spec.startswith("shape:"):
        return None
    shape = named_shape(spec.removeprefix("shape:"))
    n = shape.parameters_of(shape.layers if layers is None else min(layers, shape.layers))
    return max(4, dtype.itemsize) * n, dtype.itemsize * n


def memory_problems(device: torch.device, weights: tuple[int, int] | None, parts: dict[str, int] | None = None,
                    gpus: int = 1) -> str | None:
    """``memory_problem`` of building a ``shape:`` model (``shape_weights``), then of its weights with ``parts``
    (bytes by what for: the KV cache, ...), 1/``gpus`` of each per GPU under tensor parallelism."""
    building, built = weights or (0, 0)
    return (memory_problem({"weights": built // gpus, **{what: n // gpus for what, n in (parts or {}).items()}},
                           device)
            or memory_problem({"float32 weights while building": building}, device))


def refuse(prog: str, message: str) -> int:
    """Prints ``prog: error: message`` to stderr, as argparse words a usage error, and returns 2: the exit status of
    a run refused (its options, its memory, where its results would go)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def quantiles(values: list[float]) -> dict:
    """The p50, p90 and p99 of ``values`` (the value at that rank) and their max; None for each when there are
    none."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    values = sorted(values)

    def at(q: float) -> float:
        return values[min(int(q * len(values)), len(values) - 1)]
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": values[-1]}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def conditions(device: torch.device) -> dict:
    """What the machine is doing as a timed run starts: the host's load average over the last minute and, on CUDA,
    the GPU's temperature (C) and SM clock (MHz) through NVML (None where NVML cannot say), so that a run slower
    than its twin can be told from a busy host or a hot, slowed GPU."""
    found = {"host_load_1m": os.getloadavg()[0], "gpu_temp_c": None, "sm_clock_mhz": None}
    if device.type == "cuda":
        try:
            found.update(gpu_temp_c=torch.cuda.temperature(device), sm_clock_mhz=torch.cuda.clock_rate(device))
        except Exception:  # NVML missing or refused: the run is timed all the same
            pass
    return found


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
    """The options every model benchmark run has: --device, --dtype, --seed, and where its results go
    (``output_args``)."""
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    output_args(parser, tag)


def output_args(parser, tag: str | None, tag_help: str = "file stem of the results") -> None:
    """Where a benchmark's results go: --out (a folder) and --tag (``out/tag.json``, ``.md``, ``.png``), and
    ``overwrite_arg``."""
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder of the results")
    parser.add_argument("--tag", default=tag, help=tag_help)
    overwrite_arg(parser)


def overwrite_arg(parser) -> None:
    """--overwrite: whether a run may replace results of another device or setting (``claim_results``)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace results already there that another device or other settings wrote (without "
                             "it such a run is refused before it starts)")


# Options that say where results go and whether they may replace others', not what a run measures; the device is
# compared by its name instead (``--device auto`` and ``cuda`` are one device).
NOT_SETTINGS = frozenset({"out", "tag", "overwrite", "device"})


def run_setting(bench: str, args: argparse.Namespace, **more) -> dict:
    """What a run of ``sparsekv.bench.<bench>`` measures, to tell whose results a file holds: the bench and its
    options as parsed (before a bench fills any in) but ``NOT_SETTINGS``, with ``more`` (what the options leave out,
    such as the processes of a torchrun), in the types JSON gives back."""
    options = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
    return json.loads(json.dumps({"bench": bench, **options, **more}, default=str))


def command_setting(command: str | None) -> dict | None:
    """``run_setting`` of a recorded command line (``python -m sparsekv.bench.NAME ...``, or under torchrun), read
    by that bench's parser (``build_parser``): the setting of results written before runs recorded theirs. None if
    it names no bench or its options do not parse."""
    try:
        words = shlex.split(command or "")
    except ValueError:
        return None
    at = words.index("-m") + 1 if "-m" in words else len(words)
    module = words[at] if at < len(words) else ""
    name = module.removeprefix("sparsekv.bench.")
    if not module.startswith("sparsekv.bench.") or not name.isidentifier() or name == "common":
        return None
    try:
        parser = importlib.import_module(module).build_parser()
        with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
            args = parser.parse_args(words[at + 1:])
    except (ImportError, AttributeError, SystemExit):
        return None
    return run_setting(name, args)


def recorded_device(meta: dict) -> str | None:
    """The device a results file's meta names (``device_name``; ``device`` in the kernel benchmarks' meta)."""
    return meta.get("device_name", meta.get("device"))


def _differences(theirs: dict, ours: dict, most: int = 8) -> str:
    """The settings that differ, as "name there, here" (at most ``most`` of them)."""
    def show(d: dict, key: str) -> str:
        return json.dumps(d[key]) if key in d else "unset"

    keys = [k for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k, ...) != ours.get(k, ...)]
    parts = [f"{k.replace('_', '-')} {show(theirs, k)} there, {show(ours, k)} here" for k in keys[:most]]
    return "; ".join(parts + ([f"{len(keys) - most} more"] if len(keys) > most else []))


def results_conflict(path: Path, device: str | None, setting: dict) -> str | None:
    """None if a run on ``device`` with ``setting`` (``run_setting``) may write the results JSON ``path`` and the
    ``.md`` and ``.png`` beside it: none of them is there, or the JSON records the same device and setting (the
    run's own earlier write, or the same measurement again); else what is there against this run, in words."""
    present = [p for p in (path, path.with_suffix(".md"), path.with_suffix(".png")) if p.exists()]
    if not present:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    meta = data.get("meta", data) if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        names = ", ".join(str(p) for p in present)
        return (f"{names} hold{'s' if len(present) == 1 else ''} results of an unknown device and setting (no "
                f"results JSON with a meta at {path}); write this run's elsewhere with --out DIR (or another --tag), "
                f"or replace them with --overwrite")
    theirs = meta.get("setting") or command_setting(meta.get("command"))
    if recorded_device(meta) == device and theirs == setting:
        return None
    why = []
    if recorded_device(meta) != device:
        why.append(f"device {recorded_device(meta) or 'unknown'} there, {device or 'none'} here")
    if theirs is None:
        why.append("its setting is unknown (no command recorded that this bench reads)" if not meta.get("command")
                   else f"its setting is unknown (the command it records does not parse: {meta['command']})")
    elif theirs != setting:
        why.append(f"other settings: {_differences(theirs, setting)}")
    return (f"{path} holds results of another run ({'; '.join(why)}); write this run's elsewhere with --out DIR (or "
            f"another --tag), or replace them with --overwrite")


def claim_results(path: Path, device: str | None, setting: dict, overwrite: bool) -> None:
    """Exits with status 2, saying why and the two ways out, unless ``overwrite`` or the results JSON ``path`` and
    those beside it may be written by a run on ``device`` with ``setting`` (``results_conflict``). A benchmark
    calls it before it measures anything, so that a run whose results could not be written stops before it starts
    (not an hour later), and ``write_files`` again at every write."""
    problem = None if overwrite else results_conflict(path, device, setting)
    if problem:
        raise SystemExit(refuse(f"sparsekv.bench.{setting['bench']}", problem))


def weights_arg(parser) -> None:
    """--weights, as ``load_model``'s for a benchmark's model: float, or int4 after it is built or loaded."""
    parser.add_argument("--weights", default="float", choices=["float", "int4"],
                        help="int4: the layers' linear weights quantized to group-wise int4 after loading")


def pdl_arg(parser) -> None:
    """--pdl: programmatic dependent launch for the run (``start_pdl``)."""
    parser.add_argument("--pdl", action="store_true",
                        help="programmatic dependent launch for our kernels and torch.compile's "
                             "(kernels.set_programmatic_launch; CUDA, Hopper and later)")


def start_pdl(args, device: torch.device, parser) -> None:
    """With --pdl, turns programmatic dependent launch on for the process (a parser error off CUDA, or where this
    torch's inductor cannot take part)."""
    if not args.pdl:
        return
    if device.type != "cuda":
        parser.error(f"--pdl launches CUDA kernels, the device is {device}")
    try:
        kernels.set_programmatic_launch(True)
    except RuntimeError as err:
        parser.error(str(err))


def all_reduce_arg(parser) -> None:
    """--all-reduce: how tensor parallelism sums the row-split products (``start_all_reduce``)."""
    parser.add_argument("--all-reduce", default="nccl", choices=parallel.ALL_REDUCES,
                        help="under torchrun, how the decode step sums the partial outputs of the o and down "
                             "products: NCCL, or one-shot over CUDA symmetric memory (parallel.set_all_reduce)")


def start_all_reduce(args, device: torch.device, parser) -> None:
    """Sets --all-reduce for the process before a model is loaded (a parser error for one-shot off CUDA)."""
    if args.all_reduce != "nccl" and device.type != "cuda":
        parser.error(f"--all-reduce {args.all_reduce} sums over CUDA symmetric memory, the device is {device}")
    parallel.set_all_reduce(args.all_reduce)


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


def write_files(path: Path, data: dict, markdown: list[str] | None = None, figure=None, *,
                overwrite: bool = False) -> None:
    """Writes ``data`` as JSON at ``path``, the lines of ``markdown`` beside it (``.md``) and ``figure`` (a matplotlib
    figure, closed after) as ``.png``, once ``claim_results`` allows the device and setting that ``data``'s meta
    records (``data["meta"]``, else ``data`` itself: ``recorded_device``, ``"setting"``)."""
    meta = data.get("meta", data)
    claim_results(path, recorded_device(meta), meta["setting"], overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))  # compact, as the committed results are: the markdown is the one to read
    if markdown is not None:
        path.with_suffix(".md").write_text("\n".join(markdown) + "\n")
    if figure is not None:
        figure.savefig(path.with_suffix(".png"))
        pyplot().close(figure)


def write_results(out: Path, tag: str, meta: dict, rows: list[dict], markdown: list[str] | None = None, *,
                  figure=None, overwrite: bool = False, **extra) -> None:
    """``write_files`` of ``{"meta", "rows", **extra}`` at ``out/tag.json`` (``tag.md``, ``tag.png`` beside it);
    ``meta`` holds the run's device and ``"setting"`` (``run_setting``)."""
    write_files(out / f"{tag}.json", {"meta": meta, "rows": rows, **extra}, markdown, figure, overwrite=overwrite)


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
