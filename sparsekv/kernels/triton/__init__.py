"""Fused Triton kernels of the decode path, with the signatures of the ops in ``reference``, one module per family:
``selection`` (page scores and top-k: Quest's, spread's), ``coded`` (low-bit key codes: a page's, vLLM's blocks',
and the page scores from them), ``summary`` (what a page keeps of its keys: landmark's mean keys of its runs,
spread's mean and deviation; a row's current page's, vLLM's blocks'), ``landmark`` (the page scores from landmarks
and a step's choice), ``attention`` (split-K decoding and its merge; a prompt pass's two parts merged by their
log-sum-exp), ``scoring`` (OmniKV's window token scores), ``raas`` (RaaS's stamps and eviction), ``mass`` (the
attention a prompt's tokens receive, H2O's prompt scores; a decode step's attention with its weights), ``append``
(the cache's writes: a decode token, a prompt pass, vLLM's blocks' key bounds), ``linear`` (the weights' products of
one row), ``quant`` (those of group-quantized weights for a few rows), ``common`` (``TUNING`` and shared checks).

``sparsekv.kernels`` imports this package (and so triton) the first time an op sees a CUDA tensor, so CPU-only use
never imports triton. Tensors are fp16, bf16 or fp32 (fp64 runs the reference, which is exact); q must have the
cache's dtype. Every op takes fixed shapes and never reads a device value on the host, so a whole decode step can
be captured in a CUDA graph.
"""

from .append import append_pages, append_token, page_bounds
from .attention import merge_lse, sparse_decode, sparse_decode_tokens
from .coded import code_page, coded_scores, lowbit_select, page_codes
from .common import TUNING
from .landmark import landmark_page_scores, landmark_select
from .linear import linear
from .mass import attend_with_weights, attention_mass
from .quant import linear_quantized
from .raas import raas_update
from .scoring import window_token_maxima
from .selection import page_scores, quest_select, raas_select, select_pages, spread_page_scores, spread_select
from .summary import landmark_means, page_means, page_stats, spread_stats

# name -> Triton op, for the CUDA implementations of the ``sparsekv::`` ops.
OPS = {"page_scores": page_scores, "select_pages": select_pages, "quest_select": quest_select,
       "raas_select": raas_select, "sparse_decode": sparse_decode, "sparse_decode_tokens": sparse_decode_tokens,
       "window_token_maxima": window_token_maxima, "append_token": append_token, "append_pages": append_pages,
       "raas_update": raas_update, "linear": linear, "linear_quantized": linear_quantized, "coded_scores": coded_scores,
       "lowbit_select": lowbit_select, "code_page": code_page, "attend_with_weights": attend_with_weights,
       "attention_mass": attention_mass, "page_bounds": page_bounds, "page_codes": page_codes,
       "landmark_means": landmark_means, "landmark_page_scores": landmark_page_scores,
       "landmark_select": landmark_select, "page_means": page_means, "merge_lse": merge_lse,
       "spread_stats": spread_stats, "spread_page_scores": spread_page_scores, "spread_select": spread_select,
       "page_stats": page_stats}

__all__ = ["OPS", "TUNING", "append_pages", "append_token", "attend_with_weights", "attention_mass", "code_page",
           "coded_scores", "landmark_means", "landmark_page_scores", "landmark_select", "linear", "linear_quantized",
           "lowbit_select", "merge_lse", "page_bounds", "page_codes", "page_means", "page_scores", "page_stats",
           "quest_select", "raas_select", "raas_update", "select_pages", "sparse_decode", "sparse_decode_tokens",
           "spread_page_scores", "spread_select", "spread_stats", "window_token_maxima"]
