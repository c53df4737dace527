"""Tokens under transformers' tensor parallelism against one process, for every method.

    torchrun --nproc-per-node 2 -m sparsekv.bench.tp --model tiny:llama --context 48
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 -m sparsekv.bench.tp --model shape:llama3-8b --layers 4 --context 8192

One process per GPU (NCCL), or CPU processes on a machine without one (gloo). Every process loads the model with
``tp_plan="auto"`` (each holds 1/N of every layer's heads) and generates greedily with every method, each at a budget
below the context and at one covering it, through ``model.generate`` and through the decode engine (``engine:<name>``;
on CUDA its decode step is a CUDA graph with the collectives inside); the first process also runs the unsharded
model alone on its device. Each
run's tokens and decode statistics must equal the one-process run's, and a budget covering the context must give
the dense tokens of the same layout. ``transformers`` (the model's own attention, no sparsekv) is the control: where
it differs from one process, so does the arithmetic of the sharded model itself (in bf16 the row-parallel
projections' partial sums are rounded before their all-reduce), and the other rows can differ for that
reason alone. Exits 1 on a mismatch; ``--out`` gets the tokens as JSON.

``tiny:<arch>`` and ``shape:<name>`` models get random weights (seeded) and are saved to a temporary folder that
every process loads from.
"""

from __future__ import annotations

import argparse
import json
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
from .common import SHAPES, load_sharded, shape_model, shared_folder

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


def generate_all(model, configs: dict[str, MethodConfig], ids, mask, new_tokens: int) -> dict[str, dict]:
    """Per run, the model's own attention (``CONTROL``) and each config: greedy ``tokens`` (B, new_tokens) as lists,
    ``margins`` (B, new_tokens), the gap between the two highest logits at each step (how near a tie the choice
    was), and the decode statistics' ``summary`` (None for the control)."""
    out = {}
    for name, config in {CONTROL: None, **configs}.items():
        with torch.no_grad(), (nullcontext() if config is None else apply(model, config)) as session:
            result = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, return_dict_in_generate=True, output_logits=True)
        top2 = torch.stack(result.logits, dim=1).float().topk(2, dim=-1).values  # (B, new_tokens, 2)
        out[name] = {"tokens": result.sequences[:, ids.shape[1]:].tolist(),
                     "margins": (top2[..., 0] - top2[..., 1]).tolist(),
                     "stats": None if session is None else session.stats.summary()}
        if config is not None:
            # The decode engine (chunked prefill; on CUDA the decode step captured, collectives inside the graph).
            rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
            engine = Engine(model, config, max_batch=len(rows), max_context=ids.shape[1] + new_tokens,
                            prefill_chunk=max(16, ids.shape[1] // 2))
            result = engine.generate(rows, new_tokens, stop_tokens=())
            out[ENGINE + name] = {"tokens": result.tokens, "margins": None, "stats": result.stats}
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


def check(reference: dict[str, dict], ranks: list[dict[str, dict]]) -> list[str]:
    """Mismatches of the tensor-parallel runs (one dict per process) against one process (tokens and decode
    statistics), and of the budgets covering the context against dense in the same layout."""
    errors = [f"process {r}: {name} generated other tokens than on process 0" for r, runs in enumerate(ranks)
              for name, run in runs.items() if run["tokens"] != ranks[0][name]["tokens"]]
    got = ranks[0]
    for name, run in got.items():
        if run["tokens"] != reference[name]["tokens"]:
            errors.append(f"{name}: tokens {run['tokens']} under tensor parallelism, {reference[name]['tokens']} in "
                          f"one process ({near_tie(reference[name], run)})")
        if run["stats"] != reference[name]["stats"]:
            errors.append(f"{name}: statistics {run['stats']} under tensor parallelism, {reference[name]['stats']} "
                          "in one process")
        dense = ENGINE + "dense" if name.startswith(ENGINE) else "dense"
        for layout, runs in (("one process", reference), ("tensor parallelism", got)):
            if name.endswith("-full") and runs[name]["tokens"] != runs[dense]["tokens"]:
                errors.append(f"{name}: {runs[name]['tokens']} differs from {dense} {runs[dense]['tokens']} in "
                              f"{layout} ({near_tie(runs[dense], runs[name])})")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m sparsekv.bench.tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:llama", help="tiny:<arch>, shape:<name> or a model directory")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (tiny:/shape: models)")
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--batch", type=int, default=None, help="default: 2 on CPU (row 1 left-padded), 1 on CUDA")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 6 on CPU, 16 on CUDA")
    parser.add_argument("--page-size", type=int, default=None, help="default: 4 below 1024 tokens of context, "
                                                                    "else 16")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the tokens as JSON here (process 0)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("start it with torchrun --nproc-per-node N (N >= 2)")
    check_spec(args.model)

    # transformers shards the model over the machine's accelerator whenever there is one. It would start the process
    # group itself; it is started first here to share the model folder.
    device = parallel.start()
    cuda, rank = device.type == "cuda", dist.get_rank()
    dtype = resolve_dtype(args.dtype or ("bfloat16" if cuda else "float32"))
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
    got = generate_all(model, configs, ids, mask, new_tokens)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, got)
    if rank != 0:
        dist.destroy_process_group()
        return 0
    errors = check(reference, ranks)
    for name, run in ranks[0].items():
        same = "=" if run["tokens"] == reference[name]["tokens"] else "DIFFERENT"
        first = run["tokens"][0]
        print(f"{name:>18}: tokens {same} one process; {first[:8]}{' ...' if len(first) > 8 else ''}", flush=True)
    print("\n".join(errors) if errors else f"all {len(ranks[0])} runs equal the one-process runs (tokens, statistics)",
          flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"one_process": reference, "tensor_parallel": ranks[0], "errors": errors},
                                       indent=1))
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
