"""Paged KV storage and page metadata."""

from .paged import AppendPlan, PagedKVCache, PagedLayer, check_page_size

__all__ = ["AppendPlan", "PagedKVCache", "PagedLayer", "check_page_size"]
