"""Offline evaluation harness: tasks, metrics, the grid runner, reports, and the attention-recall probe.

Run it as ``sparsekv eval ...`` or ``python -m sparsekv.eval ...``; see docs/eval.md.
"""

from .base import EvalError, Sample, Task, TaskOptions
from .engine import Engine
from .recall import RecallConfig
from .runner import EvalSpec, method_runs, run_eval
from .tasks import TASKS, get_task

__all__ = ["EvalError", "Sample", "Task", "TaskOptions", "Engine", "RecallConfig", "EvalSpec",
           "method_runs", "run_eval", "TASKS", "get_task"]
