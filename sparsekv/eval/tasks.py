"""The task registry: name -> task class."""

from __future__ import annotations

from .base import EvalError, Task, TaskOptions
from .datasets import DATASETS
from .ruler import RULER
from .synthetic import SYNTHETIC

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (*SYNTHETIC, *RULER, *DATASETS)}


def get_task(name: str, options: TaskOptions) -> Task:
    if name not in TASKS:
        raise EvalError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    return TASKS[name](options)
