"""Tokens under transformers' tensor parallelism against one process, for every method.

    torchrun --nproc-per-node 2 -m sparsekv.bench.tp --model tiny:llama --context 48
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 -m sparsekv.bench.tp --model shape:llama3-8b --layers 4 --context 8192

One process per GPU (NCCL), or CPU processes on a machine without one (gloo). Every process loads the model with
``tp_plan="auto"`` (each holds 1/N of every layer's heads) and generates greedily with every method, each at a budget
below the context and at one covering it, through ``model.generate`` and through the decode engine (``engine:<name>``;
on CUDA its decode step is a CUDA graph with the collectives inside); the first process also runs the unsharded
model alone on its device. Every run also scores the one-process control's tokens fed through its decode path (mean
NLL per token). ``transformers`` (the model's own attention, no sparsekv) is the control.

In float32 each run's tokens and decode statistics must equal the one-process run's, and a budget covering the
context must give the dense tokens of the same layout. In bf16 (and fp16) the sharded model's own arithmetic differs
from one process (the row-parallel projections' partial sums are rounded before their all-reduce), and a
random-weight model's logits tie at bf16's resolution often, so the control itself may generate other tokens: there
the forced NLLs must agree within twice the control's own difference (at least ``NLL_FLOOR``), and tokens that part
are listed with the near tie where they part. Exits 1 on a mismatch; ``--out`` gets the runs as JSON (and a
markdown report beside it; a file there from another device or other options is kept unless ``--overwrite``).

``tiny:<arch>`` and ``shape:<name>`` models get random weights (seeded) and are saved to a temporary folder that
every process loads from.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from .. import apply, parallel
from ..engine import Engine
from ..methods import (DenseConfig, H2OConfig, MethodConfig, OmniKVConfig, QuestConfig, RaaSConfig, SnapKVConfig,
                       StreamingLLMConfig, TOVAConfig)
from ..models import resolve_dtype
from ..tiny import tiny_model
from .common import (SHAPES, all_reduce_arg, claim_results, device_name, int_arg, load_sharded, memory_problems,
                     overwrite_arg, refuse, run_setting, shape_model, shape_weights, shared_folder, start_all_reduce,
                     write_files)

CONTROL = "transformers"


def method_configs(context: int, new_tokens: int, page_size: int) -> dict[str, MethodConfig]:
    """Every method at a budget of about a quarter of the context (``<name>``) and at one covering the context
    and the generated tokens (``<name>-full``, which must decode densely). Fewer layers attend densely than the
    methods' defaults, so that a 4-layer model selects in most of them."""
    def pages(tokens: int) -> int:
        return max(page_size, -(-tokens // page_size) * page_size)

    small, full = pages(context // 4), pages(context + new_tokens)
    window = max(1, min(32, small // 2))
    omni = dict(filter_layers=(1,), wait_layers=0, window=4, page_size=page_size)
    return {"dense": DenseConfig(page_size=page_size),
            "quest": QuestConfig(token_budget=small, dense_layers=1, page_size=page_size),
            "quest-full": QuestConfig(token_budget=full, dense_layers=1, page_size=page_size),
            "omnikv": OmniKVConfig(token_budget=small, selector="exponential", **omni),
            "omnikv-full": OmniKVConfig(token_budget=1.0, **omni),
            "raas": RaaSConfig(token_budget=small, prefill="quest", page_size=page_size),
            "raas-full": RaaSConfig(token_budget=full, page_size=page_size),
            "streamingllm": StreamingLLMConfig(token_budget=small),
            "streamingllm-full": StreamingLLMConfig(token_budget=full),
            "h2o": H2OConfig(token_budget=small),
            "h2o-full": H2OConfig(token_budget=full),
            "tova": TOVAConfig(token_budget=small),
            "tova-full": TOVAConfig(token_budget=full),
            "snapkv": SnapKVConfig(token_budget=small, window=window),
            "snapkv-full": SnapKVConfig(token_budget=full, window=window)}


def prompts(vocab: int, batch: int, context: int, seed: int, device: torch.device):
    """Random ids (B, context) and their mask: row i is left-padded by i * context // 8 tokens."""
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, context, dtype=torch.long)
    for i in range(batch):
        mask[i, :i * context // 8] = 0
    return ids.to(device), mask.to(device)


class Force:
    """A logits processor that makes ``generate`` take ``tokens`` (B, T), step by step (its raw logits, returned with
    ``output_logits``, are the model's own)."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, step:step + 1], 0.0)


def generate_all(model, configs: dict[str, MethodConfig], ids, mask, new_tokens: int,
                 forced: list[list[int]] | None = None) -> dict[str, dict]:
    """Per run, the model's own attention (``CONTROL``) and each config: greedy ``tokens`` (B, new_tokens) as lists,
    ``margins`` (B, new_tokens), the gap between the two highest logits at each step (how near a tie the choice
    was), the decode statistics' ``summary`` (None for the control), and ``nll`` (B,): the mean negative
    log-likelihood per token of ``forced`` (B, new_tokens) (default: the control's own tokens) fed through the same
    decode path, which compares two runs' arithmetic where their greedy tokens part at a near tie."""
    out = {}
    for name, config in {CONTROL: None, **configs}.items():
        def session():
            return nullcontext() if config is None else apply(model, config)

        with torch.no_grad(), session() as run:
            result = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, return_dict_in_generate=True, output_logits=True)
            stats = None if run is None else run.stats.summary()
        top2 = torch.stack(result.logits, dim=1).float().topk(2, dim=-1).values  # (B, new_tokens, 2)
        tokens = result.sequences[:, ids.shape[1]:].tolist()
        forced = tokens if forced is None else forced
        target = torch.tensor(forced, device=ids.device)
        with torch.no_grad(), session():
            scored = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, return_dict_in_generate=True, output_logits=True,
                                    logits_processor=[Force(target, ids.shape[1])])
        logp = torch.stack(scored.logits, dim=1).float().log_softmax(dim=-1)  # (B, new_tokens, V)
        out[name] = {"tokens": tokens, "margins": (top2[..., 0] - top2[..., 1]).tolist(), "stats": stats,
                     "nll": (-logp.gather(2, target.unsqueeze(2)).squeeze(2).mean(dim=1)).tolist()}
        if config is not None:
            # The decode engine (chunked prefill; on CUDA the decode step captured, collectives inside the graph).
            rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
            engine = Engine(model, config, max_batch=len(rows), max_context=ids.shape[1] + new_tokens,
                            prefill_chunk=max(16, ids.shape[1] // 2))
            result = engine.generate(rows, new_tokens, stop_tokens=())
            scored = engine.generate(rows, 0, stop_tokens=(), forced=forced)
            out[ENGINE + name] = {"tokens": result.tokens, "margins": None, "stats": result.stats,
                                  "nll": [n / new_tokens for n in scored.forced_nll]}
    return out


def check_spec(spec: str) -> None:
    if not spec.startswith(("tiny:", "shape:")) and not Path(spec).is_dir():
        raise ValueError(f"--model must be tiny:<arch>, shape:<one of {', '.join(SHAPES)}> or a model directory, "
                         f"got {spec!r}")


def build_model(spec: str, layers: int | None, dtype: torch.dtype, max_positions: int, device: torch.device,
                folder: Path) -> None:
    """Saves the random-weight model ``spec`` (``tiny:<arch>`` or ``shape:<name>``, built on ``device``) to
    ``folder``."""
    if spec.startswith("tiny:"):
        # A vocabulary that every tensor-parallel size up to 8 divides (transformers 5.17 requires it).
        model = tiny_model(spec[len("tiny:"):], dtype=dtype, vocab_size=264,
                           **({} if layers is None else {"layers": layers}))
    else:
        torch.manual_seed(0)
        model = shape_model(spec[len("shape:"):], device, dtype, max_positions, layers)
    model.save_pretrained(folder)


ENGINE = "engine:"  # the runs through the decode engine, named by this prefix and the method's name


def near_tie(a: dict, b: dict) -> str:
    """Where two runs' tokens first part, per row: the step and both runs' gaps between their two highest logits
    there (a gap near the logits' rounding error means that the arithmetic, not the selection, decided)."""
    parts = []
    for row, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        step = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if step is not None and (a["margins"] is None or b["margins"] is None):
            parts.append(f"row {row} from step {step}")
        elif step is not None:
            parts.append(f"row {row} from step {step}, top-2 logit gaps {a['margins'][row][step]:.3g} and "
                         f"{b['margins'][row][step]:.3g}")
    return "; ".join(parts)


NLL_FLOOR = 0.02  # nats per token: the least tolerance of the low-precision comparison


def nll_gap(a: dict, b: dict) -> float:
    """The largest difference, over rows, of two runs' mean NLL per token of the same forced tokens."""
    return max(abs(x - y) for x, y in zip(a["nll"], b["nll"]))


def check(reference: dict[str, dict], ranks: list[dict[str, dict]], exact: bool) -> tuple[list[str], list[str]]:
    """(errors, notes) of the tensor-parallel runs (one dict per process) against one process, and of the budgets
    covering the context against dense in the same layout.

    ``exact`` (float32): the greedy tokens and decode statistics must be equal, and the forced NLLs within 1e-3.
    Otherwise (bf16, fp16) a different split of a sum rounds differently, and the random-weight models tie often
    at the logits' resolution, so the model's own sharded arithmetic (``CONTROL``) can already part from one
    process: there the forced NLLs must agree within ``tol`` = max(twice the control's own gap, ``NLL_FLOOR``), and
    greedy tokens that part are notes, with the near tie where they part."""
    errors = [f"process {r}: {name} generated other tokens than on process 0" for r, runs in enumerate(ranks)
              for name, run in runs.items() if run["tokens"] != ranks[0][name]["tokens"]]
    notes = []
    got = ranks[0]
    tol = 1e-3 if exact else max(2 * nll_gap(got[CONTROL], reference[CONTROL]), NLL_FLOOR)
    for name, run in got.items():
        same = run["tokens"] == reference[name]["tokens"]
        if not same:
            (errors if exact else notes).append(
                f"{name}: tokens {run['tokens']} under tensor parallelism, {reference[name]['tokens']} in one "
                f"process ({near_tie(reference[name], run)})")
        if (exact or same) and run["stats"] != reference[name]["stats"]:
            errors.append(f"{name}: statistics {run['stats']} under tensor parallelism, {reference[name]['stats']} "
                          "in one process")
        if nll_gap(run, reference[name]) > tol:
            errors.append(f"{name}: forced NLL {run['nll']} under tensor parallelism, {reference[name]['nll']} in "
                          f"one process (tolerance {tol:.3g})")
        dense = ENGINE + "dense" if name.startswith(ENGINE) else "dense"
        for layout, runs in (("one process", reference), ("tensor parallelism", got)):
            if not name.endswith("-full"):
                continue
            if runs[name]["tokens"] != runs[dense]["tokens"]:
                (errors if exact else notes).append(
                    f"{name}: {runs[name]['tokens']} differs from {dense} {runs[dense]['tokens']} in {layout} "
                    f"({near_tie(runs[dense], runs[name])})")
            if nll_gap(runs[name], runs[dense]) > tol:
                errors.append(f"{name}: forced NLL {runs[name]['nll']}, {dense} {runs[dense]['nll']} in {layout} "
                              f"(tolerance {tol:.3g})")
    return errors, notes


def markdown(result: dict) -> list[str]:
    """The lines of a markdown report of a run's ``--out`` JSON: per run, whether its greedy tokens equal the
    one-process run's and both forced NLLs, then the notes and errors."""
    one, tp = result["one_process"], result["tensor_parallel"]
    lines = [f"# Tensor parallelism against one process ({result['processes']} processes, {result['device']}, "
             f"{result['dtype']})", "", f"Command: `{result['command']}`", "",
             "| run | greedy tokens | forced NLL/token, tensor parallel | forced NLL/token, one process |",
             "| --- | --- | --- | --- |"]
    for name, run in tp.items():
        same = "equal" if run["tokens"] == one[name]["tokens"] else "differ"
        lines.append(f"| {name} | {same} | {', '.join(f'{x:.4f}' for x in run['nll'])} | "
                     f"{', '.join(f'{x:.4f}' for x in one[name]['nll'])} |")
    lines += ["", f"Errors: {len(result['errors'])}."] + [f"- {e}" for e in result["errors"]]
    lines += ["", f"Notes (tokens that part, with the near tie where they part): {len(result['notes'])}."]
    return lines + [f"- {n}" for n in result["notes"]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m sparsekv.bench.tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:llama", help="tiny:<arch>, shape:<name> or a model directory")
    parser.add_argument("--layers", type=int_arg(), default=None, help="keep the first N layers (tiny:/shape: models)")
    parser.add_argument("--context", type=int_arg(), default=48)
    parser.add_argument("--batch", type=int_arg(), default=None,
                        help="default: 2 on CPU (row 1 left-padded), 1 on CUDA")
    parser.add_argument("--new-tokens", type=int_arg(), default=None, help="default: 6 on CPU, 16 on CUDA")
    parser.add_argument("--page-size", type=int_arg(), default=None, help="default: 4 below 1024 tokens of context, "
                                                                    "else 16")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the tokens as JSON here (process 0)")
    all_reduce_arg(parser)
    overwrite_arg(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("start it with torchrun --nproc-per-node N (N >= 2)")
    try:
        check_spec(args.model)
        dtype = resolve_dtype(args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
        weights = shape_weights(args.model, dtype, args.layers)
    except ValueError as err:
        parser.error(str(err))
    start_all_reduce(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"), parser)

    # transformers shards the model over the machine's accelerator whenever there is one. It would start the process
    # group itself; it is started first here to share the model folder.
    device = parallel.start()
    cuda, rank = device.type == "cuda", dist.get_rank()
    setting = run_setting("tp", args, processes=dist.get_world_size())
    try:  # every process decides alike (the same file, the same memory), before the model is built
        if args.out is not None:
            claim_results(args.out, device_name(device), setting, args.overwrite)
        # The first process builds the whole model (in float32), then holds it alone for the one-process runs.
        problem = memory_problems(device, weights)
        if problem:
            raise SystemExit(refuse("sparsekv.bench.tp", f"--model {args.model} {problem}; use fewer --layers or a "
                                                          f"smaller --model (e.g. tiny:llama)"))
    except SystemExit:
        parallel.finish(wait=False)
        raise
    batch = args.batch or (1 if cuda else 2)
    new_tokens = args.new_tokens or (16 if cuda else 6)
    page_size = args.page_size or (4 if args.context < 1024 else 16)
    configs = method_configs(args.context, new_tokens, page_size)

    def both(folder: Path):
        reference = None
        if rank == 0:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
            ids, mask = prompts(model.config.vocab_size, batch, args.context, args.seed, device)
            reference = generate_all(model, configs, ids, mask, new_tokens)
            del model
        dist.barrier()
        return reference, load_sharded(folder, dtype)

    if Path(args.model).is_dir():
        reference, model = both(Path(args.model))
    else:
        with shared_folder(lambda folder: build_model(args.model, args.layers, dtype, args.context + new_tokens,
                                                      device, folder)) as folder:
            reference, model = both(folder)
    ids, mask = prompts(model.config.vocab_size, batch, args.context, args.seed, device)
    forced = [None if reference is None else reference[CONTROL]["tokens"]]
    dist.broadcast_object_list(forced, src=0)  # every layout scores the one-process control's tokens
    got = generate_all(model, configs, ids, mask, new_tokens, forced[0])
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, got)
    if rank != 0:
        dist.destroy_process_group()
        return 0
    exact = dtype == torch.float32
    errors, notes = check(reference, ranks, exact)
    for name, run in ranks[0].items():
        same = "=" if run["tokens"] == reference[name]["tokens"] else "DIFFERENT"
        first = run["tokens"][0]
        print(f"{name:>24}: tokens {same:>9} one process; forced NLL {run['nll'][0]:.4f} (one process "
              f"{reference[name]['nll'][0]:.4f}); {first[:6]}{' ...' if len(first) > 6 else ''}", flush=True)
    print("\n".join(notes), flush=True)
    what = "tokens, statistics" if exact else "forced NLL, and statistics where the tokens are equal"
    print("\n".join(errors) if errors else f"all {len(ranks[0])} runs agree with the one-process runs ({what})",
          flush=True)
    if args.out is not None:
        result = {"command": "torchrun --nproc-per-node N -m sparsekv.bench.tp " + " ".join(sys.argv[1:] if argv is None
                                                                                         else argv),
                  "processes": len(ranks), "device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                  "setting": setting, "one_process": reference, "tensor_parallel": ranks[0], "errors": errors,
                  "notes": notes}
        write_files(args.out, result, markdown(result), overwrite=args.overwrite)
    dist.destroy_process_group()
    return 1 if errors else 0

if __name__ == "__main__":
    raise SystemExit(main())
