"""What every benchmark shares: results written through ``common.write_files``, which never replaces another
device's or setting's results unless asked (``--overwrite``), checked before a run measures anything; and a memory
check before it allocates."""

import importlib
import json
import re
from pathlib import Path

import pytest
import torch

from sparsekv.bench import common

BENCHES = ["attention", "capacity", "e2e", "kv_dtype", "linear", "lowbit", "serve", "tp"]
H200 = {"device": "NVIDIA H200", "device_name": "NVIDIA H200"}


def published(out: Path, tag: str, meta: dict) -> dict[str, bytes]:
    """Results of another run at ``out/tag.*`` (JSON, markdown, figure); returns their bytes by name."""
    out.mkdir(parents=True, exist_ok=True)
    files = {f"{tag}.json": json.dumps({"meta": meta, "rows": [{"published": True}]}).encode(),
             f"{tag}.md": b"| published |\n", f"{tag}.png": b"\x89PNG published"}
    for name, data in files.items():
        (out / name).write_bytes(data)
    return files


def unchanged(out: Path, files: dict[str, bytes]) -> bool:
    return all((out / name).read_bytes() == data for name, data in files.items())


def attention_argv(out: Path, *more: str) -> list[str]:
    return ["--shapes", "tiny", "--contexts", "256", "--batches", "1", "--budgets", "64", "--reps", "2", "--no-naive",
            "--device", "cpu", "--out", str(out), *more]


@pytest.mark.parametrize("bench", BENCHES)
def test_every_bench_takes_overwrite_and_records_its_setting(bench):
    pytest.importorskip("triton")  # bench.linear imports it
    parser = importlib.import_module(f"sparsekv.bench.{bench}").build_parser()
    argv = ["ladder"] if bench == "capacity" else []
    assert parser.parse_args([*argv, "--overwrite"]).overwrite and not parser.parse_args(argv).overwrite
    setting = common.run_setting(bench, parser.parse_args(argv))
    assert setting["bench"] == bench and not {"out", "tag", "overwrite", "device"} & set(setting)
    # A recorded command line reads back as the same setting, wherever its results went.
    where = "--out /root/out/tp.json" if bench == "tp" else "--out /root/out --tag x"
    assert common.command_setting(f"python -m sparsekv.bench.{bench} {' '.join(argv)} {where}") == setting


def test_no_bench_writes_a_file_but_through_write_files():
    """Every JSON, markdown and figure file a benchmark writes goes through ``common.write_files`` (and so through
    its check): no other write in the benchmark modules."""
    folder = Path(common.__file__).parent
    writes = re.compile(r"\.write_(text|bytes)\(|\.savefig\(|json\.dump\(|open\([^)]*[\"'][wax]")
    found = [f"{bench}.py:{i}: {line.strip()}" for bench in BENCHES
             for i, line in enumerate((folder / f"{bench}.py").read_text().splitlines(), 1) if writes.search(line)]
    assert found == []


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_attention_bench_keeps_another_devices_results(tmp_path, capsys, monkeypatch):
    """The finding: ``python -m sparsekv.bench.attention`` on a CPU replaced the H200's results. It is refused
    before it measures anything, the files untouched; --out elsewhere or --overwrite are the ways out; the same
    run again (same device and setting) replaces its own results."""
    pytest.importorskip("triton")
    from sparsekv.bench import attention

    files = published(tmp_path, "attention", {"device": "NVIDIA H200", "command": "python -m sparsekv.bench."
                                              "attention --out benchmarks/results"})
    measured = []
    real = attention.copy_bandwidth
    monkeypatch.setattr(attention, "copy_bandwidth", lambda *a: measured.append(1) or real(*a))
    with pytest.raises(SystemExit) as exit_:
        attention.main(attention_argv(tmp_path))
    assert exit_.value.code == 2 and not measured and unchanged(tmp_path, files)
    err = capsys.readouterr().err
    assert f"sparsekv.bench.attention: error: {tmp_path / 'attention.json'} holds results of another run" in err
    assert "device NVIDIA H200 there, cpu here" in err and "contexts [8192, 32768, 131072, 524288] there, [256] here" \
        in err and "--out DIR" in err and "--overwrite" in err and "Traceback" not in err
    # Elsewhere: written there, the published files untouched.
    attention.main(attention_argv(tmp_path / "elsewhere"))
    assert json.loads((tmp_path / "elsewhere" / "attention.json").read_text())["meta"]["device"] == "cpu"
    assert unchanged(tmp_path, files)
    # Asked to: replaced (the figure too).
    attention.main(attention_argv(tmp_path, "--overwrite"))
    result = json.loads((tmp_path / "attention.json").read_text())
    assert result["meta"]["device"] == "cpu" and result["meta"]["setting"]["contexts"] == [256]
    assert (tmp_path / "attention.md").read_bytes() != files["attention.md"]
    if common.pyplot() is not None:
        assert (tmp_path / "attention.png").read_bytes() != files["attention.png"]
    # The same run again replaces its own results; another setting on the same device does not.
    attention.main(attention_argv(tmp_path))
    before = (tmp_path / "attention.json").read_text()
    with pytest.raises(SystemExit):
        attention.main(attention_argv(tmp_path, "--budgets", "32"))
    assert "budgets [64] there, [32] here" in capsys.readouterr().err
    assert (tmp_path / "attention.json").read_text() == before


def small_runs(out: Path) -> dict[str, tuple[list[str], str]]:
    """Per bench: a small CPU run writing ``out/t.*``, and what it runs first (which must not run when refused)."""
    return {
        "e2e": (["--model", "tiny:llama", "--contexts", "64", "--methods", "dense", "--new-tokens", "3"],
                "bench_model"),
        "capacity": (["ladder", "--model", "tiny:llama", "--contexts", "64", "--methods", "dense", "--new-tokens",
                      "3"], "bench_model"),
        "serve": (["--model", "tiny:llama", "--methods", "dense", "--requests", "1", "--prompt-len", "8", "8",
                   "--output-len", "2", "2", "--max-batch", "1", "--via", "engine"], "load_model"),
        "kv_dtype": (["--shape", "tiny", "--contexts", "256", "--check-tokens", "256", "--budget", "32", "--reps",
                      "1"], "copy_bandwidth"),
        "lowbit": (["--shape", "tiny", "--context", "256", "--budget", "64", "--bits", "2", "--reps", "1"],
                   "copy_bandwidth"),
        "attention": (["--shapes", "tiny", "--contexts", "256", "--batches", "1", "--budgets", "64", "--reps", "1"],
                      "copy_bandwidth"),
    }


@pytest.mark.parametrize("bench", ["e2e", "capacity", "serve", "kv_dtype", "lowbit", "attention"])
def test_every_bench_refuses_before_it_runs(tmp_path, capsys, monkeypatch, bench):
    if bench in ("kv_dtype", "lowbit", "attention"):
        pytest.importorskip("triton")
    module = importlib.import_module(f"sparsekv.bench.{bench}")
    argv, first = small_runs(tmp_path)[bench]

    def ran(*args, **kwargs):
        raise AssertionError(f"{bench} ran {first} with its results refused")

    monkeypatch.setattr(module, first, ran)
    files = published(tmp_path, "t", H200)
    with pytest.raises(SystemExit) as exit_:
        module.main([*argv, "--device", "cpu", "--out", str(tmp_path), "--tag", "t"])
    assert exit_.value.code == 2 and unchanged(tmp_path, files)
    err = capsys.readouterr().err
    assert f"sparsekv.bench.{bench}: error: {tmp_path / 't.json'} holds results of another run" in err
    assert "device NVIDIA H200 there, cpu here" in err and "--overwrite" in err


def test_results_without_a_readable_meta_are_kept(tmp_path):
    """A figure or table alone, or a JSON without a meta: whose they are is unknown, so they are kept."""
    setting = {"bench": "e2e", "contexts": [64]}
    (tmp_path / "t.png").write_bytes(b"\x89PNG")
    problem = common.results_conflict(tmp_path / "t.json", "cpu", setting)
    assert f"{tmp_path / 't.png'} holds results of an unknown device and setting" in problem
    (tmp_path / "t.json").write_text("not json")
    assert "unknown device and setting" in common.results_conflict(tmp_path / "t.json", "cpu", setting)
    (tmp_path / "t.json").write_text(json.dumps({"meta": {"device_name": "cpu"}, "rows": []}))
    assert "its setting is unknown (no command recorded" in common.results_conflict(tmp_path / "t.json", "cpu",
                                                                                     setting)
    assert common.results_conflict(tmp_path / "u.json", "cpu", setting) is None  # nothing there


def test_results_written_before_settings_were_recorded_are_read_by_their_command(tmp_path):
    """A published file records its command line only: it is read by the bench's parser as it is now; where it
    went (--out, --tag) is no setting."""
    from sparsekv.bench import e2e

    argv = ["--contexts", "32768", "131072", "--methods", "dense", "quest", "--compile"]
    setting = common.run_setting("e2e", e2e.build_parser().parse_args(argv))
    meta = {"device_name": "NVIDIA H200", "command": "python -m sparsekv.bench.e2e " + " ".join(argv)
            + " --out /root/out --tag e2e_bf16"}
    (tmp_path / "e2e.json").write_text(json.dumps({"meta": meta, "rows": []}))
    assert common.results_conflict(tmp_path / "e2e.json", "NVIDIA H200", setting) is None
    other = common.run_setting("e2e", e2e.build_parser().parse_args(argv[:-1]))
    assert "compile true there, false here" in common.results_conflict(tmp_path / "e2e.json", "NVIDIA H200", other)
    serve = common.run_setting("serve", importlib.import_module("sparsekv.bench.serve").build_parser().parse_args([]))
    assert 'bench "e2e" there, "serve" here' in common.results_conflict(tmp_path / "e2e.json", "NVIDIA H200", serve)
    meta["command"] = "python -m sparsekv.bench.e2e --contexts 0"  # no longer parses
    (tmp_path / "e2e.json").write_text(json.dumps({"meta": meta, "rows": []}))
    assert "the command it records does not parse" in common.results_conflict(tmp_path / "e2e.json", "NVIDIA H200",
                                                                               setting)


def test_write_results_checks_again_at_every_write(tmp_path, capsys):
    """Results another run wrote while this one ran are not replaced either (the check before the run passed)."""
    setting = {"bench": "e2e", "contexts": [64]}
    meta = {"device_name": "cpu", "setting": setting}
    common.write_results(tmp_path, "t", meta, [{"row": 1}], ["| row |"])
    common.write_results(tmp_path, "t", meta, [{"row": 1}, {"row": 2}], ["| rows |"])  # its own: replaced
    assert len(json.loads((tmp_path / "t.json").read_text())["rows"]) == 2
    files = published(tmp_path, "t", H200)
    with pytest.raises(SystemExit) as exit_:
        common.write_results(tmp_path, "t", meta, [{"row": 3}], ["| row 3 |"])
    assert exit_.value.code == 2 and unchanged(tmp_path, files)
    assert "sparsekv.bench.e2e: error:" in capsys.readouterr().err
    common.write_results(tmp_path, "t", meta, [{"row": 3}], overwrite=True)
    assert json.loads((tmp_path / "t.json").read_text())["meta"]["device_name"] == "cpu"
    with pytest.raises(KeyError):  # a bench must record its setting
        common.write_results(tmp_path, "u", {"device_name": "cpu"}, [])


@pytest.mark.parametrize("bench, argv", [
    ("kv_dtype", ["--shape", "tiny", "--contexts", "256", "--check-tokens", "256", "--budget", "32", "--reps", "1"]),
    ("lowbit", ["--shape", "tiny", "--context", "256", "--budget", "64", "--bits", "2", "--reps", "1"]),
    ("attention", ["--shapes", "tiny", "--contexts", "256", "--batches", "1", "--variants", "[{}]"]),
])
def test_kernel_benches_check_their_memory_first(tmp_path, capsys, monkeypatch, bench, argv):
    """Caches that the device cannot hold are refused before any is allocated (a host of 1 KiB here)."""
    pytest.importorskip("triton")
    module = importlib.import_module(f"sparsekv.bench.{bench}")
    monkeypatch.setattr(common, "available_bytes", lambda device: 1024)
    monkeypatch.setattr(module, "copy_bandwidth", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_:
        module.main([*argv, "--device", "cpu", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and not list(tmp_path.iterdir())
    err = capsys.readouterr().err
    assert f"sparsekv.bench.{bench}: error:" in err and "needs about" in err
    assert "but the host has 0.0 GiB available; use" in err and "Traceback" not in err


def test_kernel_benches_estimates_let_the_h200_runs_through(monkeypatch):
    """The published H200 runs (139 GiB free) pass the kernel benches' checks: kv_dtype's defaults (1M tokens),
    lowbit's and linear's."""
    from sparsekv.bench import kv_dtype

    gpu = torch.device("cuda")
    monkeypatch.setattr(common, "available_bytes", lambda device: 139 * 2**30)
    _, kv_heads, head_dim = common.SHAPES["llama3-8b"].attention
    need = kv_dtype.cache_bytes(kv_heads, head_dim, [131072, 524288, 1048576], 16)
    assert 10 * 2**30 < need < 11 * 2**30 and common.memory_problem({"KV caches": need}, gpu) is None
    pytest.importorskip("triton")
    from sparsekv.bench import linear, lowbit

    assert 4 * 2**30 < max(linear.product_bytes(n, k) for n, k in linear.SHAPES.values()) < 8 * 2**30
    assert lowbit.copies_bytes("llama3-8b", 131072, 16, (1, 2, 4), 48) < 139 * 2**30


def test_tp_bench_checks_a_shape_models_memory_first(tmp_path, capsys, monkeypatch):
    """The tensor-parallel check builds the whole model in its first process: Llama-3-8B's 32 layers on a host of
    16 GiB are refused before anything is built (a process group of one, in this process)."""
    import socket

    from sparsekv.bench import tp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(common, "available_bytes", lambda device: 16 * 2**30)
    monkeypatch.setattr(tp, "build_model", lambda *a: pytest.fail("built"))
    with pytest.raises(SystemExit) as exit_:
        tp.main(["--model", "shape:llama3-8b", "--context", "64", "--out", str(tmp_path / "tp.json")])
    assert exit_.value.code == 2 and not torch.distributed.is_initialized()
    err = capsys.readouterr().err
    assert "sparsekv.bench.tp: error: --model shape:llama3-8b needs about 29.9 GiB" in err and "--layers" in err
    # Its first 4 layers fit (the documented run); the check counts them only.
    assert common.shape_weights("shape:llama3-8b", torch.float32, 4)[0] < 16 * 2**30
