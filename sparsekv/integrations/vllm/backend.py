"""sparsekv's vLLM attention backend: vLLM's FlashAttention backend whose decode tokens attend through a sparsekv
method (``pages``), selected with ``--attention-backend CUSTOM`` once ``register`` has run.

A step of one attention layer:
- ``do_kv_cache_update``: vLLM writes the keys and values into its blocks, then each block written gets its keys'
  bounds (``kernels.page_bounds``) and, for lowbit, their codes (``kernels.page_codes``), for landmark their means
  (``kernels.page_means``), for spread their mean and deviation (``kernels.page_stats``), in prefill and decode
  alike;
- ``forward``: the batch holds its decode requests first (one token each); their tokens attend through the method
  over the blocks of their block table (``pages.decode``), the rest (prompt chunks) through vLLM's FlashAttention.

Pure decode batches run in vLLM's full CUDA graphs (``UNIFORM_SINGLE_TOKEN_DECODE``): the builder fills the rows'
tables into buffers allocated once. Mixed batches run their attention eagerly between the captured pieces.

vLLM plans its KV memory from each layer's page size, which its ``Attention`` layer states without asking the
backend; ``_count_bounds`` makes the layers of this backend state pages of ``pages.tail_bytes`` more (vLLM's
``page_size_padded``), where the bounds (and codes or means) live.
"""

from __future__ import annotations

import dataclasses

from . import method_config, require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.config import get_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType  # noqa: E402
from vllm.v1.attention.backends.flash_attn import (  # noqa: E402
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from .pages import (BlockStore, DecodeRows, code_bits, decode, leading_decodes, page_summary,  # noqa: E402
                    tail_bytes)


@dataclasses.dataclass
class SparseKVMetadata(FlashAttentionMetadata):
    """FlashAttention's metadata of the batch plus: ``decodes``, its leading decode requests (a token each, none
    for a CUDA graph's padding requests: their rows of the padded batch are decoded and dropped), with
    ``decode_tokens`` tokens; ``rows``, their page tables (``DecodeRows``, filled); ``prefill``, FlashAttention's
    metadata of the requests after them (None when there are none)."""

    decodes: int = 0
    decode_tokens: int = 0
    rows: DecodeRows | None = None
    prefill: FlashAttentionMetadata | None = None


class SparseKVMetadataBuilder(FlashAttentionMetadataBuilder):

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # A captured step fixes how many rows are decodes: only batches of decode tokens alone are captured whole.
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decode requests first (the V1 model runner asks its builders)
        rows = max(vllm_config.scheduler_config.max_num_seqs, self.max_cudagraph_size or 0)
        self.rows = DecodeRows(rows, kv_cache_spec.block_size, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> SparseKVMetadata:
        cam = common_attn_metadata
        decodes, decode_tokens = leading_decodes(cam)
        prefill_tokens = int(cam.query_start_loc_cpu[cam.num_reqs]) - decode_tokens
        if decodes:
            self.rows.fill(cam.block_table_tensor, cam.seq_lens, decodes)
        prefill = None
        if prefill_tokens:
            meta = super().build(common_prefix_len, cam, fast_build)
            prefill = dataclasses.replace(
                meta, num_actual_tokens=prefill_tokens,
                query_start_loc=cam.query_start_loc[decodes:] - decode_tokens, seq_lens=cam.seq_lens[decodes:],
                block_table=cam.block_table_tensor[decodes:], slot_mapping=cam.slot_mapping[decode_tokens:],
                use_cascade=False, scheduler_metadata=None)
        else:  # FlashAttention attends nothing this step: its planning (a kernel, host work) is skipped
            meta = FlashAttentionMetadata(
                num_actual_tokens=cam.num_actual_tokens, max_query_len=cam.max_query_len,
                query_start_loc=cam.query_start_loc, max_seq_len=cam.max_seq_len, seq_lens=cam.seq_lens,
                block_table=cam.block_table_tensor, slot_mapping=cam.slot_mapping, use_cascade=False,
                common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(FlashAttentionMetadata)}
        return SparseKVMetadata(**fields, decodes=decodes, decode_tokens=decode_tokens,
                                rows=self.rows if decodes else None, prefill=prefill)


class SparseKVImpl(FlashAttentionImpl):
    """FlashAttention for prompt tokens; the method of ``--additional-config '{"sparsekv": SPEC}'`` for decode
    tokens. A bad spec fails here, as vLLM builds the model, with sparsekv's ConfigError."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        self.config = method_config(vllm_config.additional_config, vllm_config.cache_config.block_size, layers)
        self.method = self.config.method_class()(self.config, layers)
        self.layer_idx: int | None = None
        self.store: BlockStore | None = None

    def blocks(self, kv_cache: torch.Tensor) -> BlockStore:
        """This layer's cache as our store of pages (the views made once: vLLM binds a layer's cache once)."""
        if self.store is None or self.store.kv_cache.data_ptr() != kv_cache.data_ptr():
            self.store = BlockStore(kv_cache, code_bits(self.config), page_summary(self.config))
        return self.store

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.blocks(kv_cache).write(slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # vLLM's profiling pass, before there is a cache
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        n = attn_metadata.decodes
        if n:
            if self.layer_idx is None:
                self.layer_idx = extract_layer_index(layer.layer_name)
            output[:n] = decode(self.method, self.layer_idx, query[:n], self.blocks(kv_cache), attn_metadata.rows,
                                self.scale)
        if attn_metadata.prefill is not None:
            t = attn_metadata.decode_tokens
            super().forward(layer, query[t:], key[t:], value[t:], kv_cache, attn_metadata.prefill, output[t:],
                            output_scale, output_block_scale)
        return output


class SparseKVBackend(FlashAttentionBackend):
    """FlashAttention's cache layout and prompt path; bf16/fp16 caches, decoder self-attention without sliding
    windows or sinks."""

    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SparseKVImpl]:
        return SparseKVImpl

    @staticmethod
    def get_builder_cls() -> type[SparseKVMetadataBuilder]:
        return SparseKVMetadataBuilder

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False


def _count_bounds() -> None:
    """Makes the KV-cache spec of every attention layer of this backend state pages that hold its blocks' bounds
    (and codes or means)."""
    stated = Attention.get_kv_cache_spec
    if getattr(stated, "_sparsekv", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = stated(self, vllm_config)
        if spec is None or not isinstance(self.impl, SparseKVImpl):
            return spec
        return dataclasses.replace(spec, page_size_padded=spec.real_page_size_bytes + tail_bytes(
            self.impl.config, spec.num_kv_heads, spec.block_size, spec.head_size, spec.dtype))

    get_kv_cache_spec._sparsekv = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


_count_bounds()
