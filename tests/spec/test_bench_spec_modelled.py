"""`benchmarks/bench_spec_modelled.py`'s models of the device: which reads leave the device
waiting, how verify passes are priced, and the host's clock beside the device's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

VERIFY_MS = {4: 0.77, 8: 0.84, 13: 1.31}


@pytest.fixture
def bench(bench_script):
    return bench_script("bench_spec_modelled")


def decode_pass():
    return SimpleNamespace(trees=None, mode=SimpleNamespace(name="DECODE"))


def verify_pass(*sizes):
    trees = SimpleNamespace(sizes=SimpleNamespace(lens=np.array(sizes)))
    return SimpleNamespace(trees=trees, mode=SimpleNamespace(name="VERIFY"))


def test_a_read_that_leaves_nothing_queued_costs_the_gap(bench):
    device = bench.DeviceModel(0.61, VERIFY_MS, 0.45)
    device.launched(decode_pass())
    device.launched(decode_pass())  # launched ahead of the first one's read
    device.read()  # the second is queued: no wait
    assert device.total_ms == pytest.approx(0.61) and device.wait_kinds == {}
    device.read()  # nothing queued: the device waits for the host's next launch
    device.launched(verify_pass(3, 9))  # the widest tree (9 nodes) replays the 13-wide graph
    device.read("verify")
    device.launched(decode_pass())
    assert device.total_ms == pytest.approx(0.61 + 0.61 + 0.45 + 1.31 + 0.45)
    assert device.wait_kinds == {"decode > verify": 1, "verify > decode": 1}
    assert device.passes == {"decode": 3, "verify 13": 1}


def test_a_wait_before_the_next_prompt_is_not_counted(bench):
    device = bench.DeviceModel(0.61, VERIFY_MS, 0.45)
    device.launched(decode_pass())
    device.read()
    device.request_done()
    device.launched(SimpleNamespace(trees=None, mode=SimpleNamespace(name="EXTEND")))
    assert device.total_ms == pytest.approx(0.61) and device.wait_kinds == {}


def test_the_host_clock_waits_for_a_pass_and_the_device_for_the_host(bench):
    """A read waits for its pass to end; a pass launched after more host work than the passes
    queued starts when the host gets there (the device idle in between)."""
    device = bench.HostTimeline(0.61, VERIFY_MS, scale=1.0)
    device.mark = time.perf_counter()
    device.launched(decode_pass())
    device.resume()
    device.read()  # the host waits for the pass: its clock is at least its end
    assert device.host_ms >= 0.61
    assert device.waited == "decode"  # nothing queued after it
    time.sleep(0.002)  # 2 ms of host work before the next launch
    device.launched(decode_pass())
    device.resume()
    assert device.wait_kinds == {"decode > decode": 1}
    assert device.device_free_ms >= 0.61 + 2.0 + 0.61
    device.read()  # the host's clock is at the pass's end or past it, never before
    assert device.host_ms >= device.device_free_ms


def test_the_wait_after_a_verify_pass_can_be_set_apart(bench):
    device = bench.DeviceModel(0.61, VERIFY_MS, 0.45, verify_gap_ms=0.0)
    device.launched(verify_pass(4))
    device.read("verify")  # nothing queued: the verify gap (0) is charged
    device.launched(decode_pass())
    device.read()  # the decode gap is
    assert device.total_ms == pytest.approx(0.77 + 0.61 + 0.45)
    device.request_done()
    device.launched(SimpleNamespace(trees=None, mode=SimpleNamespace(name="EXTEND")))
    assert device.total_ms == pytest.approx(0.77 + 0.61)  # the wait charged is taken back


def test_accepted_drafts_against_the_trees_best_paths(bench):
    from engine.spec.verify import VerifyOutcome
    from engine.state import DraftTrees, SeqLens

    # tree 0: root -> 1 -> 2 (the best path: each node's first child), 3 a sibling of 1,
    # accepted; tree 1: a root alone (drafted nothing: not counted); trees 2-4: the chain
    # root -> 1 -> 2 -> 3, all, a part and none of it accepted; tree 5: the root's three
    # children, the second accepted
    trees = DraftTrees.from_flat(
        [4, 1, 4, 4, 4, 4],
        [5, 6, 7, 8, 9, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8],
        [-1, 0, 1, 0, -1, -1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 0, 0],
    )
    accepted = [[3], [], [1, 2, 3], [1], [], [2]]
    outcome = VerifyOutcome(
        SeqLens(np.array([len(a) for a in accepted])),
        np.array([n for a in accepted for n in a], dtype=np.int32),
        np.zeros(6, dtype=np.int64),
    )
    assert bench.best_path_outcomes(trees, outcome) == ["off", "all", "part", "none", "off"]


def test_a_graph_takes_the_time_of_the_narrowest_timed_width_it_fits(bench):
    assert bench.graph_times([4, 8, 13], (0.77, 0.84, 1.31)) == VERIFY_MS
    # a draft budget of 15: its 16-node graph takes the fourth time, where one is given
    assert bench.graph_times([4, 8, 16], (0.77, 0.84, 1.31, 1.33)) == {4: 0.77, 8: 0.84, 16: 1.33}
    assert bench.graph_times([2, 6], (0.77, 0.84, 1.31)) == {2: 0.77, 6: 0.84}
    with pytest.raises(SystemExit, match="up to 13 nodes"):
        bench.graph_times([4, 8, 16], (0.77, 0.84, 1.31))
