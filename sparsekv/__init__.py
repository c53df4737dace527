"""sparsekv: query-aware KV-cache sparsity for long-context decoding."""

from . import compat  # noqa: F401  (first: checks the transformers release before anything imports it)
from .errors import ConfigError
from .integrations import DecodeStats, Session, SparseKVCache, apply
from .methods import (METHODS, DenseConfig, H2OConfig, LowBitConfig, MethodConfig, OmniKVConfig, OracleConfig,
                      QuestConfig, RaaSConfig, SnapKVConfig, SpreadConfig, StreamingLLMConfig, TOVAConfig)
from .quant import QuantLinear, quantize_model
from .spec import build_config

__version__ = "0.1.0"

__all__ = ["apply", "build_config", "ConfigError", "DecodeStats", "Session", "SparseKVCache", "METHODS",
           "MethodConfig", "DenseConfig", "QuestConfig", "StreamingLLMConfig", "H2OConfig", "TOVAConfig",
           "SnapKVConfig", "OmniKVConfig", "RaaSConfig", "OracleConfig", "LowBitConfig", "SpreadConfig", "QuantLinear",
           "quantize_model", "__version__"]
