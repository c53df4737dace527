"""sparsekv's backend in ``vllm serve``, over HTTP through the OpenAI client (a CUDA machine with ``sparsekv[vllm]``
installed, so that vLLM's processes find the plugin; skipped elsewhere, CI included).

The project's own model answers the pass key test at 4K tokens through Quest at a budget of 64 tokens, with prefix
caching on: a prompt's second request reads the blocks, and the bounds, that the first wrote, and gives the same
answer as a third that shares nothing (another ``cache_salt``). On one GPU, and with tensor parallelism over two
where there are two. A bad method spec stops the server at start with sparsekv's ConfigError message."""

import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from sparsekv.bench.peer import TP_COMPILATION
from worktree import ROOT, worktree_env

MODEL = ROOT / "models" / "sparsekv-llama-16m"
SPEC = "quest:token_budget=64"
LENGTH = 4096
START_S = 600
TP_OPTIONS = ["--compilation-config", json.dumps(TP_COMPILATION)]  # as the benchmarks' vLLM runs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                                reason="needs vLLM (sparsekv[vllm]) and a CUDA GPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(spec: str, tp: int, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL), "--port", str(port),
            "--attention-backend", "CUSTOM", "--additional-config", json.dumps({"sparsekv": spec}),
            "--enable-prefix-caching", "--max-model-len", str(LENGTH + 512), "--gpu-memory-utilization", "0.4",
            "--tensor-parallel-size", str(tp), "--seed", "0", *TP_OPTIONS * (tp > 1)]


def metric(port: int, name: str) -> float:
    """The sum of a counter over its labels in the server's Prometheus text."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, tmp_path_factory):
    """(port, model name) of a ``vllm serve`` of the project's model with Quest, prefix caching on."""
    tp = request.param
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(SPEC, tp, port), stdout=out, stderr=subprocess.STDOUT,
                                env=worktree_env())
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, log.read_text()[-6000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-6000:]
                time.sleep(2)
        yield port, str(MODEL)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def passkey_prompts() -> list[tuple[list[int], int]]:
    """(prompt token ids, pass key) at LENGTH tokens, one per depth of the task."""
    from transformers import AutoTokenizer

    from sparsekv.eval.base import TaskOptions, encode
    from sparsekv.eval.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    task = get_task("passkey", TaskOptions())
    out = []
    for depth in task.depths:
        (sample,) = task.samples(tokenizer, LENGTH, depth, 0, 1)
        ctx, q = encode(tokenizer, sample.context, sample.question)
        out.append((ctx + q, sample.answer))
    return out


def test_passkey_with_prefix_caching(server):
    from openai import OpenAI

    from sparsekv.eval.metrics import parse_first_int

    port, model = server
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    def answer(ids: list[int], **extra) -> str:
        out = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0.0,
                                        extra_body=extra)
        return out.choices[0].text

    for ids, key in passkey_prompts():
        hits = metric(port, "vllm:prefix_cache_hits_total")
        first = answer(ids)
        again = answer(ids)  # its full blocks come from the first request's
        assert metric(port, "vllm:prefix_cache_hits_total") - hits >= len(ids) // 16 * 16 - 16
        alone = answer(ids, cache_salt=f"alone-{key}")  # shares no block
        assert parse_first_int(first) == key, first
        assert again == first == alone, (first, again, alone)


def test_bad_spec_stops_the_server_with_our_message():
    run = subprocess.run(serve_command("quest:token_budget=-5", 1, free_port()), capture_output=True, text=True,
                         timeout=START_S)
    assert run.returncode != 0
    said = run.stdout + run.stderr
    assert "token_budget must be a positive multiple of page_size" in said, said[-6000:]
