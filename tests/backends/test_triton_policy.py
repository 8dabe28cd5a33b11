"""The launch policies: split counts and the verify config, as pure functions of the shape."""

from __future__ import annotations

import pytest

from engine.backends.triton_decode import (
    MAX_SPLITS,
    VERIFY_CONFIGS,
    choose_num_splits,
    choose_verify_config,
)

H200_SMS = 132


@pytest.mark.parametrize(
    "batch,length,expected",
    [
        (1, 8192, MAX_SPLITS),  # batch 1, long context: as many splits as allowed
        (16, 4096, 5),  # 128 programs per split: about four per SM
        (64, 2048, 1),  # 512 programs already: no split, no merge
        (256, 1024, 1),
        (1, 100, 1),  # a short context is never cut below MIN_KEYS_PER_SPLIT keys
    ],
)
def test_split_counts_for_the_benchmark_shapes(batch: int, length: int, expected: int) -> None:
    assert choose_num_splits(batch, 8, length, H200_SMS) == expected


def test_split_count_never_exceeds_the_key_blocks_or_max() -> None:
    for batch in (1, 2, 3, 7, 16, 33):
        for length in (1, 127, 129, 1000, 100_000):
            splits = choose_num_splits(batch, 8, length, H200_SMS)
            assert 1 <= splits <= MAX_SPLITS
            assert splits <= max(1, -(-length // 128))


@pytest.mark.parametrize(
    "programs,expected_block_n",
    [
        (384, 32),  # 48 requests x 8 kv heads: one wave of 3 programs per SM
        (512, 64),  # 64 requests: two full waves of 2 per SM beat 1.3 waves of 3
        (264, 64),  # 8 kv heads x 33 splits: exactly one wave of 2 per SM
        (8, 64),  # under one wave: the smaller wave is the fuller one
        (792, 32),  # both fill their waves exactly: ties go to the first
    ],
)
def test_verify_config_fills_its_waves(programs: int, expected_block_n: int) -> None:
    config = choose_verify_config(programs, H200_SMS)
    assert config["BLOCK_N"] == expected_block_n
    assert config in [entry[0] for entry in VERIFY_CONFIGS]
