"""One file per method: its config dataclass and its policy."""

from .base import Method, MethodConfig
from .dense import DenseConfig
from .h2o import H2OConfig
from .quest import QuestConfig
from .snapkv import SnapKVConfig
from .streaming import StreamingLLMConfig
from .tova import TOVAConfig

METHODS: dict[str, type[MethodConfig]] = {"dense": DenseConfig, "quest": QuestConfig}
METHODS.update(streamingllm=StreamingLLMConfig, h2o=H2OConfig, tova=TOVAConfig, snapkv=SnapKVConfig)

__all__ = ["METHODS", "Method", "MethodConfig", "DenseConfig", "QuestConfig", "StreamingLLMConfig", "H2OConfig",
           "TOVAConfig", "SnapKVConfig"]
