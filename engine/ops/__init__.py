"""A layer's elementwise work (norms, RoPE, SiLU*mul) and matrix products, in interchangeable
op sets with the same functions: `reference` (plain torch, the oracle), `triton` (fused
Triton kernels, CUDA) and `cpu` (the CPU kernels, fp32). The model names a set and gets it
from `load`; no set imports the model.

A set has `rms_norm`, `add_rms_norm`, `linear`, `silu_mul`, `stores_kv` and either
`rope_qkv` (stores_kv False: the backend writes K/V) or `rope_qkv_store` (the rotation writes
K/V too); a set may add `decoder_layer`, a whole layer in one call where it applies, and
`norm_linear` / `silu_mul_linear`, a norm or SiLU*mul and the product after it in one call,
`linear_silu_mul`, a product and the SiLU*mul after it, and `norm_linear_silu_mul`, the norm,
the gate_up product and SiLU*mul, where they apply (each returns None where it does not, and
the model runs the ops apart).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from engine import cpu_kernels

OP_SETS = ("reference", "triton", "cpu")


@functools.cache
def load(name: str) -> Any:
    """The op set `name`, imported on first use (a CPU run never loads Triton)."""
    if name not in OP_SETS:
        raise ValueError(f"op set {name!r} is unknown; choose one of {OP_SETS}")
    if name == "reference":
        from engine.ops.reference import TorchOps

        return TorchOps
    return importlib.import_module(f"engine.ops.{name}")


def default_for(device: torch.device | str, dtype: torch.dtype) -> str:
    """Triton on CUDA; the CPU kernels on a CPU where they build (fp32); else the reference."""
    device = torch.device(device)
    if device.type == "cuda":
        return "triton"
    return "cpu" if cpu_kernels.usable(device, dtype) else "reference"
