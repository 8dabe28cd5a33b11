"""GGUF block-quantized weights kept in their blocks on CPU, multiplied in fp32.

A weight stored as Q4_0, Q4_1 or Q8_0 stays in its 4/8-bit blocks in memory. The kernel
(`engine/csrc/blockq.cpp`, AVX-512) expands each block in registers to exactly the fp32 values
`gguf.quants.dequantize` gives, then multiplies in fp32 with fp32 activations. The numbers are
the dequantized model's; only the bytes read per step shrink (6-9 bits per weight as held,
not 32), and the few-row products of decode and verify run at 2-3x MKL's rate for them.

`BlockWeight.dequantize()` is the pure-torch reference (and what CUDA and other dtypes load).
The kernel is built on first use (`engine.cpu_kernels`); where it cannot be, the loader
dequantizes as before.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine import cpu_kernels

BLOCK = 32  # weights per block along K, for every format here
# From this many rows on, linear() expands W and runs MKL's GEMM. The layers' four matrices,
# kernel against expansion + MKL (ms for 8 layers, 2 threads): 64 rows 17.3 / 40.2, 128 rows
# 32.8 / 35.9, 192 rows 50.9 / 51.6, 240 rows 64.5 / 55.4 (benchmarks/bench_cpu_floor.py
# prints the whole pass at 64 and 240 rows).
DENSE_ROWS = 224
# GGUF type name -> (bytes per block, fp16 fields before the quants)
FORMATS = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1)}


class BlockWeight:
    """A [N, K] weight in blocks of 32 along K: `quants` uint8 [N, K/2] (nibbles: per block,
    16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31) or int8 [N, K]
    (bytes), `scale` and `offset` fp32 [N, K/32] (w = scale * q + offset; Q8_0 has no offset).
    Q4_0 (w = d * (q - 8)) is stored as offset = -8d, which gives the same fp32 values."""

    def __init__(self, quants: torch.Tensor, scale: torch.Tensor,
                 offset: torch.Tensor | None) -> None:
        rows, blocks = scale.shape
        nibbles = quants.dtype == torch.uint8
        if quants.dtype not in (torch.uint8, torch.int8) or quants.shape != (
                rows, blocks * (BLOCK // 2 if nibbles else BLOCK)):
            raise ValueError(f"block quants of dtype {quants.dtype} and shape "
                             f"{tuple(quants.shape)} do not fit scales of shape "
                             f"{tuple(scale.shape)}")
        if nibbles != (offset is not None):
            raise ValueError("nibble blocks need an offset per block; byte blocks have none")
        self.quants = quants.contiguous()
        self.scale = scale.float().contiguous()
        self.offset = None if offset is None else offset.float().contiguous()
        self.shape = (rows, blocks * BLOCK)

    @property
    def nibbles(self) -> bool:
        return self.quants.dtype == torch.uint8

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str) -> BlockWeight:
        """From a GGUF tensor's raw blocks, uint8 [N, bytes per row]."""
        if type_name not in FORMATS:
            raise ValueError(f"GGUF type {type_name} has no block kernel; supported: "
                             f"{', '.join(FORMATS)}")
        block_bytes, halves = FORMATS[type_name]
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, block_bytes)
        halfs = blocks[:, :, :2 * halves].copy().view(np.float16).astype(np.float32)
        scale = torch.from_numpy(np.ascontiguousarray(halfs[:, :, 0]))
        quant_bytes = np.ascontiguousarray(blocks[:, :, 2 * halves:]).reshape(rows, -1)
        if type_name == "Q8_0":
            return cls(torch.from_numpy(quant_bytes.view(np.int8)), scale, None)
        offset = (torch.from_numpy(np.ascontiguousarray(halfs[:, :, 1])) if type_name == "Q4_1"
                  else -8.0 * scale)  # exact: a power-of-two multiple of an fp16 value
        return cls(torch.from_numpy(quant_bytes), scale, offset)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Rows of several weights stacked (a fused projection); all of one kind."""
        if len({(p.nibbles, p.shape[1]) for p in parts}) != 1:
            raise ValueError("fused block weights must share one block kind and width")
        return BlockWeight(torch.cat([p.quants for p in parts]),
                           torch.cat([p.scale for p in parts]),
                           None if parts[0].offset is None else
                           torch.cat([p.offset for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight, as gguf's dequantize computes it (the reference)."""
        rows, blocks = self.scale.shape
        if self.nibbles:
            packed = self.quants.view(rows, blocks, BLOCK // 2)
            q = torch.cat((packed & 15, packed >> 4), dim=-1).float()
            return (q * self.scale[..., None] + self.offset[..., None]).view(rows, -1)
        q = self.quants.view(rows, blocks, BLOCK).float()
        return (q * self.scale[..., None]).view(rows, -1)

    @functools.cached_property
    def descriptor(self) -> tuple[int, int, int, int, int, int]:
        """(kind: 0 nibbles / 1 bytes, quants, scales, offsets or 0, N, K) addresses and
        sizes, as `engine/csrc/layer.cpp` takes a matrix (the tensors live as long as self)."""
        return (0 if self.nibbles else 1, self.quants.data_ptr(), self.scale.data_ptr(),
                0 if self.offset is None else self.offset.data_ptr(), *self.shape)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.quants, self.scale, self.offset) if t is not None)

    def expand(self) -> torch.Tensor:
        """`dequantize()` through the kernel's expansion: the same fp32 [N, K] values."""
        lib, (rows, cols) = cpu_kernels.library(), self.shape
        out = torch.empty(rows, cols, dtype=torch.float32)
        if self.nibbles:
            lib.blockq_nibbles_expand(self.quants.data_ptr(), self.scale.data_ptr(),
                                      self.offset.data_ptr(), rows, cols, out.data_ptr(),
                                      torch.get_num_threads())
        else:
            lib.blockq_bytes_expand(self.quants.data_ptr(), self.scale.data_ptr(), rows, cols,
                                    out.data_ptr(), torch.get_num_threads())
        return out

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] fp32 @ W^T -> [..., N] fp32, through the kernel; from DENSE_ROWS rows on
        (long prefill chunks), MKL's GEMM on the expanded weights."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.shape[1]:
            raise ValueError(f"block weights take fp32 CPU input [..., {self.shape[1]}]; got "
                             f"{x.dtype} on {x.device} with shape {tuple(x.shape)}")
        lib = cpu_kernels.library()
        flat = x.reshape(-1, self.shape[1]).contiguous()
        if flat.shape[0] >= DENSE_ROWS:
            return torch.nn.functional.linear(flat, self.expand()).view(*x.shape[:-1],
                                                                         self.shape[0])
        out = torch.empty(flat.shape[0], self.shape[0], dtype=torch.float32)
        if flat.shape[0]:
            if self.nibbles:
                lib.blockq_nibbles_linear(flat.data_ptr(), flat.shape[0], self.shape[1],
                                          self.quants.data_ptr(), self.scale.data_ptr(),
                                          self.offset.data_ptr(), self.shape[0],
                                          out.data_ptr(), torch.get_num_threads())
            else:
                lib.blockq_bytes_linear(flat.data_ptr(), flat.shape[0], self.shape[1],
                                        self.quants.data_ptr(), self.scale.data_ptr(),
                                        self.shape[0], out.data_ptr(), torch.get_num_threads())
        return out.view(*x.shape[:-1], self.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor | BlockWeight) -> torch.Tensor:
    """F.linear, or the block kernel for a `BlockWeight`."""
    if isinstance(weight, BlockWeight):
        return weight.linear(x)
    return torch.nn.functional.linear(x, weight)
