"""The serving benchmark runs through the engine and through the HTTP server and writes its results (timings
themselves are not tested)."""

import json

import pytest
import torch

from sparsekv.bench.serve import main
from sparsekv.engine import Sampling

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def test_serve_bench_smoke(tmp_path):
    assert main(["--model", "shape:tiny", "--device", "cpu", "--methods", "dense", "quest", "--budget", "32",
                 "--requests", "5", "--rate", "40", "--prompt-len", "16", "48", "--output-len", "3", "9",
                 "--max-batch", "3", "--static", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    rows = result["rows"]
    assert [(r["method"], r["via"]) for r in rows] == [("dense", "engine"), ("dense", "http"), ("quest", "engine"),
                                                       ("quest", "http")]
    for r in rows:
        assert r["requests_done"] == 5 and 5 * 3 <= r["output_tokens"] <= 5 * 9
        assert r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 and r["tpot_p99_ms"] >= r["tpot_p50_ms"]
        assert 1 <= r["max_running"] <= 3 and r["static_step_ms"] > 0 and r["tpot_vs_static"] > 0
        # the machine's state as the run started: the host's load; no GPU to read
        assert r["host_load_1m"] >= 0 and r["gpu_temp_c"] is None and r["sm_clock_mhz"] is None
        assert r["pool_gib"] > 0 and r["profile_gib"] is None and r["peak_device_gib"] is None
    # the same workload for every run: the same tokens
    assert len({r["output_tokens"] for r in rows}) == 1
    series = result["series"]["quest engine"]
    assert max(s[1] for s in series) <= 3 and len(series[0]) == len(result["series_columns"])
    assert "| quest | 32 | http | prefill | 5 |" in (tmp_path / "serve.md").read_text()
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_a_shared_prefix_and_the_prefix_cache(tmp_path, capsys):
    assert main(["--model", "shape:tiny", "--device", "cpu", "--methods", "dense", "quest", "--budget", "32",
                 "--requests", "4", "--prompt-len", "80", "90", "--shared-prefix", "64", "--output-len", "3", "3",
                 "--max-batch", "2", "--via", "engine", "--prefix-cache-gib", "0.01", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    # prefills run one after another: each prompt after the first starts from the first one's 64 tokens (4 pages)
    assert [r["prefix_reused"] for r in result["rows"]] == [3 * 64, 3 * 64]
    assert "every prompt begins with the same 64 tokens" in (tmp_path / "serve.md").read_text()
    assert main(["--model", "shape:tiny", "--device", "cpu", "--methods", "snapkv", "--prefix-cache-gib", "1",
                 "--requests", "1", "--prompt-len", "80", "90", "--out", str(tmp_path / "b")]) == 2
    assert "--prefix-cache-gib must be 0 with snapkv" in capsys.readouterr().err


def test_admission_grow_preempts_and_every_request_ends(tmp_path):
    """--admission grow in a store smaller than the requests' whole KV: requests are preempted, every one ends with
    all its tokens, and the table counts the preemptions."""
    assert main(["--model", "shape:tiny", "--device", "cpu", "--methods", "dense", "quest", "--budget", "32",
                 "--requests", "4", "--prompt-len", "40", "60", "--output-len", "40", "40", "--max-batch", "4",
                 "--kv-memory-gib", "0.0006", "--admission", "grow", "--via", "engine", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["meta"]["admission"] == "grow"
    for r in result["rows"]:
        assert r["requests_done"] == 4 and r["output_tokens"] == 160 and r["preempted"] > 0
    text = (tmp_path / "serve.md").read_text()
    assert "admission grow" in text and "| preempted |" in text


def test_random_fill_and_decode_priority(tmp_path):
    """Prompts' KV as random keys and values (no model prefill), labelled as such; decode-phase tokens/s reported."""
    assert main(["--model", "shape:tiny", "--device", "cpu", "--methods", "dense", "quest", "--budget", "32",
                 "--requests", "4", "--prompt-len", "40", "90", "--output-len", "6", "6", "--max-batch", "2",
                 "--fill", "random", "--prefill-share", "0.2", "--prefill-chunk", "32", "--via", "engine",
                 "--out", str(tmp_path), "--tag", "fill"]) == 0
    result = json.loads((tmp_path / "fill.json").read_text())
    assert result["meta"]["fill"] == "random" and result["meta"]["prefill_share"] == 0.2
    for r in result["rows"]:
        assert r["fill"] == "random" and r["requests_done"] == 4 and r["output_tokens"] == 24
        assert r["decode_tokens_per_s"] > 0 and r["decode_vs_dense"] > 0
    assert "| dense | - | engine | random |" in (tmp_path / "fill.md").read_text()


def test_capacity_mode_stops_when_memory_is_full(tmp_path):
    """KV memory for about two dense requests of 128 tokens: dense runs two at once, RaaS (which holds its budget)
    more; the run stops there instead of decoding every token."""
    assert main(["--model", "tiny:llama", "--device", "cpu", "--methods", "dense", "raas:page_size=8", "--budget",
                 "32", "--requests", "8", "--prompt-len", "64", "64", "--output-len", "64", "64", "--max-batch", "8",
                 "--kv-memory-gib", str(2.5 * 128 * 1024 / 2**30), "--capacity", "--via", "engine", "--out",
                 str(tmp_path), "--tag", "cap"]) == 0
    rows = json.loads((tmp_path / "cap.json").read_text())["rows"]
    assert rows[0]["max_running"] == 2 and rows[1]["max_running"] > 2
    assert all(r["stopped_at_capacity"] and r["requests_done"] == 0 for r in rows)


def test_time_slicing_is_counted_in_the_table(tmp_path):
    """--time-slice: RaaS's rows yield to the queue's front, and the table says how often."""
    assert main(["--model", "tiny:llama", "--device", "cpu", "--methods", "raas:page_size=8", "--budget", "32",
                 "--requests", "3", "--prompt-len", "16", "16", "--output-len", "6", "6", "--max-batch", "2",
                 "--time-slice", "2", "--swap-space-gib", "0.001", "--via", "engine", "--out", str(tmp_path),
                 "--tag", "sliced"]) == 0
    result = json.loads((tmp_path / "sliced.json").read_text())
    assert result["rows"][0]["requests_done"] == 3 and result["rows"][0]["yielded"] >= 2
    assert result["rows"][0]["swap_s"] > 0
    table = (tmp_path / "sliced.md").read_text()
    assert "time slicing: a running request 2 tokens ahead" in table and "0.001 GiB of page-locked" in table
    assert "| yielded | swap s |" in table


def test_int4_weights(tmp_path):
    """--weights int4 serves the model on its quantized layers, and the table says so."""
    assert main(["--model", "tiny:llama", "--device", "cpu", "--weights", "int4", "--methods", "quest", "--budget",
                 "32", "--requests", "3", "--prompt-len", "16", "40", "--output-len", "3", "3", "--max-batch", "2",
                 "--via", "engine", "--out", str(tmp_path), "--tag", "int4"]) == 0
    result = json.loads((tmp_path / "int4.json").read_text())
    assert result["meta"]["weights"] == "int4" and result["rows"][0]["requests_done"] == 3
    assert (tmp_path / "int4.md").read_text().startswith("# Serving under load (tiny:llama, int4 weights,")


def test_serve_bench_refuses_bad_options(tmp_path, capsys):
    assert main(["--model", "tiny:llama", "--prompt-len", "9", "3", "--out", str(tmp_path)]) == 2
    assert "--prompt-len must be MIN <= MAX" in capsys.readouterr().err
    assert main(["--model", "tiny:llama", "--prefill-share", "0", "--out", str(tmp_path)]) == 2
    assert "--prefill-share must be a number > 0" in capsys.readouterr().err


def test_capacity_plan_at_128k_without_a_device(tmp_path):
    """The H200's numbers (141 GB = 131.3 GiB, 125 GiB of host memory, Llama-3-8B shape, bf16): dense holds 6 rows of
    128K in shared pages (a prompt is prefilled into them: beside them, one layer's keys and values); OmniKV with
    every sparse layer offloaded and 256 new tokens holds 26 on the device but 9 in host memory (12 GiB per row);
    with device_layers left to the pool, 7 of its 24 sparse layers stay on the device and both memories hold 13
    rows."""
    assert main(["--plan", "--device-gib", "131.3", "--host-gib", "125", "--methods", "dense",
                 "omnikv:offload=true,device_layers=0", "omnikv:offload=true", "--prompt-len", "131072", "131072",
                 "--output-len", "256", "256", "--max-new-tokens", "256", "--out", str(tmp_path), "--tag", "plan"]) == 0
    dense, offload, balanced = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert (dense["rows"], dense["binds"], dense["rows_by_host"], dense["device_layers"]) == (6, "device", None, None)
    assert dense["prefill_gib"] == pytest.approx(131328 * 2 * 8 * 128 * 2 / 2**30)
    # Its own cache: the 8 layers that keep their prompt on the device, and one offloaded layer at a time.
    assert offload["prefill_gib"] == pytest.approx(9 * 131328 * 4096 / 2**30)
    assert (offload["rows_by_device"], offload["rows_by_host"], offload["rows"], offload["binds"]) == \
        (26, 9, 9, "host")
    assert offload["host_row_gib"] == pytest.approx(24 * 131328 * 4096 / 2**30)  # 24 offloaded layers
    assert offload["host_gib_for_2x_dense"] == pytest.approx(13 * offload["host_row_gib"])
    assert (balanced["device_layers"], balanced["rows_by_device"], balanced["rows_by_host"], balanced["rows"]) == \
        (7, 13, 13, 13)
    assert balanced["host_row_gib"] == pytest.approx(17 * 131328 * 4096 / 2**30)
    assert "not a run" in (tmp_path / "plan.md").read_text()


def test_capacity_plan_counts_an_fp8_cache_at_one_byte(tmp_path):
    """An fp8 cache halves every row, on the device and in the host store (the same H200 numbers as above)."""
    assert main(["--plan", "--device-gib", "131.3", "--host-gib", "125", "--methods", "dense", "dense:kv_dtype=fp8",
                 "omnikv:offload=true,device_layers=0", "omnikv:offload=true,device_layers=0,kv_dtype=fp8",
                 "--prompt-len", "131072", "131072",
                 "--output-len", "256", "256", "--max-new-tokens", "256", "--out", str(tmp_path), "--tag", "plan"]) == 0
    dense, dense8, offload, offload8 = json.loads((tmp_path / "plan.json").read_text())["rows"]
    # keys, values and bounds halve; the page table and per-slot state (16 bytes per slot and KV head) do not
    assert dense8["device_row_gib"] == pytest.approx(dense["device_row_gib"] / 2, rel=3e-3)
    assert offload8["host_row_gib"] == pytest.approx(offload["host_row_gib"] / 2)
    assert (dense8["rows"], offload8["rows"], offload8["binds"]) == (13, 19, "host")


@pytest.mark.parametrize("argv, message", [
    (["--output-len", "8", "8", "--max-new-tokens", "4"], "--max-new-tokens must be at least the --output-len MAX"),
    (["--plan", "--device-gib", "80"], "--plan must be a shape: model with --device-gib and --host-gib"),
    (["--plan", "--device-gib", "80", "--host-gib", "64", "--weights", "int4"], "--weights must be float with --plan"),
    (["--fill-chunk", "64"], "--fill-chunk must be given with --fill random only"),
    (["--preemption", "swap"], '--preemption must be given only with admission "grow"'),
    (["--methods", "dense", "quest", "--admission", "grow", "--preemption", "recompute"],
     "--preemption must be 'swap' for quest (or not given)"),
    (["--methods", "dense", "--time-slice", "8"], '--time-slice must be None for dense unless preemption is "swap"'),
    (["--methods", "dense", "--swap-space-gib", "4"], "--swap-space-gib must be 0 for dense here"),
])
def test_serve_bench_refuses_bad_pool_options(tmp_path, capsys, argv, message):
    assert main(["--model", "shape:tiny", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("refusal", ["out of memory", "pool refused"])
@pytest.mark.parametrize("limit", [0, 1, 5, 37, 63, 64])
def test_largest_batch_finds_the_most_rows_that_fit(limit, refusal):
    """A candidate fails by running out of device memory, or by the engine refusing a pool larger than the free
    memory before it allocates."""
    from sparsekv.bench.serve import largest_batch
    from sparsekv.errors import ConfigError
    from sparsekv.serve.runner import POOL_FIELD

    tried = []

    def make(batch):
        tried.append(batch)
        if batch > limit:
            raise torch.OutOfMemoryError("pool") if refusal == "out of memory" else ConfigError(POOL_FIELD, "", batch)

    assert largest_batch(make, 64) == limit
    assert len(tried) <= 14


def test_largest_batch_passes_other_config_errors_on():
    from sparsekv.bench.serve import largest_batch
    from sparsekv.errors import ConfigError

    def make(batch):
        raise ConfigError("token_budget", "an int", batch)

    with pytest.raises(ConfigError, match="token_budget"):
        largest_batch(make, 8)


def test_warm_up_runs_the_longest_prompt_and_every_batch_size_twice():
    from sparsekv.bench.serve import warm_up
    from sparsekv.serve import ServingEngine
    from sparsekv.spec import build_config
    from sparsekv.tiny import tiny_model

    engine = ServingEngine(tiny_model("llama", layers=1, max_positions=128), build_config("dense"), max_batch=4,
                           max_context=64, prefill_chunk=16)
    warm_up(engine, 4, 259, 50)
    assert not engine.has_work()
    assert engine.metrics()["prefill_work"] >= 50 + 4 * 16  # the 50-token prompt through the layer, then the others'
    assert engine.metrics()["finished_requests"] == {"length": 5}
    runs = {}
    for (n, *_), (_, step, _) in engine.runner.steps.items():
        runs[n] = runs.get(n, 0) + step.runs
    assert sorted(runs) == [1, 2, 3, 4] and min(runs.values()) >= 2


def test_the_fill_writes_its_own_passes_and_a_step_the_runners_chunk(tmp_path):
    """``--fill-chunk``: the random fill's passes are that many tokens (the first one the rest of the prompt), while a
    runner's prefill call still runs about its chunk through every layer: fewer, longer passes."""
    from sparsekv.bench.e2e import fill_passes
    from sparsekv.serve.runner import Runner
    from sparsekv.spec import build_config
    from sparsekv.tiny import tiny_model

    runner = Runner(tiny_model("llama", layers=2), build_config("quest", 32), max_batch=2, max_context=256,
                    prefill_chunk=16, cuda_graph=False, compile=False, passes=fill_passes(64))
    job = runner.start([1] * 150)
    calls = []
    while job.logits is None:
        calls.append(runner.prefill(job, runner.prefill_budget))
    # Passes of 22, 64, 64 tokens per layer; a call stops once its 16 x 2 token-layers are run (the last one ends
    # the prefill).
    assert calls == [22 + 64, 64, 22 + 64, 64, 1]
    runner.join(0, job, 1, Sampling(), 0, 4)
    runner.discard(job)
    assert runner.pool.pages.lengths[0] == 150 and set(runner.decode()) == {0}
    assert main(["--model", "shape:tiny", "--device", "cpu", "--methods", "quest", "--budget", "32", "--requests", "2",
                 "--prompt-len", "40", "90", "--output-len", "3", "3", "--max-batch", "2", "--fill", "random",
                 "--fill-chunk", "64", "--prefill-chunk", "16", "--via", "engine", "--out", str(tmp_path),
                 "--tag", "fill"]) == 0
    result = json.loads((tmp_path / "fill.json").read_text())
    assert result["meta"]["fill_chunk"] == 64 and result["rows"][0]["requests_done"] == 2
    assert "written in passes of 64 tokens" in (tmp_path / "fill.md").read_text()


def test_fill_rows_joins_prefilled_requests():
    from sparsekv.bench.common import fill_rows
    from sparsekv.serve.runner import Runner
    from sparsekv.spec import build_config
    from sparsekv.tiny import tiny_model

    runner = Runner(tiny_model("llama", layers=2), build_config("quest", 32), max_batch=3, max_context=64,
                    prefill_chunk=16, cuda_graph=False, compile=False)
    fill_rows(runner, 2, 40, 8)
    assert runner.keys == [0, 1] and runner.free_rows == 1 and runner.pool.pages.lengths[:2] == [40, 40]
    assert set(runner.decode()) == {0, 1}


def test_short_requests_under_a_long_max_context(tmp_path, capsys):
    """--max-context sets the server's limit apart from the workload: in the KV memory of two rows of 4096 tokens,
    dense and Quest (shared pages) run all 8 short requests at once, each holding the pages of its own length."""
    two_rows = 2 * 4096 * 1024 / 2**30  # tiny:llama holds 1 KiB of keys and values a token, over its 4 layers
    assert main(["--model", "tiny:llama", "--device", "cpu", "--methods", "dense", "quest", "--budget", "32",
                 "--requests", "8", "--prompt-len", "16", "48", "--output-len", "6", "6", "--max-batch", "8",
                 "--max-context", "4096", "--kv-memory-gib", str(two_rows), "--via", "engine", "--out",
                 str(tmp_path), "--tag", "short"]) == 0
    rows = json.loads((tmp_path / "short.json").read_text())["rows"]
    assert [r["max_running"] for r in rows] == [8, 8] and all(r["requests_done"] == 8 for r in rows)
    assert main(["--model", "tiny:llama", "--device", "cpu", "--prompt-len", "16", "48", "--output-len", "6", "6",
                 "--max-context", "50", "--out", str(tmp_path)]) == 2
    assert "--max-context must be at least the longest prompt and output (54)" in capsys.readouterr().err


def test_serve_bench_checks_its_memory_before_it_builds_anything(tmp_path, capsys, monkeypatch):
    """The finding: the defaults (Llama-3-8B, 64 rows of up to 128K tokens) on a CPU were killed by the OOM killer
    at 24 GB. They are refused at once, before anything is allocated, saying what they need (weights, KV pool,
    prefill) against what the host has and which options shrink it. The pool is counted as the runner sizes it:
    alone too much (a tiny model of 4096 rows of 64K), and for a loaded model once it is loaded; a small run runs."""
    import time

    from sparsekv.bench import serve

    monkeypatch.setattr(serve, "shape_model", lambda *a, **k: pytest.fail("the model was built"))
    started = time.perf_counter()
    assert main(["--device", "cpu", "--out", str(tmp_path / "defaults")]) == 2
    assert time.perf_counter() - started < 20
    err = capsys.readouterr().err
    assert "sparsekv.bench.serve: error: --model shape:llama3-8b with --max-batch 64 and requests of up to " \
           "131072 + 256 tokens needs about" in err and "Traceback" not in err
    assert "weights 29.9 GiB, KV pool 2182.3 GiB, one prompt's prefill 1.0 GiB" in err and "GiB available" in err
    assert "--max-batch, --prompt-len, --output-len or --max-context, or --kv-memory-gib" in err
    many = ["--device", "cpu", "--max-batch", "4096", "--prompt-len", "65536", "65536", "--output-len", "1", "1",
            "--via", "engine", "--out", str(tmp_path / "many")]
    assert main(["--model", "shape:tiny", *many]) == 2
    # 4096 rows of 4097 pages of 16 tokens, 2 KiB of keys and values a token and the page's bounds
    assert "needs about 545.3 GiB (weights 0.0 GiB, KV pool 545.3 GiB, one prompt's prefill 0.1 GiB" in \
        capsys.readouterr().err
    assert main(["--model", "tiny:llama", *many]) == 2  # 1 KiB of keys and values a token
    assert "needs about 274.2 GiB (KV pool 274.2 GiB" in capsys.readouterr().err and not list(tmp_path.iterdir())
    # --kv-memory-gib bounds the shared pages: 1 GiB of them beside the rows' own tables.
    runs, config = serve.method_runs(["dense"], [32]), serve.shape_config("tiny", 65552)
    pool = serve.pool_parts(runs[0].config.build(2), 2, 64, 2, torch.float32, 65537, 65537, 65536)
    assert serve.run_memory(runs, config, torch.float32, serve.build_parser().parse_args(
        [*many, "--kv-memory-gib", "1"]), 65537, torch.device("cpu"))["KV pool"] == \
        4096 * pool["row"] + 2**30 // pool["page"] * pool["page"]
    # ... and rows that hold their own pages: as many as 1 GiB admits of the longest request (as the runner makes).
    runs = serve.method_runs(["raas"], [32])
    pool = serve.pool_parts(runs[0].config.build(2), 2, 64, 2, torch.float32, 65537, 65537, 65536)
    assert 2**30 // pool["request"] == 7
    assert serve.run_memory(runs, config, torch.float32, serve.build_parser().parse_args(
        [*many, "--kv-memory-gib", "1"]), 65537, torch.device("cpu"))["KV pool"] == 7 * pool["row"]
    assert main(["--model", "tiny:llama", "--device", "cpu", "--methods", "dense", "--requests", "2", "--prompt-len",
                 "16", "24", "--output-len", "2", "2", "--max-batch", "2", "--via", "engine", "--out",
                 str(tmp_path / "small")]) == 0
    assert json.loads((tmp_path / "small" / "serve.json").read_text())["rows"][0]["requests_done"] == 2
