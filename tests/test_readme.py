"""The README's set-up commands stay true: CI runs exactly its test command, first."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_first():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    first = lines[2]
    assert first in (ROOT / "README.md").read_text()
    assert first.startswith("pip install torch==2.13.0 && ")
