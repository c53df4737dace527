"""sparsekv: query-aware KV-cache sparsity for long-context decoding."""

from .integrations import DecodeStats, Session, SparseKVCache, apply
from .methods import (METHODS, DenseConfig, H2OConfig, MethodConfig, OmniKVConfig, QuestConfig, RaaSConfig,
                      SnapKVConfig, StreamingLLMConfig, TOVAConfig)

__version__ = "0.1.0"

__all__ = ["apply", "DecodeStats", "Session", "SparseKVCache", "METHODS", "MethodConfig", "DenseConfig",
           "QuestConfig", "StreamingLLMConfig", "H2OConfig", "TOVAConfig", "SnapKVConfig", "OmniKVConfig", "RaaSConfig",
           "__version__"]
