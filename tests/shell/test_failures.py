"""Failure paths lose nothing: a pass that fails (forward, sampling, verify walk or commit)
ends only its own requests, with "error", gives every slot back, and the engine serves on."""

from __future__ import annotations

import threading

import pytest
from engine_checks import tiny

from engine import SamplingParams
from engine.errors import InvalidRequest
from engine.shell.engine import Engine
from engine.shell.failures import FAULT_POINTS, UNHEALTHY_AFTER, Faults


def repetitive(i: int) -> list[int]:
    """A prompt the n-gram proposer drafts from (its suffix recurs in it)."""
    return [5 + i, 17, 23, 42, 9] * 4


def all_free(engine: Engine) -> bool:
    engine.check()
    return (
        not engine.has_work
        and engine.book.num_available == engine.book.slots.capacity
        and engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    )


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    requests = [engine._submit(p, params, None, None) for p in prompts]
    for _ in range(500):
        if not engine.has_work:
            break
        engine.step()
        engine.check()
    assert not engine.has_work, "the engine did not finish its work"
    return requests


def test_a_failed_verify_walk_loses_no_slot():
    """The bug this file exists for: the verify walk raising (as a device error surfaces when
    the pass's results reach the host) kept the verify pass's slots forever."""
    engine = tiny(speculative=True)
    real, calls = engine.spec._verify, []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device error")
        return real(*args)

    engine.spec._verify = failing_once
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    requests = run(engine, [repetitive(i) for i in range(3)], params)
    assert all_free(engine)
    assert {r.completion().finish_reason for r in requests} == {"error"}  # one verify pass
    assert all(r.error == "RuntimeError: device error" for r in requests)
    again = engine.generate([repetitive(0)], params)[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 16
    assert len(calls) > 1, "no verify pass ran after the failure"


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_failed_pass_ends_only_its_own_requests(point, speculative):
    if point == "verify" and not speculative:
        pytest.skip("no verify walk without speculation")
    engine = tiny(speculative=speculative, chunk_size=16)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    clean = tiny(speculative=speculative, chunk_size=16)
    first = run(clean, [repetitive(0)], params)[0].completion()
    # the second request's prefill runs while the first decodes: a failure at its n-th call
    # hits one of the two passes and leaves the other request to finish
    nth = 1 if point == "verify" else 3  # drafts are rare from random weights
    engine.faults = Faults.at(**{point: [nth]})
    early = engine._submit(repetitive(0), params, None, None)
    engine.step()
    late = engine._submit(repetitive(1) * 2, params, None, None)
    run(engine, [], params)
    reasons = sorted([early.completion().finish_reason, late.completion().finish_reason])
    assert engine.faults.calls[point] >= nth
    assert reasons in (["error", "length"], ["error", "error"])
    assert all_free(engine)
    assert engine.health.failures == 1 and engine.healthy
    assert engine.metrics()["pass_failures"] == 1
    engine.faults = None
    assert engine.generate([repetitive(0)], params)[0].token_ids == first.token_ids


def test_failures_in_a_row_make_the_engine_unhealthy_until_a_pass_succeeds():
    engine = tiny()
    engine.faults = Faults.at(forward=range(1, UNHEALTHY_AFTER + 1))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(UNHEALTHY_AFTER):
        assert engine.healthy
        out = engine.generate([repetitive(i)], params)[0]
        assert out.finish_reason == "error" and "injected fault at forward" in out.error
    assert not engine.healthy and engine.health.failed_in_a_row == UNHEALTHY_AFTER
    assert engine.generate([repetitive(0)], params)[0].finish_reason == "length"
    assert engine.healthy and all_free(engine)


def test_unknown_fault_points_are_refused():
    with pytest.raises(ValueError, match=r"fault points \['forwrd'\] are unknown"):
        Faults.at(forwrd=[1])


def test_closing_a_stream_early_aborts_its_request():
    """Engine.stream: the consumer stops after the first delta; the request must not go on
    decoding to its limit."""
    engine = tiny()
    stream = engine.stream(repetitive(0), SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(stream)
    assert first.finish_reason is None
    stream.close()
    assert all_free(engine)
    assert engine.stats["generated_tokens"] < 50


def test_a_stream_read_to_its_end_is_not_aborted():
    engine = tiny()
    deltas = list(engine.stream(repetitive(0), SamplingParams(max_tokens=5, ignore_eos=True)))
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 5 and all_free(engine)


def test_a_request_id_is_taken_at_submission():
    """Two submits with one id before the loop drains its inbox: the second is refused (the
    check read a table the loop fills only when it drains)."""
    engine = tiny()
    engine.submit(repetitive(0), {"max_tokens": 2}, request_id="same")
    with pytest.raises(InvalidRequest, match="'same' is already in use"):
        engine.submit(repetitive(1), {"max_tokens": 2}, request_id="same")
    run(engine, [], SamplingParams())
    engine.submit(repetitive(1), {"max_tokens": 2}, request_id="same")  # free again
    run(engine, [], SamplingParams())
    assert all_free(engine)


def test_concurrent_submits_with_one_id_admit_one():
    engine = tiny()
    barrier, accepted, refused = threading.Barrier(8), [], []

    def submit(i: int) -> None:
        barrier.wait()
        try:
            accepted.append(engine.submit(repetitive(i), {"max_tokens": 2}, request_id="x"))
        except InvalidRequest:
            refused.append(i)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(accepted) == 1 and len(refused) == 7
    run(engine, [], SamplingParams())
    assert all_free(engine)
