"""sparsekv: query-aware KV-cache sparsity for long-context decoding."""

from .integrations import DecodeStats, Session, SparseKVCache, apply
from .methods import METHODS, DenseConfig, MethodConfig, OmniKVConfig, QuestConfig, RaaSConfig

__version__ = "0.1.0"

__all__ = ["apply", "DecodeStats", "Session", "SparseKVCache", "METHODS", "MethodConfig", "DenseConfig",
           "QuestConfig", "OmniKVConfig", "RaaSConfig", "__version__"]
