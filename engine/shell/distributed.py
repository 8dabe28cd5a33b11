"""Several ranks, one model: the process group, the workers and the messages between them.

Rank 0 owns the state: each step it sends the pass's message (a `Batch` is immutable arrays, a
natural message) to the other ranks, which run the same forward on their shard of the model;
the collectives inside the forward (all-reduce, gather) meet on every rank. Workers are
processes spawned by rank 0 on one machine (`torch.multiprocessing`, gloo on CPUs, NCCL on
GPUs). A worker that dies or stops answering fails rank 0 with `WorkerFailed` naming it, within
`timeout_s`: never a silent hang.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STOP = "stop"  # the message that ends a worker's loop
BARRIER = "barrier"  # the message every rank answers with a barrier


class WorkerFailed(RuntimeError):
    """A worker rank died or did not answer in time."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} failed: {detail}")
        self.rank = rank


@attrs.frozen
class GroupConfig:
    """Where and how the ranks meet: `world_size` ranks over `backend` ('gloo' or 'nccl'),
    rendezvous at `init_method` (a file:// or tcp:// URL), collectives bounded by
    `timeout_s`."""

    world_size: int
    backend: str
    init_method: str
    timeout_s: float = 60.0

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} is not allowed; it must be >= 1")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r} is not allowed; choose 'gloo' or 'nccl'")

    @classmethod
    def local(cls, world_size: int, device_type: str, timeout_s: float = 60.0) -> GroupConfig:
        """A group on this machine: gloo on the CPU, NCCL on CUDA, meeting at a fresh file."""
        handle, path = tempfile.mkstemp(prefix="engine-tp-")
        os.close(handle)
        os.unlink(path)  # the rendezvous file must not exist yet
        backend = "nccl" if device_type == "cuda" else "gloo"
        return cls(world_size, backend, f"file://{path}", timeout_s)

    def join(self, rank: int) -> None:
        """Join the group as `rank` (every rank calls this once)."""
        dist.init_process_group(
            self.backend,
            init_method=self.init_method,
            rank=rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )


def send(message: Any) -> None:
    """Rank 0: the message every other rank's `receive` returns."""
    box = [message]
    dist.broadcast_object_list(box, src=0)


def receive() -> Any:
    """A worker rank: rank 0's next message."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


Handler = Callable[[int, Any], None]  # (rank, message) -> None: one step of a worker


def _worker(
    rank: int, group: GroupConfig, setup: Callable[[int], Handler], ready: Any, progress: Any
) -> None:
    """A worker's life: say it is ready (its imports done), join, build its part (`setup`),
    handle rank 0's messages until STOP, counting each one handled in `progress[rank]` (so
    that rank 0 can name a rank that stopped answering)."""
    ready.put(rank)
    group.join(rank)
    try:
        handle = setup(rank)
        while True:
            message = receive()
            if message == STOP:
                return
            if message == BARRIER:
                dist.barrier()
            else:
                handle(rank, message)
            progress[rank] += 1
    finally:
        dist.destroy_process_group()


class Workers:
    """Rank 0's side: ranks 1..world_size-1 as spawned processes, each running `setup(rank)`
    and then the handler it returns on every message rank 0 `send`s. Rank 0 joins the group
    itself (`start`) and must `stop` them (also on error: no orphaned process)."""

    def __init__(
        self, group: GroupConfig, setup: Callable[[int], Handler], startup_timeout_s: float = 300
    ) -> None:
        self.group = group
        self._setup = setup
        self._startup_timeout_s = startup_timeout_s
        self._context: Any = None
        self._progress: Any = None  # messages each worker has handled
        self._sent = 0  # messages sent

    def start(self) -> None:
        """Spawn the workers, wait until each has started (a fresh process imports torch: on
        a busy machine that outlasts the collectives' timeout), and join the group as rank 0."""
        if self.group.world_size > 1:
            context = mp.get_context("spawn")
            ready = context.SimpleQueue()
            self._progress = context.Array("q", self.group.world_size)
            self._context = mp.start_processes(
                _worker_entry,
                args=(self.group, self._setup, ready, self._progress),
                nprocs=self.group.world_size - 1,
                join=False,
                start_method="spawn",
            )
            deadline = time.monotonic() + self._startup_timeout_s
            started = 0
            while started < self.group.world_size - 1:
                self.check()
                if time.monotonic() > deadline:
                    self.stop()
                    raise WorkerFailed(-1, f"workers did not start in {self._startup_timeout_s} s")
                if ready.empty():
                    time.sleep(0.05)
                else:
                    ready.get()
                    started += 1
        self.group.join(0)

    @property
    def processes(self) -> list[Any]:
        return [] if self._context is None else list(self._context.processes)

    def check(self) -> None:
        """Raise WorkerFailed naming the first worker that has exited."""
        for index, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerFailed(index + 1, f"its process exited with code {process.exitcode}")

    def send(self, message: Any) -> None:
        """`message` to every worker. A dead worker is found first; one that stops answering
        fails the collective after the group's timeout (`WorkerFailed` names it)."""
        self.check()
        try:
            send(message)
        except RuntimeError as error:
            raise self._failure(error) from error
        self._sent += 1

    def barrier(self) -> None:
        """Wait until every worker has handled every message sent before."""
        self.send(BARRIER)
        try:
            dist.barrier()
        except RuntimeError as error:
            raise self._failure(error) from error

    def _failure(self, error: RuntimeError) -> WorkerFailed:
        """The worker a failed collective waited on: one that exited, else one that has not
        handled every message sent before (it hangs in one)."""
        for index, process in enumerate(self.processes):
            if not process.is_alive():
                return WorkerFailed(index + 1, f"its process exited with code {process.exitcode}")
        behind = [
            rank
            for rank in range(1, self.group.world_size)
            if self._progress is not None and self._progress[rank] < self._sent
        ]
        if behind:
            return WorkerFailed(
                behind[0],
                f"it did not answer within {self.group.timeout_s} s (it handled "
                f"{self._progress[behind[0]]} of {self._sent} messages): {error}",
            )
        return WorkerFailed(-1, f"a collective failed: {error}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell every worker to stop and join them; kill any that does not exit in time."""
        if self._context is None:
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        try:
            if all(p.is_alive() for p in self.processes) and dist.is_initialized():
                send(STOP)
        except RuntimeError:
            pass  # a worker is gone: the others are killed below
        sentinels = [p.sentinel for p in self.processes]
        multiprocessing.connection.wait(sentinels, timeout=timeout_s)
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout_s)
        self._context = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_entry(
    index: int, group: GroupConfig, setup: Callable[[int], Handler], ready: Any, progress: Any
) -> None:
    """torch.multiprocessing's entry: process `index` is rank index + 1. CPU threads are
    split between the ranks (each rank is one process on the same cores)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    _worker(index + 1, group, setup, ready, progress)
