"""The README's set-up commands stay true: CI runs exactly its test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text()
    assert ci.startswith("pip install torch==2.13.0 && ")


def test_the_engine_snippet_runs_as_written_on_the_shipped_model(monkeypatch, capsys):
    """The tour's first snippet, executed from the repository's root: loads the shipped model, generates a batch
    of two with sampling and the model's EOS as stop token, and prints what it says."""
    import re

    tour = (ROOT / "README.md").read_text().split("## A short tour", 1)[1]
    code = re.search(r"```python\n(.*?)```", tour, re.S).group(1)
    assert "max_context=18432" in code and "stop_tokens=" in code
    monkeypatch.chdir(ROOT)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    out = scope["out"]
    assert len(out.texts) == 2 and all(1 <= len(tokens) <= 64 for tokens in out.tokens)
    assert out.decode_tokens_per_second > 0 and out.stats["attended_per_head"] > 0
    assert capsys.readouterr().out.count("\n") >= 2  # the streamed tokens, then the results
