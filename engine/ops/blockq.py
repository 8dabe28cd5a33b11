"""GGUF block-quantized weights kept in their blocks on CPU, multiplied in fp32.

A weight stored as Q4_0, Q4_1 or Q8_0 stays in its 4/8-bit blocks in memory. The kernel
(`engine/csrc/blockq.cpp`) has two paths. On AVX-512 FMAs it expands each block to exactly the
fp32 values `gguf.quants.dequantize` gives, then multiplies in fp32 with fp32 activations. On
AMX tiles (where the CPU has them: the default there) it multiplies each block's quants, exact
in bf16, by x split exactly into three bf16 planes, sums in fp32 and scales per block: as
accurate as the FMAs (tested against float64), not the same bits. Either way the numbers are
the dequantized model's; only the bytes read per step shrink (6-9 bits per weight as held, not
32). Each output row's sums run in one fixed order whatever the other rows are, so a row's
result does not depend on the batch it is in (bit for bit, on either path), and a process
uses one path for every product (`engine.cpu_kernels.amx`).

`BlockWeight.dequantize()` is the pure-torch reference (and what CUDA and other dtypes load).
The kernel is built on first use (`engine.cpu_kernels`); where it cannot be, the loader
dequantizes as before.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from engine import cpu_kernels

BLOCK = 32  # weights per block along K, for every format here (kBlock in blockq.cpp)
PANEL = 32  # rows of W per panel of the kernel's layout (kPanel in blockq.cpp)
# GGUF type name -> (bytes per block, fp16 fields before the quants)
FORMATS = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1)}


class BlockWeight:
    """A [N, K] weight in blocks of 32 along K, built from GGUF's row layout: `quants` uint8
    [N, K/2] (nibbles: per block, 16 bytes whose low nibbles are elements 0..15 and high
    nibbles 16..31) or int8 [N, K] (bytes), `scale` and `offset` fp32 [N, K/32] (w = scale *
    q + offset; Q8_0 has no offset). Q4_0 (w = d * (q - 8)) is stored as offset = -8d, which
    gives the same fp32 values.

    Held as the kernel reads it: panels of 32 rows, block by block (`engine/csrc/blockq.cpp`
    has the layout), so one panel's weights are one stream and a loaded vector holds 16 rows'
    weights at one k. `rows()` gives the row layout back."""

    def __init__(
        self, quants: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
    ) -> None:
        rows, blocks = scale.shape
        nibbles = quants.dtype == torch.uint8
        if quants.dtype not in (torch.uint8, torch.int8) or quants.shape != (
            rows,
            blocks * (BLOCK // 2 if nibbles else BLOCK),
        ):
            raise ValueError(
                f"block quants of dtype {quants.dtype} and shape "
                f"{tuple(quants.shape)} do not fit scales of shape "
                f"{tuple(scale.shape)}"
            )
        if nibbles != (offset is not None):
            raise ValueError("nibble blocks need an offset per block; byte blocks have none")
        if offset is not None and offset.shape != scale.shape:
            raise ValueError(
                f"offsets of shape {tuple(offset.shape)} do not fit scales of "
                f"shape {tuple(scale.shape)}"
            )
        self.shape = (rows, blocks * BLOCK)
        self.quants = _to_panels(quants.reshape(rows, blocks, -1))
        self.scale = _to_panels(scale.float()[..., None])
        self.offset = None if offset is None else _to_panels(offset.float()[..., None])

    @property
    def nibbles(self) -> bool:
        return self.quants.dtype == torch.uint8

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(quants, scale, offset) in the row layout the constructor takes."""
        n = self.shape[0]
        return (
            _from_panels(self.quants, n).reshape(n, -1),
            _from_panels(self.scale, n).reshape(n, -1),
            None if self.offset is None else _from_panels(self.offset, n).reshape(n, -1),
        )

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str) -> BlockWeight:
        """From a GGUF tensor's raw blocks, uint8 [N, bytes per row]."""
        if type_name not in FORMATS:
            raise ValueError(
                f"GGUF type {type_name} has no block kernel; supported: {', '.join(FORMATS)}"
            )
        block_bytes, halves = FORMATS[type_name]
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, block_bytes)
        halfs = blocks[:, :, : 2 * halves].copy().view(np.float16).astype(np.float32)
        scale = torch.from_numpy(np.ascontiguousarray(halfs[:, :, 0]))
        quant_bytes = np.ascontiguousarray(blocks[:, :, 2 * halves :]).reshape(rows, -1)
        if type_name == "Q8_0":
            return cls(torch.from_numpy(quant_bytes.view(np.int8)), scale, None)
        offset = (
            torch.from_numpy(np.ascontiguousarray(halfs[:, :, 1]))
            if type_name == "Q4_1"
            else -8.0 * scale
        )  # exact: a power-of-two multiple of an fp16 value
        return cls(torch.from_numpy(quant_bytes), scale, offset)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Rows of several weights stacked (a fused projection); all of one kind."""
        if len({(p.nibbles, p.shape[1]) for p in parts}) != 1:
            raise ValueError("fused block weights must share one block kind and width")
        quants, scale, offset = zip(*(p.rows() for p in parts), strict=True)
        return BlockWeight(
            torch.cat(quants), torch.cat(scale), None if offset[0] is None else torch.cat(offset)
        )

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight, as gguf's dequantize computes it (the reference)."""
        quants, scale, offset = self.rows()
        rows, blocks = scale.shape
        if self.nibbles:
            assert offset is not None  # nibble blocks have one (the constructor checks)
            packed = quants.view(rows, blocks, BLOCK // 2)
            q = torch.cat((packed & 15, packed >> 4), dim=-1).float()
            return (q * scale[..., None] + offset[..., None]).view(rows, -1)
        q = quants.view(rows, blocks, BLOCK).float()
        return (q * scale[..., None]).view(rows, -1)

    @functools.cached_property
    def descriptor(self) -> tuple[int, int, int, int, int, int]:
        """(kind: 0 nibbles / 1 bytes, quants, scales, offsets or 0, N, K) addresses and
        sizes, as `blockq_linear` (engine/csrc/blockq.cpp) takes a matrix (the tensors live
        as long as self)."""
        return (
            0 if self.nibbles else 1,
            self.quants.data_ptr(),
            self.scale.data_ptr(),
            0 if self.offset is None else self.offset.data_ptr(),
            *self.shape,
        )

    @functools.cached_property
    def _c_descriptor(self) -> ctypes.Array:
        return (ctypes.c_int64 * 6)(*self.descriptor)

    def num_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.quants, self.scale, self.offset)
            if t is not None
        )

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] fp32 @ W^T -> [..., N] fp32, through the kernel (any number of rows:
        from ~240 rows on it runs at about MKL's fp32 GEMM rate, without expanding W)."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.shape[1]:
            raise ValueError(
                f"block weights take fp32 CPU input [..., {self.shape[1]}]; got "
                f"{x.dtype} on {x.device} with shape {tuple(x.shape)}"
            )
        lib = cpu_kernels.library()
        flat = x.reshape(-1, self.shape[1]).contiguous()
        out = torch.empty(flat.shape[0], self.shape[0], dtype=torch.float32)
        lib.blockq_linear(
            flat.data_ptr(),
            flat.shape[0],
            self._c_descriptor,  # 0 rows: none
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out.view(*x.shape[:-1], self.shape[0])


def _to_panels(rows: torch.Tensor) -> torch.Tensor:
    """[N, blocks, per block] -> [panels, blocks, per block, 32 rows], the rows past N zero."""
    n, blocks, per_block = rows.shape
    panels = -(-n // PANEL)
    padded = rows.new_zeros(panels * PANEL, blocks, per_block)
    padded[:n] = rows
    return padded.view(panels, PANEL, blocks, per_block).permute(0, 2, 3, 1).contiguous()


def _from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `_to_panels`: [N, blocks, per block]."""
    count, blocks, per_block, _ = panels.shape
    return panels.permute(0, 3, 1, 2).reshape(count * PANEL, blocks, per_block)[:n]


def linear(x: torch.Tensor, weight: torch.Tensor | BlockWeight) -> torch.Tensor:
    """F.linear, or the block kernel for a `BlockWeight`."""
    if isinstance(weight, BlockWeight):
        return weight.linear(x)
    return torch.nn.functional.linear(x, weight)
