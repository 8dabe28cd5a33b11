"""Hopper's tensor-memory (TMA) loads of [tokens, heads, head_dim] tensors: whether a GPU and
a tensor allow them (`tma_ready`), and the descriptors the extend kernel reads its new
tokens' q, K and V tiles through (`rows_descriptor`)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether Hopper's tensor-memory loads can read these [T, H, D] tensors as [T, H*D] rows:
    a GPU of compute capability 9 or more, 2-byte elements, heads adjacent, 16-byte aligned
    base and row stride. (2-byte elements only, measured in bf16: a float32 q tile through
    TMA would sit in shared memory beside the pipelined K/V stages, about 224 KB at head_dim
    128 against the H200's 227 KB.)"""
    if not tensors[0].is_cuda or _capability(tensors[0].device)[0] < 9:
        return False
    return all(
        t.element_size() == 2
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
        for t in tensors
    )


def rows_descriptor(t: torch.Tensor, block_rows: int, block_heads: int = 1):
    """A tensor-memory descriptor of t [T, H, D] as T rows of H*D, read in [block_rows, D]
    tiles; with block_heads > 1, of t as it is, read in [block_rows, block_heads, D] tiles
    (rows past T read as zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tokens, heads, dim = t.shape
    if block_heads > 1:
        return TensorDescriptor(
            t, [tokens, heads, dim], [t.stride(0), t.stride(1), 1], [block_rows, block_heads, dim]
        )
    return TensorDescriptor(t, [tokens, heads * dim], [t.stride(0), 1], [block_rows, dim])
