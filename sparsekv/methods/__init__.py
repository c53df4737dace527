"""One file per method: its config dataclass and its policy."""

from .base import Method, MethodConfig
from .dense import DenseConfig
from .h2o import H2OConfig
from .landmark import LandmarkConfig
from .lowbit import LowBitConfig
from .omnikv import OmniKVConfig
from .oracle import OracleConfig
from .quest import QuestConfig
from .raas import RaaSConfig
from .snapkv import SnapKVConfig
from .sparq import SparQConfig
from .spread import SpreadConfig
from .streaming import StreamingLLMConfig
from .tova import TOVAConfig

METHODS: dict[str, type[MethodConfig]] = {"dense": DenseConfig, "quest": QuestConfig}
METHODS.update(streamingllm=StreamingLLMConfig, h2o=H2OConfig, tova=TOVAConfig, snapkv=SnapKVConfig)
METHODS.update(omnikv=OmniKVConfig, raas=RaaSConfig, oracle=OracleConfig, lowbit=LowBitConfig, spread=SpreadConfig)
METHODS.update(sparq=SparQConfig, landmark=LandmarkConfig)

__all__ = ["METHODS", "Method", "MethodConfig", "DenseConfig", "QuestConfig", "StreamingLLMConfig", "H2OConfig",
           "TOVAConfig", "SnapKVConfig", "OmniKVConfig", "RaaSConfig", "OracleConfig", "LowBitConfig",
           "SpreadConfig", "SparQConfig", "LandmarkConfig"]
