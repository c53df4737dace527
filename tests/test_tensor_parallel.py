"""Tensor parallelism on the CPU: two processes (gloo) holding half of a tiny model's heads each give exactly the
one-process tokens and decode statistics for every method, through ``generate`` and through the decode engine, and
budgets covering the context give the dense tokens.
``sparsekv.bench.tp`` runs both layouts and compares them; this starts it with torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sparsekv import parallel
from sparsekv.bench.tp import CONTROL, ENGINE
from sparsekv.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_two_processes_give_the_one_process_tokens(tmp_path):
    assert dist.is_gloo_available()
    out = tmp_path / "tp.json"
    # The worktree first, so that the processes import this checkout's sparsekv; one thread each on a small CPU.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sparsekv.bench.tp", "--model", "tiny:llama", "--context", "48", "--new-tokens", "6",
           "--out", str(out)]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["notes"] == []  # float32: every token equal
    runs = result["tensor_parallel"]
    methods = {"dense", "quest", "omnikv", "raas", "streamingllm", "h2o", "tova", "snapkv"}
    assert methods | {ENGINE + name for name in methods} < set(runs)  # generate and the engine (eager here)
    for name, run in runs.items():
        method = name.removeprefix(ENGINE)
        if method not in (CONTROL, "dense") and not method.endswith("-full"):
            # The small budgets change the tokens, so the equality above covers real selections.
            assert run["tokens"] != runs["dense"]["tokens"], name
            assert run["stats"]["fraction"] < 1.0, name
        assert len(run["nll"]) == 2, name  # the forced tokens' NLL, per row, within 1e-3 of one process's


def test_generate_under_torchrun_prints_the_one_process_text(tmp_path):
    """``sparsekv generate`` started by torchrun loads the folder with tensor parallelism; the first process prints
    the one-process text."""
    from sparsekv.tiny import byte_tokenizer

    model = tiny_model("llama", vocab_size=264)  # transformers shards the vocabulary: divisible by 2
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    args = ["-m", "sparsekv.cli", "generate", "--model", str(tmp_path / "model"), "--method",
            "quest:dense_layers=0", "--budget", "16", "--prompt", "The pass key is 4312. " * 6, "--max-new-tokens",
            "8", "--no-progress"]
    one = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert one.stdout and two.stdout == one.stdout


def test_one_process_has_no_head_group():
    assert parallel.head_group(tiny_model()) is None
    assert parallel.size(None) == 1
    t = torch.tensor([1.0, -2.0])
    assert parallel.all_reduce_sum(t, None) is t and parallel.all_reduce_max(t, None) is t
    assert t.tolist() == [1.0, -2.0]


def test_e2e_bench_under_torchrun(tmp_path):
    """``bench.e2e`` started by torchrun: the first process builds the shape model, both load it sharded, and
    the first writes the rows (memory per process, floor over both processes' bandwidth)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sparsekv.bench.e2e", "--model", "shape:tiny", "--contexts", "96", "--device", "cpu",
           "--new-tokens", "4", "--methods", "dense", "quest", "--budget", "32", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert [(r["spec"], r["gpus"]) for r in result["rows"]] == [("dense", 2), ("quest", 2)]
    assert "tensor parallel" in result["meta"]["device_name"]
    assert run.stdout.count("| quest | 32 | 96 |") == 1  # printed by the first process only
