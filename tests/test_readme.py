"""The README's set-up commands stay true: CI runs exactly its test command, first."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_first():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    first = lines[2]
    # a failure anywhere in the command fails CI (set -e lets an && list fail and go on)
    assert first.endswith(" || exit 1")
    command = first.removesuffix(" || exit 1")
    assert command in (ROOT / "README.md").read_text()
    assert command.startswith("pip install torch==2.13.0 && ")


def test_readme_apply_snippet_runs_as_written(capsys):
    """The ``sparsekv.apply`` snippet, on a tiny model and a prompt longer than its budget."""
    import re

    import torch

    from sparsekv.tiny import byte_tokenizer, tiny_model

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    (snippet,) = [b for b in blocks if "with sparsekv.apply(model, config) as session:" in b]
    model = tiny_model("llama")
    inputs = byte_tokenizer()(["The grass is green. " * 80], return_tensors="pt")
    scope = {"model": model, "inputs": inputs}
    with torch.no_grad():
        exec(snippet, scope)
    summary = scope["session"].stats.summary()
    assert summary["decode_steps"] == 255 and 0 < summary["fraction"] < 1
    assert str(summary) in capsys.readouterr().out
    assert model.config._attn_implementation != "sparsekv"


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
