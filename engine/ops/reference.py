"""The reference op set: a layer's elementwise work and matrix products in plain torch. It
is what a CPU without the CPU kernels runs, and the oracle for the Triton and CPU sets."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from engine.ops.blockq import linear


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D] (rotate-half layout, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 normalisation rounded to x's dtype, then scaled (HF's order of rounding)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@attrs.frozen(eq=False)
class QkvExtras:
    """What a family does to the q/k/v projection before RoPE: a bias on q, k and v
    (Qwen2, [q + 2 kv]) and an RMSNorm over each q and k head (Qwen3, [head_dim] each).
    The op sets take it with the rotation; Triton applies it inside the RoPE launch."""

    bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6

    def __attrs_post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("QkvExtras takes both q_norm and k_norm or neither")


def apply_qkv_extras(
    qkv: torch.Tensor,
    extras: QkvExtras | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm,
) -> torch.Tensor:
    """qkv [T, q + 2 kv] biased and its q and k heads normed (with `norm`, an op set's
    rms_norm) as `extras` says, in separate ops: a new tensor, or qkv itself without extras."""
    if extras is None:
        return qkv
    if extras.bias is not None:
        qkv = qkv + extras.bias
    if extras.q_norm is None or extras.k_norm is None:
        return qkv
    num_tokens, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = norm(q.reshape(-1, head_dim), extras.q_norm, extras.eps)
    k = norm(k.reshape(-1, head_dim), extras.k_norm, extras.eps)
    return torch.cat((q.view(num_tokens, -1), k.view(num_tokens, -1), v), dim=-1)


class TorchOps:
    """A layer's elementwise work and matrix products in plain torch: what a CPU without the
    CPU kernels runs, and the oracle for `engine.ops.triton` and `engine.ops.cpu`, which have the
    same functions except that their RoPE is `rope_qkv_store` (the model calls that where
    `stores_kv` is true)."""

    rms_norm = staticmethod(rms_norm)
    linear = staticmethod(linear)  # F.linear, or the block kernel for a BlockWeight (CPU)
    stores_kv = False  # rope_qkv leaves the K/V cache write to the backend

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return rms_norm(residual, weight, eps), residual

    @staticmethod
    def rope_qkv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        extras: QkvExtras | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """q and k rotated, v as is, from qkv [T, q + 2 kv] with `extras` applied first."""
        qkv = apply_qkv_extras(qkv, extras, num_heads, num_kv_heads, head_dim)
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up


def split_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, Hq, D], k and v [T, Hkv, D] of a fused projection's output [T, width]."""
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    num_tokens = qkv.shape[0]
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
