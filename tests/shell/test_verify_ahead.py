"""Passes planned and launched around verify passes, with `launch_ahead`: the decode pass
after a verify pass planned during it (for the outcome where no draft is accepted) and
launched once it commits, and the verify pass launched ahead of its drafts' step
(`verify_ahead`). Outputs are those of the engine without them; no slot is lost, under
retraction and failures too; the scenarios are reached whatever the model's tokens
(`engine_checks.draft_in_turns`)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from engine_checks import draft_in_turns
from plan_cases import (
    DEVICE,
    greedy_params,
    params_of,
    prompts_of,
    run_all,
    run_checking_rows,
    tiny_engine,
)

from engine.shell.engine import Engine
from engine.shell.logits import VerifyLaunched
from engine.state import DraftTrees, FinishReason, SamplingParams


def test_a_verify_pass_plans_the_decode_pass_after_it():
    """With the device apart from the host (`launch_ahead`), a verify pass plans the decode
    pass that follows it if no draft is accepted: where every request kept its root alone
    and the next step drafts nothing, that step uses the plan; otherwise it is dropped. The
    steps are the same as without these plans (so are a seeded sampler's draws): outputs
    equal, such plans taken by a step; no slot is lost, under retraction too. (The torch
    backend: the Triton backend plans a decode pass the same whatever pass ran before it,
    as `test_plan_ahead.py::test_plan_ahead_with_speculation[triton]` shows.)"""
    backend = "torch"
    used, planned_any = [], 0
    # which steps' drafts all fail follows the random model's tokens, which differ between
    # devices: a batch of four (under retraction too), single requests, and a proposer that
    # drafts in turns whatever the tokens (its guesses fail)
    batch = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *prompts_of(2)]
    cases = [
        (batch, 256, params_of(4), False),
        (batch, 40, [SamplingParams(max_tokens=24)] * 4, False),
        *(([p], 256, [SamplingParams(max_tokens=24)], False) for p in ([5, 28], [5, 6, 7, 5])),
        (batch, 256, [SamplingParams(max_tokens=16)] * 4, True),
    ]
    for prompts, pool, params, fake in cases:
        without = tiny_engine(backend, speculative=True, launch_ahead=True, kv_cache_slots=pool)
        without._plan_after_verify = lambda open_pass: None
        engine = tiny_engine(backend, speculative=True, launch_ahead=True, kv_cache_slots=pool)
        if fake:
            draft_in_turns(without)
            draft_in_turns(engine)
        reference = run_all(without, prompts, params)
        plan_after_verify, planned = engine._plan_after_verify, []

        def recording_plan(open_pass, real=plan_after_verify, engine=engine, planned=planned):
            real(open_pass)
            planned.append(engine.ahead.prepared is not None)
            if planned[-1]:  # the roots' slots are in the table already; nothing else is
                batches.append(engine.ahead.prepared.batch)
                batch = open_pass.batch
                table = engine.book.table.host[batch.running.rows]
                kv = batch.running.kv_lens.lens
                roots = batch.out_slots[batch.trees.sizes.starts()]
                assert (table[np.arange(len(kv)), kv] == roots).all()
                assert not table[np.arange(len(kv)), kv + 1].any()

        batches, take = [], engine.ahead.take

        def recording_take(running, take=take, batches=batches):
            prepared = take(running)
            # a plan made during a verify pass (scheduled again at its commit: its slots)
            if prepared is not None and any(
                prepared.batch.out_slots is b.out_slots for b in batches
            ):
                used.append(prepared)
            return prepared

        engine._plan_after_verify, engine.ahead.take = recording_plan, recording_take
        assert run_all(engine, prompts, params) == reference
        modes = [mode for mode, _ in engine.step_times]
        assert modes == [mode for mode, _ in without.step_times]
        if pool == 40:
            assert engine.stats["retractions"] > 0, "the pool was meant to retract"
        planned_any += any(planned)
    assert planned_any, "no verify pass planned the pass after it"
    assert used, "no plan made during a verify pass was used"


def test_a_verify_walk_that_fails_after_its_plan_loses_no_slot():
    """A verify walk that fails once the decode pass after it is planned: the pass's
    requests end with "error", the roots' early table writes are undone and the plan's
    slots and the trees' go back; the engine serves the rest."""
    engine = tiny_engine("torch", speculative=True, launch_ahead=True)
    verify, held = engine.spec.verify, []

    def flaky(*args):  # the first walk after a plan fails
        if engine.ahead.num_held and not held:
            held.append(engine.ahead.num_held)
            raise RuntimeError("injected failure")
        return verify(*args)

    engine.spec.verify = flaky
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *prompts_of(2)]
    greedy = [SamplingParams(max_tokens=48, ignore_eos=True)] * 4
    requests = run_checking_rows(engine, prompts, greedy)
    assert held, "no verify pass planned the pass after it"
    assert any(r.finish_reason.openai == "error" for r in requests)
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    served = engine._submit(prompts[0], greedy[0], None, None)
    while engine.has_work:
        engine.step()
    assert served.finish_reason.openai == "length" and len(served.output_ids) == 48


def test_the_plan_of_a_verify_pass_its_last_request_leaves_goes_back():
    """The verify pass in which the last running request finishes planned the decode pass
    after it: no step follows to take or drop that plan, so the verify step gives it back
    itself; the pool is whole once the engine is idle. (Found by
    `test_plan_ahead.py::test_plan_ahead_changes_nothing_on_random_workloads` with more
    examples.)"""
    ended_so = 0  # runs whose last step was a verify step that held a plan
    # a few prompts and lengths: which run ends so follows the random model's tokens, which
    # differ between devices; and a proposer that drafts in turns whatever the tokens
    prompts = [[5, 28], [5, 6, 7, 5, 6, 7, 5]]
    for prompt, max_tokens, fake in itertools.product(prompts, range(6, 14), [False, True]):
        engine = tiny_engine("torch", speculative=True, launch_ahead=True, kv_cache_slots=40)
        if fake:
            draft_in_turns(engine)
        real, held = engine._plan_after_verify, []

        def recording(open_pass, real=real, held=held, engine=engine):
            real(open_pass)
            held.append(engine.ahead.num_held)

        engine._plan_after_verify = recording
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)]
        ((tokens, reason),) = run_all(engine, [prompt], params)  # the pool whole at the end
        assert len(tokens) == max_tokens and reason == FinishReason.LENGTH
        assert engine.ahead.prepared is None
        ended_so += engine.step_times[-1][0] == "verify" and bool(held) and held[-1] > 0
    assert ended_so, "no run ended in a verify step that held a plan"


def _spec_params() -> list[SamplingParams]:
    """Greedy with a stop token and staggered lengths, a seeded sampler with penalties, and
    logprobs beside a bias."""
    return [
        SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(9,)),
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, repetition_penalty=1.3),
        SamplingParams(max_tokens=18, ignore_eos=True, logprobs=2, logit_bias={7: 1.5}),
    ]


def _drafting_a_while() -> list[list[int]]:
    """Prompts whose last tokens occurred before, in some repeating a pattern: requests draft
    at first, and some stop drafting once their text diverges."""
    return [[5, 6, 7, 8, 9] * 3 + [100, 101], [40, 41, 42] * 4 + [77]] + [
        q + q[:2] for q in prompts_of(3)[1:]
    ]


def test_the_pass_after_a_speculative_step_is_launched_once_it_commits():
    """With `launch_ahead`, where nothing was launched during a speculative step's pass, the
    next pass is launched as soon as that pass commits (`_launch_next`), before its outputs
    are emitted where no request's next pass follows them: a verify pass of the drafts the
    proposer makes then (`verify_at_commit`), else the decode pass, from the plan made
    during the pass (which holds older tokens) or planned then; and the next step takes it.
    Outputs, logprobs and a seeded sampler's draws, and the steps, are those of the engine
    that launches at the next step; under retraction too. Rows with a bias or penalties
    launch after the outputs, and no verify pass."""
    prompts = _drafting_a_while()
    planned = []  # per decode launch: from the plan made during the pass (else planned then)
    kinds, asked = set(), set()
    for pool, params in itertools.product((256, 40), (_spec_params(), _ahead_params())):
        without = tiny_engine("torch", speculative=True, launch_ahead=True, kv_cache_slots=pool)
        without._launch_next = lambda verify: None
        reference = run_checking_rows(without, prompts, params)
        engine = tiny_engine("torch", speculative=True, launch_ahead=True, kv_cache_slots=pool)
        real, launched, taken = engine._launch_next, [], []

        def recording(verify, real=real, engine=engine):
            asked.add(verify)
            before = engine.ahead.prepared  # planned during the pass, or None
            if before is not None and before.launched is not None:
                return real(verify)  # launched during the pass (`launch_ahead`)
            real(verify)
            prepared = engine.ahead.prepared
            if prepared is not None and prepared.launched is not None:
                kind = "verify" if prepared.batch.trees is not None else "decode"
                launched.append((len(engine.step_times), kind))
                if kind == "decode":
                    # the plan made during the pass: its slots, handed on
                    planned.append(
                        before is not None and prepared.batch.out_slots is before.batch.out_slots
                    )

        take = engine.ahead.take

        def recording_take(running, take=take, engine=engine):
            if launched and launched[-1][0] == len(engine.step_times) - 1:
                taken.append(engine.ahead.launched)
            return take(running)

        engine._launch_next, engine.ahead.take = recording, recording_take
        got = run_checking_rows(engine, prompts, params)
        assert [(r.output_ids, r.finish_reason) for r in got] == [
            (r.output_ids, r.finish_reason) for r in reference
        ]
        for have, want in zip(got[3].logprobs, reference[3].logprobs, strict=True):
            assert have.token_id == want.token_id
            assert have.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert taken and all(taken), "a pass launched at a commit was not taken"
        modes = [mode for mode, _ in engine.step_times]
        assert modes == [mode for mode, _ in without.step_times]
        assert all(modes[step + 1] == kind for step, kind in launched)
        kinds |= {(modes[step], kind) for step, kind in launched}
        assert engine.stats["verify_launched_at_commit"] == sum(
            kind == "verify" for _, kind in launched
        )
        if pool == 40:
            assert engine.stats["retractions"] > 0, "the pool was meant to retract"
    assert {("verify", "decode"), ("verify", "verify"), ("decode", "verify")} <= kinds
    assert asked == {True, False}, "outputs that a next pass follows were not met"
    assert any(planned) and not all(planned), "launched from one kind of plan only"


@pytest.mark.parametrize(
    "kind, after_outputs", [("decode", True), ("decode", False), ("verify", False)]
)
def test_a_launch_at_a_commit_that_fails_loses_no_slot(kind, after_outputs):
    """The pass launched as a speculative step's pass commits (a decode pass, or a verify
    pass; before its outputs are emitted, or after them for rows with a bias or penalties)
    fails at its launch: the running requests end with "error", their outputs up to the
    commit emitted, the plan's slots are back, and the engine serves the next request."""
    params = _spec_params() if after_outputs else _ahead_params()
    engine = tiny_engine("torch", speculative=True, launch_ahead=True)
    real, forward, failed = engine._launch_next, engine.passes.forward, []

    def failing_forward(batch, *args, **kwargs):
        if not failed and (batch.trees is not None) == (kind == "verify"):
            failed.append(engine.ahead.num_held)
            raise RuntimeError("injected failure")
        return forward(batch, *args, **kwargs)

    def launch_next(verify):
        engine.passes.forward = failing_forward
        try:
            real(verify)
        finally:
            engine.passes.forward = forward

    engine._launch_next = launch_next
    prompts = _drafting_a_while()
    requests = run_checking_rows(engine, prompts, params)
    assert failed and failed[0] > 0, f"no {kind} pass was launched at a commit"
    _failed_cleanly(engine, requests, prompts)
    without = tiny_engine("torch", speculative=True, launch_ahead=True)
    without._launch_next = lambda verify: None
    reference = without.generate(prompts, params)
    for request, want in zip(requests, reference, strict=True):  # nothing committed is lost
        assert request.output_ids == list(want.token_ids[: len(request.output_ids)])


def _failed_cleanly(engine: Engine, requests: list, prompts: list) -> None:
    """Some of `requests` ended with the injected failure and none otherwise; every slot and
    row is back, and the engine serves the next request with a fresh engine's tokens."""
    assert any(r.finish_reason.openai == "error" for r in requests)
    assert all("injected failure" in r.error for r in requests if r.finish_reason.openai == "error")
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    again = engine.generate(prompts[:1], greedy_params(1))[0]
    assert (
        again.token_ids == tiny_engine("torch").generate(prompts[:1], greedy_params(1))[0].token_ids
    )


def _ahead_params() -> list[SamplingParams]:
    """Rows a verify pass launched ahead serves: greedy with a stop token and staggered
    lengths, a seeded sampler, logprobs (no bias or penalties: their drafts wait a step)."""
    return [
        SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(9,)),
        SamplingParams(max_tokens=36, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, seed=5),
        SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2),
    ]


def test_a_verify_pass_launched_ahead_changes_no_greedy_output():
    """`verify_ahead`: where drafts wait for a decode pass launched ahead, the verify pass
    after it is launched at once, rooted at that pass's token on the device, with the
    drafts below each root's best guess; the next step walks it. Greedy outputs and
    logprobs are plain decoding's (in the small pool, where requests are cut short, those of
    speculation without it), the seeded sampler ends as asked; no slot is lost (checked after
    every step), under retraction too. On the CPU the guesses both hit and miss here (the
    random model's tokens differ on other devices); on any device, a proposer that drafts in
    turns launches verify passes ahead. (The Triton backend's static path:
    `tests/shell/test_graphs.py`.)"""
    backend = "torch"
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *prompts_of(2)]
    params = _ahead_params()
    guesses = missed = taken_any = 0
    for pool in (256, 40):
        plain = run_checking_rows(
            tiny_engine(backend)
            if pool == 256
            else tiny_engine(backend, speculative=True, launch_ahead=True, kv_cache_slots=pool),
            prompts,
            params,
        )
        engine = tiny_engine(
            backend, speculative=True, launch_ahead=True, verify_ahead=True, kv_cache_slots=pool
        )
        verify_step, taken = engine._verify_step, []

        def recording(trees, started, ahead=None, real=verify_step, engine=engine):
            # launched ahead (not at the last commit: `verify_at_commit`, planned on this
            # Running)
            taken.append(ahead is not None and ahead.batch.running is not engine.running)
            return real(trees, started, ahead)

        engine._verify_step = recording
        got = run_checking_rows(engine, prompts, params)
        for have, want, asked in zip(got, plain, params, strict=True):
            if asked.temperature == 0:
                assert have.output_ids == want.output_ids
                assert have.finish_reason == want.finish_reason
            else:
                assert have.finish_reason == FinishReason.LENGTH
                assert 0 < len(have.output_ids) <= asked.max_tokens
        for have, want in zip(got[3].logprobs, plain[3].logprobs, strict=True):
            assert have.token_id == want.token_id
            assert have.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert sum(taken) <= engine.stats["verify_launched_ahead"]
        taken_any += any(taken)
        guesses += engine.stats["verify_ahead_guesses"]
        missed += engine.stats["verify_ahead_guesses_missed"]
        if pool == 40:
            assert engine.stats["retractions"] > 0, "the pool was meant to retract"
    if DEVICE == "cpu":  # the model's tokens: the proposer's drafts and guesses follow them
        assert taken_any, "no verify pass launched ahead was taken"
        assert 0 < missed < guesses, "the guesses did not both hit and miss"
    # drafts in turns, whatever the model's tokens (guesses it hardly ever samples)
    engine = tiny_engine(backend, speculative=True, launch_ahead=True, verify_ahead=True)
    draft_in_turns(engine)
    got = run_checking_rows(engine, prompts, params)
    want = run_checking_rows(tiny_engine(backend), prompts, params)
    for have, asked, wanted in zip(got, params, want, strict=True):
        assert have.output_ids == wanted.output_ids or asked.temperature > 0
    assert engine.stats["verify_launched_ahead"] > 3
    assert engine.stats["verify_ahead_guesses_missed"] > 0


def test_a_missed_guess_counts_as_no_draft():
    """A tree launched ahead whose root is not its guess drafted nothing as speculation's
    statistics count it, unless a draft was accepted anyway; a root alone has no guess."""
    trees = DraftTrees.from_lists([[3, 4, 5], [6], [7, 8]], [[-1, 0, 1], [-1], [-1, 0]])
    launched = VerifyLaunched(torch.zeros(6, 2), np.array([3, -1, 9]))
    assert launched.missed(trees).tolist() == [False, False, True]
    recorded = launched.recorded(trees, np.array([0, 0, 0]))
    assert recorded.sizes.lens.tolist() == [3, 1, 1]
    assert launched.recorded(trees, np.array([0, 0, 1])) is trees
    assert launched.select(np.array([0])) is None  # never cut: dropped


@pytest.mark.parametrize("where", ["launch", "walk"])
def test_a_verify_pass_launched_ahead_that_fails_loses_no_slot(where):
    """The verify pass launched ahead fails at its launch (the decode pass it follows fails
    with it) or at its walk in the next step: the requests of that step end with "error",
    every slot and row is back (checked after every step), and the engine serves the next
    request with a fresh engine's tokens."""
    engine = tiny_engine("torch", speculative=True, launch_ahead=True, verify_ahead=True)
    draft_in_turns(engine)  # verify passes launched ahead on any device
    failed = []
    if where == "launch":
        real, forward = engine._verify_ahead, engine.passes.forward

        def failing_forward(*args, **kwargs):
            if not failed:
                failed.append(engine.ahead.num_held)
                raise RuntimeError("injected failure")
            return forward(*args, **kwargs)

        def verify_ahead(*args):
            engine.passes.forward = failing_forward
            try:
                return real(*args)
            finally:
                engine.passes.forward = forward

        engine._verify_ahead = verify_ahead
    else:
        take, verify = engine.ahead.take_verify, engine.spec.verify
        walking = []

        def recording_take(running):
            prepared = take(running)
            walking.append(prepared is not None)
            return prepared

        def failing_verify(*args):
            if walking and walking[-1] and not failed:
                failed.append(engine.ahead.num_held + 1)
                raise RuntimeError("injected failure")
            return verify(*args)

        engine.ahead.take_verify, engine.spec.verify = recording_take, failing_verify
    prompts = _drafting_a_while()
    requests = run_checking_rows(engine, prompts, _ahead_params())
    assert failed and failed[0] > 0, f"no verify pass launched ahead failed at its {where}"
    _failed_cleanly(engine, requests, prompts)


def test_a_verify_pass_launched_at_a_commit_is_charged_to_the_step_that_takes_it(monkeypatch):
    """The measured pass costs (`PassCost`, fitted from each step's time) see a verify pass's
    launch at a commit, the proposal included, in the verify step that takes it, not in the
    step that launched it. A clock that moves only when the proposer is asked (one unit a
    call) makes each step's observed time its proposals."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    engine = tiny_engine("torch", speculative=True, launch_ahead=True, draft_cost=None)
    spec = engine.spec
    propose, observe, step, verify_step = (
        spec.propose,
        spec.observe,
        engine.step,
        engine._verify_step,
    )
    observed, steps, took = [], [], []

    def proposing(*args):
        clock[0] += 1.0
        return propose(*args)

    def observing(rows, started, verify=False):
        observed.append(clock[0] - started)
        return observe(rows, started, verify)

    def stepping():
        before, launched = clock[0], engine.stats["verify_launched_at_commit"]
        step()
        steps.append((clock[0] - before, engine.stats["verify_launched_at_commit"] > launched))

    def verifying(trees, started, ahead=None):
        took.append(ahead is not None and ahead.batch.running is engine.running)
        return verify_step(trees, started, ahead)

    spec.propose, spec.observe = proposing, observing
    engine.step, engine._verify_step = stepping, verifying
    run_checking_rows(engine, _drafting_a_while(), _ahead_params())
    modes = [mode for mode, _ in engine.step_times]
    assert len(steps) == len(modes) and len(observed) == sum(
        m in ("decode", "verify") for m in modes
    )
    taking, seen = iter(took), iter(observed)
    charged = checked = 0
    for (mode, _), (proposals, launched) in zip(engine.step_times, steps, strict=True):
        if mode not in ("decode", "verify"):
            continue
        taken = mode == "verify" and next(taking)
        # this step's proposals, less the one that launched the next step's verify pass,
        # plus the one of the verify pass it took
        assert next(seen) == proposals - launched + taken, (mode, proposals, launched, taken)
        charged += taken
        checked += launched
    assert charged and checked, "no verify pass was launched at a commit and taken"
