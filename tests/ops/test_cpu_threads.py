"""cpu_kernels.ThreadGovernor: the thread count it chooses from the load it reads (fake
counters; nothing timed)."""

import os
import threading
import time
import types

import torch

from engine import cpu_kernels
from engine.cpu_kernels import ThreadGovernor, threads_for


def test_threads_for():
    assert threads_for(2, 2, 0.0) == 2
    assert threads_for(2, 2, 0.49) == 2
    assert threads_for(2, 2, 0.5) == 1  # half a CPU taken counts as one
    assert threads_for(2, 2, 0.67) == 1  # a busy neighbour's share beside 2 spinning threads
    assert threads_for(2, 2, 1.9) == 1  # never none
    assert threads_for(8, 2, 0.0) == 2  # no more than the CPUs
    assert threads_for(1, 2, 0.0) == 1  # no more than asked
    assert threads_for(16, 16, 1.0) == 15


class Load:
    """Counters a test moves by hand: monotonic seconds, busy CPU seconds, our CPU seconds."""

    def __init__(self, cpus: set[int]) -> None:
        self.at, self.busy, self.own, self.cpus = 0.0, 100.0, 10.0, cpus

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(
            0.25,
            clock=lambda: self.at,
            busy=lambda cpus: self.busy,
            own=lambda: self.own,
            affinity=lambda: self.cpus,
        )

    def advance(self, seconds: float, busy: float, own: float) -> None:
        self.at, self.busy, self.own = self.at + seconds, self.busy + busy, self.own + own


def test_governor_follows_the_others_load():
    load = Load({0, 1})
    governor = load.governor()
    assert governor.choose(2) == 2  # no sample yet: the affinity mask alone
    load.advance(1.0, busy=2.0, own=1.0)  # someone else kept one CPU busy
    assert governor.choose(2) == 1 and governor.others == 1.0
    load.advance(0.1, busy=0.2, own=0.2)  # within the interval: no new sample
    assert governor.choose(2) == 1
    load.advance(1.0, busy=1.8, own=1.8)  # all the time was ours again
    assert governor.choose(2) == 2 and governor.others == 0.0
    load.advance(1.0, busy=0.3, own=0.2)  # 0.1 of a CPU: noise
    assert governor.choose(2) == 2
    load.advance(1.0, busy=2.0, own=1.0)
    assert governor.choose(1) == 1  # the caller's count is the most


def test_governor_follows_the_affinity_mask():
    load = Load({0, 1, 2, 3})
    governor = load.governor()
    assert governor.choose(8) == 4
    load.cpus = {0, 1}
    load.advance(1.0, busy=3.0, own=1.0)  # counters of other CPUs: not compared
    assert governor.choose(8) == 2 and governor.others == 0.0


def test_threads_sets_torch_within_and_restores():
    load = Load({0, 1})
    governor = load.governor()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        governor.choose(2)
        load.advance(1.0, busy=2.0, own=1.0)
        with governor.threads() as chosen:
            assert chosen == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        load.advance(1.0, busy=2.0, own=2.0)
        with governor.threads() as chosen:
            assert chosen == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_real_counters():
    """The /proc and clock readings the governor uses by default move as they should."""
    cpus = os.sched_getaffinity(0)
    stop = threading.Event()

    def meanwhile() -> None:  # another Python thread working too (an earlier test's, a server's)
        while not stop.is_set():
            pass

    busy, own = cpu_kernels._busy_seconds(cpus), cpu_kernels._own_compute_seconds()
    neighbour = threading.Thread(target=meanwhile)
    neighbour.start()
    try:  # this thread's 0.05 s of CPU (not the process's: the neighbour's is not own)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # the caller's work: counted as own
            pass
        assert cpu_kernels._own_compute_seconds() - own >= 0.05
    finally:
        stop.set()
        neighbour.join()
    assert cpu_kernels._busy_seconds(cpus) >= busy

    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # 0.1 s of CPU in another Python thread (a server's HTTP thread)
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait()

    own = cpu_kernels._own_compute_seconds()
    other = threading.Thread(target=spin)
    other.start()
    try:
        spun.wait()
        assert cpu_kernels._own_compute_seconds() - own < 0.05  # not the caller's: others'
    finally:
        done.set()
        other.join()
    assert 1 <= ThreadGovernor().choose(len(cpus)) <= len(cpus)


def test_governor_without_proc_keeps_torchs_count():
    def missing(*_: object) -> float:
        raise FileNotFoundError("/proc/stat")

    governor = ThreadGovernor(busy=missing)
    assert governor.choose(3) == 3 and governor.blind
    assert ThreadGovernor(affinity=lambda: missing()).choose(5) == 5


def test_own_time_never_reads_short_while_another_thread_runs(monkeypatch):
    """Another Python thread keeps running while the clocks are read one after another (the
    interpreter may hand it the GIL between two reads): the caller's own time may read long
    by what it ran meanwhile, never short. Read the process clock before the other thread's
    and the other thread's later run is taken from the caller's own time (a flaky
    `test_real_counters` on a busy machine)."""
    own, other = 1.0, 5.0  # CPU seconds so far: the caller's and another Python thread's
    reads = []

    def clock_gettime(clock: object) -> float:
        nonlocal other
        reads.append(clock)
        value = own + other if clock == "process" else other
        other += 0.005  # the other thread runs 5 ms between any two reads
        return value

    fake_time = types.SimpleNamespace(
        clock_gettime=clock_gettime,
        CLOCK_PROCESS_CPUTIME_ID="process",
        pthread_getcpuclockid=lambda ident: "thread",
    )
    threads = [types.SimpleNamespace(ident=threading.get_ident() + 1)]
    monkeypatch.setattr(cpu_kernels, "time", fake_time)
    monkeypatch.setattr(cpu_kernels.threading, "enumerate", lambda: threads)
    assert cpu_kernels._own_compute_seconds() >= own
    assert sorted(reads) == ["process", "thread"]  # one read of each clock
