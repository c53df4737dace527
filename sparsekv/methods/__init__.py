"""One file per method: its config dataclass and its policy."""

from .base import Method, MethodConfig
from .dense import DenseConfig
from .omnikv import OmniKVConfig
from .quest import QuestConfig
from .raas import RaaSConfig

METHODS: dict[str, type[MethodConfig]] = {"dense": DenseConfig, "quest": QuestConfig, "omnikv": OmniKVConfig,
                                          "raas": RaaSConfig}

__all__ = ["METHODS", "Method", "MethodConfig", "DenseConfig", "QuestConfig", "OmniKVConfig", "RaaSConfig"]
