"""One file per method: its config dataclass and its policy."""

from .base import Method, MethodConfig
from .dense import DenseConfig
from .quest import QuestConfig

METHODS: dict[str, type[MethodConfig]] = {"dense": DenseConfig, "quest": QuestConfig}

__all__ = ["METHODS", "Method", "MethodConfig", "DenseConfig", "QuestConfig"]
