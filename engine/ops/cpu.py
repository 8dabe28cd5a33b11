"""The CPU's fused op set for a decoder layer (fp32, AVX-512 kernels in `engine/csrc/ops.cpp`):
the same functions as `engine.ops.triton` (Triton, CUDA) and `TorchOps` (the reference), one
kernel call each where torch runs several ops. Matrix products go through `blockq.linear`
(the block kernel for GGUF block weights, F.linear otherwise)."""

from __future__ import annotations

import ctypes
import weakref

import torch

from engine import cpu_kernels
from engine.ops.blockq import BlockWeight, linear  # noqa: F401  (linear: the set's products)
from engine.ops.checks import (
    check_gate_up,
    check_norm,
    check_qkv_extras,
    check_rope_store,
    check_rope_tables,
)
from engine.ops.reference import QkvExtras, apply_qkv_extras, split_heads

stores_kv = True  # the model calls rope_qkv_store: the K/V cache write rides the rotation


def _fp32(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise ValueError(
                f"{name} must be a float32 CPU tensor for the CPU kernels; got "
                f"{tensor.dtype} on {tensor.device}"
            )


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_norm(x, residual, weight.shape[0])
    _fp32(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    x, weight = x.contiguous(), weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    residual_out = out if residual is None else torch.empty_like(x)
    cpu_kernels.library().cpu_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        out.data_ptr(),
        None if residual is None else residual_out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, (x if residual is None else residual_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, hidden] scaled by weight [hidden], as `RMSNorm.forward`."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one call; the inputs are left unchanged."""
    return _norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from gate_up [T, 2 * inter] (gate first) -> [T, inter]."""
    inter = check_gate_up(gate_up)
    _fp32(gate_up=gate_up)
    gate_up = gate_up.contiguous()
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    cpu_kernels.library().cpu_silu_mul(
        gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr(), torch.get_num_threads()
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
    """`TorchOps.rope_qkv` with q and k rotated in place in qkv, and in the same call the
    rotated k and the v of token t written to k_cache[slots[t]] and v_cache[slots[t]].
    `extras` (bias, q/k head norms) run first as separate ops (the whole-layer kernel,
    `decoder_layer`, has them inside)."""
    check_qkv_extras(extras, qkv, head_dim)
    qkv = apply_qkv_extras(qkv, extras, num_heads, num_kv_heads, head_dim, rms_norm)
    check_rope_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slots)
    _fp32(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous for the CPU kernels")
    if cos.stride(0) != sin.stride(0):  # the kernel walks both tables with one row stride
        cos, sin = cos[:, : head_dim // 2].contiguous(), sin[:, : head_dim // 2].contiguous()
    cpu_kernels.library().cpu_rope_qkv_store(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        slots.contiguous().data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        qkv.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        torch.get_num_threads(),
    )
    return split_heads(qkv, num_heads, num_kv_heads, head_dim)


def decoder_layer(
    layer,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    metadata,
    backend,
) -> tuple[torch.Tensor, ...] | None:
    """`DecoderLayer.forward` in one kernel call (`engine/csrc/layer.cpp`: the same kernels
    in the same order as the per-op path) when the pass's attention is the backend's CPU
    kernel (decode, verify) and the layer's four matrices are block weights; None otherwise,
    and the layer runs op by op. A q/k/v bias (Qwen2) and q/k head norms (Qwen3) run inside
    the call too."""
    weights = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    if not all(isinstance(w, BlockWeight) for w in weights):
        return None
    attention = backend.cpu_kernel_attention(layer.index, metadata)
    if attention is None:
        return None
    k_cache, v_cache, *indices, bits = attention
    tokens, width = hidden.shape[0], weights[0].shape[1]  # the width the kernel uses
    check_norm(hidden, residual, width)
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    descriptors = _descriptors(layer, weights, (norm_in.weight, norm_post.weight))
    bias, q_norm, k_norm, eps_qk = _qkv_extras(layer)
    check_rope_tables(hidden, cos, sin, layer.head_dim // 2)  # [tokens, >= half] each
    slots = metadata.out_slots
    if slots.dtype != torch.int64 or tuple(slots.shape) != (tokens,):
        raise ValueError(
            f"the pass's out_slots must be int64 [{tokens}]; got {slots.dtype} {tuple(slots.shape)}"
        )
    _fp32(hidden=hidden, cos=cos, sin=sin, **({} if residual is None else {"residual": residual}))
    hidden = hidden.contiguous()
    residual = None if residual is None else residual.contiguous()
    if cos.stride(0) != sin.stride(0):  # the kernel walks both tables with one row stride
        cos, sin = cos.contiguous(), sin.contiguous()
    out, residual_out = torch.empty(tokens, width), torch.empty(tokens, width)
    cpu_kernels.library().cpu_decoder_layer(
        hidden.data_ptr(),
        None if residual is None else residual.data_ptr(),
        tokens,
        norm_in.weight.data_ptr(),
        norm_in.eps,
        norm_post.weight.data_ptr(),
        norm_post.eps,
        descriptors,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        slots.contiguous().data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *(t.data_ptr() for t in indices),
        None if bits is None else bits.data_ptr(),
        metadata.prefix_lens.shape[0],
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        layer.head_dim**-0.5,
        bias,
        q_norm,
        k_norm,
        eps_qk,
        out.data_ptr(),
        residual_out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, residual_out


def _qkv_extras(layer) -> tuple[int | None, int | None, int | None, float]:
    """Pointers to the layer's q/k/v bias and q/k head norm weights (None: it has none), and
    the norms' eps."""
    bias = _vector("qkv_bias", layer.qkv_bias, layer.q_size + 2 * layer.kv_size)
    if layer.q_norm is None or layer.k_norm is None:
        return bias, None, None, 0.0
    q_norm = _vector("q_norm.weight", layer.q_norm.weight, layer.head_dim)
    k_norm = _vector("k_norm.weight", layer.k_norm.weight, layer.head_dim)
    return bias, q_norm, k_norm, layer.q_norm.eps


def _vector(name: str, tensor: torch.Tensor | None, size: int) -> int | None:
    """The address of a weight vector the kernel reads `size` floats from, checked."""
    if tensor is None:
        return None
    _fp32(**{name: tensor})
    if tuple(tensor.shape) != (size,) or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous [{size}] (the kernel reads {size} floats from it); "
            f"got {tuple(tensor.shape)}"
        )
    return tensor.data_ptr()


_LAYER_DESCRIPTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _descriptors(
    layer, weights: tuple[BlockWeight, ...], norms: tuple[torch.Tensor, torch.Tensor]
) -> ctypes.Array:
    """The four matrices as `layer.cpp` takes them, made once per layer (and again only if
    its weights or norms were replaced), after checking that their shapes agree: the kernel
    sizes its buffers from W_qkv's K and N and W_down's K alone, and reads that many floats
    from each norm weight."""
    cached = _LAYER_DESCRIPTORS.get(layer)
    params = (*weights, *norms)
    if cached is None or any(a is not b for a, b in zip(cached[0], params, strict=True)):
        _check_layer_shapes(layer, weights, norms)
        values = [v for w in weights for v in w.descriptor]
        cached = (params, (ctypes.c_int64 * len(values))(*values))
        _LAYER_DESCRIPTORS[layer] = cached
    return cached[1]


def _check_layer_shapes(
    layer, weights: tuple[BlockWeight, ...], norms: tuple[torch.Tensor, torch.Tensor]
) -> None:
    (_, width), _, _, (_, inter) = (w.shape for w in weights)
    for name, norm in zip(("input_layernorm", "post_attention_layernorm"), norms, strict=True):
        _fp32(**{name: norm})
        if tuple(norm.shape) != (width,) or not norm.is_contiguous():
            raise ValueError(
                f"{name}.weight must be contiguous [{width}] (the kernel reads "
                f"{width} floats from it); got {tuple(norm.shape)}"
            )
    expected = {
        "qkv_proj": (layer.q_size + 2 * layer.kv_size, width),
        "o_proj": (width, layer.q_size),
        "gate_up_proj": (2 * inter, width),
        "down_proj": (width, inter),
    }
    for (name, want), weight in zip(expected.items(), weights, strict=True):
        if tuple(weight.shape) != want:
            raise ValueError(
                f"the whole-layer kernel got {name} of shape {tuple(weight.shape)} "
                f"(N, K); this layer's heads and the other matrices need {want}"
            )
