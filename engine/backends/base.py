"""The backend contract: a backend reads a `Batch` snapshot and the pool tensors, nothing else."""

from __future__ import annotations

import abc
from collections.abc import Callable

import attrs
import numpy as np
import torch

from engine.state import PADDING_SLOT, Batch, Mode


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

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_cache[0].shape[1])


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
    # the most new tokens and keys of a request: the batch's, or for a graph's plan bounds
    # that hold for every pass it replays (its token count or tree width, the table's width)
    max_new_len: int
    max_seq_len: int
    extra: dict = attrs.field(factory=dict)  # backend-specific (split counts, buffers)


UPLOAD_ALIGN = 16  # bytes: each array's place in the packed buffer (any dtype's alignment)


def upload(device: torch.device | str, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """1-D host arrays as tensors of their dtypes on `device`, without the host waiting.

    On CUDA they are packed into one pinned buffer and copied in one non-blocking copy (a
    copy from pageable memory, `torch.tensor(array, device=...)`, waits for every pass
    queued before it: the host could not plan or launch ahead of the device). Torch's
    pinned-memory cache hands the buffer out again only once that copy has run. Elsewhere
    each is copied (a snapshot's arrays are read-only)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {name: torch.from_numpy(np.array(a)).to(device) for name, a in arrays.items()}
    places, end = {}, 0
    for name, a in arrays.items():
        places[name] = (end, a.nbytes)
        end += -(-a.nbytes // UPLOAD_ALIGN) * UPLOAD_ALIGN
    host = torch.empty(max(end, UPLOAD_ALIGN), dtype=torch.uint8, pin_memory=True)
    packed = host.numpy()
    for name, a in arrays.items():
        start, size = places[name]
        packed[start : start + size] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return {
        name: on_device[start : start + size].view(_torch_dtype(arrays[name].dtype))
        for name, (start, size) in places.items()
    }


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def host_metadata(
    batch: Batch,
    device: torch.device | str,
    extra: dict[str, np.ndarray] | None = None,
    num_tokens: int | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The host-derived part shared by all backends (indptrs, lengths, slots) on `device`,
    and the backend's own `extra` arrays, in one `upload`. `num_tokens` (at least the
    batch's new tokens): the pass's token count with padding tokens after the batch's, which
    belong to no request and write their K/V to PADDING_SLOT."""
    real = batch.new_lens.total
    num_tokens = real if num_tokens is None else num_tokens
    if num_tokens < real:
        raise ValueError(f"num_tokens={num_tokens}: the batch has {real} new tokens")
    out_slots = np.full(num_tokens, PADDING_SLOT, dtype=np.int64)
    out_slots[:real] = batch.out_slots
    arrays: dict[str, np.ndarray] = {
        "kv_indptr": batch.seq_lens.indptr().astype(np.int32),
        "prefix_lens": batch.prefix_lens.lens.astype(np.int32),
        "qo_indptr": batch.new_lens.indptr().astype(np.int32),
        "out_slots": out_slots,
    }
    if batch.trees is not None:
        bits = np.zeros(num_tokens, dtype=np.int64)  # a padding token sees no tree node
        bits[:real] = batch.trees.ancestor_bits
        arrays["tree_bits"] = bits
    extra = extra or {}
    if clash := arrays.keys() & extra.keys():
        raise ValueError(f"extra arrays {sorted(clash)} would replace the metadata's own")
    tensors = upload(device, arrays | extra)
    more = {name: tensors.pop(name) for name in extra}
    meta = dict(
        mode=batch.mode,
        tree_bits=tensors.pop("tree_bits", None),
        max_new_len=batch.new_lens.max,
        max_seq_len=batch.seq_lens.max,
        **tensors,
    )
    return meta, more


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
