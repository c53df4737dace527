"""Model integrations."""

from .transformers import SUPPORTED_MODELS, DecodeStats, Session, SparseKVCache, apply

__all__ = ["SUPPORTED_MODELS", "DecodeStats", "Session", "SparseKVCache", "apply"]
