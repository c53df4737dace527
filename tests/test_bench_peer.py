"""The vLLM peer of the benchmarks, on the CPU: without vLLM it says what is missing; with a stand-in ``vllm``
package (the few names the peer uses) the child process's rows come back through ``peer_rows``."""

import json
import os
import re
import sys
import textwrap

import pytest

from sparsekv.bench import peer

FAKE_VLLM = '''
import types

__version__ = "0.26.0"


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos, detokenize):
        assert temperature == 0.0 and ignore_eos and not detokenize
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, load_format, skip_tokenizer_init, dtype, max_model_len, gpu_memory_utilization,
                 enable_prefix_caching, seed, disable_log_stats, max_num_seqs=256, kv_cache_memory_bytes=None,
                 attention_backend=None, additional_config=None, tensor_parallel_size=1, compilation_config=None):
        import json, os, pathlib
        print("devices seen:", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
        # under TP, vLLM's FlashInfer all-reduce + RMSNorm fusion is off (it faults without NVLink multicast)
        assert compilation_config == (None if tensor_parallel_size == 1 else
                                      {"pass_config": {"fuse_allreduce_rms": False}})
        config = json.loads((pathlib.Path(model) / "config.json").read_text())
        assert (attention_backend, additional_config) == (None, None) or (
            attention_backend == "CUSTOM" and set(additional_config) == {"sparsekv"})
        assert load_format == "dummy" and skip_tokenizer_init and not disable_log_stats
        assert config["max_position_embeddings"] == max_model_len
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(get_vocab_size=lambda: config["vocab_size"]),
            vllm_config=types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384),
                cache_config=types.SimpleNamespace(kv_cache_memory_bytes=kv_cache_memory_bytes)))

    preempted = 0

    def get_metrics(self):  # a request preempted for every one after the first
        return [types.SimpleNamespace(name="vllm:num_preemptions", value=float(self.preempted)),
                types.SimpleNamespace(name="vllm:num_requests_running", value=0.0)]

    def generate(self, prompts, params, use_tqdm):
        assert len(prompts) == len(params)
        self.preempted += len(prompts) - 1
        outs = []
        for p, sp in zip(prompts, params):
            n = len(p["prompt_token_ids"])
            # a prompt's first token after n / 10000 s, then 2 ms a token
            metrics = types.SimpleNamespace(first_token_latency=n / 1e4, first_token_ts=100.0,
                                            last_token_ts=100.0 + 0.002 * (sp.max_tokens - 1))
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * sp.max_tokens)],
                                              metrics=metrics))
        return outs
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                                "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    return tmp_path


def test_without_vllm_the_peer_says_what_is_missing(capsys):
    if peer.missing_vllm() is None:
        pytest.skip("vLLM is installed here")
    assert peer.main(["decode", "--contexts", "64"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "sparsekv[vllm]" in err


@pytest.mark.parametrize("argv, says", [
    (["decode", "--model", "tiny:llama"], "--model must be shape:<name>"),
    (["decode", "--model", "shape:nope"], "shape must be one of"),
    (["load", "--workload", "/nonexistent.json"], "--workload /nonexistent.json: not a workload file"),
    (["decode", "--contexts", "0"], "must be an integer >= 1"),
])
def test_bad_options_are_named(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        peer.main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_decode_rows_come_back_from_the_child(fake_vllm, capsys):
    result = peer.peer_rows("vllm", "decode", ["--model", "shape:tiny", "--contexts", "1000", "4000",
                                               "--new-tokens", "11"], timeout_s=120)
    assert result["peer"] == "vllm" and result["version"] == "0.26.0"
    first, second = result["rows"]
    assert (first["context"], second["context"]) == (1000, 4000)
    assert first["ttft_s"] == pytest.approx(0.1) and first["prefill_tok_s"] == pytest.approx(1e4)
    assert second["decode_ms"] == pytest.approx(2.0) and second["tokens_per_s"] == pytest.approx(500.0)
    assert "peer: vLLM dense ctx 4000" in capsys.readouterr().out


def test_tensor_parallel_reaches_vllm(fake_vllm):
    result = peer.peer_rows("vllm", "decode", ["--model", "shape:tiny", "--contexts", "1000",
                                               "--tensor-parallel-size", "2"], timeout_s=120)
    assert [row["context"] for row in result["rows"]] == [1000]


def test_sparsekv_inside_the_peer(fake_vllm, capsys):
    """--sparsekv SPEC: vLLM gets sparsekv's backend (CUSTOM) and the spec; the rows name it."""
    result = peer.peer_rows("vllm", "decode", ["--model", "shape:tiny", "--contexts", "1000", "--sparsekv",
                                               "quest:token_budget=64"], timeout_s=120)
    assert [row["method"] for row in result["rows"]] == ["quest:token_budget=64"]
    assert "peer: vLLM quest:token_budget=64 ctx 1000" in capsys.readouterr().out


def test_vllm_backend_bench_without_vllm_and_its_covering_spec(capsys):
    from sparsekv.bench import vllm_backend

    assert vllm_backend.covering_spec("quest:token_budget=2048,dense_layers=1", 8256) == \
        "quest:token_budget=8256,dense_layers=1"
    assert vllm_backend.covering_spec("quest", 100) == "quest:token_budget=112"
    if peer.missing_vllm() is None:
        pytest.skip("vLLM is installed here")
    assert vllm_backend.main(["decode", "--contexts", "64"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err


def test_load_rows_come_back_from_the_child(fake_vllm, monkeypatch, capsys):
    """The rows of ``load`` come back; with ``gpu`` (an index among this process's devices) the child's
    CUDA_VISIBLE_DEVICES names that device alone, its lines are marked as the peer's, and nothing reads this
    process's device after it."""
    work = fake_vllm / "load.json"
    work.write_text(json.dumps({"prompts": [[1] * 100, [2] * 200, [3] * 150], "output_lens": [9, 3, 9]}))
    result = peer.peer_rows("vllm", "load", ["--model", "shape:tiny", "--workload", str(work), "--max-num-seqs", "4"],
                            timeout_s=120)
    (row,) = result["rows"]
    assert row["requests_done"] == 3 and row["output_tokens"] == 21 and row["max_batch"] == 4
    assert row["step_tokens"] == 16384 and row["kv_capacity_gib"] is None and row["preempted"] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(peer, "device_free_bytes", lambda: pytest.fail("this process's device was read"))
    capsys.readouterr()
    kept = peer.load_rows_of("vllm", "shape:tiny", [[1] * 100], [9], 4, 0, kv_cache_memory_bytes=2**30, gpu=1)
    assert kept["rows"][0]["kv_capacity_gib"] == 1.0
    assert "[vllm, GPU 1] devices seen: 5" in capsys.readouterr().out
    assert row["tpot_p50_ms"] == pytest.approx(2.0) and row["ttft_p50_ms"] == pytest.approx(15.0)
    assert row["ttft_max_ms"] >= row["ttft_p99_ms"]
    assert row["output_tokens_per_s"] == pytest.approx(21 / row["duration_s"])


@pytest.mark.parametrize("work", [{"prompts": [[1, 2]], "output_lens": [0]}, {"prompts": [[]], "output_lens": [4]},
                                  {"prompts": [[1, -2]], "output_lens": [4]}, {"prompts": [[1]]},
                                  {"prompts": [[1], [2]], "output_lens": [4]},
                                  {"prompts": [[1]], "output_lens": [2], "forced": [[5]]},
                                  {"prompts": [[1]], "output_lens": [1], "forced": [[-5]]}])
def test_a_bad_workload_file_is_named(work, tmp_path, capsys):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(work))
    with pytest.raises(SystemExit):
        peer.main(["load", "--workload", str(path)])
    assert f"--workload {path}" in capsys.readouterr().err


def test_a_failing_child_is_a_peer_error_with_its_output(fake_vllm):
    """A child that fails is a PeerError with its output; given ``cpus``, it (and what it starts) runs on those CPUs
    only, and ``split_cpus`` halves this process's."""
    ours = sorted(os.sched_getaffinity(0))
    halves = peer.split_cpus()
    assert halves is None if len(ours) < 2 else (halves[0] | halves[1] == set(ours) and not halves[0] & halves[1])
    (fake_vllm / "vllm" / "__init__.py").write_text(FAKE_VLLM + textwrap.dedent('''
        import os

        class LLM(LLM):
            def __init__(self, **kw):
                raise RuntimeError(f"no GPU for the peer on cpus {sorted(os.sched_getaffinity(0))}")
        '''))
    with pytest.raises(peer.PeerError, match=re.escape(f"no GPU for the peer on cpus {ours[-1:]}")):
        peer.peer_rows("vllm", "decode", ["--model", "shape:tiny", "--contexts", "64"], timeout_s=120,
                       cpus={ours[-1]})


def test_only_known_peers():
    with pytest.raises(peer.PeerError, match="peer must be one of vllm"):
        peer.peer_rows("sglang", "decode", [])


def test_missing_timestamps_are_an_error_not_a_number():
    import types

    out = types.SimpleNamespace(metrics=None, outputs=[types.SimpleNamespace(token_ids=[1, 2])])
    with pytest.raises(peer.PeerError, match="no first/last token timestamps"):
        peer.request_times(out)
    assert json.dumps(peer.OFFLINE_ENV)


def test_e2e_puts_the_peers_rows_in_its_table(tmp_path, monkeypatch):
    """``bench.e2e --peer vllm``: the peer runs first, its rows join the table with the ratio of each of ours."""
    from sparsekv.bench import e2e

    calls = []

    def fake_peer(peer_name, kind, options):
        calls.append((peer_name, kind, options))
        return {"peer": "vllm", "version": "0.26.0", "rows": [
            {"context": 128, "ttft_s": 0.01, "prefill_tok_s": 12800.0, "decode_ms": 1e6, "tokens_per_s": 1e-3}]}

    monkeypatch.setattr(e2e, "run_peer", fake_peer)
    monkeypatch.setattr(e2e, "peer_problem", lambda args, device, dtype: None)  # the CPU stands in for the GPU
    assert e2e.main(["--model", "shape:tiny", "--device", "cpu", "--contexts", "128", "--methods", "dense",
                     "--new-tokens", "4", "--peer", "vllm", "--out", str(tmp_path)]) == 0
    assert calls == [("vllm", "decode", ["--model", "shape:tiny", "--contexts", "128", "--new-tokens", "4",
                                         "--seed", "0"])]
    result = json.loads((tmp_path / "e2e.json").read_text())
    peer_row, dense = result["rows"]
    assert peer_row["spec"] == "vllm" and dense["spec"] == "dense" and result["meta"]["peer"]["version"] == "0.26.0"
    assert dense["vs_peer"] == pytest.approx(1e6 / dense["decode_ms"])
    table = (tmp_path / "e2e.md").read_text()
    assert "vs vllm" in table and "vllm 0.26.0 (dense, in a process of its own" in table


@pytest.mark.parametrize("peer_gpu", [None, 1])
def test_serve_puts_the_peers_row_in_its_table(peer_gpu, tmp_path, monkeypatch):
    """``bench.serve --peer vllm``: the peer runs the same requests first, or with ``--peer-gpu`` beside ours on
    that GPU (its workload file holds our prompts and output lengths), its row joins the table first, and each of
    ours gets the ratio to it."""
    from sparsekv.bench import serve

    seen = {}

    def fake_peer(peer_name, kind, options, gpu=None, cpus=None):
        work = json.loads(open(options[options.index("--workload") + 1]).read())
        seen.update(kind=kind, options=options, work=work, gpu=gpu, cpus=cpus)
        assert peer_name == "vllm" and options[:2] == ["--model", "shape:tiny"]
        return {"peer": "vllm", "version": "0.26.0", "rows": [
            {"peer": "vllm", "requests_done": 3, "output_tokens": 12, "duration_s": 1e4, "output_tokens_per_s": 12e-4,
             "requests_per_s": 3e-4, "ttft_p50_ms": 5.0, "ttft_p90_ms": 6.0, "ttft_p99_ms": 6.0, "ttft_max_ms": 6.0,
             "tpot_p50_ms": 2.0, "tpot_p90_ms": 2.0, "tpot_p99_ms": 2.0, "max_batch": 2}]}

    monkeypatch.setattr(peer, "peer_rows", fake_peer)
    monkeypatch.setattr(serve, "peer_problem", lambda args, device: None)  # the CPU stands in for the GPU
    monkeypatch.setattr(serve, "keep_to_cpus", lambda cpus: seen.update(ours=cpus))  # this process keeps its CPUs
    monkeypatch.setattr(serve, "split_cpus", lambda: ({0}, {1}))
    assert serve.main(["--model", "shape:tiny", "--device", "cpu", "--methods", "dense", "--requests", "3",
                       "--prompt-len", "16", "32", "--output-len", "4", "4", "--max-batch", "2", "--via", "engine",
                       "--no-warmup", "--peer", "vllm", "--out", str(tmp_path),
                       *([] if peer_gpu is None else ["--peer-gpu", str(peer_gpu)])]) == 0
    assert seen["kind"] == "load" and seen["options"][-4:] == ["--max-num-seqs", "2", "--seed", "0"]
    assert seen["gpu"] == peer_gpu
    # beside ours, each process on half the host's CPUs
    assert (seen["cpus"], seen.get("ours")) == ((None, None) if peer_gpu is None else ({1}, {0}))
    assert seen["work"]["output_lens"] == [4, 4, 4] and all(16 <= len(p) <= 32 for p in seen["work"]["prompts"])
    result = json.loads((tmp_path / "serve.json").read_text())
    peer_row, dense = result["rows"]
    assert peer_row["via"] == "vllm" and dense["spec"] == "dense" and result["meta"]["peer"]["version"] == "0.26.0"
    assert dense["vs_peer"] == pytest.approx(dense["output_tokens_per_s"] / 12e-4)
    # the share of each run before its last first token: 6 ms of 10,000 s for the peer
    assert peer_row["until_last_ttft"] == pytest.approx(6e-7)
    assert dense["until_last_ttft"] == pytest.approx(dense["ttft_max_ms"] / 1e3 / dense["duration_s"])
    assert 0 < dense["until_last_ttft"] <= 1
    table = (tmp_path / "serve.md").read_text()
    assert "vs vllm tok/s" in table and "vllm 0.26.0 (dense, prefix caching off" in table
    assert ("before ours" if peer_gpu is None else "at the same time as ours, on GPU 1 of the same machine (ours on "
            "GPU 0, each process on 1 of the host's CPUs)") in table
    assert result["meta"]["peer"]["gpu"] == peer_gpu


def test_serve_takes_a_peer_gpu_that_is_another_of_this_machines(monkeypatch, tmp_path, capsys):
    import argparse

    import torch

    from sparsekv.bench import serve

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = argparse.Namespace(model="shape:llama3-8b", dtype=None, weights="float", rate=float("inf"),
                              concurrency=0, duration=None, fill="prefill", prefix_cache_gib=0, peer_gpu=1)
    assert serve.peer_problem(args, torch.device("cuda")) is None
    for gpu, device in ((0, "cuda"), (1, "cuda:1"), (2, "cuda")):
        args.peer_gpu = gpu
        assert "--peer-gpu must be a CUDA device of this machine other than ours" in serve.peer_problem(
            args, torch.device(device))
    assert serve.main(["--model", "shape:tiny", "--device", "cpu", *SERVE, "--peer-gpu", "1",
                       "--out", str(tmp_path)]) == 2
    assert "--peer-gpu must be given with --peer, got 1" in capsys.readouterr().err


E2E = ["--contexts", "128"]
SERVE = ["--requests", "2", "--prompt-len", "16", "32", "--output-len", "4", "4"]


@pytest.mark.parametrize("bench, options, says", [
    ("e2e", [*E2E, "--model", "tiny:llama"], "--peer needs a shape:<name> --model"),
    ("e2e", [*E2E, "--model", "shape:tiny"], "--peer runs on one CUDA device"),
    ("serve", [*SERVE, "--model", "tiny:llama"], "--peer needs a shape:<name> --model"),
    ("serve", [*SERVE, "--model", "shape:tiny"], "--peer runs on a CUDA device"),
])
def test_a_peer_that_cannot_compare_is_refused(bench, options, says, tmp_path, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"sparsekv.bench.{bench}").main(
            ["--device", "cpu", "--peer", "vllm", "--out", str(tmp_path), *options])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_settle_device_waits_until_the_peer_gives_the_memory_back(monkeypatch, capsys):
    free = iter([1 << 30, 5 << 30, 9 << 30])
    monkeypatch.setattr(peer, "device_free_bytes", lambda: next(free))
    monkeypatch.setattr(peer.time, "sleep", lambda s: None)
    peer.settle_device(10 << 30)
    assert next(free, None) is None  # read until within SETTLE_SLACK_BYTES of the 10 GiB it had
    assert "came back" in capsys.readouterr().out
    peer.settle_device(None)  # no device: nothing read
