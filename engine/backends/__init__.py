"""Attention backends: plan(batch) -> ForwardMetadata; forward(layer, q, k, v, metadata)."""

from engine.backends.base import (
    AttentionBackend,
    BufferTooSmall,
    ForwardMetadata,
    KVPool,
    register,
    registered,
)

__all__ = [
    "AttentionBackend",
    "BufferTooSmall",
    "ForwardMetadata",
    "KVPool",
    "get_backend",
    "register",
]


def get_backend(name: str, pool: KVPool) -> AttentionBackend:
    """The backend `name` ('torch' or 'triton') over `pool`; its module is imported on first
    use (a CPU run never loads Triton) and registers itself."""
    if name == "triton" and name not in registered():
        import engine.backends.triton_backend  # noqa: F401
    if name == "torch" and name not in registered():
        import engine.backends.torch_backend  # noqa: F401
    if name not in registered():
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(registered())}")
    return registered()[name](pool)
