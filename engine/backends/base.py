"""The backend contract: a backend reads a `Batch` snapshot and the pool tensors, nothing else."""

from __future__ import annotations

import abc
from collections.abc import Callable

import attrs
import torch

from engine.state import Batch, Mode


class BufferTooSmall(ValueError):
    """An index or output buffer cannot hold what the snapshot needs; nothing was written."""


@attrs.frozen(eq=False)
class KVPool:
    """Per-layer K and V caches of shape [num_slots, num_kv_heads, head_dim] (slot 0 is the
    padding slot) and the request table req_to_token [rows, max_context] (int32)."""

    k_cache: tuple[torch.Tensor, ...]
    v_cache: tuple[torch.Tensor, ...]
    req_to_token: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        req_to_token: torch.Tensor,
    ) -> KVPool:
        device = req_to_token.device
        shape = (num_slots, num_kv_heads, head_dim)
        k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers))
        v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers))
        return cls(k, v, req_to_token)

    @property
    def num_slots(self) -> int:
        return int(self.k_cache[0].shape[0])


@attrs.frozen(eq=False)
class ForwardMetadata:
    """Everything a backend's forward needs, derived from one snapshot by `plan`.

    kv_indices of request i are its committed slots (its table row up to its prefix length)
    followed by the slots of its new tokens; kv_indptr is their cumulative count, so
    kv_indices has exactly batch.seq_lens.total entries.
    """

    mode: Mode
    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [seq_lens.total] int32
    prefix_lens: torch.Tensor  # [B] int32 (seq_lens are kv_indptr's differences)
    out_slots: torch.Tensor  # [new_lens.total] int64
    tree_bits: torch.Tensor | None  # [new_lens.total] int64 ancestor-or-self bits (verify)
    max_new_len: int
    max_seq_len: int
    extra: dict = attrs.field(factory=dict)  # backend-specific (split counts, buffers)


def host_metadata(batch: Batch, device: torch.device) -> dict:
    """The host-derived part shared by all backends: indptrs and lengths, on `device`."""
    kv_indptr = batch.seq_lens.indptr_to(device)
    prefix_lens = batch.prefix_lens.lens_to(device)
    qo_indptr = batch.new_lens.indptr_to(device)
    out_slots = torch.from_numpy(batch.out_slots.copy()).to(device)
    tree_bits = None
    if batch.trees is not None:
        tree_bits = torch.from_numpy(batch.trees.ancestor_bits.copy()).to(device)
    return dict(
        mode=batch.mode,
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        prefix_lens=prefix_lens,
        out_slots=out_slots,
        tree_bits=tree_bits,
        max_new_len=batch.new_lens.max,
        max_seq_len=batch.seq_lens.max,
    )


class AttentionBackend(abc.ABC):
    """plan(batch) once per forward pass; forward(layer, ...) once per layer."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abc.abstractmethod
    def plan(self, batch: Batch) -> ForwardMetadata: ...

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: ForwardMetadata,
        scale: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the T new tokens. Writes k/v into the pool at
        metadata.out_slots (unless the caller already did: `kv_stored`, as the fused RoPE
        kernel does) and returns attention output [T, Hq, D]."""

    def cpu_kernel_attention(self, layer: int, metadata: ForwardMetadata) -> tuple | None:
        """For a caller that runs a whole layer in one CPU kernel (`engine.ops.cpu.decoder_layer`):
        this pass's attention as the CPU attention kernel's inputs (this layer's caches and
        the plan's indices), or None when the pass's attention is not that kernel's."""
        return None


_REGISTRY: dict[str, Callable[[KVPool], AttentionBackend]] = {}


def register(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered() -> dict[str, Callable[[KVPool], AttentionBackend]]:
    """The backends registered so far, by name (a copy)."""
    return dict(_REGISTRY)
