"""Shared by the op tests (tests/ops): the device they run on, tolerances, seeded inputs."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def random_tensor(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])
