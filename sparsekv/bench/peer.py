"""vLLM, the peer the benchmarks compare with: the same published model shape with random weights
(``load_format="dummy"``), prompts given as token ids, on the same GPU, in a process of its own so that its engine
and the memory it takes (``--gpu-memory-utilization`` of the device) are gone before our runs start.

    python -m sparsekv.bench.peer decode --contexts 32768 131072 --new-tokens 64
    python -m sparsekv.bench.peer load --workload load.json --max-num-seqs 16

``decode``: one request at a time, a prompt of ``context`` random tokens and ``new_tokens`` greedy tokens with EOS
ignored; the time to the first token, and the decode time per token from the engine's timestamps of the first
and last token (host clock: what a client of vLLM sees, its scheduling included). ``load``: the requests of a
workload file (``{"prompts": [[token ids], ...], "output_lens": [n, ...]}``, as ``bench.serve --peer`` writes its
own) given at once, each greedy for its output length with EOS ignored: output tokens/s over the whole run, and
time to first token (from the request's arrival) and per output token (p50, p90, p99), in ``bench.serve``'s names.
``score``: a workload's requests decoded greedily, or fed the workload's ``"forced"`` tokens, with each request's
tokens and their mean negative log-likelihood (``bench.vllm_backend agree``). ``--sparsekv SPEC`` runs vLLM with
sparsekv's attention backend deciding the decode tokens' pages (``sparsekv.integrations.vllm``); ``--weights`` loads
a saved checkpoint in place of random ones.

The rows go to stdout as one JSON line (``PEER_ROWS {...}``) and, with ``--json FILE``, to that file. Other
benchmarks run this module through ``peer_rows`` (their ``--peer vllm``). vLLM is the optional extra
``sparsekv[vllm]`` (a CUDA machine's, never installed by CI); without it this module says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import int_arg, named_shape, quantiles, shape_config

PEERS = ("vllm",)
VLLM_VERSIONS = ">=0.26,<0.27"  # the release built for torch 2.11, the GPU image's; pyproject's extra says the same
# vLLM reads these at import: no network, no usage reports, no tokenizer threads.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "TOKENIZERS_PARALLELISM": "false"}
# Under tensor parallelism vLLM fuses its all-reduce with the next RMSNorm through FlashInfer, whose kernel faulted in
# CUDA-graph capture on 2 H200s with NVLink multicast off; the products and attention are what is compared.
TP_COMPILATION = {"pass_config": {"fuse_allreduce_rms": False}}


class PeerError(RuntimeError):
    """The peer could not run (not installed, or its process failed): the message says why."""


def missing_vllm() -> str | None:
    """None if vLLM imports, else what is missing and how to get it."""
    try:
        import vllm
    except ImportError as err:
        return (f"vLLM is not installed ({err}): the peer needs pip install 'sparsekv[vllm]' (vllm{VLLM_VERSIONS}) "
                f"on a CUDA machine")
    return None if hasattr(vllm, "LLM") else f"vllm {getattr(vllm, '__version__', '?')} has no LLM class"


def write_shape(name: str, max_positions: int, folder: Path) -> None:
    """The ``config.json`` of ``SHAPES[name]`` (``common.shape_config``, bf16) in ``folder``, for vLLM to fill with
    random weights."""
    config = shape_config(name, max_positions)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(folder)


def request_times(output) -> tuple[float, float | None]:
    """(time to first token in s, decode ms per token after the first) of a finished ``vllm.RequestOutput``, from
    the timestamps its engine keeps per request; the decode time is None for a single token."""
    m = output.metrics
    if m is None or not getattr(m, "first_token_ts", 0) or not getattr(m, "last_token_ts", 0):
        raise PeerError("vLLM's RequestOutput carries no first/last token timestamps (metrics): this vLLM release "
                        f"is not the one supported (vllm{VLLM_VERSIONS})")
    tokens = len(output.outputs[0].token_ids)
    decode = (m.last_token_ts - m.first_token_ts) * 1e3 / (tokens - 1) if tokens > 1 else None
    return m.first_token_latency, decode


def engine(args, max_len: int, **extra):
    """A ``vllm.LLM`` over a random-weight model of ``args.model``'s shape (or the checkpoint in ``args.weights``),
    no tokenizer, no prefix cache; with ``args.sparsekv`` (a method spec) sparsekv's attention backend decodes
    (``sparsekv.integrations.vllm``). ``extra``: more of ``LLM``'s options."""
    from vllm import LLM

    if args.weights:
        model, load_format = args.weights, "auto"
    else:
        model, load_format = Path(tempfile.mkdtemp(prefix="sparsekv-peer-")), "dummy"
        write_shape(args.model.removeprefix("shape:"), max_len, model)
    options = dict(model=str(model), load_format=load_format, skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=max_len, gpu_memory_utilization=args.gpu_memory_utilization,
                   enable_prefix_caching=False, seed=args.seed,
                   disable_log_stats=False, **extra)  # LLM turns the per-request stats off, and the timestamps
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
        options["compilation_config"] = TP_COMPILATION
    if args.kv_cache_memory_bytes:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.sparsekv:
        options.update(attention_backend="CUSTOM", additional_config={"sparsekv": args.sparsekv})
    t0 = time.perf_counter()
    llm = LLM(**options)
    print(f"peer: vLLM engine up in {time.perf_counter() - t0:.0f} s ({method_of(args)})", flush=True)
    return llm


def method_of(args) -> str:
    """The rows' ``method``: ``dense`` (vLLM's own attention), or the spec sparsekv's backend runs."""
    return args.sparsekv or "dense"


def generate(llm, prompts: list[list[int]], new_tokens: list[int]) -> tuple[list, float]:
    """The outputs of ``prompts`` (token ids), given at once, each greedy for its ``new_tokens`` with EOS ignored;
    and the wall seconds of the call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in new_tokens]
    t0 = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return outputs, time.perf_counter() - t0


def random_prompt(llm, length: int, seed: int) -> list[int]:
    """``length`` random token ids from ``seed``, below the model's vocabulary."""
    import torch

    vocab = llm.llm_engine.model_config.get_vocab_size()
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_rows(args) -> list[dict]:
    llm = engine(args, max(args.contexts) + args.new_tokens)
    generate(llm, [[0] * 512], [8])  # the first request pays the engine's lazy set-up
    rows = []
    for context in args.contexts:
        (out,), _ = generate(llm, [random_prompt(llm, context, args.seed + context)], [args.new_tokens])
        ttft, decode_ms = request_times(out)
        rows.append({"peer": "vllm", "method": method_of(args), "context": context, "batch": 1, "ttft_s": ttft,
                     "prefill_tok_s": context / ttft, "decode_ms": decode_ms, "tokens_per_s": 1e3 / decode_ms})
        print(f"peer: vLLM {method_of(args)} ctx {context}: TTFT {ttft:.3f} s, {decode_ms:.2f} ms/token", flush=True)
    return rows


def load_rows(args) -> list[dict]:
    work = json.loads(args.workload.read_text())
    prompts, lengths = work["prompts"], work["output_lens"]
    llm = engine(args, max(len(p) + n for p, n in zip(prompts, lengths)))
    generate(llm, [[0] * 512], [8])
    before = preemptions(llm)
    outputs, wall = generate(llm, prompts, lengths)
    after = preemptions(llm)
    times = [request_times(o) for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = quantiles([t for t, _ in times])
    tpot = quantiles([d for _, d in times if d is not None])
    kv = llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
    row = {"peer": "vllm", "method": method_of(args), "requests_done": len(outputs), "output_tokens": tokens,
           "duration_s": wall, "output_tokens_per_s": tokens / wall, "requests_per_s": len(outputs) / wall,
           **{f"ttft_{k}_ms": None if v is None else 1e3 * v for k, v in ttft.items()},
           **{f"tpot_{k}_ms": v for k, v in tpot.items()},
           "max_batch": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
           "step_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
           "kv_capacity_gib": None if kv is None else kv / 2**30,
           "preempted": None if before is None or after is None else after - before}
    print(f"peer: vLLM {method_of(args)}, {len(prompts)} requests: {row['output_tokens_per_s']:.1f} output tok/s, "
          f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.2f} ms", flush=True)
    return [row]


def preemptions(llm) -> int | None:
    """vLLM's preemptions since its engine started (its ``vllm:num_preemptions`` counter, summed over its engines; a
    preempted request is recomputed), None where its metrics hold no such counter."""
    found = [m.value for m in llm.get_metrics() if m.name.removesuffix("_total") == "vllm:num_preemptions"]
    return round(sum(found)) if found else None


def score_rows(args) -> list[dict]:
    """Each request of the workload decoded greedily, or fed its ``forced`` tokens (the workload's, through
    ``vllm_forced.ForcedTokens``) through the decode steps: its tokens and their mean negative log-likelihood per
    token under the model (vLLM's log-probabilities before any logits processor)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .vllm_forced import ForcedTokens

    work = json.loads(args.workload.read_text())
    prompts, lengths, forced = work["prompts"], work["output_lens"], work.get("forced")
    # A logits processor puts vLLM on its V1 model runner; greedy runs keep the default (V2 for Llama).
    llm = engine(args, max(len(p) + n for p, n in zip(prompts, lengths)),
                 **({} if forced is None else {"logits_processors": [ForcedTokens]}))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0,
                             extra_args=None if forced is None else {ForcedTokens.KEY: forced[i]})
              for i, n in enumerate(lengths)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows = []
    for out in outputs:
        done = out.outputs[0]
        nll = -sum(step[token].logprob for step, token in zip(done.logprobs, done.token_ids)) / len(done.token_ids)
        rows.append({"peer": "vllm", "method": method_of(args), "tokens": list(done.token_ids), "nll": nll})
    print(f"peer: vLLM {method_of(args)}: mean NLL per token {[round(r['nll'], 4) for r in rows]}", flush=True)
    return rows


def workload_problem(path: Path) -> str | None:
    """What is wrong with a workload file (None: nothing): prompts of token ids >= 0, one output length >= 1 each."""
    try:
        work = json.loads(path.read_text())
        prompts, lengths = work["prompts"], work["output_lens"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"not a workload file ({type(err).__name__}: {err})"
    ok = (isinstance(prompts, list) and isinstance(lengths, list) and prompts and len(prompts) == len(lengths)
          and all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p) for p in prompts)
          and all(type(n) is int and n >= 1 for n in lengths))
    forced = work.get("forced")
    ok = ok and (forced is None or (isinstance(forced, list) and len(forced) == len(prompts) and all(
        isinstance(f, list) and len(f) == n and all(type(t) is int and t >= 0 for t in f)
        for f, n in zip(forced, lengths))))
    return None if ok else ('needs "prompts": a non-empty list of non-empty lists of token ids >= 0, '
                            '"output_lens": one int >= 1 per prompt, and optionally "forced": per prompt its '
                            'output_lens token ids >= 0')


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsekv.bench.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    decode = sub.add_parser("decode", help="batch-1 decode at each context")
    decode.add_argument("--contexts", type=int_arg(), nargs="+", default=[32768, 131072])
    decode.add_argument("--new-tokens", type=int_arg(2), default=64)
    load = sub.add_parser("load", help="a workload's requests given at once")
    score = sub.add_parser("score", help="a workload's tokens (greedy, or its \"forced\" ones) and their NLL")
    for s in (load, score):
        s.add_argument("--workload", type=Path, required=True,
                       help='JSON: {"prompts": [[token ids], ...], "output_lens": [n, ...]} (score: and optionally '
                            '"forced": [[token ids], ...], output_lens of them)')
    for s in (decode, load, score):
        s.add_argument("--model", default="shape:llama3-8b", help="shape:<name>: a published shape, random weights")
        s.add_argument("--weights", type=Path, default=None,
                       help="a saved checkpoint (a transformers folder) instead of the shape's random weights")
        s.add_argument("--sparsekv", default=None, metavar="SPEC",
                       help="decode through sparsekv's attention backend with this method spec (e.g. "
                            "quest:token_budget=2048); default: vLLM's own attention")
        s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        s.add_argument("--max-num-seqs", type=int_arg(), default=None, help="vLLM's cap on running requests")
        s.add_argument("--tensor-parallel-size", type=int_arg(), default=1, help="vLLM's tensor parallelism (GPUs)")
        s.add_argument("--kv-cache-memory-bytes", type=int_arg(), default=None,
                       help="vLLM's KV cache size (default: what --gpu-memory-utilization leaves)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.model.startswith("shape:"):
        p.error(f"--model must be shape:<name> (the peer builds random weights of a published shape), "
                f"got {args.model!r}")
    try:
        named_shape(args.model.removeprefix("shape:"))
    except ValueError as err:
        p.error(f"--model: {err}")
    if args.kind in ("load", "score"):
        problem = workload_problem(args.workload)
        if problem:
            p.error(f"--workload {args.workload}: {problem}")
    problem = missing_vllm()
    if problem:
        print(f"sparsekv.bench.peer: error: {problem}", file=sys.stderr)
        return 2
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    rows = {"decode": decode_rows, "load": load_rows, "score": score_rows}[args.kind](args)
    import vllm

    result = {"peer": "vllm", "version": vllm.__version__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result))
    print("PEER_ROWS " + json.dumps(result), flush=True)
    return 0


def peer_rows(peer: str, kind: str, options: list[str], timeout_s: float = 900, gpu: int | None = None,
              cpus: set[int] | None = None) -> dict:
    """Runs ``python -m sparsekv.bench.peer KIND OPTIONS`` in a child process (its output shown as it comes) and
    returns what it wrote: {"peer", "version", "rows"}, once the device has its memory back (``settle_device``).
    ``gpu``: the child sees only that CUDA device of this process's (``CUDA_VISIBLE_DEVICES``), one that this
    process does not use, so nothing is waited for after it. ``cpus``: the child and the processes it starts run
    on these CPUs only (``split_cpus``). A child that fails, or passes ``timeout_s``, is a ``PeerError`` with the
    end of its output."""
    if peer not in PEERS:
        raise PeerError(f"peer must be one of {', '.join(PEERS)}, got {peer!r}")
    with tempfile.TemporaryDirectory(prefix="sparsekv-peer-") as folder:
        result = Path(folder) / "rows.json"
        command = [sys.executable, "-m", "sparsekv.bench.peer", kind, *options, "--json", str(result)]
        free = device_free_bytes() if gpu is None else None
        env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1"}
        if gpu is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        mark = "" if gpu is None else f"[{peer}, GPU {gpu}] "  # its lines among those of the runs beside it
        tail: list[str] = []
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) as child:
            if cpus:  # before the child starts its engine's processes, which take its CPUs
                os.sched_setaffinity(child.pid, cpus)
            deadline = time.monotonic() + timeout_s
            for line in child.stdout:
                if not line.startswith("PEER_ROWS "):
                    print(mark + line, end="", flush=True)
                tail = (tail + [line])[-20:]
                if time.monotonic() > deadline:
                    child.kill()
                    raise PeerError(f"the {peer} peer ran past {timeout_s:.0f} s:\n" + "".join(tail))
            code = child.wait()
        if code != 0 or not result.exists():
            raise PeerError(f"the {peer} peer exited {code}:\n" + "".join(tail))
        settle_device(free)
        return json.loads(result.read_text())


def split_cpus() -> tuple[set[int], set[int]] | None:
    """This process's CPUs in two halves, (ours, the peer's), for a peer that runs beside our run on a GPU of its
    own, so that neither's host work waits on the other's: the peer's compile workers as its engine starts and its
    engine's busy loop; our eager steps and copies between the device and host memory. None with fewer than 2."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return (set(cpus[:half]), set(cpus[half:])) if half else None


def keep_to_cpus(cpus: set[int]) -> None:
    """Runs every thread of this process, and the threads it starts, on ``cpus`` only, with as many intra-op
    threads as them."""
    import torch

    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), cpus)
    torch.set_num_threads(len(cpus))


# What a finished peer may leave held on the device and still be taken as gone: ours is timed only once the peer's
# engine (vLLM's EngineCore runs in a process of its own) has given its memory back, so that no run shares the GPU
# with it. On the H200 the memory was back as the peer exited.
SETTLE_SLACK_BYTES = 2 << 30


def device_free_bytes() -> int | None:
    """The CUDA device's free memory (None without one)."""
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def settle_device(free: int | None, timeout_s: float = 300) -> None:
    """Waits until the device has ``free`` bytes free again, less ``SETTLE_SLACK_BYTES`` (what it had before the
    peer ran; None: no device), at most ``timeout_s``, and says how long it waited."""
    if free is None:
        return
    began = time.monotonic()
    while device_free_bytes() < free - SETTLE_SLACK_BYTES:
        if time.monotonic() - began > timeout_s:
            print(f"peer: the device's memory did not come back within {timeout_s:.0f} s; timing on", flush=True)
            return
        time.sleep(0.5)
    print(f"peer: the device's memory came back {time.monotonic() - began:.1f} s after the peer exited", flush=True)


def load_rows_of(peer: str, model: str, prompts: list[list[int]], output_lens: list[int], max_num_seqs: int,
                 seed: int, kv_cache_memory_bytes: int | None = None, gpu: int | None = None,
                 cpus: set[int] | None = None) -> dict:
    """``peer_rows`` of ``load`` over these requests (their workload file written for the child, then removed),
    with ``kv_cache_memory_bytes`` of KV where given, on ``gpu`` and ``cpus`` where given."""
    with tempfile.TemporaryDirectory(prefix="sparsekv-peer-") as folder:
        path = Path(folder) / "workload.json"
        path.write_text(json.dumps({"prompts": prompts, "output_lens": output_lens}))
        kv = [] if kv_cache_memory_bytes is None else ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
        return peer_rows(peer, "load", ["--model", model, "--workload", str(path), "--max-num-seqs",
                                        str(max_num_seqs), "--seed", str(seed), *kv], gpu=gpu, cpus=cpus)


if __name__ == "__main__":
    raise SystemExit(main())
