"""Tensor parallelism in the shell: rank 0's runner, which sends each pass to the workers, the
request-table changes those messages carry, and a worker's side (its part of the model, its
KV pool of its KV heads, its mirror of rank 0's request table).

Rank 0 alone schedules and owns the slots. Every change to its request table is recorded
(`JournaledTable`) and travels with the next pass (`Pass`): a worker applies the changes to its
mirror, in order, and runs the same forward on its shard, so its table reads as rank 0's did.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from engine.shell.config import EngineConfig
from engine.shell.distributed import (
    GroupConfig,
    WorkerFailed,
    Workers,
    launched_rank,
    serve_launched,
)
from engine.shell.runner import ModelRunner, Prepared
from engine.shell.runtime import Runtime, build_runtime, rank_device
from engine.shell.table import RequestTable
from engine.state import Batch

# A table change: (rows, cols, slots) written, or an int: that row cleared (released).
Change = tuple[np.ndarray, np.ndarray, np.ndarray] | int


class JournaledTable(RequestTable):
    """Rank 0's request table: it also records each change until `take` hands them over."""

    def __init__(self, num_rows: int, max_context: int, device: torch.device | str) -> None:
        super().__init__(num_rows, max_context, device)
        self._changes: list[Change] = []

    def write(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        super().write(rows, cols, slots)
        if rows.size:
            self._changes.append(
                tuple(np.array(a, dtype=np.int64) for a in (rows, cols, slots))  # type: ignore[arg-type]
            )

    def clear(self, row: int) -> None:
        super().clear(row)
        self._changes.append(int(row))

    def take(self) -> tuple[Change, ...]:
        """The changes since the last `take`, oldest first."""
        changes, self._changes = tuple(self._changes), []
        return changes


def apply_changes(table: RequestTable, changes: tuple[Change, ...]) -> None:
    """A worker's mirror: rank 0's table changes, in their order."""
    for change in changes:
        if isinstance(change, int):
            table.clear(change)
        else:
            table.write(*change)


def digest(table: RequestTable) -> str:
    return hashlib.sha1(table.host.tobytes()).hexdigest()


@attrs.frozen
class Pass:
    """One step's message: the table changes since the last pass, then the pass to run
    (None: only the changes, ahead of a check)."""

    batch: Batch | None
    table_changes: tuple[Change, ...]


@attrs.frozen
class CheckMirror:
    """Asks each worker for what `ParallelRunner.check` compares with rank 0's."""


class ParallelRunner:
    """Rank 0's runner under tensor parallelism: each launch first sends the pass (with the
    table changes before it) to the workers, so that every rank runs it; a collective that
    fails (a rank died or hangs) fails this and every later pass with `WorkerFailed`."""

    def __init__(self, runner: ModelRunner, workers: Workers, table: JournaledTable) -> None:
        self.inner, self.workers, self.table = runner, workers, table
        self.model, self.backend, self.graphs = runner.model, runner.backend, runner.graphs
        self.failed: WorkerFailed | None = None

    def prepare(self, batch: Batch) -> Prepared:
        return self.inner.prepare(batch)

    def launch(
        self, prepared: Prepared, batch: Batch, input_ids: Any = None, shift: Any = None
    ) -> torch.Tensor:
        """Send the pass to every worker, then run rank 0's part. `input_ids` and `shift` on
        the device (a pass launched ahead, one moved on by a walk on the device) exist on rank
        0 alone: refused (`EngineConfig` refuses `launch_ahead` with several ranks)."""
        if input_ids is not None or shift is not None:
            raise ValueError("a pass launched ahead cannot run on several ranks")
        if self.failed is not None:
            raise self.failed
        try:
            self.workers.send(Pass(batch, self.table.take()))
            return self.inner.launch(prepared, batch)
        except WorkerFailed as failure:
            self.failed = failure
            raise
        except RuntimeError as error:
            # the ranks are out of step either way: a collective failed (a rank died or
            # hangs), or this rank's part of the pass did (the others wait in a collective)
            if isinstance(error, dist.DistBackendError):
                self.failed = self.workers.failure(error)
            else:
                self.failed = WorkerFailed(0, f"its part of the pass failed: {error}")
            raise self.failed from error

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.launch(self.prepare(batch), batch)

    def check(self) -> None:
        """Every worker's mirror equals rank 0's table after the changes not yet sent, and
        its KV pool has rank 0's slots (raises AssertionError naming the rank)."""
        if self.failed is not None:
            raise self.failed
        self.workers.send(Pass(None, self.table.take()))
        answers = self.workers.ask(CheckMirror())
        want = (digest(self.table), self.inner.backend.pool.num_slots)
        for rank, answer in enumerate(answers[1:], start=1):
            if answer != want:
                raise AssertionError(
                    f"rank {rank}'s request-table mirror or KV pool (digest, slots) {answer} "
                    f"differs from rank 0's {want}"
                )


@attrs.frozen
class WorkerSetup:
    """What a worker rank builds (in the worker's process: spawned with it, or sent it as a
    launched worker's first message): rank 0's config
    with its pool size and context fixed, so that every rank's pool and table match."""

    config: EngineConfig

    def __call__(self, rank: int) -> Any:
        runtime = build_runtime(self.config, rank)
        cfg = self.config
        table = RequestTable(cfg.max_running_requests, runtime.max_context, runtime.device)
        runner = runtime.make_runner(table)

        def handle(rank: int, message: Any) -> Any:
            if isinstance(message, CheckMirror):
                return digest(table), runner.backend.pool.num_slots
            apply_changes(table, message.table_changes)
            if message.batch is not None:
                runner.forward(message.batch)
            return None

        return handle


def start_workers(config: EngineConfig, runtime: Runtime) -> Workers:
    """Ranks 1..tensor_parallel_size-1, each building its part of the model with rank 0's
    pool size and context, joined by this process as rank 0: spawned on this machine, or
    where a launcher (torchrun) started this process, the ranks it started."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a process group (another engine with "
            "tensor_parallel_size > 1 that is not closed): close it first (Engine.close())"
        )
    fixed = config.replace(kv_cache_slots=runtime.num_slots, max_context=runtime.max_context)
    world, timeout_s = config.tensor_parallel_size, config.tensor_parallel_timeout
    launched = launched_rank()
    if launched is None:
        group = GroupConfig.local(world, runtime.device.type, timeout_s)
    else:
        _check_launched(config, launched[1])
        group = GroupConfig.launched(world, runtime.device.type, timeout_s)
    workers = Workers(group, WorkerSetup(fixed), launched=launched is not None)
    workers.start()
    return workers


def serve_as_worker(config: EngineConfig) -> None:
    """A rank > 0 that a launcher (torchrun) started: serve rank 0's passes until it stops.
    Rank 0 (the same command with RANK=0) sends what to build."""
    launched = launched_rank()
    if launched is None:
        raise ValueError("serve_as_worker needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    _check_launched(config, launched[1])
    device = rank_device(config.device, *launched)  # this rank's (`Runtime`'s choice)
    group = GroupConfig.launched(
        config.tensor_parallel_size, device.type, config.tensor_parallel_timeout
    )
    serve_launched(group, launched[0])


def _check_launched(config: EngineConfig, world: int) -> None:
    if config.tensor_parallel_size != world:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} but the launcher started "
            f"WORLD_SIZE={world} processes; give --tensor-parallel-size {world}"
        )
