"""Planning each decode pass while the previous one runs (`plan_ahead`) changes no output and
loses no slot: requests finishing at different steps, stop tokens, seeded sampling, aborts
and retraction, on the torch backend and on the static (CUDA-graph) path of the Triton one.
On CUDA the graph path captures real graphs, and the plan overlaps a running replay."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from engine_checks import draft_in_turns
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import state
from engine.shell import grammar
from engine.shell.ahead import VerifyLaunched
from engine.shell.engine import Engine
from engine.shell.graphs import GraphRunner
from engine.shell.logits import Sampled
from engine.state import DraftTrees, FinishReason, Mode, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A configured draft cost: with speculation, which steps verify and which decode (and so the
# plans used and dropped, the retractions, a seeded sampler's batches) do not follow the
# machine's timings, as a measured cost would make them.
DRAFT_COST = 0.1


def _prompts(count: int) -> list[list[int]]:
    return [[(11 * i + 3 * j) % 240 + 5 for j in range(4 + 3 * i)] for i in range(count)]


def _params(count: int, stop_token: int | None = None) -> list[SamplingParams]:
    """Staggered lengths (requests leave at different steps), one stop token, one sampler."""
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(count)]
    if stop_token is not None:
        params[0] = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,))
    params[-1] = SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=7)
    return params


def _run(engine: Engine, prompts: list, params: list, abort_at: int | None = None) -> list:
    """Submit all, step to the end checking slot conservation after every step."""
    requests = [engine._submit(p, q, None, None) for p, q in zip(prompts, params, strict=True)]
    steps = 0
    while engine.has_work:
        engine.step()
        engine.check()
        steps += 1
        if steps == abort_at:
            engine.abort(requests[min(1, len(requests) - 1)].request_id)
    outputs = [(r.output_ids, r.finish_reason) for r in requests]
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    return outputs


def _tiny(backend: str, **overrides) -> Engine:
    """A tiny random-weight engine with a small pool (a pool sized from free GPU memory
    would exhaust compute-sanitizer's shadow memory)."""
    settings = dict(
        random_weights="tiny",
        attention_backend=backend,
        device=DEVICE,
        dtype="float32",
        max_context=128,
        cuda_graph_max_batch=0,
        kv_cache_slots=256,
        draft_cost=DRAFT_COST,
    )
    return Engine(**{**settings, **overrides})


@pytest.mark.parametrize("abort_at", [None, 5])
def test_plan_ahead_changes_no_output_torch_backend(abort_at):
    prompts = _prompts(5)
    probe = _tiny("torch", plan_ahead=False)
    free_run = probe.generate(prompts[:1], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free_run[0].token_ids[8]
    params = _params(5, stop)
    reference = _run(probe, prompts, params, abort_at)
    ahead = _tiny("torch")
    got = _run(ahead, prompts, params, abort_at)
    assert got == reference
    assert ahead.stats["plans_ahead_used"] > 5
    # each early leaver voids one plan, or is cut from it where it was launched (CUDA)
    assert ahead.stats["plans_ahead_dropped"] + ahead.stats["launches_ahead_narrowed"] >= 3
    assert probe.stats["plans_ahead_used"] == 0


def test_plan_ahead_under_retraction_keeps_outputs():
    prompts, params = _prompts(4), _params(4)
    reference = _run(_tiny("torch", plan_ahead=False), prompts, params)
    tight = _tiny("torch", kv_cache_slots=48, max_running_requests=4)
    assert _run(tight, prompts, params) == reference
    assert tight.stats["retractions"] > 0, "the pool was meant to force retraction"


def test_plan_ahead_continues_while_requests_wait_for_a_row():
    """Requests that cannot be admitted (every row taken) do not stop planning ahead; when
    a row frees, the plan is dropped and the next request is admitted at once."""
    prompts, params = _prompts(5), _params(5)
    reference = _run(_tiny("torch", plan_ahead=False, max_running_requests=2), prompts, params)
    engine = _tiny("torch", max_running_requests=2)
    take = engine.ahead.take
    used_while_waiting = []

    def recording_take(running):
        prepared = take(running)
        if prepared is not None and engine.waiting:
            used_while_waiting.append(len(engine.waiting))
        return prepared

    engine.ahead.take = recording_take
    assert _run(engine, prompts, params) == reference
    assert len(used_while_waiting) > 8


def test_plan_ahead_on_the_graph_path():
    """Six requests over graphs of at most four: the first passes run eagerly, and as requests
    leave, plans move to the captured (static-buffer) path."""
    prompts, params = _prompts(6), _params(6)
    reference = _run(_tiny("triton", plan_ahead=False), prompts, params)
    engine = _tiny("triton")
    runner = engine.runner
    graph = GraphRunner(runner.model, runner.backend, Mode.DECODE, 4, capture=DEVICE == "cuda")
    runner.graphs = [graph]
    replays, real_replay = [], graph.replay
    graph.replay = lambda *args: replays.append(1) or real_replay(*args)
    planned_on_graph, real_take = [], engine.ahead.take

    def recording_take(running):
        prepared = real_take(running)
        if prepared is not None:
            planned_on_graph.append(prepared.runner is not None)
        return prepared

    engine.ahead.take = recording_take
    assert _run(engine, prompts, params) == reference
    assert engine.stats["plans_ahead_used"] > 5
    assert replays, "no pass took the graph path"
    assert any(planned_on_graph), "no plan made ahead ran on the graph path"
    assert not all(planned_on_graph), "no plan made ahead ran eagerly"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plan_ahead_with_speculation(backend):
    """With speculation, a step where nothing was drafted plans the next decode pass: the
    next step uses it when it drafts nothing either, and a verify pass drops it (its slots go
    to the tree). Outputs are those of speculation without planning ahead (and, greedy, of
    plain decoding); no slot is lost, under retraction too. Planned, not launched: a launched
    pass makes drafts wait a step (`test_launch_ahead_with_speculation_defers_drafts`), and
    a seeded sampler's draws under speculation follow which steps verify."""
    # repeated prompts, so that verify passes come between decode steps
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *_prompts(2)]
    params = _params(4)
    greedy = [SamplingParams(max_tokens=24, ignore_eos=True)] * 4
    # the Triton backend (minutes in the interpreter) with the small pool alone: retraction
    # among its plans; the large pool's steps are the torch backend's
    for pool in (256, 40) if backend == "torch" else (40,):
        plain = _run(_tiny(backend, launch_ahead=False, kv_cache_slots=pool), prompts, greedy)
        # (a seeded sampler's draws under speculation depend on its batch: the same pool)
        reference = _run(
            _tiny(
                backend, plan_ahead=False, speculative=True, launch_ahead=False, kv_cache_slots=pool
            ),
            prompts,
            params,
        )
        engine = _tiny(backend, speculative=True, launch_ahead=False, kv_cache_slots=pool)
        planned_at_entry, verify_after_plan = [], []
        run_decode, verify = engine._run_decode, engine.spec.verify

        def recording_run():
            planned_at_entry.append(engine.ahead.prepared is not None)
            return run_decode()

        def recording_verify(*args):
            assert engine.ahead.prepared is None, "a verify pass ran while a plan held slots"
            verify_after_plan.append(planned_at_entry[-1])
            return verify(*args)

        engine._run_decode, engine.spec.verify = recording_run, recording_verify
        assert _run(engine, prompts, params) == reference
        assert engine.stats["plans_ahead_used"] > 2
        assert any(verify_after_plan), "no verify pass followed a plan"
        greedy_engine = _tiny(backend, speculative=True, launch_ahead=False, kv_cache_slots=pool)
        assert _run(greedy_engine, prompts, greedy) == plain
        assert greedy_engine.stats["plans_ahead_used"] > 5
        if pool == 40:
            assert greedy_engine.stats["retractions"] > 0, "the pool was meant to retract"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launch_ahead_with_speculation_defers_drafts(backend):
    """With speculation a step that drafted nothing launches the next pass ahead; where the
    next step's proposer then drafts, the launched pass decodes and the drafts wait a step
    (that step launches nothing ahead), so no verify pass ever finds a launched pass to
    drop. Greedy outputs are those of plain decoding; no slot is lost."""
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *_prompts(2)]
    greedy = [SamplingParams(max_tokens=32, ignore_eos=True)] * 4
    plain = _run(_tiny(backend), prompts, greedy)
    engine = _tiny(backend, speculative=True, launch_ahead=True)
    launched_at_verify = []
    verify_step = engine._verify_step

    def recording_verify_step(*args):
        launched_at_verify.append(engine.ahead.launched)
        return verify_step(*args)

    engine._verify_step = recording_verify_step
    assert _run(engine, prompts, greedy) == plain
    assert engine.stats["launches_ahead"] > 5, "no pass was launched ahead"
    assert engine.stats["drafts_deferred"] > 0, "no draft waited for a launched pass"
    assert launched_at_verify, "no verify pass ran"
    assert not any(launched_at_verify), "a verify pass dropped a pass launched ahead"


def test_a_verify_pass_plans_the_decode_pass_after_it():
    """With the device apart from the host (`launch_ahead`), a verify pass plans the decode
    pass that follows it if no draft is accepted: where every request kept its root alone
    and the next step drafts nothing, that step uses the plan; otherwise it is dropped. The
    steps are the same as without these plans (so are a seeded sampler's draws): outputs
    equal, such plans taken by a step; no slot is lost, under retraction too. (The torch
    backend: the Triton backend plans a decode pass the same whatever pass ran before it,
    as `test_plan_ahead_with_speculation[triton]` shows.)"""
    backend = "torch"
    used, planned_any = [], 0
    # which steps' drafts all fail follows the random model's tokens, which differ between
    # devices: a batch of four (under retraction too), single requests, and a proposer that
    # drafts in turns whatever the tokens (its guesses fail)
    batch = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *_prompts(2)]
    cases = [
        (batch, 256, _params(4), False),
        (batch, 40, [SamplingParams(max_tokens=24)] * 4, False),
        *(([p], 256, [SamplingParams(max_tokens=24)], False) for p in ([5, 28], [5, 6, 7, 5])),
        (batch, 256, [SamplingParams(max_tokens=16)] * 4, True),
    ]
    for prompts, pool, params, fake in cases:
        without = _tiny(backend, speculative=True, launch_ahead=True, kv_cache_slots=pool)
        without._plan_after_verify = lambda open_pass: None
        engine = _tiny(backend, speculative=True, launch_ahead=True, kv_cache_slots=pool)
        if fake:
            draft_in_turns(without)
            draft_in_turns(engine)
        reference = _run(without, prompts, params)
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
            if prepared is not None and any(prepared.batch is b for b in batches):
                used.append(prepared)
            return prepared

        engine._plan_after_verify, engine.ahead.take = recording_plan, recording_take
        assert _run(engine, prompts, params) == reference
        modes = [mode for mode, _ in engine.step_times]
        assert modes == [mode for mode, _ in without.step_times]
        if pool == 40:
            assert engine.stats["retractions"] > 0, "the pool was meant to retract"
        planned_any += any(planned)
    assert planned_any, "no verify pass planned the pass after it"
    assert used, "no plan made during a verify pass was used"


def _run_checking_rows(engine: Engine, prompts: list, params: list) -> list:
    """Submit all and step to the end, checking after every step that no slot is lost and
    that no row holds a slot past its committed length (a failed pass's early table writes
    undone)."""
    requests = [engine._submit(p, q, None, None) for p, q in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
        engine.check()
        table = engine.book.table.host
        for row, committed in zip(
            engine.running.rows.tolist(), engine.running.kv_lens.tolist(), strict=True
        ):
            assert not table[row, committed:].any(), "a slot left past a row's committed length"
    return requests


def test_a_verify_walk_that_fails_after_its_plan_loses_no_slot():
    """A verify walk that fails once the decode pass after it is planned: the pass's
    requests end with "error", the roots' early table writes are undone and the plan's
    slots and the trees' go back; the engine serves the rest."""
    engine = _tiny("torch", speculative=True, launch_ahead=True)
    verify, held = engine.spec.verify, []

    def flaky(*args):  # the first walk after a plan fails
        if engine.ahead.num_held and not held:
            held.append(engine.ahead.num_held)
            raise RuntimeError("injected failure")
        return verify(*args)

    engine.spec.verify = flaky
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *_prompts(2)]
    greedy = [SamplingParams(max_tokens=48, ignore_eos=True)] * 4
    requests = _run_checking_rows(engine, prompts, greedy)
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
    `test_plan_ahead_changes_nothing_on_random_workloads` with more examples.)"""
    ended_so = 0  # runs whose last step was a verify step that held a plan
    # a few prompts and lengths: which run ends so follows the random model's tokens, which
    # differ between devices; and a proposer that drafts in turns whatever the tokens
    prompts = [[5, 28], [5, 6, 7, 5, 6, 7, 5]]
    for prompt, max_tokens, fake in itertools.product(prompts, range(6, 14), [False, True]):
        engine = _tiny("torch", speculative=True, launch_ahead=True, kv_cache_slots=40)
        if fake:
            draft_in_turns(engine)
        real, held = engine._plan_after_verify, []

        def recording(open_pass, real=real, held=held, engine=engine):
            real(open_pass)
            held.append(engine.ahead.num_held)

        engine._plan_after_verify = recording
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)]
        ((tokens, reason),) = _run(engine, [prompt], params)  # the pool whole at the end
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
        q + q[:2] for q in _prompts(3)[1:]
    ]


def test_the_decode_pass_after_a_verify_pass_is_launched_once_it_commits():
    """Where no request will draft at the next step, the decode pass after a verify pass is
    launched as soon as the verify pass commits (`_launch_after_verify`), its input ids the
    committed tokens (also from the plan made during the verify pass, which holds older
    ones), and the next step takes it. Outputs, logprobs and a seeded sampler's draws, and
    the steps, are those of the engine that launches that pass at the next step; under
    retraction too."""
    prompts = _drafting_a_while()
    planned = []  # per launch: from the plan made during the verify pass (else planned then)
    for pool in (256, 40):
        without = _tiny("torch", speculative=True, launch_ahead=True, kv_cache_slots=pool)
        without._launch_after_verify = lambda: None
        reference = _run_checking_rows(without, prompts, _spec_params())
        engine = _tiny("torch", speculative=True, launch_ahead=True, kv_cache_slots=pool)
        real, launched, taken = engine._launch_after_verify, [], []

        def recording(real=real, engine=engine):
            during = engine.ahead.prepared  # planned during the verify pass, or None
            real()
            if engine.ahead.launched:
                launched.append(len(engine.step_times))
                planned.append(during is not None and engine.ahead.prepared.batch is during.batch)

        take = engine.ahead.take

        def recording_take(running, take=take, engine=engine):
            if launched and launched[-1] == len(engine.step_times) - 1:
                taken.append(engine.ahead.launched)
            return take(running)

        engine._launch_after_verify, engine.ahead.take = recording, recording_take
        got = _run_checking_rows(engine, prompts, _spec_params())
        assert [(r.output_ids, r.finish_reason) for r in got] == [
            (r.output_ids, r.finish_reason) for r in reference
        ]
        for have, want in zip(got[3].logprobs, reference[3].logprobs, strict=True):
            assert have.token_id == want.token_id
            assert have.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert launched, "no decode pass was launched after a verify pass"
        assert taken and all(taken), "a pass launched after a verify pass was not taken"
        modes = [mode for mode, _ in engine.step_times]
        assert modes == [mode for mode, _ in without.step_times]
        assert all(modes[step : step + 2] == ["verify", "decode"] for step in launched)
        if pool == 40:
            assert engine.stats["retractions"] > 0, "the pool was meant to retract"
    assert any(planned) and not all(planned), "launched from one kind of plan only"


def test_a_launch_after_a_verify_pass_that_fails_loses_no_slot():
    """The decode pass launched after a verify pass fails at its launch: the running
    requests end with "error", the plan's slots are back, and the engine serves the next
    request."""
    engine = _tiny("torch", speculative=True, launch_ahead=True)
    real, launch, failed = engine._launch_after_verify, engine.passes.launch, []

    def failing_launch(*args, **kwargs):
        if not failed:
            failed.append(engine.ahead.num_held)
            raise RuntimeError("injected failure")
        return launch(*args, **kwargs)

    def launch_after_verify():
        engine.passes.launch = failing_launch
        try:
            real()
        finally:
            engine.passes.launch = launch

    engine._launch_after_verify = launch_after_verify
    prompts = _drafting_a_while()
    requests = _run_checking_rows(engine, prompts, _spec_params())
    assert failed and failed[0] > 0, "no pass was launched after a verify pass"
    _failed_cleanly(engine, requests, prompts)


def _failed_cleanly(engine: Engine, requests: list, prompts: list) -> None:
    """Some of `requests` ended with the injected failure and none otherwise; every slot and
    row is back, and the engine serves the next request with a fresh engine's tokens."""
    assert any(r.finish_reason.openai == "error" for r in requests)
    assert all("injected failure" in r.error for r in requests if r.finish_reason.openai == "error")
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    again = engine.generate(prompts[:1], _greedy(1))[0]
    assert again.token_ids == _tiny("torch").generate(prompts[:1], _greedy(1))[0].token_ids


@pytest.mark.parametrize("launch_ahead", [False, True])
@pytest.mark.parametrize("failing", ["prepare", "launch", "fetch"])
def test_a_failure_around_a_plan_loses_no_slot(failing, launch_ahead):
    """A pass that fails while planning ahead, launching a prepared plan or reading its
    tokens (with the next pass launched ahead from them, or not): the requests of that pass
    end with "error", their slots and rows are back (the early table writes undone), and the
    engine serves the next request as before."""
    engine = _tiny("torch", launch_ahead=launch_ahead)
    prompts, params = _prompts(3), _params(3)
    # "fetch": the device tokens of the 4th pass fail when read (a device error surfaces there)
    target = engine.passes if failing == "fetch" else engine.runner
    name = {"prepare": "prepare", "launch": "launch", "fetch": "sample"}[failing]
    real, calls = getattr(target, name), []

    class Unreadable(Sampled):  # its tokens on the device (a pass may launch from them)
        def tokens_on_host(self):
            raise RuntimeError("injected failure")

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            if failing == "fetch":
                return Unreadable(real(*args, **kwargs).tokens)
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    setattr(target, name, flaky)
    requests = _run_checking_rows(engine, prompts, params)
    setattr(target, name, real)
    reasons = [r.completion().finish_reason for r in requests]
    assert "error" in reasons and all(r in ("error", "length", "stop") for r in reasons)
    failed = [r for r in requests if r.finish_reason.openai == "error"]
    assert all("injected failure" in r.error for r in failed)
    assert engine.health.failures == 1 and engine.healthy
    assert (engine.stats["launches_ahead"] > 0) == launch_ahead
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    again = engine.generate(prompts[:1], params[:1])[0]
    reference = _tiny("torch", plan_ahead=False).generate(prompts[:1], params[:1])[0]
    assert again.token_ids == reference.token_ids


@st.composite
def workloads(draw):
    count = draw(st.integers(1, 6))
    prompts = [draw(st.lists(st.integers(5, 250), min_size=1, max_size=14)) for _ in range(count)]
    params = []
    for _ in range(count):
        stop = draw(st.lists(st.integers(5, 250), max_size=2))
        temperature = draw(st.sampled_from([0.0, 0.0, 0.9]))
        params.append(
            SamplingParams(
                max_tokens=draw(st.integers(1, 12)),
                ignore_eos=True,
                stop_token_ids=tuple(stop),
                temperature=temperature,
                seed=draw(st.integers(0, 99)),
                frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.8])),
                repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
            )
        )
    settings_ = dict(
        max_running_requests=draw(st.integers(1, 4)),
        kv_cache_slots=draw(st.sampled_from([40, 64, 256])),
        speculative=draw(st.booleans()),
        launch_ahead=draw(st.booleans()),  # on the CPU too: the same order of work
    )
    # verify passes launched ahead: with speculation and launches only (refused otherwise)
    settings_["verify_ahead"] = (
        draw(st.booleans()) and settings_["speculative"] and (settings_["launch_ahead"])
    )
    abort_at = draw(st.sampled_from([None, 2, 5]))
    return prompts, params, settings_, abort_at


@settings(  # a large space, drawn the same every run: 20 workloads, two engines each
    max_examples=int(
        os.environ.get("PLAN_AHEAD_EXAMPLES", os.environ.get("ENGINE_TEST_EXAMPLES", "20"))
    ),
    deadline=None,
)
@given(workload=workloads())
def test_plan_ahead_changes_nothing_on_random_workloads(workload):
    """Random prompts, lengths, stop tokens, samplers, penalties, row limits, pool sizes,
    aborts and speculation: the same outputs and finish reasons with and without planning
    ahead (with speculation and passes launched ahead: the greedy requests'), no slot lost."""
    prompts, params, settings_, abort_at = workload
    reference = _run(_tiny("torch", plan_ahead=False, **settings_), prompts, params, abort_at)
    outputs = _run(_tiny("torch", **settings_), prompts, params, abort_at)
    if settings_["speculative"] and settings_["launch_ahead"]:
        # a launched pass makes drafts wait a step: which steps verify differs, and with it a
        # seeded sampler's draws and what the request aborted at a step had (greedy tokens
        # never change)
        greedy = [p.temperature == 0 for p in params]
        if abort_at is not None:
            greedy[min(1, len(params) - 1)] = False
        reference = [r for r, g in zip(reference, greedy, strict=True) if g]
        outputs = [o for o, g in zip(outputs, greedy, strict=True) if g]
    assert outputs == reference


def _greedy(count: int, stop_token: int | None = None) -> list[SamplingParams]:
    """Staggered lengths and one stop token: requests leave at different steps, each cut
    from the pass launched ahead of its last one."""
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(count)]
    if stop_token is not None:
        params[0] = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,))
    return params


def _on_graphs(engine: Engine, max_batch: int) -> list:
    """Give `engine` a decode graph runner of at most `max_batch` (captured on CUDA only);
    returns the list its replays are recorded in."""
    runner = engine.runner
    graph = GraphRunner(runner.model, runner.backend, Mode.DECODE, max_batch, DEVICE == "cuda")
    runner.graphs = [graph]
    replays, real_replay = [], graph.replay
    graph.replay = lambda *args: replays.append(args) or real_replay(*args)
    return replays


@pytest.mark.parametrize("backend,abort_at", [("torch", None), ("torch", 6), ("triton", None)])
def test_launch_ahead_changes_no_output(backend, abort_at):
    """Each decode pass launched before the last one's tokens are read, its input ids those
    tokens on the device: the same outputs as planning nothing ahead, no slot lost (`_run`
    checks after every step). A request that leaves (by length, a stop token or an abort) is
    cut from the pass launched ahead, which serves the others: only the pass launched past
    the last request is dropped."""
    prompts = _prompts(5)
    probe = _tiny(backend, plan_ahead=False)
    free_run = probe.generate(prompts[:1], SamplingParams(max_tokens=30, ignore_eos=True))
    params = _greedy(5, free_run[0].token_ids[10])  # its 11th: no one leaves by length then
    reference = _run(probe, prompts, params, abort_at)
    assert reference[0][1] == FinishReason.STOP
    engine = _tiny(backend, launch_ahead=True)
    replays = _on_graphs(engine, 4) if backend == "triton" else []
    assert _run(engine, prompts, params, abort_at) == reference
    stats = engine.stats
    assert stats["launches_ahead"] > 5
    assert stats["launches_ahead_narrowed"] == 4  # the 4 who leave before the last one
    assert stats["launches_ahead_dropped"] == 1
    if backend == "triton":  # launched ahead on the static path: ids copied on the device
        assert any(args[-1] is not None for args in replays)


@pytest.mark.parametrize(
    "asked",
    [
        dict(logit_bias={7: 2.0, 40: -1.5}),
        dict(logprobs=2),
        dict(logprobs=0),
        dict(frequency_penalty=2.0),
        dict(presence_penalty=2.0, logit_bias={7: 2.0}),
        dict(repetition_penalty=2.0),
        dict(temperature=0.8, seed=3, repetition_penalty=1.5, frequency_penalty=0.5),
    ],
)
def test_launch_ahead_beside_bias_penalties_and_logprobs(asked):
    """A bias does not depend on the tokens; penalties count the running pass's tokens on
    the device (the requests' histories lack them at launch); logprobs come from the
    launched pass's own logits there: passes are launched ahead beside all of them, with
    the same tokens and logprobs as planning nothing ahead, also when the others leave and
    the launched pass is cut to the request (its logprobs with it)."""
    prompts = _prompts(3)
    params = _greedy(3)
    params[2] = SamplingParams(max_tokens=16, ignore_eos=True, **asked)  # the last to leave

    def run(engine):
        requests = [engine._submit(p, q, None, None) for p, q in zip(prompts, params, strict=True)]
        while engine.has_work:
            engine.step()
            engine.check()
        return requests

    reference = run(_tiny("torch", plan_ahead=False))
    engine = _tiny("torch", launch_ahead=True)
    got = run(engine)
    assert [(r.output_ids, r.finish_reason) for r in got] == [
        (r.output_ids, r.finish_reason) for r in reference
    ]
    assert engine.stats["launches_ahead"] > 5
    assert engine.stats["launches_ahead_narrowed"] == 2  # the two who leave first
    if "logprobs" in asked:  # computed in batches of other sizes: equal to rounding
        expected, actual = reference[2].logprobs, got[2].logprobs
        assert len(expected) == len(actual) == 16
        for want, have in zip(expected, actual, strict=True):
            assert have.token_id == want.token_id
            assert have.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in have.top] == [t for t, _ in want.top]
            assert [v for _, v in have.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launch_ahead_draws_what_sampling_after_the_tokens_draws(backend):
    """Seeded sampling rows launched ahead draw from their step count one step on (the
    pass's tokens have not reached their requests yet): the same tokens as planning nothing
    ahead, beside greedy rows. (An unseeded request draws from the engine seed and its uid,
    which differs between two engines.)"""
    prompts = _prompts(4)
    params = [
        SamplingParams(max_tokens=14, temperature=0.9, top_k=30, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=1.2, top_p=0.9, seed=0, ignore_eos=True),
        SamplingParams(max_tokens=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, min_p=0.05, seed=5, ignore_eos=True),
    ]
    reference = _run(_tiny(backend, plan_ahead=False), prompts, params)
    engine = _tiny(backend, launch_ahead=True)
    assert _run(engine, prompts, params) == reference
    assert engine.stats["launches_ahead"] > 5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launch_ahead_drops_the_pass_a_refused_token_fed(backend, monkeypatch):
    """Greedy rows under a grammar go unmasked and are checked once read; a pass launched
    ahead took the unmasked tokens as its input ids, so a refused one (drawn again under its
    mask) drops it: the same tokens as planning nothing ahead, where every check passed
    before the next launch. (Every token checked first: no masked runs after a refusal.)"""
    monkeypatch.setattr(grammar, "MASKED_FIRST_MAX", 0)
    pattern = r"[ -~]{6,24}"  # printable ASCII: some of what the tiny model draws, not all
    prompts = [[5 + i, 6, 7 * i % 200] for i in range(4)]
    params = [SamplingParams(max_tokens=20, structured_outputs={"regex": pattern})] * 3
    params.append(SamplingParams(max_tokens=16, ignore_eos=True))  # unconstrained beside
    reference = _run(_tiny(backend, plan_ahead=False), prompts, params)
    engine = _tiny(backend, launch_ahead=True)
    assert _run(engine, prompts, params) == reference
    stats = engine.stats
    assert stats["launches_ahead"] > 3
    assert 0 < stats["grammar_tokens_redrawn"] < stats["grammar_tokens_checked"]
    assert stats["launches_ahead_dropped"] > 0


def _on_one_output_buffer(engine: Engine) -> None:
    """Every pass of `engine` returns its logits in one buffer, as a CUDA graph's replays do
    (each writes its static output)."""
    real, buffers = engine.runner.launch, {}

    def launch(*args, **kwargs):
        out = real(*args, **kwargs)
        buffer = buffers.setdefault(out.shape[1], torch.empty(256, out.shape[1], device=DEVICE))
        buffer[: out.shape[0]].copy_(out)
        return buffer[: out.shape[0]]

    engine.runner.launch = launch


def test_a_refused_token_is_drawn_again_from_its_own_pass_logits(monkeypatch):
    """With the logits in one buffer (a graph's output), the pass launched ahead writes over
    the running pass's before its tokens are checked: a refused token is drawn again from the
    copy of its row kept at launch, the same tokens as planning nothing ahead. An
    unconstrained row before the checked ones is not in the kept span."""
    monkeypatch.setattr(grammar, "MASKED_FIRST_MAX", 0)  # every token checked first
    pattern = r"[ -~]{6,24}"
    prompts = [[5 + i, 6, 7 * i % 200] for i in range(4)]
    params = [SamplingParams(max_tokens=20, structured_outputs={"regex": pattern})] * 4
    params[0] = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = _run(_tiny("torch", plan_ahead=False), prompts, params)
    engine = _tiny("torch", launch_ahead=True)
    _on_one_output_buffer(engine)
    assert _run(engine, prompts, params) == reference
    assert engine.stats["launches_ahead_dropped"] > 0 and engine.stats["launches_ahead"] > 3


def test_launch_ahead_is_on_by_default_with_a_cuda_device_and_one_rank():
    """None (the default) resolves to on where the device runs apart from the host (CUDA),
    off on the CPU (a pass launched ahead runs at once there and gains nothing); a choice
    given is kept."""
    assert _tiny("torch").config.launch_ahead is None
    assert _tiny("torch").launch_ahead == (DEVICE == "cuda")
    assert _tiny("torch", launch_ahead=True).launch_ahead
    assert not _tiny("torch", launch_ahead=False).launch_ahead
    with pytest.raises(ValueError, match=r"launch_ahead='yes' is not allowed; it must be True"):
        _tiny("torch", launch_ahead="yes")
    # verify passes launched ahead where nothing is launched ahead: refused, not ignored
    with pytest.raises(ValueError, match=r"^verify_ahead=True with launch_ahead=None on cpu"):
        _tiny("torch", device="cpu", speculative=True, verify_ahead=True)


def test_a_plan_that_fits_is_kept_without_looking_for_rows_left():
    """Most steps leave the batch as planned: `fit` keeps the plan on the cheap layout check
    and looks for the rows left (`kept_rows`, a copy of the Running) only when it changed
    (it copies the Running: a third of a step's host work, done on every step)."""
    engine = _tiny("torch", launch_ahead=True)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(state, name)

        def kept_rows(self, planned, committed):
            calls.append(len(planned) - len(committed))
            return state.kept_rows(planned, committed)

    engine.ahead.machine = Counting()
    _run(engine, _prompts(4), _greedy(4))
    assert engine.stats["plans_ahead_used"] > 10
    assert calls and all(gone > 0 for gone in calls)  # only where requests left


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
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *_prompts(2)]
    params = _ahead_params()
    guesses = missed = taken_any = 0
    for pool in (256, 40):
        plain = _run_checking_rows(
            _tiny(backend)
            if pool == 256
            else _tiny(backend, speculative=True, launch_ahead=True, kv_cache_slots=pool),
            prompts,
            params,
        )
        engine = _tiny(
            backend, speculative=True, launch_ahead=True, verify_ahead=True, kv_cache_slots=pool
        )
        verify_step, taken = engine._verify_step, []

        def recording(trees, started, ahead=None, real=verify_step):
            taken.append(ahead is not None)
            return real(trees, started, ahead)

        engine._verify_step = recording
        got = _run_checking_rows(engine, prompts, params)
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
    engine = _tiny(backend, speculative=True, launch_ahead=True, verify_ahead=True)
    draft_in_turns(engine)
    got = _run_checking_rows(engine, prompts, params)
    want = _run_checking_rows(_tiny(backend), prompts, params)
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
    engine = _tiny("torch", speculative=True, launch_ahead=True, verify_ahead=True)
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
    requests = _run_checking_rows(engine, prompts, _ahead_params())
    assert failed and failed[0] > 0, f"no verify pass launched ahead failed at its {where}"
    _failed_cleanly(engine, requests, prompts)
