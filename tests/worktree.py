"""The environment of a process a test starts: this checkout's sparsekv first on the path."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree_env(**more: str) -> dict[str, str]:
    """This environment with ``more``, the worktree first on the path, so that the processes a test starts import
    this checkout's sparsekv."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                **more)
