"""The README's set-up commands stay true: CI runs exactly its test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text()
    assert ci.startswith("pip install torch==2.13.0 && ")
