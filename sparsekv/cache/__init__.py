"""Paged KV storage and page metadata."""

from .paged import (KV_DTYPE_HELP, KV_DTYPES, AppendPlan, PagedKVCache, PagedLayer, SharedPages, check_kv_dtype,
                    check_page_size, device_tensor, free_slots, storage_dtype)

__all__ = ["KV_DTYPE_HELP", "KV_DTYPES", "AppendPlan", "PagedKVCache", "PagedLayer", "SharedPages", "check_kv_dtype",
           "check_page_size", "device_tensor", "free_slots", "storage_dtype"]
