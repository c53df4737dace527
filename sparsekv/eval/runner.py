"""The evaluation grid: methods x budgets x lengths x depths x samples, one JSONL record per run.

Every finished run is appended (and flushed) at once, keyed by its coordinates; a rerun with the same ``--out``
skips the keys already there, so a crashed or interrupted grid resumes where it stopped. Records written with
different settings (question mode, chat, recall, new tokens, ...) are refused rather than mixed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class MethodRun:
    """One point of the method axis: the spec as the user wrote it, the budget (None if the method has none)."""

    label: str
    budget: int | float | None
    config: MethodConfig


def method_runs(specs: list[str], budgets: list[int | float] | None) -> list[MethodRun]:
    """Configs for every method spec (``spec.build_config``'s syntax, e.g. ``quest:per_query_head=true``) and
    budget: a method with a ``token_budget`` the spec leaves unset runs once per budget."""
    runs = []
    for spec in specs:
        if not takes_budget(spec):
            config = build_config(spec)
            runs.append(MethodRun(spec, getattr(config, "token_budget", None), config))
            continue
        if not budgets:
            raise EvalError(f"method {spec} needs --budgets (KV tokens attended per layer and KV head)")
        runs += [MethodRun(spec, budget, build_config(spec, budget)) for budget in budgets]
    return runs


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
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ConfigError("--limit", "an integer >= 1 (or unset: the task's default)", self.limit)


def _axis(given, default, name: str, task: str, option: str) -> list:
    if default is None:
        if given:
            raise EvalError(f"task {task} has no {name} axis; drop {option}")
        return [None]
    return list(given) if given else list(default)


def _parse_lines(path: Path) -> tuple[list[dict], list[int]]:
    """The records of a results file and the numbers of its lines that are not whole records."""
    if not path.exists():
        return [], []
    records, torn = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                torn.append(n)
    return records, torn


def read_results(path: Path) -> list[dict]:
    """The whole records of a results file; lines cut short by a crash are warned about and skipped."""
    records, torn = _parse_lines(path)
    for n in torn:
        print(f"warning: {path}:{n} is not a complete record; ignoring it", file=sys.stderr)
    return records


def repair_results(path: Path, records: list[dict], torn: list[int], log=print) -> None:
    """Rewrites a results file as its whole ``records``, without the lines ``torn`` that a crash cut short (said
    once) and with every record ending its line, so that appends start on a line of their own."""
    if torn or (path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in records), encoding="utf-8")
        os.replace(tmp, path)
        if torn:
            log(f"{path}: removed {len(torn)} incomplete line(s) (line {', '.join(map(str, torn))}, a write cut "
                f"short); those runs are redone")


def check_out(out: Path) -> None:
    """Refuses an output folder that cannot be written (a file of that name, no permission) before any work."""
    if out.exists() and not out.is_dir():
        raise EvalError(f"--out {out}: is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise EvalError(f"--out {out}: cannot create the folder ({err.strerror})") from None
    target = out / RESULTS
    if not os.access(out, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise EvalError(f"--out {out}: not writable")


def run_eval(spec: EvalSpec, log=print, progress: bool = True, loaded: LoadedModel | None = None) -> Path:
    """Runs the grid of ``spec`` (skipping finished runs), writes the report; returns the output folder."""
    task = get_task(spec.task, spec.options)
    lengths = _axis(spec.lengths, task.lengths, "length", task.name, "--lengths")
    depths = _axis(spec.depths, task.depths, "depth", task.name, "--depths")
    for d in depths:
        if d is not None and not 0.0 <= d <= 1.0:
            raise EvalError(f"--depths must lie in [0, 1], got {d}")
    runs = method_runs(spec.methods, spec.budgets)
    out = Path(spec.out)
    check_out(out)
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
    if task.name == "perplexity":
        settings["prefill_tokens"] = spec.options.prefill_tokens

    path = out / RESULTS
    previous, torn = _parse_lines(path)
    for rec in previous:
        if rec.get("task") == task.name and rec.get("settings") != settings:
            raise EvalError(f"{path} holds {task.name} runs made with settings {rec.get('settings')}, not "
                            f"{settings}; use another --out or the same options")
    repair_results(path, previous, torn, log)
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
            where = run.label if run.budget is None else f"{run.label} @{run.budget}"
            bar.set_postfix_str(f"{where}: {task.metric} {result['score']:.3g}")
    bar.close()
    write_report(read_results(path), out, task.name, plots=spec.plots, log=log)
    return out


def _config_dict(config: MethodConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
