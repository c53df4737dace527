"""Paged KV storage and page metadata."""

from .paged import KV_DTYPES, AppendPlan, PagedKVCache, PagedLayer, check_kv_dtype, check_page_size

__all__ = ["KV_DTYPES", "AppendPlan", "PagedKVCache", "PagedLayer", "check_kv_dtype", "check_page_size"]
