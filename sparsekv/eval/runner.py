"""The evaluation grid: methods x budgets x lengths x depths x samples, one JSONL record per run.

Every finished run is appended (and flushed) at once, keyed by its coordinates; a rerun with the same ``--out``
skips the keys already there, so a crashed or interrupted grid resumes where it stopped. Records of another model
or written with different settings (question mode, chat, recall, new tokens, ...) are refused rather than mixed
into one table, and so is a grid that lists a point twice. A run holds its folder (a lock file): a second run on
it fails at once. Only a last line can be cut short by a crash; it is moved aside, never dropped, and any other
line that is not a record stops the run with its file and line named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import check_kv_dtype
from ..errors import ConfigError
from ..methods.base import MethodConfig
from ..quant import check_weights
from ..models import LoadedModel, check_context, load_model
from ..spec import build_config, takes_budget
from .base import EvalError, Sample, TaskOptions
from .engine import Engine
from .report import write_report
from .tasks import get_task

RESULTS = "results.jsonl"
LOCK = ".sparsekv-eval.lock"


@dataclass
class MethodRun:
    """One point of the method axis: the spec as the user wrote it, the budget (None if the method has none)."""

    label: str
    budget: int | float | None
    config: MethodConfig


def method_runs(specs: list[str], budgets: list[int | float] | None, kv_dtype: str = "auto") -> list[MethodRun]:
    """Configs for every method spec (``spec.build_config``'s syntax, e.g. ``quest:per_query_head=true``) and
    budget: a method with a ``token_budget`` the spec leaves unset runs once per budget. ``kv_dtype`` other than
    "auto" (the --kv-dtype option) sets every config's."""
    runs = []
    for spec in specs:
        if not takes_budget(spec):
            config = build_config(spec)
            runs.append(MethodRun(spec, getattr(config, "token_budget", None), config))
            continue
        if not budgets:
            raise EvalError(f"method {spec} needs --budgets (KV tokens attended per layer and KV head)")
        runs += [MethodRun(spec, budget, build_config(spec, budget)) for budget in budgets]
    return runs if kv_dtype == "auto" else [with_kv_dtype(run, kv_dtype) for run in runs]


def with_kv_dtype(run: MethodRun, kv_dtype: str) -> MethodRun:
    return dataclasses.replace(run, config=dataclasses.replace(run.config, kv_dtype=kv_dtype))


@dataclass
class EvalSpec:
    """Everything that defines a grid; ``limit``: samples per cell (generated tasks) or rows per file."""

    task: str
    methods: list[str] = field(default_factory=lambda: ["dense", "quest"])
    budgets: list[int | float] | None = None
    lengths: list[int] | None = None
    depths: list[float] | None = None
    seed: int = 0
    limit: int | None = None
    model: str | None = None
    dtype: str = "auto"
    weights: str = "float"
    kv_dtype: str = "auto"
    device: str = "auto"
    out: str = "eval_results"
    question_mode: str = "decode"
    chat: str = "auto"
    recall: bool = False
    plots: bool = True
    options: TaskOptions = field(default_factory=TaskOptions)

    def __post_init__(self):
        if self.question_mode not in ("decode", "prefill"):
            raise ConfigError("--question-mode", "decode or prefill", self.question_mode)
        if self.chat not in ("auto", "on", "off"):
            raise ConfigError("--chat", "auto, on or off", self.chat)
        check_weights(self.weights)
        check_kv_dtype(self.kv_dtype)
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ConfigError("--limit", "an integer >= 1 (or unset: the task's default)", self.limit)


def _axis(given, default, name: str, task: str, option: str) -> list:
    if default is None:
        if given:
            raise EvalError(f"task {task} has no {name} axis; drop {option}")
        return [None]
    return list(given) if given else list(default)


_NUMBER = (int, float)
_NONE = type(None)
# What every reader of a results file needs of a record, with the types allowed; ``kv``'s fields after.
SCHEMA = {"key": ((str,), "a string"), "task": ((str,), "a string"), "model": ((str,), "a string"),
          "method": ((str,), "a string"), "metric": ((str,), "a string"),
          "budget": ((*_NUMBER, _NONE), "a number or null"), "length": ((int, _NONE), "an integer or null"),
          "depth": ((*_NUMBER, _NONE), "a number or null"), "sample": ((int,), "an integer"),
          "seed": ((int,), "an integer"), "settings": ((dict,), "an object"), "score": (_NUMBER, "a number"),
          "kv": ((dict,), "an object"), "kv_resident_bytes": (_NUMBER, "a number")}
KV_SCHEMA = {"attended_per_head": ((*_NUMBER, _NONE), "a number or null"), "fraction": ((*_NUMBER, _NONE),
                                                                                       "a number or null")}


def record_problem(rec) -> str | None:
    """What makes ``rec`` (a parsed line of a results file) not a record of the runner, or None if nothing."""
    if not isinstance(rec, dict):
        return f"not a JSON object (a {type(rec).__name__})"
    for where, fields, schema in (("", rec, SCHEMA), ("'kv' ", rec.get("kv"), KV_SCHEMA)):
        for name, (types, allowed) in schema.items():
            if name not in fields:
                return f"{where}has no {name!r} field"
            value = fields[name]
            if isinstance(value, bool) or not isinstance(value, types):  # a bool is an int to isinstance
                return f"{where}{name!r} is {value!r}, not {allowed}"
    return None


def _parse_lines(path: Path) -> tuple[list[dict], tuple[int, bytes] | None]:
    """The records of a results file, and (number, text) of its last line if a crash cut it short (no newline, not
    a whole record). Any other line that is not a record raises ``EvalError`` naming it: only a hand edit or
    another program writes those, so nothing of them is dropped."""
    if not path.exists():
        return [], None
    lines = path.read_bytes().split(b"\n")
    records, torn, lines_of = [], None, {}
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if n == len(lines):  # the unterminated last line: a write cut short
                torn = n, raw
                continue
            what = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else f"not a JSON record ({err})"
            raise EvalError(f"{path}:{n}: {what}; fix or remove that line (the file was left as it is)") from None
        problem = record_problem(rec)
        if problem is None and rec["key"] in lines_of:
            problem = f"repeats the key of line {lines_of[rec['key']]} (a grid point written twice)"
        if problem:
            raise EvalError(f"{path}:{n}: {problem}; fix or remove that line (the file was left as it is)")
        records.append(rec)
        lines_of[rec["key"]] = n
    return records, torn


def read_results(path: Path) -> list[dict]:
    """The records of a results file, which is left as it is; a last line cut short by a crash is warned about
    and skipped, any other bad line raises ``EvalError``."""
    records, torn = _parse_lines(path)
    if torn is not None:
        print(f"warning: {path}:{torn[0]} is a record cut short; ignoring it", file=sys.stderr)
    return records


def repair_results(path: Path, torn: tuple[int, bytes] | None, log=print) -> None:
    """Makes appends to a results file start on a line of their own: a last line cut short (``torn``) is moved
    to ``<file>.torn-<n>`` (said once, its run is redone), a whole last record gets its newline."""
    if not path.exists():
        return
    data = path.read_bytes()
    if torn is not None:
        n = 1
        while (aside := path.with_name(f"{path.name}.torn-{n}")).exists():
            n += 1
        aside.write_bytes(torn[1])
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(torn[1]))
        log(f"{path}:{torn[0]} is a record cut short (a crash while writing it); moved to {aside}, "
            f"its run is redone")
    elif data and not data.endswith(b"\n"):
        with open(path, "ab") as f:
            f.write(b"\n")


def check_out(out: Path) -> None:
    """Refuses an output folder that cannot be written (a file of that name, no permission) before any work."""
    if out.exists() and not out.is_dir():
        raise EvalError(f"--out {out}: is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise EvalError(f"--out {out}: cannot create the folder ({err.strerror})") from None
    target = out / RESULTS
    if target.exists() and not target.is_file():
        raise EvalError(f"--out {out}: {RESULTS} is not a file")
    if not os.access(out, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise EvalError(f"--out {out}: not writable")


@contextlib.contextmanager
def locked(out: Path):
    """Holds ``out`` for one run: a second run on the same folder (this or another process) fails at once, naming
    the pid of the first, rather than both appending the same grid points. The lock goes with its process."""
    f = open(out / LOCK, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            raise EvalError(f"--out {out} is in use by another run (pid {pid}); wait for it to end or use another "
                            f"--out") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()


def _once(values: list, option: str) -> None:
    """Refuses a grid axis that lists a value twice (its runs would be written twice)."""
    for i, v in enumerate(values):
        if v in values[:i]:
            raise EvalError(f"{option} lists {v} twice; give each value once")


def run_eval(spec: EvalSpec, log=print, progress: bool = True, loaded: LoadedModel | None = None) -> Path:
    """Runs the grid of ``spec`` (skipping finished runs), writes the report; returns the output folder."""
    _once(list(spec.options.datasets), "--datasets")
    task = get_task(spec.task, spec.options)
    lengths = _axis(spec.lengths, task.lengths, "length", task.name, "--lengths")
    depths = _axis(spec.depths, task.depths, "depth", task.name, "--depths")
    for d in depths:
        if d is not None and not 0.0 <= d <= 1.0:
            raise EvalError(f"--depths must lie in [0, 1], got {d}")
    for values, option in ((spec.methods, "--methods"), (spec.budgets or [], "--budgets"), (lengths, "--lengths"),
                           (depths, "--depths")):
        _once(list(values), option)
    runs = method_runs(spec.methods, spec.budgets, spec.kv_dtype)
    for i, run in enumerate(runs):
        for other in runs[:i]:
            if other.config == run.config:
                raise EvalError(f"--methods {_run_name(other)} and {_run_name(run)} are the same run; give it once")
    out = Path(spec.out)
    check_out(out)
    with locked(out):
        return _run_grid(spec, task, lengths, depths, runs, out, log, progress, loaded)


def _run_name(run: MethodRun) -> str:
    return run.label if run.budget is None or not takes_budget(run.label) else f"{run.label} @{run.budget}"


def _run_grid(spec: EvalSpec, task, lengths: list, depths: list, runs: list[MethodRun], out: Path, log,
              progress: bool, loaded: LoadedModel | None) -> Path:
    """``run_eval`` once the grid is checked and ``out`` is held."""
    if loaded is None:
        try:
            loaded = load_model(spec.model, spec.device, spec.dtype, log, weights=spec.weights)
        except (FileNotFoundError, ImportError) as err:  # ImportError: a missing optional extra (gguf)
            raise EvalError(f"--model {spec.model}: {err}") from None
    if lengths[0] is not None:
        check_context(loaded.model, max(lengths) + task.new_tokens(), "use smaller --lengths or --max-new-tokens")
    chat = spec.chat == "on" or (spec.chat == "auto" and bool(getattr(loaded.tokenizer, "chat_template", None)))
    settings = {"question_mode": spec.question_mode, "chat": chat, "recall": spec.recall,
                "max_new_tokens": spec.options.max_new_tokens, "dtype": spec.dtype}
    if spec.weights != "float":  # absent for float weights: the settings of results made before the option
        settings["weights"] = spec.weights
    if spec.kv_dtype != "auto":
        settings["kv_dtype"] = spec.kv_dtype
    if task.name == "perplexity":
        settings["prefill_tokens"] = spec.options.prefill_tokens

    path = out / RESULTS
    previous, torn = _parse_lines(path)
    for rec in previous:
        # One table per task and folder: runs of another model or with other settings would be averaged into it.
        if rec["task"] == task.name and rec["model"] != loaded.name:
            raise EvalError(f"{path} holds {task.name} runs of model {rec['model']}, not {loaded.name}; use another "
                            f"--out for each model")
        if rec["task"] == task.name and rec["settings"] != settings:
            raise EvalError(f"{path} holds {task.name} runs made with settings {rec['settings']}, not "
                            f"{settings}; use another --out or the same options")
    repair_results(path, torn, log)
    done = {rec["key"] for rec in previous}

    count = spec.limit if spec.limit is not None else task.default_samples
    cells = [(length, depth, task.samples(loaded.tokenizer, length, depth, spec.seed, count))
             for length in lengths for depth in depths]
    engines = [Engine(loaded, r.config, spec.question_mode, chat, spec.recall) for r in runs]
    todo, skipped = [], 0
    for length, depth, samples in cells:
        for i, sample in enumerate(samples):
            for run, engine in zip(runs, engines):
                key = json.dumps([task.name, loaded.name, run.label, run.budget, length, depth, i, spec.seed])
                if key in done:
                    skipped += 1
                else:
                    todo.append((key, length, depth, i, sample, run, engine))
    if skipped:
        log(f"resuming: {skipped} runs already in {path}, {len(todo)} to go")
    # One short prompt per method first, so that tokens/s leaves out one-time costs (kernel compilation, caches).
    for engine in dict.fromkeys(item[-1] for item in todo):
        engine.generate(Sample("Warm up. " * 16, " Go", None, 2))
    bar = _progress(len(todo), task.name, progress)
    with open(path, "a", encoding="utf-8") as f:
        for key, length, depth, i, sample, run, engine in todo:
            result = task.run(engine, sample)
            record = {"key": key, "task": task.name, "model": loaded.name, "method": run.label,
                      "method_name": run.config.name, "budget": run.budget, "length": length, "depth": depth,
                      "sample": i, "seed": spec.seed, "settings": settings, "metric": task.metric,
                      "config": _config_dict(run.config), "meta": sample.meta,
                      "target": task.target(sample),
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            bar.update(1)
            bar.set_postfix_str(f"{_run_name(run)}: {task.metric} {result['score']:.3g}")
    bar.close()
    write_report(read_results(path), out, task.name, plots=spec.plots, log=log)
    return out


def _config_dict(config: MethodConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
