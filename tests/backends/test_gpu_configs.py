"""The attention kernels at the launch configurations a GPU takes (on a CPU the backend takes
small interpreter tiles): decode at both warp counts with and without the fused merge, verify
at each of its configurations, extend with tensor-memory loads (the default launch and the
short prompts'). They match the reference in the interpreter, and `make test` compiles these
launches for sm_90 (tests/kernel_launches.py) with their tiles, warps and pipeline depths,
which the interpreter does not check."""

from __future__ import annotations

import pytest
from backend_cases import DTYPES, ON_CUDA
from test_triton_attention import check_against_reference

from engine.backends import decode_policy, extend_policy, triton_extend

pytestmark = pytest.mark.skipif(ON_CUDA, reason="a GPU runs these configurations anyway")

CASE = dict(num_kv_heads=2, group=4, head_dim=128, dtype=DTYPES[-1], seed=41)
DECODE_CONFIGS = [
    dict(decode_policy.DECODE_CONFIG, num_warps=warps, FUSED_MERGE=fused)
    for warps in (decode_policy.ONE_WAVE_WARPS, decode_policy.DECODE_CONFIG["num_warps"])
    for fused in (False, True)
]


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=str)
def test_decode_at_the_gpu_configurations(config: dict, monkeypatch) -> None:
    monkeypatch.setattr(decode_policy, "INTERPRETER_CONFIG", config)
    for num_splits in (1, 3):
        shape = dict(CASE, prefix_lens=[70, 5, 129], new_lens=[1, 1, 1], num_splits=num_splits)
        check_against_reference("decode", shape)


@pytest.mark.parametrize("config", [c for c, _ in decode_policy.VERIFY_CONFIGS], ids=str)
def test_verify_at_the_gpu_configurations(config: dict, monkeypatch) -> None:
    monkeypatch.setattr(decode_policy, "INTERPRETER_CONFIG", dict(config, FUSED_MERGE=False))
    for num_splits in (1, 2):
        shape = dict(CASE, prefix_lens=[40, 3], new_lens=[5, 12], num_splits=num_splits)
        check_against_reference("verify", shape)


@pytest.mark.parametrize(
    "config",
    [
        extend_policy.EXTEND_CONFIG,
        {**extend_policy.EXTEND_CONFIG, **extend_policy.SHORT_PROMPTS_CONFIG},
    ],
    ids=str,
)
def test_extend_at_the_gpu_configurations(config: dict, monkeypatch) -> None:
    monkeypatch.setattr(extend_policy, "INTERPRETER_CONFIG", config)
    monkeypatch.setattr(triton_extend, "tma_ready", lambda *tensors: True)  # as Hopper reads
    assert config["TMA"]
    shape = dict(CASE, prefix_lens=[70, 0], new_lens=[33, 80], num_splits=None)
    check_against_reference("extend", shape)
