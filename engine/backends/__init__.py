"""Attention backends: plan(batch) -> ForwardMetadata; forward(layer, q, k, v, metadata)."""

from engine.backends.base import (
    AttentionBackend,
    BufferTooSmall,
    ForwardMetadata,
    KVPool,
    get_backend,
    register,
)

__all__ = ["AttentionBackend", "BufferTooSmall", "ForwardMetadata", "KVPool", "get_backend",
           "register"]
