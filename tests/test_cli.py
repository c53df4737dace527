"""The command line on a tiny model saved to disk, and its errors."""

import pytest

from sparsekv.cli import main
from sparsekv.models import make_config
from sparsekv.tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", layers=3).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def test_generate_prints_text_speed_and_attended_tokens(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--method", "quest", "--budget", "32", "--opt", "dense_layers=1",
                 "--prompt", "The grass is green. " * 8, "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "6 tokens in" in err and "tokens/s" in err
    assert "KV tokens attended per layer-head per decode step" in err


def test_generate_from_prompt_file_with_sampling(model_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time " * 10)
    assert main(["generate", "--model", model_dir, "--method", "dense", "--prompt-file", str(prompt),
                 "--max-new-tokens", "4", "--sample", "--temperature", "0.7"]) == 0
    assert "4 tokens in" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file: no file at"),
    (["--prompt", "hi", "--budget", "30"], "token_budget must be a positive multiple of page_size"),
    (["--prompt", "hi", "--opt", "selector=last"], "quest has no option selector"),
    (["--prompt", "hi", "--dtype", "int8"], "dtype must be one of"),
])
def test_generate_errors_name_the_parameter(model_dir, capsys, argv, message):
    assert main(["generate", "--model", model_dir, *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_directory(capsys):
    assert main(["generate", "--model", "/nonexistent/model", "--prompt", "hi"]) == 2
    assert "model: no model directory at '/nonexistent/model'" in capsys.readouterr().err


def test_unknown_method_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "x", "--prompt", "hi", "--method", "magic"])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_make_config_errors():
    with pytest.raises(ValueError, match="method must be one of"):
        make_config("magic", 64)
    with pytest.raises(ValueError, match="method dense takes no budget"):
        make_config("dense", 64)


def test_demo_runs_every_method_on_the_shipped_model(capsys):
    """The README's main job: the project's trained model finds the pass key densely, and every method runs."""
    import re

    from sparsekv.methods import METHODS

    assert main(["demo", "--prompt-tokens", "1000", "--max-new-tokens", "8", "--budget", "64"]) == 0
    out = capsys.readouterr().out
    key = re.search(r"the answer is (\d+)", out).group(1)
    assert f"| dense | - | {key}. |" in out
    for name in METHODS:
        assert f"| {name} |" in out


def test_demo_on_a_tiny_model_and_a_missing_default(capsys, monkeypatch):
    from sparsekv import models

    assert main(["demo", "--model", "tiny:llama", "--method", "quest", "--prompt-tokens", "300",
                 "--max-new-tokens", "2"]) == 0
    assert "| quest | 256 |" in capsys.readouterr().out
    monkeypatch.setattr(models, "DEFAULT_MODEL", "/nonexistent/model")
    with pytest.raises(FileNotFoundError, match="pip install -e"):
        models.default_model()
