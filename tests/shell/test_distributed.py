"""The process group on CPUs (gloo): rank 0's messages reach every worker, collectives meet, a
worker that dies or hangs fails rank 0 with an error naming it within the timeout, and stopping
leaves no process behind."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed_workers import summing

from engine.shell.distributed import GroupConfig, WorkerFailed, Workers
from engine.state import FinishRules, Running, schedule_extend

TIMEOUT_S = 5.0


def _batch(lengths: list[int]):
    n = len(lengths)
    rules = FinishRules([8] * n, [0] * n, [-1] * n, np.zeros((n, 0), dtype=np.int64))
    running = Running.admitted(range(n), range(n), lengths, lengths, [1] * n, rules, 64)
    total = sum(lengths)
    return schedule_extend(running, lengths, np.ones(total, np.int64), np.arange(1, total + 1))


@pytest.fixture
def workers():
    group = GroupConfig.local(3, "cpu", timeout_s=TIMEOUT_S)
    started = Workers(group, summing)
    started.start()
    yield started
    started.stop(timeout_s=TIMEOUT_S)
    assert not any(p.is_alive() for p in started.processes)
    assert not dist.is_initialized()


def test_a_batch_reaches_every_rank_and_their_collectives_meet(workers):
    for lengths in ([3, 5], [7], [1, 1, 2, 9]):
        batch = _batch(lengths)
        workers.send(batch)
        value = torch.tensor([float(batch.seq_lens.total)])
        dist.all_reduce(value)
        assert value.item() == batch.seq_lens.total * (1 + 2 + 3)  # ranks 0, 1, 2
    workers.barrier()


def test_a_worker_that_dies_is_named(workers):
    workers.send(("die", 1))
    deadline = time.monotonic() + TIMEOUT_S * 4
    while all(p.is_alive() for p in workers.processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(WorkerFailed, match="rank 1 failed: its process exited with code 3"):
        workers.send(_batch([2]))


def test_a_worker_that_hangs_is_named_within_the_timeout(workers):
    workers.send(("hang", 2))
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 2 failed: it did not answer"):
        workers.barrier()
    assert time.monotonic() - started < TIMEOUT_S * 6  # bounded: not a hang


def test_the_group_config_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="world_size=0"):
        GroupConfig(0, "gloo", "file:///tmp/x")
    with pytest.raises(ValueError, match="backend='mpi'"):
        GroupConfig(2, "mpi", "file:///tmp/x")


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # split evenly, and replicated (1 < 2 ranks)
def test_a_layer_split_over_two_ranks_equals_the_whole_layer(num_kv_heads):
    from distributed_workers import (
        LAYER_SHAPES,
        layer_forward,
        layer_weights,
        run_shard,
        sharded_layer,
    )

    from engine.model.parallel import ShardPlan

    group = GroupConfig.local(2, "cpu", timeout_s=TIMEOUT_S)
    workers = Workers(group, sharded_layer)
    workers.start()
    try:
        x = torch.randn(5, LAYER_SHAPES["hidden"], generator=torch.Generator().manual_seed(1))
        workers.send((num_kv_heads, 2, x))
        attn, mlp, logits = run_shard(0, 2, num_kv_heads, x, ShardPlan)
    finally:
        workers.stop(timeout_s=TIMEOUT_S)
    whole = layer_forward(x, layer_weights(num_kv_heads), LAYER_SHAPES["heads"], num_kv_heads)
    for got, want in zip((attn, mlp, logits), whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_shape_that_does_not_split_is_refused_naming_it():
    from engine.model.parallel import ShardPlan

    with pytest.raises(ValueError, match="num_attention_heads=6 does not split"):
        ShardPlan(0, 4, 6, 2, 8, 64, 100)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ShardPlan(0, 2, 6, 3, 8, 64, 100)
    with pytest.raises(ValueError, match="intermediate_size=63"):
        ShardPlan(0, 2, 4, 2, 8, 63, 100)
