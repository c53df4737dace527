"""Tensor parallelism on the CPU: two processes (gloo) holding half of a tiny model's heads each give exactly the
one-process tokens and decode statistics for every method, through ``generate`` and through the decode engine, and
budgets covering the context give the dense tokens.
``sparsekv.bench.tp`` runs both layouts and compares them; this starts it with torchrun."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from sparsekv import models, parallel
from sparsekv.bench.tp import CONTROL, ENGINE
from sparsekv.tiny import tiny_model
from worktree import ROOT, worktree_env


def test_two_processes_give_the_one_process_tokens(tmp_path):
    assert dist.is_gloo_available()
    out = tmp_path / "tp.json"
    env = worktree_env(OMP_NUM_THREADS="1")  # one thread a process on a small CPU
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
    env = worktree_env(OMP_NUM_THREADS="1")
    args = ["-m", "sparsekv.cli", "generate", "--model", str(tmp_path / "model"), "--method",
            "quest:dense_layers=0", "--budget", "16", "--prompt", "The pass key is 4312. " * 6, "--max-new-tokens",
            "8", "--no-progress"]
    one = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert one.stdout and two.stdout == one.stdout


def test_one_process_has_no_head_group():
    model = tiny_model()
    assert parallel.head_group(model) is None
    assert parallel.row_split(model.get_decoder().layers[0].self_attn.o_proj) is None  # a plain weight: no sum
    assert parallel.column_split(model.get_decoder().layers[0].self_attn.q_proj) is None  # nor local rows
    assert parallel.size(None) == 1
    t = torch.tensor([1.0, -2.0])
    assert parallel.all_reduce_sum(t, None) is t and parallel.all_reduce_max(t, None) is t
    assert t.tolist() == [1.0, -2.0]


def test_e2e_bench_under_torchrun(tmp_path):
    """``bench.e2e`` started by torchrun: the first process builds the shape model, both load it sharded, and
    the first writes the rows (memory per process, floor over both processes' bandwidth)."""
    env = worktree_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sparsekv.bench.e2e", "--model", "shape:tiny", "--contexts", "96", "--device", "cpu",
           "--new-tokens", "4", "--methods", "dense", "quest", "--budget", "32", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert [(r["spec"], r["gpus"]) for r in result["rows"]] == [("dense", 2), ("quest", 2)]
    assert "tensor parallel" in result["meta"]["device_name"]
    assert run.stdout.count("| quest | 32 | 96 |") == 1  # printed by the first process only


def test_processes_given_different_arguments_all_stop_naming_it(tmp_path):
    """Under torchrun, ``sparsekv generate`` compares the options of every process before loading: each option
    that differs is named with every process's value, on every process (exit status 2, nothing printed, no hang);
    equal options (the prompt compared by its text) generate. A model whose KV heads the process count does not
    divide is refused before transformers splits it."""
    from sparsekv.tiny import byte_tokenizer

    for name, heads in (("model", (4, 2)), ("bad", (6, 3))):
        model = tiny_model("llama", vocab_size=264, heads=heads[0], kv_heads=heads[1])
        model.generation_config.eos_token_id = None
        model.save_pretrained(tmp_path / name)
        byte_tokenizer().save_pretrained(tmp_path / name)
    env = worktree_env(OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "tests" / "tp_arguments.py"), str(tmp_path / "model"), str(tmp_path / "bad"),
                          str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in (0, 1)]
    differ = {"method": "--method differs: process 0: 'quest:dense_layers=0', process 1: 'h2o'",
              "spec": "--method differs: process 0: 'quest:dense_layers=0', process 1: 'quest:dense_layers=1'",
              "budget": "--budget differs: process 0: 16, process 1: 32",
              "opt": "--opt differs: process 0: ['page_size=16'], process 1: ['page_size=8']",
              "prompt": "the prompt (--prompt or --prompt-file) differs: process 0: 'The pass key is 4312.",
              "prompt-file": "(662 characters, sha256",
              "max-new-tokens": "--max-new-tokens differs: process 0: 4, process 1: 5",
              "seed": "--seed differs: process 0: 0, process 1: 1",
              "temperature": "--temperature differs: process 0: 1.0, process 1: 0.5",
              "sample": "--sample differs: process 0: True, process 1: False",
              "chat": "--chat differs: process 0: False, process 1: True",
              "dtype": "--dtype differs: process 0: 'float32', process 1: 'bfloat16'",
              "model": f"--model differs: process 0: '{tmp_path / 'model'}', process 1: '{tmp_path / 'bad'}'",
              "heads": "model: 6 attention heads and 3 KV heads cannot be split over 2 processes (torchrun "
                       "--nproc-per-node 2); tensor parallelism needs a process count that divides both: 1, 3"}
    for case, message in differ.items():
        for rank in ranks:
            assert rank[case]["code"] == 2 and rank[case]["out"] == "", case
            assert message in rank[case]["err"], (case, rank[case]["err"])
            assert "Traceback" not in rank[case]["err"], case
            assert rank[case]["err"].count("differs") == (case != "heads"), case  # only the option that differs
    assert "(728 characters, sha256" in ranks[0]["prompt-file"]["err"]
    for case in ("same", "prompt-file-same"):
        assert [r[case]["code"] for r in ranks] == [0, 0], ranks[0][case]["err"] + ranks[1][case]["err"]
        assert ranks[0][case]["out"] and not ranks[1][case]["out"]  # the first process prints
    assert ranks[0]["same"]["out"] == ranks[0]["prompt-file-same"]["out"]


def test_heads_must_divide_by_the_process_count():
    from types import SimpleNamespace as Config

    models.check_heads(Config(num_attention_heads=32, num_key_value_heads=8), 8)
    models.check_heads(Config(num_attention_heads=6, num_key_value_heads=6), 3)
    refused = ((32, 8, 3, "1, 2, 4, 8"), (6, 2, 4, "1, 2"), (15, None, 2, "1, 3, 5, 15"))
    for heads, kv_heads, processes, counts in refused:
        with pytest.raises(ValueError, match=rf"model: {heads} attention heads and {kv_heads or heads} KV heads cannot "
                                             rf"be split over {processes} processes \(torchrun --nproc-per-node "
                                             rf"{processes}\); tensor parallelism needs a process count that divides "
                                             rf"both: {counts}$"):
            models.check_heads(Config(num_attention_heads=heads, num_key_value_heads=kv_heads), processes)


def test_agreement_needs_no_group_and_describes_long_values_by_digest():
    parallel.check_agree({"--prompt": "anything"})  # one process: nothing to compare
    assert parallel.describe(16) == "16" and parallel.describe("quest") == "'quest'"
    assert parallel.describe("/a/path/" * 20) == repr("/a/path/" * 20)  # whole up to 200 characters
    long = parallel.describe("x" * 1000)
    assert long.startswith("'xxx") and "(1002 characters, sha256 " in long and len(long) < 250
    assert long != parallel.describe("x" * 999 + "y")


def test_all_reduce_setting_is_checked_and_one_shot_needs_cuda():
    assert parallel.all_reduce() == "nccl"
    with pytest.raises(ValueError, match=r"^all_reduce: must be one of nccl, one-shot, got 'ring'$"):
        parallel.set_all_reduce("ring")
    assert parallel.all_reduce() == "nccl"
    group = object()  # not reached: nccl prepares nothing, and one-shot stops at the device
    assert parallel.one_shot(group, torch.bfloat16, torch.device("cpu")) is None
    parallel.set_all_reduce("one-shot")
    try:
        with pytest.raises(ValueError, match=r"all_reduce: 'one-shot' sums over CUDA symmetric memory, the device "
                                             r"is cpu; use 'nccl'"):
            parallel.one_shot(group, torch.bfloat16, torch.device("cpu"))
    finally:
        parallel.set_all_reduce("nccl")
    with pytest.raises(RuntimeError, match="no symmetric buffer of 4 torch.float32 elements for group 'none'"):
        parallel.one_shot_sum(torch.zeros(2, 2), "none")


def test_benches_refuse_one_shot_off_cuda(capsys):
    from sparsekv.bench import e2e

    with pytest.raises(SystemExit) as stop:
        e2e.main(["--model", "shape:tiny", "--device", "cpu", "--contexts", "64", "--all-reduce", "one-shot"])
    assert stop.value.code == 2
    assert "--all-reduce one-shot sums over CUDA symmetric memory, the device is cpu" in capsys.readouterr().err
    assert parallel.all_reduce() == "nccl"


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
# NVLink multicast stays off: on shared hosts a program using it can take the GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@TWO_GPUS
def test_one_shot_all_reduce_equals_nccl(tmp_path):
    """Bit for bit, eagerly, compiled and from a CUDA graph, in bf16 and float32; a tensor larger than the buffer
    goes through NCCL."""
    env = worktree_env(**NO_MULTICAST)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "tests" / "tp_one_shot.py"), str(tmp_path / "out.json")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert len(results) == 2 * (5 * 3 + 1) and all(results.values()), [case for case, ok in results.items() if not ok]


@TWO_GPUS
def test_one_shot_engine_gives_the_one_process_tokens(tmp_path):
    """The captured decode step with one-shot sums gives the one-process tokens of every method in float32."""
    out = tmp_path / "tp.json"
    env = worktree_env(**NO_MULTICAST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sparsekv.bench.tp", "--model", "tiny:llama", "--context", "96", "--dtype", "float32",
           "--all-reduce", "one-shot", "--out", str(out)]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["notes"] == []
    assert any(name.startswith(ENGINE) for name in result["tensor_parallel"])
