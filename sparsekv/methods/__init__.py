"""One file per method: its config dataclass and its policy."""

from .base import Method, MethodConfig
from .dense import DenseConfig
from .h2o import H2OConfig
from .landmark import LandmarkConfig
from .lowbit import LowBitConfig
from .lowrank import LowRankConfig
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
METHODS.update(sparq=SparQConfig, landmark=LandmarkConfig, lowrank=LowRankConfig)


def selection_bytes(config: MethodConfig, layers: int, kv_heads: int, head_dim: int, itemsize: int, context: int,
                    batch: int = 1) -> int:
    """Bytes of page metadata a decode step reads to choose pages, for ``batch`` rows of ``context`` tokens of a
    model of ``layers`` layers and ``kv_heads`` KV heads of ``head_dim``, in a cache of ``itemsize`` bytes a
    value: per scored page and KV head, Quest's bounds and what its variants read besides or instead
    (``metadata_bytes`` of the config: the codes of ``lowbit``, every key for ``oracle``), RaaS's bounds in every
    layer; 0 for methods that choose no pages."""
    if isinstance(config, QuestConfig):
        scored, per_page = layers - config.dense_layers, config.metadata_bytes(head_dim, itemsize)
    elif isinstance(config, RaaSConfig):
        scored, per_page = layers, 2 * head_dim * itemsize
    else:
        return 0
    return scored * batch * kv_heads * -(-context // config.page_size) * per_page


__all__ = ["METHODS", "selection_bytes", "Method", "MethodConfig", "DenseConfig", "QuestConfig",
           "StreamingLLMConfig", "H2OConfig", "TOVAConfig", "SnapKVConfig", "OmniKVConfig", "RaaSConfig",
           "OracleConfig", "LowBitConfig", "SpreadConfig", "SparQConfig", "LandmarkConfig", "LowRankConfig"]
