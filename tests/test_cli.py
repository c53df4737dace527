"""The command line on a tiny model saved to disk, and its errors."""

import pytest

from sparsekv import cli
from sparsekv.cli import build_parser, main
from sparsekv.errors import ConfigError
from sparsekv.spec import build_config
from sparsekv.tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", layers=3, max_positions=512).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def test_generate_prints_text_speed_and_attended_tokens(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--method", "quest", "--budget", "32", "--opt", "dense_layers=1",
                 "--prompt", "The grass is green. " * 8, "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "prefill of" in err and "6 new tokens, decode" in err and "tokens/s after the first" in err
    assert "KV tokens attended per layer-head per decode step" in err
    assert "MiB of tokens held" in err and "MiB allocated" in err
    assert "[quest] decode" in err  # the progress bar, on stderr


def test_generate_reports_prefill_and_decode_apart_and_held_kv_bytes(model_dir):
    """The prefill is timed apart from the decode steps; the KV held (tokens) is below what is allocated (room for
    growth, metadata) and equals the K/V bytes of the tokens: 3 layers x 2 KV heads x 16 dims x 2 x 4 bytes."""
    from sparsekv.models import load_model

    loaded = load_model(model_dir, "cpu")
    result = cli.generate(loaded.model, loaded.tokenizer, build_config("dense"), "The grass is green. " * 5, 5)
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.decode_tokens_per_second == pytest.approx(4 / result.decode_seconds)
    held_tokens = result.prompt_tokens + result.new_tokens - 1  # the last token is sampled, never stored
    assert result.kv_held_bytes == held_tokens * 3 * 2 * 16 * 2 * 4
    assert result.kv_held_bytes < result.kv_allocated_bytes


def test_no_progress_keeps_stderr_to_the_summary(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--method", "dense", "--prompt", "hi there", "--max-new-tokens",
                 "3", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("[dense] prefill of") and err.count("\n") == 1


def test_generate_without_a_model_takes_the_shipped_one(capsys):
    assert main(["generate", "--prompt", "hi there", "--max-new-tokens", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("no --model given: using the project's trained model") and "[quest] prefill of" in err


def test_generate_from_prompt_file_with_sampling(model_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time " * 10)
    assert main(["generate", "--model", model_dir, "--method", "dense", "--prompt-file", str(prompt),
                 "--max-new-tokens", "4", "--sample", "--temperature", "0.7"]) == 0
    assert "4 new tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file: no file at"),
    (["--prompt", "hi", "--budget", "30"], "token_budget must be a positive multiple of page_size"),
    (["--prompt", "hi", "--opt", "selector=last"], "method field must be FIELD=VALUE with a field of quest"),
    (["--prompt", "hi", "--dtype", "int8"], "dtype must be one of"),
    (["--prompt", "hi", "--opt", "per_query_head=maybe"], "per_query_head must be true or false, got 'maybe'"),
    (["--prompt", "hi", "--top-p", "2", "--sample"], "--top-p must be a number in (0, 1], got 2.0"),
    (["--prompt", "hi", "--temperature", "0", "--sample"], "--temperature must be a number > 0"),
    (["--prompt", "hi", "--temperature", "0.7"], "--temperature must be given only with --sample"),
    (["--prompt", "hi", "--top-p", "0.9"], "--top-p must be given only with --sample"),
    (["--prompt", ""], "--prompt: is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--prompt", "hi", "--device", "gpu0"], "device must be auto, cpu, cuda or cuda:N, got 'gpu0'"),
    (["--prompt", "word " * 600], "context of 3064 tokens (prompt plus new tokens) exceeds the model's maximum of "
                                  "512 positions"),
    (["--prompt", "hi", "--budget", "32", "--opt", "token_budget=64"], "token_budget must be given once"),
])
def test_generate_errors_name_the_parameter(model_dir, capsys, argv, message):
    assert main(["generate", "--model", model_dir, *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_directory(capsys):
    assert main(["generate", "--model", "/nonexistent/model", "--prompt", "hi"]) == 2
    assert "model: no model directory at '/nonexistent/model'" in capsys.readouterr().err


def test_a_model_file_that_is_not_gguf_is_named(tmp_path, capsys):
    text = tmp_path / "long.txt"
    text.write_text("not a model")
    assert main(["generate", "--model", str(text), "--prompt", "hi"]) == 2
    assert f"model: '{text}' is a file but not a GGUF file (.gguf)" in capsys.readouterr().err


def test_unknown_method_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "x", "--prompt", "hi", "--method", "magic"])
    assert "method must be one of dense, quest" in capsys.readouterr().err


def test_build_config_errors():
    with pytest.raises(ConfigError, match="method must be one of"):
        build_config("magic", 64)
    with pytest.raises(ConfigError, match="method dense takes no budget"):
        build_config("dense", 64)


@pytest.mark.parametrize("argv", [
    ["--method", "quest", "--opt", "dense_layers=0", "--opt", "per_query_head=false"],
    ["--method", "quest:dense_layers=0,per_query_head=false"],
    ["--method", "quest:dense_layers=0", "--opt", "per_query_head=False"],
])
def test_one_spec_syntax_with_booleans_read_as_booleans(argv):
    """--opt and NAME:FIELD=VALUE go through the same parser: 'false' is False, whatever the command."""
    from sparsekv.eval.runner import method_runs

    args = build_parser().parse_args(["generate", "--model", "x", "--prompt", "hi", "--budget", "128", *argv])
    _, _, config = cli._setup(args, args.method)
    assert config.per_query_head is False and config.dense_layers == 0 and config.token_budget == 128
    run, = method_runs(["quest:dense_layers=0,per_query_head=false"], [128])
    assert run.config == config


def test_spec_values_are_typed_by_the_field():
    config = build_config("omnikv:filter_layers=[1,3],selector=uniform,offload=yes", 0.1)
    assert config.filter_layers == (1, 3) and config.offload is True and config.token_budget == 0.1
    assert build_config("omnikv", 2048).token_budget == 2048
    assert build_config("raas:top_fraction=none,alpha=0.2").alpha == 0.2
    with pytest.raises(ConfigError, match="window must be an integer, got '1.5'"):
        build_config("omnikv:window=1.5")
    with pytest.raises(ConfigError, match="alpha must be a number or none, got 'x'"):
        build_config("raas:alpha=x")


def test_interrupted_generate_is_a_message(model_dir, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate", interrupted)
    assert main(["generate", "--model", model_dir, "--prompt", "hi"]) == 130
    assert "sparsekv generate: interrupted" in capsys.readouterr().err


def test_unknown_model_name_fails_fast_saying_what_was_tried(capsys):
    import time

    start = time.perf_counter()
    assert main(["generate", "--model", "nope_model", "--prompt", "hi"]) == 2
    assert time.perf_counter() - start < 20
    err = capsys.readouterr().err
    assert "'nope_model' is neither a local directory nor in the Hugging Face cache" in err


def test_demo_on_a_tiny_model_and_a_missing_default(capsys, monkeypatch):
    from sparsekv import models

    assert main(["demo", "--model", "tiny:llama", "--method", "quest", "--prompt-tokens", "300",
                 "--max-new-tokens", "2"]) == 0
    assert "| quest | 256 |" in capsys.readouterr().out
    assert main(["demo", "--model", "tiny:llama", "--method", "quest", "--prompt-tokens", "50"]) == 2
    assert "--prompt-tokens 50: length 50 is too short for this task" in capsys.readouterr().err
    assert main(["demo", "--model", "tiny:llama", "--method", "quest", "--prompt-tokens", "9000"]) == 2
    assert "exceeds the model's maximum of 8192 positions" in capsys.readouterr().err
    monkeypatch.setattr(models, "DEFAULT_MODEL", "/nonexistent/model")
    with pytest.raises(FileNotFoundError, match="pip install -e"):
        models.default_model()


def test_demo_samples_the_dense_reference_too(monkeypatch, capsys):
    """--sample: dense (the row and the reference every method is compared with) samples like the methods."""
    calls = []
    real = cli.generate

    def spy(model, tokenizer, config, prompt, max_new_tokens, **kwargs):
        calls.append((config.name, kwargs.get("sample", False)))
        return real(model, tokenizer, config, prompt, max_new_tokens, **kwargs)

    monkeypatch.setattr(cli, "generate", spy)
    assert main(["demo", "--model", "tiny:llama", "--method", "dense", "--sample", "--prompt-tokens", "300",
                 "--max-new-tokens", "3", "--no-progress"]) == 0
    assert calls[1:] == [("dense", True)]  # after the warm-up: one dense run, sampled, used for its row too
    assert capsys.readouterr().out.count("| dense |") == 1


def _number_fields() -> list[tuple[str, str, str]]:
    """(method, field, kind) for every field of every method's config read as a number or a list of integers;
    kind: "int", "float", "int|float" or "list"."""
    import dataclasses
    import typing

    from sparsekv.methods import METHODS

    out = []
    for name, cls in METHODS.items():
        for f in dataclasses.fields(cls):
            members = set(typing.get_args(typing.get_type_hints(cls)[f.name])) - {type(None)}
            members = members or {typing.get_type_hints(cls)[f.name]}
            if any(typing.get_origin(m) is tuple for m in members):
                out.append((name, f.name, "list"))
            elif members & {int, float}:
                out.append((name, f.name, "|".join(t.__name__ for t in (int, float) if t in members)))
    return out


@pytest.mark.parametrize("method, field, kind", _number_fields())
def test_numbers_out_of_range_in_a_spec_name_the_field(method, field, kind):
    values = ["1180591620717411303424", "-1180591620717411303424", "9223372036854775808", "2147483648"]
    values += {"float": ["inf", "-inf", "nan", "1e400"], "int|float": ["1e400", "-1e400"]}.get(kind, [])
    for value in values:
        with pytest.raises(ConfigError, match=f"{field} must be"):
            build_config(f"{method}:{field}=" + (f"[1,{value}]" if kind == "list" else value))


@pytest.mark.parametrize("method", ["quest", "h2o", "streamingllm", "tova", "snapkv", "omnikv", "raas"])
def test_a_huge_budget_is_an_error_not_a_traceback(model_dir, capsys, method):
    for argv in (["--method", f"{method}:token_budget={2**70}"], ["--method", method, "--budget", str(2**70)]):
        assert main(["generate", "--model", model_dir, "--prompt", "hi", "--max-new-tokens", "2", *argv]) == 2
        err = capsys.readouterr().err
        assert "token_budget must be" in err and "Traceback" not in err


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"), (b"  \n\t\n", "is empty"), (b"\xff\xfe\x00binary\x80", "is not UTF-8 text"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "is not UTF-8 text"),
])
def test_an_empty_or_binary_prompt_file_names_the_option(model_dir, tmp_path, capsys, content, message):
    prompt = tmp_path / "prompt.bin"
    prompt.write_bytes(content)
    assert main(["generate", "--model", model_dir, "--prompt-file", str(prompt), "--max-new-tokens", "2"]) == 2
    assert f"--prompt-file {prompt}: {message}" in capsys.readouterr().err


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"sparsekv {version('sparsekv')}\n"
