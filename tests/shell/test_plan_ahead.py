"""Planning each decode pass while the previous one runs (`plan_ahead`) changes no output and
loses no slot: requests finishing at different steps, stop tokens, seeded sampling, aborts
and retraction, on the torch backend and on the static (CUDA-graph) path of the Triton one.
On CUDA the graph path captures real graphs, and the plan overlaps a running replay. The
passes planned and launched around verify passes: `test_verify_ahead.py`."""

from __future__ import annotations

import os

import pytest
import torch
from engine_checks import holds
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_cases import (
    DEVICE,
    greedy_params,
    params_of,
    prompts_of,
    run_all,
    run_checking_rows,
    tiny_engine,
)

from engine import state
from engine.shell import grammar
from engine.shell.engine import Engine
from engine.shell.graphs import GraphRunner
from engine.shell.logits import Sampled
from engine.state import FinishReason, Mode, SamplingParams


@pytest.mark.parametrize("abort_at", [None, 5])
def test_plan_ahead_changes_no_output_torch_backend(abort_at):
    prompts = prompts_of(5)
    probe = tiny_engine("torch", plan_ahead=False)
    free_run = probe.generate(prompts[:1], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free_run[0].token_ids[8]
    params = params_of(5, stop)
    reference = run_all(probe, prompts, params, abort_at)
    ahead = tiny_engine("torch")
    got = run_all(ahead, prompts, params, abort_at)
    assert got == reference
    assert ahead.stats["plans_ahead_used"] > 5
    # each early leaver voids one plan, or is cut from it where it was launched (CUDA)
    assert ahead.stats["plans_ahead_dropped"] + ahead.stats["launches_ahead_narrowed"] >= 3
    assert probe.stats["plans_ahead_used"] == 0


def test_plan_ahead_under_retraction_keeps_outputs():
    prompts, params = prompts_of(4), params_of(4)
    reference = run_all(tiny_engine("torch", plan_ahead=False), prompts, params)
    tight = tiny_engine("torch", kv_cache_slots=48, max_running_requests=4)
    assert run_all(tight, prompts, params) == reference
    assert tight.stats["retractions"] > 0, "the pool was meant to force retraction"


def test_plan_ahead_continues_while_requests_wait_for_a_row():
    """Requests that cannot be admitted (every row taken) do not stop planning ahead; when
    a row frees, the plan is dropped and the next request is admitted at once."""
    prompts, params = prompts_of(5), params_of(5)
    reference = run_all(
        tiny_engine("torch", plan_ahead=False, max_running_requests=2), prompts, params
    )
    engine = tiny_engine("torch", max_running_requests=2)
    take = engine.ahead.take
    used_while_waiting = []

    def recording_take(running):
        prepared = take(running)
        if prepared is not None and engine.waiting:
            used_while_waiting.append(len(engine.waiting))
        return prepared

    engine.ahead.take = recording_take
    assert run_all(engine, prompts, params) == reference
    assert len(used_while_waiting) > 8


def test_plan_ahead_on_the_graph_path():
    """Six requests over graphs of at most four: the first passes run eagerly, and as requests
    leave, plans move to the captured (static-buffer) path."""
    prompts, params = prompts_of(6), params_of(6)
    reference = run_all(tiny_engine("triton", plan_ahead=False), prompts, params)
    engine = tiny_engine("triton")
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
    assert run_all(engine, prompts, params) == reference
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
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *prompts_of(2)]
    params = params_of(4)
    greedy = [SamplingParams(max_tokens=24, ignore_eos=True)] * 4
    # the Triton backend (minutes in the interpreter) with the small pool alone: retraction
    # among its plans; the large pool's steps are the torch backend's
    for pool in (256, 40) if backend == "torch" else (40,):
        plain = run_all(
            tiny_engine(backend, launch_ahead=False, kv_cache_slots=pool), prompts, greedy
        )
        # (a seeded sampler's draws under speculation depend on its batch: the same pool)
        reference = run_all(
            tiny_engine(
                backend, plan_ahead=False, speculative=True, launch_ahead=False, kv_cache_slots=pool
            ),
            prompts,
            params,
        )
        engine = tiny_engine(backend, speculative=True, launch_ahead=False, kv_cache_slots=pool)
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
        assert run_all(engine, prompts, params) == reference
        assert engine.stats["plans_ahead_used"] > 2
        assert any(verify_after_plan), "no verify pass followed a plan"
        greedy_engine = tiny_engine(
            backend, speculative=True, launch_ahead=False, kv_cache_slots=pool
        )
        assert run_all(greedy_engine, prompts, greedy) == plain
        assert greedy_engine.stats["plans_ahead_used"] > 5
        if pool == 40:
            assert greedy_engine.stats["retractions"] > 0, "the pool was meant to retract"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launch_ahead_with_speculation_defers_drafts(backend):
    """With speculation a step that drafted nothing launches the next pass ahead; where the
    next step's proposer then drafts, the launched pass decodes and the drafts wait a step
    (that step launches nothing ahead), so no verify pass ever finds a launched pass to
    drop. Greedy outputs are those of plain decoding; no slot is lost."""
    prompts = [[5, 6, 7, 8, 9] * 5, [40, 41, 42] * 6, *prompts_of(2)]
    greedy = [SamplingParams(max_tokens=32, ignore_eos=True)] * 4
    plain = run_all(tiny_engine(backend), prompts, greedy)
    engine = tiny_engine(backend, speculative=True, launch_ahead=True)
    launched_at_verify = []
    verify_step = engine._verify_step

    def recording_verify_step(*args):
        launched_at_verify.append(engine.ahead.launched)
        return verify_step(*args)

    engine._verify_step = recording_verify_step
    assert run_all(engine, prompts, greedy) == plain
    assert engine.stats["launches_ahead"] > 5, "no pass was launched ahead"
    assert engine.stats["drafts_deferred"] > 0, "no draft waited for a launched pass"
    assert launched_at_verify, "no verify pass ran"
    assert not any(launched_at_verify), "a verify pass dropped a pass launched ahead"


@pytest.mark.parametrize("launch_ahead", [False, True])
@pytest.mark.parametrize("failing", ["prepare", "launch", "fetch"])
def test_a_failure_around_a_plan_loses_no_slot(failing, launch_ahead):
    """A pass that fails while planning ahead, launching a prepared plan or reading its
    tokens (with the next pass launched ahead from them, or not): the requests of that pass
    end with "error", their slots and rows are back (the early table writes undone), and the
    engine serves the next request as before."""
    engine = tiny_engine("torch", launch_ahead=launch_ahead)
    prompts, params = prompts_of(3), params_of(3)
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
    requests = run_checking_rows(engine, prompts, params)
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
    reference = tiny_engine("torch", plan_ahead=False).generate(prompts[:1], params[:1])[0]
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
    settings_["verify_at_commit"] = draw(st.booleans())
    settings_["draft_min_match"] = draw(st.sampled_from([2, 4]))
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
    reference = run_all(
        tiny_engine("torch", plan_ahead=False, **settings_), prompts, params, abort_at
    )
    outputs = run_all(tiny_engine("torch", **settings_), prompts, params, abort_at)
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
    prompts = prompts_of(5)
    probe = tiny_engine(backend, plan_ahead=False)
    free_run = probe.generate(prompts[:1], SamplingParams(max_tokens=30, ignore_eos=True))
    params = greedy_params(5, free_run[0].token_ids[10])  # its 11th: no one leaves by length then
    reference = run_all(probe, prompts, params, abort_at)
    assert reference[0][1] == FinishReason.STOP
    engine = tiny_engine(backend, launch_ahead=True)
    replays = _on_graphs(engine, 4) if backend == "triton" else []
    assert run_all(engine, prompts, params, abort_at) == reference
    stats = engine.stats
    assert stats["launches_ahead"] > 5
    assert stats["launches_ahead_narrowed"] == 4  # the 4 who leave before the last one
    assert stats["launches_ahead_dropped"] == 1
    if backend == "triton":  # launched ahead on the static path: ids copied on the device
        assert any(args[2] is not None for args in replays)  # (graph, batch, input_ids, shift)


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
        dict(allowed_token_ids=(7, 40, 41, 99), repetition_penalty=1.5, logprobs=1),
    ],
)
def test_launch_ahead_beside_bias_penalties_and_logprobs(asked):
    """A bias does not depend on the tokens; penalties count the running pass's tokens on
    the device (the requests' histories lack them at launch); logprobs come from the
    launched pass's own logits there: passes are launched ahead beside all of them, with
    the same tokens and logprobs as planning nothing ahead, also when the others leave and
    the launched pass is cut to the request (its logprobs with it)."""
    prompts = prompts_of(3)
    params = greedy_params(3)
    params[2] = SamplingParams(max_tokens=16, ignore_eos=True, **asked)  # the last to leave

    def run(engine):
        requests = [engine._submit(p, q, None, None) for p, q in zip(prompts, params, strict=True)]
        while engine.has_work:
            engine.step()
            engine.check()
        return requests

    reference = run(tiny_engine("torch", plan_ahead=False))
    engine = tiny_engine("torch", launch_ahead=True)
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


def test_launch_ahead_keeps_bad_words_out_as_planning_nothing_does():
    """A bad word's last token is banned where the output ends with the rest of it; launched
    ahead, the output's last token is still on the device (the running pass's), and the ban
    that needs it is decided there: the same tokens as planning nothing ahead, and none of
    the bad words in them."""
    prompts = prompts_of(3)
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = tiny_engine("torch", plan_ahead=False)
    out = list(reference.generate(prompts[2:], free)[0].token_ids)
    words = ((out[2], out[3]), (out[5], out[6], out[7]), (out[10],))
    params = greedy_params(3)
    params[2] = SamplingParams(max_tokens=16, ignore_eos=True, bad_word_ids=words)
    want = run_all(reference, prompts, params)
    engine = tiny_engine("torch", launch_ahead=True)
    got = run_all(engine, prompts, params)
    assert got == want
    assert engine.stats["launches_ahead"] > 5
    banned = got[2][0]
    assert banned != out and banned[:3] == out[:3]  # the first ban changed its 4th token
    assert not any(holds(banned, word) for word in words)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launch_ahead_draws_what_sampling_after_the_tokens_draws(backend):
    """Seeded sampling rows launched ahead draw from their step count one step on (the
    pass's tokens have not reached their requests yet): the same tokens as planning nothing
    ahead, beside greedy rows. (An unseeded request draws from the engine seed and its uid,
    which differs between two engines.)"""
    prompts = prompts_of(4)
    params = [
        SamplingParams(max_tokens=14, temperature=0.9, top_k=30, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=1.2, top_p=0.9, seed=0, ignore_eos=True),
        SamplingParams(max_tokens=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, min_p=0.05, seed=5, ignore_eos=True),
    ]
    reference = run_all(tiny_engine(backend, plan_ahead=False), prompts, params)
    engine = tiny_engine(backend, launch_ahead=True)
    assert run_all(engine, prompts, params) == reference
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
    reference = run_all(tiny_engine(backend, plan_ahead=False), prompts, params)
    engine = tiny_engine(backend, launch_ahead=True)
    assert run_all(engine, prompts, params) == reference
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
    reference = run_all(tiny_engine("torch", plan_ahead=False), prompts, params)
    engine = tiny_engine("torch", launch_ahead=True)
    _on_one_output_buffer(engine)
    assert run_all(engine, prompts, params) == reference
    assert engine.stats["launches_ahead_dropped"] > 0 and engine.stats["launches_ahead"] > 3


def test_launch_ahead_is_on_by_default_with_a_cuda_device_and_one_rank():
    """None (the default) resolves to on where the device runs apart from the host (CUDA),
    off on the CPU (a pass launched ahead runs at once there and gains nothing); a choice
    given is kept."""
    assert tiny_engine("torch").config.launch_ahead is None
    assert tiny_engine("torch").launch_ahead == (DEVICE == "cuda")
    assert tiny_engine("torch", launch_ahead=True).launch_ahead
    assert not tiny_engine("torch", launch_ahead=False).launch_ahead
    with pytest.raises(ValueError, match=r"launch_ahead='yes' is not allowed; it must be True"):
        tiny_engine("torch", launch_ahead="yes")
    # verify passes launched ahead where nothing is launched ahead: refused, not ignored
    for name in ("verify_ahead", "walk_ahead"):
        with pytest.raises(ValueError, match=rf"^{name}=True with launch_ahead=None on cpu"):
            tiny_engine("torch", device="cpu", speculative=True, **{name: True})


def test_a_plan_that_fits_is_kept_without_looking_for_rows_left():
    """Most steps leave the batch as planned: `fit` keeps the plan on the cheap layout check
    and looks for the rows left (`kept_rows`, a copy of the Running) only when it changed
    (it copies the Running: a third of a step's host work, done on every step)."""
    engine = tiny_engine("torch", launch_ahead=True)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(state, name)

        def kept_rows(self, planned, committed):
            calls.append(len(planned) - len(committed))
            return state.kept_rows(planned, committed)

    engine.ahead.machine = Counting()
    run_all(engine, prompts_of(4), greedy_params(4))
    assert engine.stats["plans_ahead_used"] > 10
    assert calls and all(gone > 0 for gone in calls)  # only where requests left
