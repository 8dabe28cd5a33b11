"""Several ranks, one model: the process group, the workers and the messages between them.

Rank 0 owns the state: each step it sends the pass's message (a `Batch` is immutable arrays, a
natural message) to the other ranks, which run the same forward on their shard of the model;
the collectives inside the forward (all-reduce, gather) meet on every rank. Workers are
processes spawned by rank 0 on one machine (`torch.multiprocessing`, gloo on CPUs, NCCL on
GPUs), or started by a launcher (torchrun), which then receive what to build as their first
message. A spawned worker that dies or stops answering fails rank 0 with `WorkerFailed` naming
it, within `timeout_s`: never a silent hang (a launched one is not named: rank -1).
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing.connection
import os
import pickle
import signal
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
ASK = "ask"  # (ASK, payload): every worker answers with its handler's result (`Workers.ask`)
# Messages travel on a gloo group of their own, whose wait has no practical bound: a worker
# waits for the next message as long as rank 0 is idle. The collectives of a pass run on the
# default group, bounded by `GroupConfig.timeout_s`: a rank that hangs fails them.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class WorkerFailed(RuntimeError):
    """A worker rank died or did not answer in time."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} failed: {detail}")
        self.rank = rank


def backend_for(device_type: str) -> str:
    """The collectives' backend for ranks on `device_type`: NCCL on CUDA, gloo on CPUs."""
    return "nccl" if device_type == "cuda" else "gloo"


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
        return cls(world_size, backend_for(device_type), f"file://{path}", timeout_s)

    @classmethod
    def launched(cls, world_size: int, device_type: str, timeout_s: float = 60.0) -> GroupConfig:
        """The group a launcher such as torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR and
        MASTER_PORT in the environment), on one machine or several."""
        return cls(world_size, backend_for(device_type), "env://", timeout_s)

    def join(self, rank: int) -> Any:
        """Join the group as `rank` (every rank calls this once); returns the messages' group."""
        dist.init_process_group(
            self.backend,
            init_method=self.init_method,
            rank=rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def send(message: Any, control: Any, timeout_s: float) -> None:
    """Rank 0: the message every other rank's `receive` returns (its pickled bytes, after
    their count). A root's broadcast waits until every rank has received it: the wait is
    bounded by `timeout_s` here, where the group's own bound is the workers' long one."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    for tensor in (torch.tensor([data.numel()], dtype=torch.int64), data):
        work = dist.broadcast(tensor, src=0, group=control, async_op=True)
        if not work.wait(datetime.timedelta(seconds=timeout_s)):
            raise RuntimeError(f"a message was not received within {timeout_s} s")


def receive(control: Any) -> Any:
    """A worker rank: rank 0's next message (waiting as long as rank 0 sends none)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=control)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=control)
    return pickle.loads(data.numpy().tobytes())


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) of this process when a launcher (torchrun) started it; else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


Handler = Callable[[int, Any], Any]  # (rank, message) -> answer (to ASK messages): one step


def _worker(
    rank: int, group: GroupConfig, setup: Callable[[int], Handler], ready: Any, progress: Any
) -> None:
    """A worker's life: say it is ready (its imports done), join, build its part (`setup`)
    and say so, handle rank 0's messages until STOP, counting each one handled in
    `progress[rank]` (so that rank 0 can name a rank that stopped answering)."""
    ready.put(rank)
    control = group.join(rank)
    try:
        handle = setup(rank)
        ready.put(rank)
        _serve(rank, group, control, handle, progress)
    finally:
        dist.destroy_process_group()


def serve_launched(group: GroupConfig, rank: int) -> None:
    """A worker that a launcher started (torchrun): join, build its part from the setup
    rank 0 sends first, say so (a barrier), then handle rank 0's messages until STOP."""
    control = group.join(rank)
    try:
        handle = receive(control)(rank)
        dist.barrier(group=control)
        _serve(rank, group, control, handle, None)
    finally:
        dist.destroy_process_group()


def _serve(rank: int, group: GroupConfig, control: Any, handle: Handler, progress: Any) -> None:
    while True:
        message = receive(control)
        if isinstance(message, str) and message == STOP:
            return
        if isinstance(message, str) and message == BARRIER:
            dist.barrier()
        elif isinstance(message, tuple) and message[:1] == (ASK,):
            dist.all_gather_object([None] * group.world_size, handle(rank, message[1]))
        else:
            handle(rank, message)
        if progress is not None:
            progress[rank] += 1


class Workers:
    """Rank 0's side: ranks 1..world_size-1 as spawned (or launched) processes, each running
    `setup(rank)`
    and then the handler it returns on every message rank 0 `send`s. Rank 0 joins the group
    itself (`start`) and must `stop` them (also on error: no orphaned process)."""

    def __init__(
        self,
        group: GroupConfig,
        setup: Callable[[int], Handler],
        startup_timeout_s: float = 300,
        launched: bool = False,
    ) -> None:
        """`launched`: the workers were started by a launcher (torchrun, `serve_launched`),
        not spawned here; they get `setup` as their first message."""
        self.group = group
        self._launched = launched
        self._setup = setup
        self._startup_timeout_s = startup_timeout_s
        self._context: Any = None
        self._progress: Any = None  # messages each worker has handled
        self._sent = 0  # messages sent
        self._control: Any = None  # the messages' group (`GroupConfig.join`)

    def start(self) -> None:
        """Spawn the workers (launched ones are sent `setup`), wait until each has started (a
        fresh process imports torch: on a busy machine that outlasts the collectives'
        timeout), join the group as rank 0, and
        wait until each worker has built its part (`setup`), so that the first collective
        does not wait on a worker's loading."""
        if self.group.world_size == 1:
            self._control = self.group.join(0)
            return
        if self._launched:
            self._control = self.group.join(0)
            atexit.register(self.stop)  # the workers stop when this process ends
            self.send(self._setup)
            # until every worker has built its part, within the startup timeout (the group's
            # own timeout is the messages' wait for the next step: long)
            built = dist.barrier(group=self._control, async_op=True)
            try:
                built.wait(timeout=datetime.timedelta(seconds=self._startup_timeout_s))
            except RuntimeError as error:
                raise WorkerFailed(-1, f"a launched rank did not build its part: {error}") from None
            return
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
        atexit.register(self.stop)  # no worker outlives this process, whatever ends it
        deadline = time.monotonic() + self._startup_timeout_s
        self._await(ready, deadline, "start")
        self._control = self.group.join(0)
        self._await(ready, deadline, "build their part of the model")

    def _await(self, ready: Any, deadline: float, what: str) -> None:
        """One word from each worker on `ready`, before `deadline`."""
        heard = 0
        while heard < self.group.world_size - 1:
            try:
                self.check()
            except WorkerFailed:
                self.stop()
                raise
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerFailed(-1, f"workers did not {what} in {self._startup_timeout_s} s")
            if ready.empty():
                time.sleep(0.05)
            else:
                ready.get()
                heard += 1

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
        self._sent += 1  # counted before: a worker that hangs before receiving it is behind
        try:
            send(message, self._control, self.group.timeout_s)
        except RuntimeError as error:
            raise self.failure(error) from error

    def ask(self, payload: Any) -> list[Any]:
        """Every worker's handler's answer to `payload`, by rank (rank 0's entry is None)."""
        self.send((ASK, payload))
        answers: list[Any] = [None] * self.group.world_size
        try:
            dist.all_gather_object(answers, None)
        except RuntimeError as error:
            raise self.failure(error) from error
        return answers

    def barrier(self) -> None:
        """Wait until every worker has handled every message sent before."""
        self.send(BARRIER)
        try:
            dist.barrier()
        except RuntimeError as error:
            raise self.failure(error) from error

    def failure(self, error: RuntimeError) -> WorkerFailed:
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
        if behind:  # the furthest behind hangs; the others may wait on rank 0, which waits on it
            rank = min(behind, key=lambda r: self._progress[r])
            return WorkerFailed(
                rank,
                f"it did not answer within {self.group.timeout_s} s (it handled "
                f"{self._progress[rank]} of {self._sent} messages): {error}",
            )
        return WorkerFailed(-1, f"a collective failed: {error}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell every worker to stop and join them; kill any that does not exit in time."""
        if self._control is None and self._context is None:
            return  # never started, or stopped already
        atexit.unregister(self.stop)
        try:
            if all(p.is_alive() for p in self.processes) and self._control is not None:
                send(STOP, self._control, self.group.timeout_s)
        except RuntimeError:
            pass  # a worker is gone: the others are killed below
        deadline = time.monotonic() + timeout_s
        waiting = [p.sentinel for p in self.processes]
        while waiting and time.monotonic() < deadline:
            done = multiprocessing.connection.wait(waiting, timeout=deadline - time.monotonic())
            waiting = [s for s in waiting if s not in done]
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout_s)
        self._context = self._control = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_entry(
    index: int, group: GroupConfig, setup: Callable[[int], Handler], ready: Any, progress: Any
) -> None:
    """torch.multiprocessing's entry: process `index` is rank index + 1. CPU threads are
    split between the ranks (each rank is one process on the same cores). Ctrl-C reaches every
    process of the terminal's group: a worker leaves it to rank 0, which stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    _worker(index + 1, group, setup, ready, progress)
