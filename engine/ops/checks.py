"""Argument checks shared by the fused op sets (Triton on CUDA, `engine.ops.cpu` on the CPU): each
names what was wrong and what is allowed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.ops.reference import QkvExtras


def check_rows(name: str, tensor: torch.Tensor, width: int) -> None:
    if tensor.dim() != 2 or tensor.shape[1] != width or tensor.stride(1) != 1:
        raise ValueError(
            f"{name} must be [tokens, {width}] with unit stride along the row; "
            f"got shape {tuple(tensor.shape)}, strides {tensor.stride()}"
        )


def check_norm(x: torch.Tensor, residual: torch.Tensor | None, hidden: int) -> None:
    check_rows("x", x, hidden)
    if residual is not None:
        check_rows("residual", residual, hidden)
        if residual.shape[0] != x.shape[0] or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match "
                f"x {tuple(x.shape)} {x.dtype}"
            )


def check_gate_up(gate_up: torch.Tensor) -> int:
    """The intermediate size of gate_up [T, 2 * inter] (gate first)."""
    inter = gate_up.shape[-1] // 2
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have an even width (gate then up); got {gate_up.shape}")
    check_rows("gate_up", gate_up, 2 * inter)
    return inter


def check_rope_tables(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape[0] != qkv.shape[0] or table.shape[1] < half or table.stride(1) != 1:
            raise ValueError(
                f"{name} must be [{qkv.shape[0]}, >= {half}] with unit stride "
                f"along the row; got {tuple(table.shape)}, {table.stride()}"
            )


def check_rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    check_rows("qkv", qkv, (num_heads + 2 * num_kv_heads) * head_dim)
    if head_dim % 2:
        raise ValueError(f"the head size must be even for RoPE; got {head_dim}")
    check_rope_tables(qkv, cos, sin, head_dim // 2)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            cache.dim() != 3
            or tuple(cache.shape[1:]) != (num_kv_heads, head_dim)
            or cache.stride(2) != 1
            or cache.stride(1) != head_dim
        ):
            raise ValueError(
                f"{name} must be [slots, {num_kv_heads}, {head_dim}] with the "
                f"heads contiguous; got {tuple(cache.shape)}, {cache.stride()}"
            )
    if slots.dim() != 1 or slots.shape[0] != qkv.shape[0] or slots.dtype != torch.int64:
        raise ValueError(
            f"slots must be int64 [{qkv.shape[0]}] (one per token); got "
            f"{slots.dtype} {tuple(slots.shape)}"
        )


def check_qkv_extras(extras: QkvExtras | None, qkv: torch.Tensor, head_dim: int) -> None:
    """A bias of qkv's width and head-norm weights of one head each, contiguous, on qkv's
    device: the kernels read exactly that many values."""
    if extras is None:
        return
    for name, vector, size in (
        ("bias", extras.bias, qkv.shape[1]),
        ("q_norm", extras.q_norm, head_dim),
        ("k_norm", extras.k_norm, head_dim),
    ):
        if vector is None:
            continue
        if vector.dim() != 1 or vector.shape[0] != size or vector.stride(0) != 1:
            raise ValueError(
                f"extras.{name} must be contiguous [{size}]; got {tuple(vector.shape)}, "
                f"strides {vector.stride()}"
            )
        if vector.device != qkv.device:
            raise ValueError(f"extras.{name} is on {vector.device}; qkv is on {qkv.device}")
