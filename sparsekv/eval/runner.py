"""The evaluation grid: methods x budgets x lengths x depths x samples, one JSONL record per run.

Every finished run is appended (and flushed) at once, keyed by its coordinates; a rerun with the same ``--out``
skips the keys already there, so a crashed or interrupted grid resumes where it stopped. Records written with
different settings (question mode, chat, recall, new tokens, ...) are refused rather than mixed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..methods import METHODS
from ..methods.base import MethodConfig
from .base import EvalError, Sample, TaskOptions
from .engine import Engine, LoadedModel, load_model
from .report import write_report
from .tasks import get_task

RESULTS = "results.jsonl"


@dataclass
class MethodRun:
    """One point of the method axis: the spec as the user wrote it, the budget (None if the method has none)."""

    label: str
    budget: int | None
    config: MethodConfig


def _parse_value(raw: str, default, where: str):
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise EvalError(f"{where}: expected true or false, got {raw!r}")
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(raw)
            except ValueError:
                raise EvalError(f"{where}: expected {kind.__name__}, got {raw!r}") from None
    return raw


def method_runs(specs: list[str], budgets: list[int] | None) -> list[MethodRun]:
    """Configs for every method spec and budget. A spec is ``name`` or ``name:field=value,field=value`` (e.g.
    ``quest:per_query_head=true,dense_layers=0``); methods with a ``token_budget`` field run once per budget."""
    runs = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        if name not in METHODS:
            raise EvalError(f"unknown method {name!r}; methods: {', '.join(METHODS)}")
        cls = METHODS[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        overrides = {}
        for item in filter(None, rest.split(",")):
            key, eq, raw = item.partition("=")
            if not eq or key not in fields:
                raise EvalError(f"method spec {spec!r}: {item!r} is not field=value with a field of {name} "
                                f"({', '.join(fields)})")
            default = fields[key].default
            overrides[key] = _parse_value(raw, None if default is dataclasses.MISSING else default,
                                          f"{spec!r} field {key}")
        if "token_budget" in fields and "token_budget" not in overrides:
            if not budgets:
                raise EvalError(f"method {name} needs --budgets (KV tokens attended per layer and KV head)")
            points = [(b, {"token_budget": b}) for b in budgets]
        else:
            points = [(overrides.get("token_budget"), {})]
        for budget, extra in points:
            try:
                config = cls(**overrides, **extra)
            except (ValueError, TypeError) as e:
                raise EvalError(f"method {spec!r} at budget {budget}: {e}") from None
            runs.append(MethodRun(spec, budget, config))
    return runs


@dataclass
class EvalSpec:
    """Everything that defines a grid; ``limit``: samples per cell (generated tasks) or rows per file."""

    task: str
    methods: list[str] = field(default_factory=lambda: ["dense", "quest"])
    budgets: list[int] | None = None
    lengths: list[int] | None = None
    depths: list[float] | None = None
    seed: int = 0
    limit: int | None = None
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    out: str = "eval_results"
    question_mode: str = "decode"
    chat: str = "auto"
    recall: bool = False
    plots: bool = True
    options: TaskOptions = field(default_factory=TaskOptions)


def _axis(given, default, name: str, task: str, option: str) -> list:
    if default is None:
        if given:
            raise EvalError(f"task {task} has no {name} axis; drop {option}")
        return [None]
    return list(given) if given else list(default)


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                # A crash mid-write can leave a partial last line; that run is simply redone.
                print(f"warning: {path}:{n} is not a complete record; ignoring it", file=sys.stderr)
    return records


def run_eval(spec: EvalSpec, log=print, progress: bool = True, loaded: LoadedModel | None = None) -> Path:
    """Runs the grid of ``spec`` (skipping finished runs), writes the report; returns the output folder."""
    if spec.question_mode not in ("decode", "prefill"):
        raise EvalError(f"--question-mode must be decode or prefill, got {spec.question_mode!r}")
    if spec.chat not in ("auto", "on", "off"):
        raise EvalError(f"--chat must be auto, on or off, got {spec.chat!r}")
    task = get_task(spec.task, spec.options)
    lengths = _axis(spec.lengths, task.lengths, "length", task.name, "--lengths")
    depths = _axis(spec.depths, task.depths, "depth", task.name, "--depths")
    for d in depths:
        if d is not None and not 0.0 <= d <= 1.0:
            raise EvalError(f"--depths must lie in [0, 1], got {d}")
    runs = method_runs(spec.methods, spec.budgets)
    loaded = loaded or load_model(spec.model, spec.dtype, spec.device, log)
    limit = loaded.max_positions
    if limit is not None and lengths[0] is not None and max(lengths) + task.new_tokens() > limit:
        raise EvalError(f"length {max(lengths)} plus {task.new_tokens()} new tokens exceeds the model's maximum of "
                        f"{limit} tokens (max_position_embeddings); use smaller --lengths")
    chat = spec.chat == "on" or (spec.chat == "auto" and bool(getattr(loaded.tokenizer, "chat_template", None)))
    settings = {"question_mode": spec.question_mode, "chat": chat, "recall": spec.recall,
                "max_new_tokens": spec.options.max_new_tokens, "dtype": spec.dtype}
    if task.name == "perplexity":
        settings["prefill_tokens"] = spec.options.prefill_tokens

    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    previous = read_results(path)
    for rec in previous:
        if rec.get("task") == task.name and rec.get("settings") != settings:
            raise EvalError(f"{path} holds {task.name} runs made with settings {rec.get('settings')}, not "
                            f"{settings}; use another --out or the same options")
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
        if f.tell() and not path.read_bytes().endswith(b"\n"):
            f.write("\n")  # end a line cut by a crash, so the next record starts on its own line
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
