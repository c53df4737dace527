"""Trains the project's small long-context Llama from scratch and ships it in HF format with a model card.

    python -m training.train --out models/sparsekv-llama-16m          # the default run, ~12 H200-minutes
    python -m training.train --out /tmp/dry --dry-run --device cpu     # tiny config, a minute on a CPU
    python -m training.train --out models/sparsekv-llama-16m --train-minutes 5.5 --pack $OUT   # one 10-min command

``--train-minutes`` sets the step count (at most ``--steps``) from the FLOP rate measured in the first steps, so the
run fits a machine that limits one command's time; ``--pack`` writes the finished folder as chunks of at most
15 MiB. A run also keeps its state in ``--checkpoint-dir`` (default ``.train/<name>``, git-ignored); with
``--session-minutes`` a process ends with a checkpoint (exit code 3) and the same command resumes.
docs/training.md has the device recipe.

Steps: train a byte-level BPE tokenizer on the essays' training split plus generated task text; build a
LlamaForCausalLM (GQA, RoPE theta 5e5, <= 20M parameters, <= 40 MB as bf16; both asserted); stream the mixture of
``training.data`` through DataLoader workers; AdamW with linear warm-up and cosine decay, bf16 autocast on CUDA,
SDPA attention, gradient clipping; evaluate with the harness every ``--eval-every`` steps and at the end (dense,
the saved bf16 weights); save weights (bf16 safetensors), tokenizer, ``README.md`` (the model card, filled from
the final evaluation), ``training_args.json``, ``train_log.jsonl`` and the evaluation records under ``eval/``.

Cost of the default model (8 layers, d 384, 6 query / 2 KV heads of 64, FFN 1024, vocab 4096; 14.1M weights in
matmuls incl. the LM head, 1.6M in the embedding table): training FLOPs per token are about
6 * 14.1M = 85M for the matmuls plus, for causal attention over a row of L tokens, 6 * layers * d * L = 18.4K * L
(QK^T and AV, forward and backward): 104M at L = 1K, 160M at 4K, 255M at 9216. Over the curriculum's mix of
lengths the mean is about 200M per token.

Throughput on an H200 (about 790 TFLOP/s on large bf16 matrix products): a model this narrow runs its matmuls
(K = 384) and flash attention (head dim 64) far below that, and its norms, RoPE and SiLU are memory-bound, so expect
roughly 60-120 TFLOP/s, i.e. 300K-600K tokens/s. The default 1500 steps of 131072 tokens (197M tokens) then take
5.5-11 minutes, and the evaluations about 2 more (batch-1 greedy decoding in the harness's eager loop, ~10K decode
steps in the final one, most of them arith workings): about 12 GPU-minutes at the conservative end.
``--max-minutes`` stops training early (then evaluates and saves) should the GPU be slower than that; the log prints
tokens/s and the projected time every ``--log-every`` steps.

Data generation must keep up: one CPU core generates a mixed batch at 90K-125K tokens/s (measured on the 2-core
development machine at every curriculum length; see docs/training.md), so the default 14 workers give about 1.4M
tokens/s, two to four times what the GPU consumes. The log's ``wait`` column is the time the loop spent waiting for
data; it should stay near zero.

Reproducibility: the data are a function of ``--seed`` and the batch index alone (any number of workers gives the
same batches), the weights are initialised from ``torch.manual_seed(seed)``; GPU kernels (flash attention's
backward, atomics in reductions) are not bitwise deterministic, so a rerun matches in its statistics, not bit for
bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekv.eval.base import REPO_ROOT
from sparsekv.models import LoadedModel
from sparsekv.eval.report import group_by, mean_of
from sparsekv.eval.runner import RESULTS, EvalSpec, read_results, run_eval
from sparsekv.models import resolve_device

from .data import DEFAULT_MIX, KINDS, Mixture, Stream, essays_dir, split_essays, tokenize_essays, \
    tokenizer_corpus, train_tokenizer

MAX_PARAMS = 20_000_000
MAX_BYTES = 40_000_000  # as bf16 safetensors

# Tunables: the default run, and the dry run's tiny config. Options given on the command line win over both.
DEFAULTS = dict(vocab=4096, context=9216, min_len=512, steps=6000, tokens_per_step=65536, curriculum=0.5,
                lr=2e-3, min_lr_ratio=0.1, warmup=200, weight_decay=0.1, clip=1.0, prompt_weight=0.1,
                answer_weight=1.0, layers=8, hidden=384, heads=6, kv_heads=2, ffn=1024, rope_theta=500000.0,
                held_out=4, eval_every=2000, eval_lengths=[4096, 8192], arith_steps=[16, 32, 64], eval_samples=5,
                log_every=10, workers=None, checkpoint_every=250)
DRY_RUN = dict(vocab=512, context=1024, min_len=512, steps=4, tokens_per_step=2048, warmup=1, layers=2, hidden=64,
               heads=4, kv_heads=2, ffn=128, eval_every=2, eval_lengths=[1024], arith_steps=[4], eval_samples=1,
               log_every=1, workers=0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output model folder, e.g. models/sparsekv-llama-16m")
    p.add_argument("--essays", help="folder of essay .txt files (default $SPARSEKV_DATA_DIR or ../shared/data, "
                                    "haystack/paul_graham_essays)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="autocast dtype of training (weights and optimizer stay float32); auto: bfloat16 on CUDA")
    p.add_argument("--dry-run", action="store_true", help="tiny config for a CPU check of the whole pipeline")
    p.add_argument("--evaluate-only", action="store_true",
                   help="no training: rerun the final evaluation of the model saved in --out (e.g. with more "
                        "--eval-samples than fitted the training command) and update its model card")
    p.add_argument("--max-minutes", type=float, help="stop training after this many minutes, then evaluate and save")
    p.add_argument("--train-minutes", type=float,
                   help="fit training into this many minutes: after --calibrate-steps the step count (at most "
                        "--steps) is set from the measured FLOP rate and the known row lengths, and re-estimated at "
                        "every log line; the learning-rate schedule follows it")
    p.add_argument("--calibrate-steps", type=int, default=30, help="steps measured before --train-minutes applies")
    p.add_argument("--session-minutes", type=float,
                   help="end this process after this many minutes with a checkpoint (exit code 3); the same command "
                        "resumes (for machines that limit one command's time)")
    p.add_argument("--eval-minutes", type=float, default=3.0,
                   help="with --session-minutes: the final evaluation and saving are left to the next command unless "
                        "this much of the session is left after training (default 3)")
    p.add_argument("--pack", metavar="DIR", help="also write the saved model folder as DIR/<name>.tar.gz.NN chunks "
                                                 "of at most 15 MiB")
    p.add_argument("--checkpoint-dir", help="the run's working folder, kept between sessions (default "
                                            ".train/<name of --out> in the repository, git-ignored)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start from the weights and tokenizer of a model saved by this script (a second training "
                        "stage; the architecture options must match it) instead of a new tokenizer and random "
                        "weights")
    p.add_argument("--mix", nargs="+", metavar="KIND=W",
                   help=f"row mixture weights over {', '.join(KINDS)} (default "
                        f"{' '.join(f'{k}={v}' for k, v in DEFAULT_MIX.items())})")
    ints = ("vocab", "context", "min_len", "steps", "tokens_per_step", "warmup", "layers", "hidden", "heads",
            "kv_heads", "ffn", "held_out", "eval_every", "eval_samples", "log_every", "workers", "checkpoint_every")
    floats = ("curriculum", "lr", "min_lr_ratio", "weight_decay", "clip", "prompt_weight", "answer_weight",
              "rope_theta")
    helps = {"context": "longest row (tokens); also the longest training prompt", "min_len": "shortest row",
             "curriculum": "fraction of the steps over which the longest row length grows to --context",
             "prompt_weight": "LM weight of task prompt tokens (answers have their own term)",
             "answer_weight": "weight of the answer term", "held_out": "essays held out for perplexity",
             "eval_every": "steps between evaluations (0: final only)",
             "checkpoint_every": "steps between checkpoints (0: only when a session ends)",
             "workers": "DataLoader workers (default: CPU count - 2, at most 14)",
             "tokens_per_step": "tokens per optimizer step (rows = this // row length)"}
    for name in ints + floats:
        p.add_argument("--" + name.replace("_", "-"), type=int if name in ints else float,
                       help=f"{helps.get(name, '')} (default {DEFAULTS[name]}; dry run {DRY_RUN.get(name, '-')})")
    p.add_argument("--eval-lengths", type=int, nargs="+", help="prompt lengths of the evaluations")
    p.add_argument("--arith-steps", type=int, nargs="+", help="step counts of the arith evaluations")
    args = p.parse_args(argv)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, DRY_RUN.get(key, value) if args.dry_run and key in DRY_RUN else value)
    if args.workers is None:
        args.workers = max(0, min(14, (os.cpu_count() or 1) - 2))
    args.mix = parse_mix(args.mix)
    return args


def parse_mix(items: list[str] | None) -> dict[str, float]:
    if not items:
        return dict(DEFAULT_MIX)
    out = {}
    for item in items:
        kind, eq, raw = item.partition("=")
        if not eq or kind not in KINDS:
            raise SystemExit(f"--mix takes KIND=WEIGHT with KIND in {', '.join(KINDS)}, got {item!r}")
        out[kind] = float(raw)
    return out


def build_model(args, vocab_size: int):
    """The LlamaForCausalLM of ``args``; refuses a config outside the project's limits (MAX_PARAMS, MAX_BYTES)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.hidden % args.heads or args.heads % args.kv_heads or args.heads // args.kv_heads < 2:
        raise ValueError(f"--heads {args.heads} must divide --hidden {args.hidden} and be a multiple (>= 2x) of "
                         f"--kv-heads {args.kv_heads} (GQA)")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                         # Room for prompts of --context tokens plus the answers the harness generates after them.
                         max_position_embeddings=2 * args.context,
                         rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    if params > MAX_PARAMS or 2 * params > MAX_BYTES:
        raise ValueError(f"model has {params / 1e6:.2f}M parameters ({2 * params / 1e6:.1f} MB as bf16); the "
                         f"limits are {MAX_PARAMS / 1e6:.0f}M and {MAX_BYTES / 1e6:.0f} MB: shrink "
                         f"--layers/--hidden/--ffn/--vocab")
    return model


def flops_per_token(args, length: int) -> float:
    """Training FLOPs per token (forward and backward) for rows of ``length`` tokens; see the module docstring."""
    d_kv = args.kv_heads * args.hidden // args.heads
    matmul = args.layers * (2 * args.hidden * args.hidden + 2 * args.hidden * d_kv + 3 * args.hidden * args.ffn)
    matmul += args.hidden * args.vocab
    return 6 * matmul + 6 * args.layers * args.hidden * length


def lr_at(args, step: int, total: int | None = None) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at the last step (``total``
    steps, default ``args.steps``)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, (total or args.steps) - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def steps_within(args, mixture: Mixture, done: int, progress: dict) -> int:
    """The step count that fits ``--train-minutes``: the FLOP rate achieved so far, applied to the FLOPs of each next
    batch (its row length is known in advance), until the time left is used; at most ``--steps``."""
    rate = progress["flops"] / max(progress["train_s"], 1e-9)
    left = 60 * args.train_minutes - progress["train_s"]
    n = done
    while n < args.steps:
        length = mixture.row_length(n)
        left -= max(1, args.tokens_per_step // length) * length * flops_per_token(args, length) / rate
        if left < 0:
            break
        n += 1
    return max(n, done)


def loss_terms(logits: torch.Tensor, batch: dict, answer_weight: float):
    """(loss, lm term, answer term, per-row answer NLL (B,)) of logits (B, L, V) for ``batch`` (see
    ``training.data``): the LM term is the ``lm_weight``-weighted mean NLL; the answer term the mean over rows with
    answers of each row's mean answer NLL (0 for a row without answers). Token t's weights apply to predicting it
    from position t - 1. No host sync."""
    ids = batch["input_ids"]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    nll = nll.view(ids.shape[0], -1)
    lm_w = batch["lm_weight"][:, 1:]
    lm = (nll * lm_w).sum() / lm_w.sum().clamp(min=1e-6)
    ans = batch["answer"][:, 1:].float()
    count = ans.sum(1)
    has = (count > 0).float()
    per_row = (nll * ans).sum(1) / count.clamp(min=1)
    answer = (per_row * has).sum() / has.sum().clamp(min=1)
    return lm + answer_weight * answer, lm, answer, per_row


def answer_by_kind(kinds: list[str], per_row: torch.Tensor) -> dict[str, float]:
    """Mean answer NLL of this batch's rows per row kind (essay rows have no answers), for the log: one answer
    term averaged over kinds hides a kind that is not learning."""
    values = per_row.tolist()
    by_kind: dict[str, list[float]] = {}
    for kind, value in zip(kinds, values):
        if kind != "essays":
            by_kind.setdefault(kind, []).append(value)
    return {kind: round(sum(v) / len(v), 4) for kind, v in sorted(by_kind.items())}


def eval_plan(args, final: bool) -> list[tuple[str, list[int], list[float] | None, int]]:
    """(task, lengths, depths, samples per cell) of an evaluation; periodic ones are small and at the longest
    length, the final one covers every length the model card reports."""
    n, longest = args.eval_samples, [max(args.eval_lengths)]
    if final:
        return [("passkey", args.eval_lengths, [0.0, 0.25, 0.5, 0.75, 1.0], n),
                ("multikey", args.eval_lengths, None, 2 * n), ("vartrack", args.eval_lengths, None, n),
                ("2stage", args.eval_lengths, None, 2 * n), ("arith", args.arith_steps, None, n)]
    return [("passkey", args.eval_lengths, [0.0, 0.5, 1.0], 1), ("multikey", longest, None, 2),
            ("2stage", longest, None, 2), ("arith", args.arith_steps[:1], None, 2)]


def evaluate(model, tokenizer, plan, out: Path, name: str, log=print) -> dict[str, dict[int, float]]:
    """Dense scores {task: {length: mean score}} of ``model`` with the harness (greedy, question fed token by
    token); the records are kept under ``out/<task>``."""
    loaded = LoadedModel(model, tokenizer, name)
    scores = {}
    for task, lengths, depths, samples in plan:
        folder = out / task
        run_eval(EvalSpec(task=task, methods=["dense"], lengths=lengths, depths=depths, limit=samples, seed=0,
                          out=str(folder), chat="off", plots=False), log=lambda *_: None, progress=False,
                 loaded=loaded)
        by_length = group_by(read_results(folder / RESULTS), "length")
        scores[task] = {length: mean_of(r["score"] for r in rs) for (length,), rs in sorted(by_length.items())}
        log(f"  eval {task}: " + ", ".join(f"{length}: {s:.2f}" for length, s in scores[task].items()))
    return scores


@torch.no_grad()
def perplexity(model, ids: list[int], window: int, device: torch.device, autocast) -> float:
    """Teacher-forced perplexity over consecutive windows of ``window`` tokens of ``ids`` (the last, shorter one
    included)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        x = torch.tensor([ids[start:start + window]], device=device)
        if x.shape[1] < 2:
            break
        with autocast():
            logits = model(input_ids=x).logits
        nll += float(F.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum"))
        count += x.shape[1] - 1
    return math.exp(nll / count)


# Options that must not change when a run resumes from its checkpoint (the others: --max-minutes, --workers, ...).
RESUME_KEYS = ("seed", "init_from", "vocab", "context", "min_len", "steps", "tokens_per_step", "curriculum", "lr",
               "min_lr_ratio", "warmup", "weight_decay", "clip", "prompt_weight", "answer_weight", "layers", "hidden",
               "heads", "kv_heads", "ffn", "rope_theta", "held_out", "mix", "dtype")


class Checkpoint:
    """The run's working folder (``--checkpoint-dir``): tokenizer, ``state.pt`` (weights, optimizer, step, timings),
    ``train_log.jsonl`` and the periodic evaluations. It outlives one process, so a run cut into several commands
    (``--session-minutes``) or killed resumes where its last checkpoint left off."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.state_path = folder / "state.pt"
        self.tokenizer_dir = folder / "tokenizer"
        self.log_path = folder / "train_log.jsonl"
        self.eval_dir = folder / "eval"

    def load(self, args) -> dict | None:
        if not self.state_path.exists():
            return None
        state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        changed = {k: (state["args"].get(k), getattr(args, k)) for k in RESUME_KEYS
                   if state["args"].get(k) != getattr(args, k)}
        if changed:
            diff = ", ".join(f"--{k.replace('_', '-')} {a} then, {b} now" for k, (a, b) in changed.items())
            raise SystemExit(f"{self.state_path} was made with other options ({diff}); use the same options, or "
                             f"another --checkpoint-dir (or delete it) to start afresh")
        return state

    def save(self, state: dict) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)  # a process killed mid-write leaves the previous checkpoint intact


def main(argv=None) -> int:
    """Returns 0 when the model is saved, 3 when ``--session-minutes`` ended this process before the last step
    (rerun the same command to continue)."""
    args = parse_args(argv)
    if args.evaluate_only:
        return evaluate_saved(args, sys.argv[1:] if argv is None else list(argv))
    started = time.time()
    out = Path(args.out)
    ckpt = Checkpoint(Path(args.checkpoint_dir or REPO_ROOT / ".train" / out.name))
    ckpt.folder.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    args.dtype = str(dtype).removeprefix("torch.")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers fork; each tokenizes on its own core
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    train_files, held_files = split_essays(essays_dir(args.essays), args.held_out)
    state = ckpt.load(args)
    if state is None:
        if args.init_from:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(args.init_from, local_files_only=True).save_pretrained(ckpt.tokenizer_dir)
            tokenizer = AutoTokenizer.from_pretrained(ckpt.tokenizer_dir, local_files_only=True)
        else:
            tokenizer = train_tokenizer(tokenizer_corpus(train_files, seed=args.seed), args.vocab,
                                        ckpt.tokenizer_dir)
        ckpt.log_path.write_text("")
        shutil.rmtree(ckpt.eval_dir, ignore_errors=True)  # the harness would resume from an earlier run's records
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ckpt.tokenizer_dir, local_files_only=True)
        print(f"resuming from {ckpt.state_path} at step {state['progress']['step']} of {args.steps}")
    print(f"tokenizer: {len(tokenizer)} tokens, trained on {len(train_files)} essays + generated task text; "
          f"held out: {', '.join(f.name for f in held_files) or 'none'}")
    essay_ids = tokenize_essays(tokenizer, train_files)
    model = build_model(args, len(tokenizer))
    if args.init_from and state is None:
        from transformers import AutoModelForCausalLM

        init = AutoModelForCausalLM.from_pretrained(args.init_from, local_files_only=True, dtype=torch.float32)
        model.load_state_dict(init.state_dict())  # raises if the architecture options differ from that model's
        print(f"weights and tokenizer from {args.init_from}")
    model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, {2 * params / 1e6:.1f} MB as bf16; training FLOPs/token "
          f"{flops_per_token(args, args.min_len) / 1e6:.0f}M at {args.min_len} .. "
          f"{flops_per_token(args, args.context) / 1e6:.0f}M at {args.context}; {device}, autocast {dtype}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                                  **({"fused": True} if device.type == "cuda" else {}))
    progress = {"step": 0, "train_s": 0.0, "wall_s": 0.0, "tokens": 0, "flops": 0.0, "sessions": 0, "evals": [],
                "stopped": None, "total": args.steps}
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        progress = state["progress"]
    progress["sessions"] += 1

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def eval_copy():
        return copy.deepcopy(model).to(torch.bfloat16).eval()

    def save_state():
        progress["wall_s"] = wall_before + time.time() - started
        ckpt.save({"args": vars(args), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                   "progress": progress})

    wall_before = progress["wall_s"]
    if progress["step"] < progress["total"] and progress["stopped"] is None:
        done = train_steps(args, model, optimizer, tokenizer, essay_ids, device, autocast, eval_copy, ckpt, progress,
                           save_state, started)
        save_state()
        if not done:
            print(f"--session-minutes {args.session_minutes}: stopped at step {progress['step']} of "
                  f"{progress['total']}; checkpoint in {ckpt.folder}. Rerun the same command to continue.")
            return 3
    if args.session_minutes is not None and time.time() - started > 60 * (args.session_minutes - args.eval_minutes):
        print(f"training done; less than --eval-minutes {args.eval_minutes} left of --session-minutes "
              f"{args.session_minutes}: rerun the same command to evaluate and save (checkpoint in {ckpt.folder})")
        return 3

    out.mkdir(parents=True, exist_ok=True)
    final = eval_copy()
    results = final_evaluation(args, final, tokenizer, out, held_files)

    final.generation_config.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    final.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The in-training evaluations' scores are in the log; their records stay in the checkpoint folder.
    shutil.copy(ckpt.log_path, out / "train_log.jsonl")
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    if size > MAX_BYTES:
        raise RuntimeError(f"{weights} is {size / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB limit")
    total_s = wall_before + time.time() - started
    record = {"args": vars(args), "argv": sys.argv[1:] if argv is None else list(argv),
              "git_commit": _git_commit(), "device": _device_name(device), "torch": torch.__version__,
              "python": platform.python_version(), "params": params, "safetensors_bytes": size,
              "train_s": round(progress["train_s"], 1), "total_s": round(total_s, 1),
              "sessions": progress["sessions"], "steps_done": progress["stopped"] or progress["total"],
              "stopped_early": progress["stopped"] is not None, "tokens": progress["tokens"],
              "tokenizer_vocab": len(tokenizer), "held_out": [f.name for f in held_files],
              "train_essays": len(train_files), "essay_tokens": len(essay_ids), **results,
              "periodic_evals": progress["evals"]}
    (out / "training_args.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / "README.md").write_text(model_card(record, final.config))
    if args.pack:
        print("packed into " + ", ".join(str(p) for p in pack(out, Path(args.pack))))
    print(f"saved {out} ({size / 1e6:.1f} MB weights); train {progress['train_s'] / 60:.1f} min, eval "
          f"{results['eval_s'] / 60:.1f} min, whole run {total_s / 60:.1f} min in {progress['sessions']} session(s)")
    return 0


def final_evaluation(args, model, tokenizer, out: Path, held_files: list[Path]) -> dict:
    """The model card's evaluation of ``model`` (bf16, eval mode): the harness's final plan (records in
    ``out/eval/final``) and the held-out essay perplexity. Returns the record's fields ``scores``, ``perplexity``,
    ``perplexity_window``, ``held_out_tokens`` and ``eval_s``."""
    t0 = time.perf_counter()
    print("final evaluation (dense, bf16 weights as saved)")
    shutil.rmtree(out / "eval" / "final", ignore_errors=True)  # records of other weights must not be resumed
    scores = evaluate(model, tokenizer, eval_plan(args, final=True), out / "eval" / "final", out.name)
    held_ids = tokenize_essays(tokenizer, held_files)
    window = min(args.context, 4096)
    device = next(model.parameters()).device
    ppl = perplexity(model, held_ids, window, device, lambda: torch.autocast(device.type, enabled=False)) \
        if held_files else None
    if ppl is not None:
        print(f"held-out essay perplexity {ppl:.2f} ({len(held_ids)} tokens, windows of {window})")
    return {"scores": scores, "perplexity": ppl, "perplexity_window": window, "held_out_tokens": len(held_ids),
            "eval_s": round(time.perf_counter() - t0, 1)}


def evaluate_saved(args, argv: list[str]) -> int:
    """``--evaluate-only``: the final evaluation of the model saved in ``--out`` (with ``--eval-samples``,
    ``--eval-lengths``, ``--arith-steps`` of this command), written into its ``training_args.json`` and model
    card; the training record is kept. For a run whose own final evaluation was kept small to fit a time limit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(args.out)
    record_path = out / "training_args.json"
    if not record_path.exists():
        raise SystemExit(f"--evaluate-only: {record_path} not found; --out must be a folder saved by this script")
    record = json.loads(record_path.read_text())
    device = resolve_device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.bfloat16).to(device).eval()
    _, held_files = split_essays(essays_dir(args.essays), record["args"]["held_out"])
    args.context = record["args"]["context"]
    record.update(final_evaluation(args, model, tokenizer, out, held_files))
    record["final_eval_argv"] = argv
    record_path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / "README.md").write_text(model_card(record, model.config))
    if args.pack:
        print("packed into " + ", ".join(str(p) for p in pack(out, Path(args.pack))))
    return 0


def train_steps(args, model, optimizer, tokenizer, essay_ids, device, autocast, eval_copy, ckpt: Checkpoint,
                progress: dict, save_state, started: float) -> bool:
    """Trains from ``progress["step"]``; True when training is over (last step, or --max-minutes), False when
    --session-minutes ended this process first. Updates ``progress`` and checkpoints every --checkpoint-every
    steps."""
    mixture = Mixture(tokenizer, essay_ids, seed=args.seed, context=args.context, min_len=args.min_len,
                      tokens_per_step=args.tokens_per_step, curriculum_steps=int(args.curriculum * args.steps),
                      weights=args.mix, prompt_weight=args.prompt_weight)
    loader = torch.utils.data.DataLoader(Stream(mixture, progress["step"], args.steps), batch_size=None,
                                         num_workers=args.workers, pin_memory=device.type == "cuda",
                                         prefetch_factor=4 if args.workers else None)
    window = {"tokens": 0, "wait": 0.0, "t": time.perf_counter()}
    model.train()
    batches = iter(loader)
    with open(ckpt.log_path, "a", encoding="utf-8") as log_file:
        for step in range(progress["step"], args.steps):
            if step >= progress["total"]:
                break
            t_wait = time.perf_counter()
            batch = next(batches)
            window["wait"] += time.perf_counter() - t_wait
            for group in optimizer.param_groups:
                group["lr"] = lr_at(args, step, progress["total"])
            gpu = {k: batch[k].to(device, non_blocking=True) for k in ("input_ids", "answer", "lm_weight")}
            with autocast():
                logits = model(input_ids=gpu["input_ids"]).logits
            loss, lm, answer, per_row = loss_terms(logits, gpu, args.answer_weight)
            del logits
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            window["tokens"] += batch["input_ids"].numel()
            progress["flops"] += batch["input_ids"].numel() * flops_per_token(args, batch["input_ids"].shape[1])
            progress["step"] = step + 1
            last = step + 1 == progress["total"]
            session_over = args.session_minutes is not None and time.time() - started > 60 * args.session_minutes
            if (step + 1) % args.log_every == 0 or last or session_over:
                elapsed = time.perf_counter() - window["t"]
                progress["train_s"] += elapsed
                progress["tokens"] += window["tokens"]
                rec = {"step": step + 1, "length": batch["input_ids"].shape[1], "rows": batch["input_ids"].shape[0],
                       "loss": loss.item(), "lm": lm.item(), "answer": answer.item(), "grad_norm": grad_norm.item(),
                       "lr": lr_at(args, step, progress["total"]),
                       "tokens_per_s": round(window["tokens"] / max(elapsed, 1e-9)),
                       "wait_s": round(window["wait"], 3), "train_s": round(progress["train_s"], 1),
                       "tokens": progress["tokens"], "answer_by_kind": answer_by_kind(batch["kind"], per_row)}
                if args.train_minutes and step + 1 >= args.calibrate_steps and not last:
                    progress["total"] = steps_within(args, mixture, step + 1, progress)
                    last = step + 1 == progress["total"]
                eta = progress["train_s"] / (step + 1) * (progress["total"] - step - 1)
                print(f"step {step + 1}/{progress['total']} L {rec['length']} x{rec['rows']} loss {rec['loss']:.3f} "
                      f"(lm {rec['lm']:.3f}, answer {rec['answer']:.3f}) lr {rec['lr']:.2e} "
                      f"{rec['tokens_per_s']:,} tok/s wait {rec['wait_s']:.2f}s train "
                      f"{progress['train_s'] / 60:.1f} min, ~{eta / 60:.1f} min to go", flush=True)
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
                window = {"tokens": 0, "wait": 0.0, "t": time.perf_counter()}
                if args.max_minutes and progress["train_s"] > 60 * args.max_minutes and not last:
                    progress["stopped"] = step + 1
                    print(f"--max-minutes {args.max_minutes} reached: stopping at step {step + 1}")
                    return True
            if args.eval_every and (step + 1) % args.eval_every == 0 and not last:
                t0 = time.perf_counter()
                print(f"evaluating at step {step + 1}")
                scores = evaluate(eval_copy(), tokenizer, eval_plan(args, final=False),
                                  ckpt.eval_dir / f"step{step + 1}", f"step{step + 1}")
                progress["evals"].append({"step": step + 1, "scores": scores,
                                          "eval_s": round(time.perf_counter() - t0, 1)})
                log_file.write(json.dumps({"eval": progress["evals"][-1]}) + "\n")
                model.train()
                window["t"] += time.perf_counter() - t0  # evaluation time is not training time
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and not last:
                t0 = time.perf_counter()
                save_state()
                window["t"] += time.perf_counter() - t0
            if session_over and not last:
                return False  # the caller saves the checkpoint
    return True


def pack(folder: Path, dest: Path, chunk: int = 15 * 2**20) -> list[Path]:
    """``folder`` as a gzipped tar split into files of at most ``chunk`` bytes, ``dest/<name>.tar.gz.00``, ``.01``,
    ...: a form that passes size and file-count limits on copying results back from a machine. Unpack with
    ``cat <name>.tar.gz.* | tar xzf - -C models/``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    data = buf.getvalue()
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(0, len(data), chunk):
        paths.append(dest / f"{folder.name}.tar.gz.{i // chunk:02d}")
        paths[-1].write_bytes(data[i:i + chunk])
    return paths


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def model_card(rec: dict, config) -> str:
    """The model folder's README.md, from the run's record."""
    a = rec["args"]
    mix = ", ".join(f"{k} {v:g}" for k, v in a["mix"].items())
    cmd = "python -m training.train " + " ".join(rec["argv"])
    budget = f" (the count that fit --train-minutes {a['train_minutes']:g})" if a["train_minutes"] else ""
    lines = [
        f"# {Path(a['out']).name}", "",
        "A small long-context Llama trained from scratch by sparsekv's `training/train.py`, so that the "
        "sparse KV methods can be judged on a model whose attention is genuinely sparse and query-dependent. It is "
        "a test model, not a general language model: it knows the harness's tasks and the style of the essays.", "",
        "## Model", "",
        f"`LlamaForCausalLM`: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads of {config.head_dim} (GQA), "
        f"FFN {config.intermediate_size}, RoPE theta {a['rope_theta']:g}, vocabulary {config.vocab_size} "
        f"(byte-level BPE trained with HF `tokenizers` on the training essays and generated task text; digits one "
        f"per token; `<pad>` 0, `<s>` 1 prepended, `</s>` 2). {rec['params'] / 1e6:.2f}M parameters, "
        f"{rec['safetensors_bytes'] / 1e6:.1f} MB as bf16 safetensors. Trained on rows of up to {a['context']} "
        f"tokens; `max_position_embeddings` {config.max_position_embeddings} leaves room for generation after "
        f"prompts of that length.", "",
        "## Training", "",
        f"- Command: `{cmd}` at commit `{rec['git_commit']}`; seed {a['seed']} (data, initialisation, sample "
        f"generation; evaluation samples use the harness's seed 0, training samples their own seeds)."
        + (f" Continued from `{a['init_from']}` (weights and tokenizer; `docs/training.md` lists the stages)."
           if a.get("init_from") else ""),
        f"- {rec['steps_done']} steps{' (stopped early by --max-minutes)' if rec['stopped_early'] else ''}"
        f"{budget} of "
        f"{a['tokens_per_step']} tokens ({rec['tokens'] / 1e6:.0f}M tokens); AdamW (0.9, 0.95), lr {a['lr']:g}, "
        f"warm-up {a['warmup']}, cosine to {a['min_lr_ratio']:g}x, weight decay {a['weight_decay']:g}, clip "
        f"{a['clip']:g}, bf16 autocast on CUDA, SDPA attention.",
        f"- Rows of {a['min_len']} to {a['context']} tokens, the longest length allowed doubling over the first "
        f"{a['curriculum']:.0%} of the steps. Row mixture: {mix}. Task rows are drawn by the harness's own "
        f"generators (`sparsekv.eval.synthetic`) at prompt lengths of L/2 to L - 64 with the answer and `</s>` "
        f"after the question, the rest of the row a recall document; arith rows pack chains of "
        f"8-96 steps with the reference working as target; recall rows state facts in the tasks' sentence forms "
        f"among noise and ask them again later (see `training/data.py`).",
        f"- Loss: mean NLL over the answer/working tokens of each task row (averaged over rows), weight "
        f"{a['answer_weight']:g}, plus the weighted mean NLL of the other tokens (essay text 1, task prompts "
        f"{a['prompt_weight']:g}).",
        f"- Essays: {rec['train_essays']} for training ({rec['essay_tokens']} tokens), held out: "
        f"{', '.join(rec['held_out']) or 'none'} ({rec['held_out_tokens']} tokens).",
        f"- Hardware: {rec['device']}; training {rec['train_s'] / 60:.1f} min, evaluation {rec['eval_s'] / 60:.1f} "
        f"min, whole run {rec['total_s'] / 60:.1f} min in {rec['sessions']} session(s); torch {rec['torch']}.", "",
        "## Dense accuracy", "",
        "The harness (`sparsekv eval`, method dense, greedy, the question fed token by token, seed 0) on the saved "
        "bf16 weights. Lengths are prompt tokens (arith: step counts). Records in `eval/final/`."
        + (f" Evaluated after training by `python -m training.train {' '.join(rec['final_eval_argv'])}`, "
           f"{rec['args']['eval_samples']} samples per cell in the training command, more here."
           if rec.get("final_eval_argv") else ""), "",
    ]
    lengths = sorted({length for s in rec["scores"].values() for length in s})
    lines += ["| task | " + " | ".join(str(n) for n in lengths) + " |", "| --- |" + " --- |" * len(lengths)]
    for task, by_length in rec["scores"].items():
        lines.append(f"| {task} | " + " | ".join(f"{by_length[n]:.2f}" if n in by_length else "-" for n in lengths)
                     + " |")
    if rec["perplexity"] is not None:
        lines += ["", f"Held-out essay perplexity: **{rec['perplexity']:.2f}** (teacher-forced, windows of "
                      f"{rec['perplexity_window']} tokens over {rec['held_out_tokens']} tokens)."]
    lines += ["", "## Use", "", "```", f"sparsekv eval --task passkey --model {a['out']} --methods dense quest "
              "--budgets 128 256 512 --lengths 4096 8192", "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
