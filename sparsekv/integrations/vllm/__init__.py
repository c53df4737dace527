"""sparsekv inside vLLM: a method's page choice for the decode tokens of vLLM's attention layers.

    pip install -e ".[vllm]"
    vllm serve MODEL --attention-backend CUSTOM --additional-config '{"sparsekv": "quest:token_budget=2048"}'

The ``vllm.general_plugins`` entry point (``register``) makes ``backend.SparseKVBackend`` vLLM's CUSTOM attention
backend in every vLLM process. Prompt tokens go through vLLM's own FlashAttention; decode tokens through the
method, over vLLM's blocks (a block is a page, chosen per KV head), with our kernels. Each block keeps its keys'
channel-wise min and max (and lowbit's codes) at the end of its page, in memory vLLM's KV planning counts
(``pages.tail_bytes``).
``docs/vllm.md`` says what maps onto vLLM and what does not, and why.

This module imports without vLLM; ``register`` and the ``backend`` module say what is missing.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...methods.base import MethodConfig
from ...methods.lowbit import LowBitConfig
from ...methods.oracle import OracleConfig
from ...spec import build_config

# The releases whose backend, metadata and KV-cache interfaces the backend is written against: 0.26 is the one
# built for torch 2.11 (the GPU image's), and vLLM changes these interfaces between minor releases.
VLLM_VERSIONS = ">=0.26,<0.27"
CONFIG_KEY = "sparsekv"  # the key of vLLM's --additional-config that holds the method spec
# Methods whose decode step reads the pages through the table and keeps nothing per request beyond them.
METHODS = ("quest", "lowbit", "spread", "sparq", "landmark", "oracle")
BACKEND = "sparsekv.integrations.vllm.backend.SparseKVBackend"


def require_vllm():
    """The vllm module, or an ImportError that says what to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"sparsekv's vLLM backend needs vLLM {VLLM_VERSIONS}, the vllm extra: pip install -e "
                          f"'.[vllm]' from a checkout ({err})") from None
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    if major_minor != (0, 26):
        raise ImportError(f"sparsekv's vLLM backend supports vLLM {VLLM_VERSIONS}, found {vllm.__version__}")
    return vllm


def register() -> None:
    """The ``vllm.general_plugins`` entry point: makes sparsekv's backend vLLM's CUSTOM attention backend (chosen by
    ``--attention-backend CUSTOM``). Cheap and importing nothing of the backend, as vLLM calls it in every
    process of every run, sparsekv's or not."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)


def method_config(additional_config, block_size: int, num_layers: int) -> MethodConfig:
    """The method of vLLM's ``additional_config[CONFIG_KEY]``, a spec as the CLI's ``--method`` takes (e.g.
    ``"quest:token_budget=2048"``), checked against vLLM's ``block_size`` (a block is a page) and the model's
    ``num_layers``. A ConfigError names the field and what it allows."""
    spec = (additional_config or {}).get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if not isinstance(spec, str):
        raise ConfigError(f"additional_config[{CONFIG_KEY!r}]", f"a method spec, one of {', '.join(METHODS)} "
                          "(e.g. \"quest:token_budget=2048\")", spec)
    name = spec.strip().partition(":")[0]
    if name not in METHODS:
        raise ConfigError("method", f"one of {', '.join(METHODS)} inside vLLM (the others evict, offload or keep "
                          "state per request: docs/vllm.md)", name, where=spec)
    config = build_config(spec)
    if config.page_size != block_size:
        raise ConfigError("page_size", f"vLLM's block size ({block_size}): a block is a page", config.page_size,
                          where=spec)
    if isinstance(config, OracleConfig) and config.granularity != "page":
        raise ConfigError("granularity", "\"page\" inside vLLM", config.granularity, where=spec)
    if isinstance(config, LowBitConfig) and config.reuse != 1:
        raise ConfigError("reuse", "1 inside vLLM (a choice kept across steps would be state per request)",
                          config.reuse, where=spec)
    config.check_model(num_layers)
    return config
