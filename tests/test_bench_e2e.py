"""The end-to-end benchmark script runs and writes its tables (timings themselves are not tested)."""

import json

import pytest

from sparsekv.bench.e2e import main, step_time


def test_e2e_bench_smoke(tmp_path):
    assert main(["--model", "tiny:llama", "--contexts", "96", "--methods", "dense", "quest", "lowbit", "--budget",
                 "32", "--new-tokens", "4", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense", "quest", "lowbit"]
    assert rows[1]["attended_per_head"] < rows[0]["attended_per_head"]
    # Page metadata read per step: none for dense; the 2-bit codes add to Quest's min/max.
    assert rows[0]["metadata_mib"] == 0 and 0 < rows[1]["metadata_mib"] < rows[2]["metadata_mib"]
    assert "| quest | 32 | 96 |" in (tmp_path / "e2e.md").read_text()


def test_step_time_of_a_method_whose_steps_repeat():
    """lowbit with reuse 4: one step in four chooses pages; its step time is the mean over such runs, not the median
    step (a reusing one)."""
    steps = [1.0, 1.0, 5.0, 1.0] * 5 + [1.0, 1.0]
    assert step_time(steps, 4) == 2.0 and step_time(steps, 1) == 1.0
    assert step_time([3.0, 1.0], 4) == 2.0  # fewer steps than a run: their mean


def test_e2e_bench_rejects_unknown_methods(tmp_path, capsys):
    assert main(["--model", "tiny:llama", "--methods", "magic", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "method must be one of dense, quest" in capsys.readouterr().err


def test_e2e_bench_reads_specs_as_eval_does(tmp_path):
    """The same spec parser: 'false' is False, a fractional budget is a fraction (OmniKV)."""
    assert main(["--model", "shape:tiny", "--contexts", "64", "--methods", "quest:per_query_head=false",
                 "omnikv:filter_layers=[0]", "--budget", "0.5", "--new-tokens", "3", "--device", "cpu",
                 "--out", str(tmp_path)]) == 2
    assert main(["--model", "shape:tiny", "--contexts", "64", "--methods", "quest:per_query_head=false,token_budget=32",
                 "omnikv:filter_layers=[0]", "--budget", "0.5", "--new-tokens", "3", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [(r["spec"], r["budget"]) for r in rows] == [("quest:per_query_head=false,token_budget=32", 32),
                                                        ("omnikv:filter_layers=[0]", 0.5)]


def test_capacity_bench_smoke(tmp_path):
    """The ladder stops a method at its first failure; the long decode reports RaaS's held KV at its budget."""
    from sparsekv.bench.capacity import main as capacity

    omnikv = "omnikv:offload=true,filter_layers=[1],wait_layers=0"
    assert capacity(["ladder", "--model", "tiny:llama", "--device", "cpu", "--contexts", "96", "160", "--methods",
                     "dense", omnikv, "--budget", "16", "--new-tokens", "4", "--prefill", "96",
                     "--out", str(tmp_path), "--tag", "ladder"]) == 0
    rows = json.loads((tmp_path / "ladder.json").read_text())["rows"]
    assert [(r["spec"], r["context"], r["status"], r["fill"]) for r in rows] == [
        ("dense", 96, "ok", "prefill"), ("dense", 160, "ok", "random"),
        (omnikv, 96, "ok", "prefill"), (omnikv, 160, "ok", "random")]
    assert rows[3]["kv_host_gib"] > 0
    assert capacity(["long-decode", "--model", "tiny:llama", "--device", "cpu", "--prompt", "16", "--decode", "48",
                     "--window", "16", "--methods", "quest", "raas", "--budget", "32", "--out", str(tmp_path),
                     "--tag", "long"]) == 0
    quest, raas = json.loads((tmp_path / "long.json").read_text())["rows"]
    assert raas["held_gib_measured_end"] < quest["held_gib_measured_end"]
    assert "| raas |" in (tmp_path / "long.md").read_text()


def test_e2e_bench_refuses_a_run_that_does_not_fit_in_memory(tmp_path, capsys, monkeypatch):
    """The defaults (Llama-3-8B at 32K and 128K) on a host of 16 GiB: refused before any allocation, saying what
    the run needs, what is available and which flags to change."""
    from sparsekv.bench import common

    monkeypatch.setattr(common, "available_bytes", lambda device: 16 * 2**30)
    assert main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "sparsekv.bench.e2e: error: --model shape:llama3-8b" in err and "Traceback" not in err
    assert "needs about" in err and "weights 29.9 GiB" in err and "16.0 GiB available" in err
    assert "--contexts" in err and "--batches" in err and not list(tmp_path.iterdir())
    # The KV cache alone can be too much, too.
    assert main(["--model", "shape:tiny", "--device", "cpu", "--contexts", str(2**20), "--batches", "4096",
                 "--out", str(tmp_path)]) == 2
    assert "KV cache 8192.5 GiB" in capsys.readouterr().err
    # The capacity ladder's model, too.
    from sparsekv.bench.capacity import main as capacity

    assert capacity(["ladder", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "sparsekv.bench.capacity: error: --model shape:llama3-8b needs about 29.9 GiB" in err
    assert "16.0 GiB available" in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--new-tokens", "0"], "argument --new-tokens: must be an integer >= 2, got '0'"),
    (["--new-tokens", "1"], "argument --new-tokens: must be an integer >= 2, got '1'"),
    (["--new-tokens", "-3"], "argument --new-tokens: must be an integer >= 2, got '-3'"),
    (["--contexts", "0"], "argument --contexts: must be an integer >= 1, got '0'"),
    (["--contexts", "96", "-1"], "argument --contexts: must be an integer >= 1, got '-1'"),
    (["--batches", "0"], "argument --batches: must be an integer >= 1, got '0'"),
    (["--prefill-chunk", "0"], "argument --prefill-chunk: must be an integer >= 1, got '0'"),
    (["--contexts", "x"], "argument --contexts: must be an integer >= 1, got 'x'"),
    (["--profile", "-1"], "argument --profile: must be an integer >= 0, got '-1'"),
    (["--contexts", "8190"], "--contexts 8190 with --new-tokens 4: context of 8194 tokens (prompt plus new tokens) "
                             "exceeds the model's maximum of 8192 positions"),
    (["--dtype", "int8"], "error: dtype must be one of auto, float32"),
    (["--device", "gpu0"], "error: device must be auto, cpu, cuda or cuda:N, got 'gpu0'"),
    (["--model", "/nonexistent/model"], "error: model: no model directory at '/nonexistent/model'"),
    (["--model", "shape:nope"], "error: shape must be one of llama3-8b, llama2-7b, tiny, got 'nope'"),
])
def test_e2e_bench_argument_errors_are_usage_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "tiny:llama", "--device", "cpu", "--new-tokens", "4", "--methods", "dense",
              "--out", str(tmp_path), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not list(tmp_path.iterdir())


def test_e2e_bench_cpu_table_says_host_timer_and_no_bandwidth_floor(tmp_path, capsys):
    assert main(["--model", "tiny:llama", "--contexts", "64", "--methods", "dense", "--new-tokens", "3",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "e2e.md").read_text()
    assert "CUDA" not in table and "host clock" in table and "floor" not in table.lower()
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert result["meta"]["bandwidth_tbs"] is None and result["rows"][0]["x_floor"] is None
    assert "floor" not in capsys.readouterr().out.lower()


@pytest.mark.parametrize("module, argv, message", [
    ("capacity", ["ladder", "--new-tokens", "1"], "argument --new-tokens: must be an integer >= 2, got '1'"),
    ("capacity", ["ladder", "--contexts", "0"], "argument --contexts: must be an integer >= 1, got '0'"),
    ("capacity", ["long-decode", "--decode", "-5"], "argument --decode: must be an integer >= 4, got '-5'"),
    ("capacity", ["long-decode", "--decode", "3"], "argument --decode: must be an integer >= 4, got '3'"),
    ("capacity", ["long-decode", "--window", "0"], "argument --window: must be an integer >= 1, got '0'"),
    ("capacity", ["ladder", "--budget", "0"], "argument --budget: must be an integer >= 1, got '0'"),
    ("capacity", ["ladder", "--device", "gpu0"], "error: device must be auto, cpu, cuda or cuda:N, got 'gpu0'"),
    ("capacity", ["ladder", "--model", "shape:nope"], "error: shape must be one of llama3-8b, llama2-7b, tiny"),
    ("capacity", ["ladder", "--model", "tiny:llama", "--contexts", "8190"],
     "context of 8193 tokens (prompt plus new tokens) exceeds the model's maximum of 8192 positions"),
    ("attention", ["--contexts", "0"], "argument --contexts: must be an integer >= 1, got '0'"),
    ("attention", ["--batches", "0"], "argument --batches: must be an integer >= 1, got '0'"),
    ("attention", ["--reps", "0"], "argument --reps: must be an integer >= 1, got '0'"),
    ("attention", ["--page-size", "0"], "argument --page-size: must be an integer >= 1, got '0'"),
    ("attention", ["--budgets", "-16"], "argument --budgets: must be an integer >= 1, got '-16'"),
    ("tp", ["--context", "0"], "argument --context: must be an integer >= 1, got '0'"),
    ("tp", ["--new-tokens", "0"], "argument --new-tokens: must be an integer >= 1, got '0'"),
    ("tp", ["--batch", "-1"], "argument --batch: must be an integer >= 1, got '-1'"),
])
def test_every_bench_refuses_counts_below_one_as_usage_errors(tmp_path, capsys, module, argv, message):
    import importlib

    bench = importlib.import_module(f"sparsekv.bench.{module}")
    with pytest.raises(SystemExit) as exit_:
        # Small shapes, should a check be missing (the defaults are Llama-3-8B sized); the argument under test last.
        small = {"capacity": ["--model", "shape:tiny", "--contexts", "64", "--prompt", "16", "--decode", "16",
                              "--window", "16", "--budget", "16", "--new-tokens", "2", "--device", "cpu"],
                 "attention": ["--shapes", "tiny", "--contexts", "64", "--budgets", "16", "--batches", "1",
                               "--reps", "1", "--device", "cpu"], "tp": []}[module]
        mode = argv[:1] if module == "capacity" else []
        bench.main([*mode, *small, *argv[len(mode):], *(["--out", str(tmp_path)] if small else [])])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_memory_check_lets_the_documented_h200_runs_through(monkeypatch):
    """The README's H200 runs (139 GiB free) pass the check: Llama-3-8B in bfloat16 at 512K x 1 and 128K x 4."""
    import argparse

    import torch

    from sparsekv.bench import common, e2e

    monkeypatch.setattr(common, "available_bytes", lambda device: 139 * 2**30)
    gpu, shape = torch.device("cuda"), common.SHAPES["llama3-8b"]
    weights = common.shape_weights("shape:llama3-8b", torch.bfloat16)
    assert weights == (shape.parameters * 4, shape.parameters * 2)
    for contexts, batches in (([32768, 131072, 524288], [1]), ([32768, 131072], [4])):
        args = argparse.Namespace(contexts=contexts, batches=batches, new_tokens=64)
        kv = e2e.kv_bytes(args, shape.layers, shape.kv_heads, shape.head_dim, 2)
        assert common.memory_problems(gpu, weights, {"KV cache": kv}) is None
    args = argparse.Namespace(contexts=[524288], batches=[4], new_tokens=64)
    kv = e2e.kv_bytes(args, shape.layers, shape.kv_heads, shape.head_dim, 2)
    assert "KV cache 256.0 GiB) but the GPU has 139.0 GiB available" in common.memory_problems(
        gpu, weights, {"KV cache": kv})


def test_random_fill_hands_h2o_the_prompt_attentions_lse(monkeypatch):
    """The random fill computes the prompt's attention for H2O only (``reads_prompt_lse``), and the prompt scores
    H2O builds from its log-sum-exps are those of the kernel's two passes (lse=None), chunk after chunk."""
    import torch

    from sparsekv.bench.e2e import random_fill
    from sparsekv.engine import Engine
    from sparsekv.methods import METHODS, h2o
    from sparsekv.methods.h2o import H2OConfig
    from sparsekv.models import load_model

    model = load_model("tiny:llama", "cpu", torch.float32).model
    seen = []

    def checked(q, layer, plan, scale, last=None, lse=None):
        score = h2o_attention(q, layer, plan, scale, last, lse)
        seen.append(lse is not None)
        torch.testing.assert_close(score, h2o_attention(q, layer, plan, scale, last, None), rtol=1e-5, atol=1e-6)
        return score

    h2o_attention = h2o.prompt_attention
    monkeypatch.setattr(h2o, "prompt_attention", checked)
    engine = Engine(model, H2OConfig(token_budget=24), max_batch=2, max_context=120, prefill_chunk=32)
    out = engine.generate([[1] * 100, [2] * 90], 3, stop_tokens=(), prefill=random_fill(model))
    assert seen and all(seen) and [len(t) for t in out.tokens] == [3, 3]
    # Every other method's fill skips the attention: it has no prefill_chunk that reads it.
    assert [name for name, config in METHODS.items() if config.method_class(config).reads_prompt_lse] == ["h2o"]
