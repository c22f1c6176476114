"""Attention over a paged KV cache: metadata for ragged batches and backends chosen by name."""

from kvserve.attention.backends import (
    AttentionBackend,
    available_backends,
    get_attention_backend,
    register_backend,
)
from kvserve.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_backends",
    "build_attention_metadata",
    "get_attention_backend",
    "register_backend",
]
