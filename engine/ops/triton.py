"""Triton kernels for a Llama layer's elementwise work, one launch each: RMSNorm (alone or fused
with the residual add), RoPE on q and k in place with k and v stored into the KV cache in
the same launch (with a family's q/k/v bias and q/k head norms before it), and
SiLU(gate) * up; `linear` adds the matrix-vector kernel, `norm_linear` and
`silu_mul_linear` run a norm or SiLU*mul inside it where it takes the product,
`linear_silu_mul` the SiLU*mul after the gate_up product inside the all-rows kernel, and
`norm_linear_silu_mul` the norm before it too. Math is fp32;
results are rounded to the input dtype where the torch reference rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.ops.checks import check_gate_up, check_norm, check_qkv_extras, check_rope_store
from engine.ops.gemv import (  # noqa: F401  (the ops set's matrix products)
    linear,
    linear_silu_mul,
    norm_linear,
    norm_linear_silu_mul,
    silu_mul_linear,
)
from engine.ops.reference import QkvExtras, split_heads
from engine.pdl import enter

SILU_BLOCK = 1024
ROPE_HEADS_PER_PROGRAM = 8
stores_kv = True  # the model calls rope_qkv_store: the K/V cache write rides the rotation


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    residual_out,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    values = tl.load(x + token * stride_x + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        added = values.to(tl.float32) + tl.load(
            residual + token * stride_r + cols, mask=in_row, other=0.0
        ).to(tl.float32)
        values = added.to(values.dtype)  # the new residual, rounded as torch's add rounds it
        tl.store(residual_out + token * stride_ro + cols, values, mask=in_row)
    values32 = values.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(values32 * values32, axis=0) / hidden + eps)
    normed = (values32 * inv_rms).to(values.dtype).to(tl.float32)
    scale = tl.load(weight + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out + token * stride_o + cols, (normed * scale).to(out.dtype.element_ty), mask=in_row)


@triton.jit
def _rope_store_kernel(
    qkv,
    cos,
    sin,
    slots,
    k_cache,
    v_cache,
    bias,
    q_norm,
    k_norm,
    stride_t,
    stride_cos,
    stride_sin,
    stride_k,
    stride_v,
    num_heads,
    num_kv_heads,
    half,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token's q, k, v heads (program axis 1 walks them in blocks): with HAS_BIAS the
    bias added to every head, with HAS_NORM each q and k head RMS-normed (rounded as the
    reference's separate ops round), then q and k rotated in place, and the rotated k and
    the v heads written to the caches at the token's slot."""
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    in_half = dims < half
    num_rotated = num_heads + num_kv_heads
    rotated = heads < num_rotated
    is_k = rotated & (heads >= num_heads)
    is_v = (heads >= num_rotated) & (heads < num_rotated + num_kv_heads)
    mask = (rotated | is_v)[:, None] & in_half[None, :]
    offsets = heads[:, None] * (2 * half) + dims[None, :]
    first_ptrs = qkv + token * stride_t + offsets
    first = tl.load(first_ptrs, mask=mask, other=0.0)
    second = tl.load(first_ptrs + half, mask=mask, other=0.0)
    dtype = first.dtype
    if HAS_BIAS:  # rounded to the dtype, as torch's `qkv + bias` rounds
        first_bias = tl.load(bias + offsets, mask=mask, other=0.0).to(tl.float32)
        second_bias = tl.load(bias + offsets + half, mask=mask, other=0.0).to(tl.float32)
        first = (first.to(tl.float32) + first_bias).to(dtype)
        second = (second.to(tl.float32) + second_bias).to(dtype)
    spin = rotated[:, None]
    if HAS_NORM:  # RMSNorm over each whole head (both halves), then its weight
        first32, second32 = first.to(tl.float32), second.to(tl.float32)
        squares = tl.sum(first32 * first32, axis=1) + tl.sum(second32 * second32, axis=1)
        inv_rms = tl.rsqrt(squares / (2 * half) + eps)[:, None]
        is_q = (heads < num_heads)[:, None]
        q_first = tl.load(q_norm + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        q_second = tl.load(q_norm + half + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        k_first = tl.load(k_norm + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        k_second = tl.load(k_norm + half + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        normed_first = (first32 * inv_rms).to(dtype).to(tl.float32)
        normed_second = (second32 * inv_rms).to(dtype).to(tl.float32)
        normed_first = (normed_first * tl.where(is_q, q_first, k_first)).to(dtype)
        normed_second = (normed_second * tl.where(is_q, q_second, k_second)).to(dtype)
        first = tl.where(spin, normed_first, first)
        second = tl.where(spin, normed_second, second)
    cos_half = tl.load(cos + token * stride_cos + dims, mask=in_half, other=0.0)
    sin_half = tl.load(sin + token * stride_sin + dims, mask=in_half, other=0.0)
    cos_half = cos_half.to(tl.float32)[None, :]
    sin_half = sin_half.to(tl.float32)[None, :]
    first32, second32 = first.to(tl.float32), second.to(tl.float32)
    new_first = tl.where(spin, first32 * cos_half - second32 * sin_half, first32).to(dtype)
    new_second = tl.where(spin, second32 * cos_half + first32 * sin_half, second32).to(dtype)
    # q and k go back rotated; v too when the bias changed it (the returned v is a view)
    written = (rotated | is_v) if HAS_BIAS else rotated
    out_mask = written[:, None] & in_half[None, :]
    tl.store(first_ptrs, new_first, mask=out_mask)
    tl.store(first_ptrs + half, new_second, mask=out_mask)
    slot = tl.load(slots + token).to(tl.int64)
    k_ptrs = k_cache + slot * stride_k + (heads - num_heads)[:, None] * (2 * half) + dims[None, :]
    k_mask = is_k[:, None] & in_half[None, :]
    tl.store(k_ptrs, new_first.to(k_cache.dtype.element_ty), mask=k_mask)
    tl.store(k_ptrs + half, new_second.to(k_cache.dtype.element_ty), mask=k_mask)
    v_ptrs = v_cache + slot * stride_v + (heads - num_rotated)[:, None] * (2 * half) + dims[None, :]
    v_mask = is_v[:, None] & in_half[None, :]
    tl.store(v_ptrs, first.to(v_cache.dtype.element_ty), mask=v_mask)
    tl.store(v_ptrs + half, second.to(v_cache.dtype.element_ty), mask=v_mask)


@triton.jit
def _silu_mul_kernel(
    gate_up, out, stride_in, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < inter
    gate = tl.load(gate_up + token * stride_in + cols, mask=in_row, other=0.0).to(tl.float32)
    up = tl.load(gate_up + token * stride_in + inter + cols, mask=in_row, other=0.0)
    product = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out + token * stride_out + cols, product.to(out.dtype.element_ty), mask=in_row)


def _norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = weight.shape[0]
    check_norm(x, residual, hidden)
    out = torch.empty_like(x)
    residual_out = out if residual is None else torch.empty_like(x)
    if x.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        source = x if residual is None else residual
        _rms_norm_kernel[(x.shape[0],)](
            x,
            source,
            weight,
            out,
            residual_out,
            x.stride(0),
            source.stride(0),
            out.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
            **pdl.launch(x.device, "ops"),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, hidden] scaled by weight [hidden], as `RMSNorm.forward`."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one launch; the inputs are left unchanged."""
    return _norm_launch(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from gate_up [T, 2 * inter] (gate first) -> [T, inter]."""
    inter = check_gate_up(gate_up)
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] > 0:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            **pdl.launch(gate_up.device, "ops"),
        )
    return out


def rope_qkv_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    extras: QkvExtras | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_qkv`, and in the same launch the rotated k and the v of token t written to
    k_cache[slots[t]] and v_cache[slots[t]] (caches [num_slots, num_kv_heads, head_dim]).
    Replaces the rotation kernel plus two index_copy_ launches per layer; `extras` (a q/k/v
    bias, q/k head norms) ride the same launch, so Qwen2 and Qwen3 layers launch no more
    kernels than Llama's. qkv is changed in place (biased where there is a bias)."""
    check_rope_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slots)
    check_qkv_extras(extras, qkv, head_dim)
    bias = None if extras is None else extras.bias
    q_norm = None if extras is None else extras.q_norm  # q_norm and k_norm: both or neither
    k_norm = None if extras is None else extras.k_norm
    eps = 0.0 if extras is None or q_norm is None else extras.eps
    has_norm = q_norm is not None
    if qkv.shape[0] > 0:
        total_heads = num_heads + 2 * num_kv_heads
        heads_per_program = min(ROPE_HEADS_PER_PROGRAM, triton.next_power_of_2(total_heads))
        grid = (qkv.shape[0], triton.cdiv(total_heads, heads_per_program))
        _rope_store_kernel[grid](
            qkv,
            cos,
            sin,
            slots,
            k_cache,
            v_cache,
            qkv if bias is None else bias,  # an unread pointer where there is none
            qkv if q_norm is None else q_norm,  # unread pointers where there are none
            qkv if k_norm is None else k_norm,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            k_cache.stride(0),
            v_cache.stride(0),
            num_heads,
            num_kv_heads,
            head_dim // 2,
            eps,
            HAS_BIAS=bias is not None,
            HAS_NORM=has_norm,
            BLOCK_H=heads_per_program,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            **pdl.launch(qkv.device, "ops"),
        )
    return split_heads(qkv, num_heads, num_kv_heads, head_dim)
