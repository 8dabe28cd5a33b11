"""Speculative decoding in the engine: greedy with speculation equals greedy without, token for
token (default model and a tiny random model), under retraction, with stops and max_tokens;
seeded sampling with speculation is reproducible."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.shell.engine import Engine
from engine.spec.cost import Fit, PassCost
from engine.state import SamplingParams

CODE = """class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count
"""
PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "encompasses seven million square kilometres, of which five and a half million are "
    "covered by the rainforest. The majority of the forest is contained within Brazil."
)
COPY_PROMPTS = [
    [
        {
            "role": "user",
            "content": "Repeat the following code, but rename the class Counter to "
            "Tally:\n\n" + CODE,
        }
    ],
    [{"role": "user", "content": "Summarize the following passage:\n\n" + PASSAGE}],
]
CHAT_PROMPT = [{"role": "user", "content": "List three colors."}]
PROMPTS = [*COPY_PROMPTS, CHAT_PROMPT]
GREEDY = SamplingParams(max_tokens=40)
TINY_VOCAB = 256
# A configured draft cost (in decoded tokens' time) for the tests that are not about its
# measurement: their trees, and so their passes, retractions and acceptance counts, do not
# follow the machine's timings.
DRAFT_COST = 0.1
# The pass times the measuring tests feed the cost model instead of wall-clock time.
SYNTHETIC = Fit(fixed=0.030, per_row=0.004, verify_premium=0.010)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine, spinning OpenMP threads are slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def spec_engine() -> Engine:
    """Shares the default model's weights with the session's `default_engine`."""
    return Engine(
        dtype="float32",
        device="cpu",
        max_running_requests=16,
        speculative=True,
        draft_cost=DRAFT_COST,
    )


@pytest.fixture(scope="module")
def measured_engine() -> Engine:
    """As `spec_engine`, but measuring its draft cost (the tests control what it measures)."""
    return Engine(dtype="float32", device="cpu", max_running_requests=16, speculative=True)


@pytest.fixture(scope="module")
def references(default_engine) -> list[tuple[int, ...]]:
    """Non-speculative greedy outputs of PROMPTS, each computed alone."""
    return [default_engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def _accepted(engine: Engine) -> int:
    return engine.metrics().get("spec_accepted_tokens_total", 0)


def _tiny(**overrides) -> Engine:
    settings = dict(random_weights="tiny", dtype="float32", device="cpu", draft_cost=DRAFT_COST)
    return Engine(**{**settings, **overrides})


def _repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Token-id prompts within the tiny vocabulary: a random motif repeated, with noise."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        motif = rng.integers(3, TINY_VOCAB, int(rng.integers(2, 7))).tolist()
        noise = rng.integers(3, TINY_VOCAB, int(rng.integers(0, 5))).tolist()
        prompts.append(noise + motif * int(rng.integers(1, 5)))
    return prompts


def _synthetic_timings(engine: Engine, monkeypatch) -> list[tuple[int, bool]]:
    """A fresh cost model for `engine` that is fed SYNTHETIC's time for each pass the engine
    times, in place of the wall-clock seconds; returns the (rows, verify) of those passes."""
    cost, observed = PassCost(), []
    observe = cost.observe

    def synthetic(rows: int, seconds: float, verify: bool = False) -> None:
        observed.append((rows, verify))
        fixed, per_row, premium = SYNTHETIC
        observe(rows, fixed + per_row * rows + premium * verify, verify)

    monkeypatch.setattr(cost, "observe", synthetic)
    monkeypatch.setattr(engine.spec, "cost", cost)
    return observed


# --- (a) the default model -------------------------------------------------------------------
def test_default_model_batch_1_equals_plain_greedy(
    measured_engine, references, assert_all_free, monkeypatch
):
    spec = measured_engine.spec
    observed = _synthetic_timings(measured_engine, monkeypatch)
    judged = []  # (the draft cost a verify pass was judged with, the fit it came from)
    draft_cost = spec.draft_cost
    monkeypatch.setattr(
        spec,
        "draft_cost",
        lambda batch: judged.append((draft_cost(batch), spec.cost.fit())) or judged[-1][0],
    )
    before = _accepted(measured_engine)
    for prompt, reference in zip(PROMPTS, references, strict=True):
        assert measured_engine.generate([prompt], GREEDY)[0].token_ids == reference
    assert _accepted(measured_engine) > before, "copy-heavy prompts should accept some drafts"
    assert_all_free(measured_engine)
    # the engine timed its decode passes (one row each, at batch 1) and verify passes of
    # several row counts: enough to tell the three parts of a pass's time apart
    assert {rows for rows, verify in observed if not verify} == {1}
    assert len({rows for rows, verify in observed if verify}) > 1
    # adaptive drafting weighed the drafts with the cost fitted from these passes' times (the
    # synthetic ones, recovered), and the metric reports the one it used
    used, fit = judged[-1]
    assert fit == pytest.approx(SYNTHETIC, rel=1e-6)  # None (unfitted) fails here
    # the metric is the cost the last verify pass (batch 1) was judged with: its fit's
    # per_row / (fixed + per_row)
    assert measured_engine.metrics()["spec_draft_cost"] == used
    assert used == pytest.approx(fit.per_row / (fit.fixed + fit.per_row), rel=1e-12)
    assert used == pytest.approx(SYNTHETIC.per_row / (SYNTHETIC.fixed + SYNTHETIC.per_row))


def test_default_model_mixed_batch_equals_plain_greedy(spec_engine, references, assert_all_free):
    # Different lengths in one batch, plus a sampling request: the greedy rows then verify
    # through rejection sampling against one-hot targets, and must still match.
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    outputs = spec_engine.generate(
        [*PROMPTS, "The quick brown fox"], [GREEDY, SamplingParams(max_tokens=17), GREEDY, sampled]
    )
    assert outputs[0].token_ids == references[0]
    assert outputs[1].token_ids == references[1][:17]
    assert outputs[2].token_ids == references[2]
    assert 0 < len(outputs[3].token_ids) <= 24
    assert_all_free(spec_engine)


# --- (b) a tiny random-weight model over many random prompts ---------------------------------
def test_tiny_model_random_prompts_equal_plain_greedy():
    plain, spec = _tiny(), _tiny(speculative=True)
    rng = np.random.default_rng(5)
    for seed in range(4):
        prompts = _repetitive_prompts(seed, 10)
        params = [
            SamplingParams(max_tokens=int(n), ignore_eos=True)
            for n in rng.integers(1, 40, len(prompts))
        ]
        expected = [c.token_ids for c in plain.generate(prompts, params)]
        assert [c.token_ids for c in spec.generate(prompts, params)] == expected
        # Each alone (batch 1) too, for a few of them.
        for i in range(0, len(prompts), 4):
            assert spec.generate([prompts[i]], params[i])[0].token_ids == expected[i]
    assert _accepted(spec) > 0
    spec.check()
    assert spec.book.num_available == spec.book.slots.capacity


def test_tiny_model_context_limit_with_speculation():
    prompts = _repetitive_prompts(11, 4)
    # each fills the context exactly (a max_tokens beyond the room left is refused)
    params = [SamplingParams(max_tokens=48 - len(p), ignore_eos=True) for p in prompts]
    plain, spec = _tiny(max_context=48), _tiny(max_context=48, speculative=True)
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert len(prompt) + len(have.token_ids) == 48
        assert have.finish_reason == "length"


# --- (c) retraction during speculative decoding ----------------------------------------------
def _run_checked(
    engine: Engine, prompts: list, params: SamplingParams, max_steps: int | None = None
) -> tuple[list, list[str]]:
    """generate(), stepping by hand so that slot conservation is checked after every step
    (at most `max_steps`: a livelock fails instead of hanging). Returns the requests and
    what each speculative step ran ("verify", "decode" or "retract")."""
    modes: list[str] = []
    run_decode = engine._run_decode

    def recording() -> str:
        modes.append(run_decode())
        return modes[-1]

    engine._run_decode = recording
    uids = [engine.submit(p, params) for p in prompts]
    engine._drain_inbox()
    requests = [engine.by_request_id[u] for u in uids]
    steps = 0
    while engine.has_work:
        assert max_steps is None or steps < max_steps, "the engine did not finish its work"
        engine.step()
        engine.check()
        steps += 1
    assert all(r.done for r in requests)
    return requests, modes


def _outputs(requests: list) -> list[tuple[int, ...]]:
    return [tuple(r.output_ids) for r in requests]


def _tight_pool_case() -> tuple[list[list[int]], SamplingParams, list, Engine]:
    """Prompts, params and plain outputs, and a speculative engine whose pool holds the
    longest request with its tree and 8 slots more: six at once must retract."""
    prompts = _repetitive_prompts(21, 6)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = [c.token_ids for c in _tiny().generate(prompts, params)]
    longest = max(len(p) for p in prompts) + 30 + 13
    tight = _tiny(speculative=True, kv_cache_slots=longest + 8, max_running_requests=6)
    return prompts, params, expected, tight


def test_tiny_pool_retraction_keeps_outputs_and_frees_every_slot(assert_all_free):
    prompts, params, expected, tight = _tight_pool_case()
    requests, modes = _run_checked(tight, prompts, params)
    assert _outputs(requests) == expected
    assert "retract" in modes, "the pool was meant to force retraction while verifying"
    assert _accepted(tight) > 0
    assert_all_free(tight)


def test_a_draft_less_step_records_statistics_only_if_it_decodes(assert_all_free):
    """Nothing is drafted (the proposer returns roots): every step is a decode pass, and its
    statistics are recorded while the pass runs. A step that retracts instead records
    nothing (recording before the pass, as before its reservation, would count it)."""
    prompts, params, expected, tight = _tight_pool_case()
    spec = tight.spec
    spec.proposer.may_draft = lambda rid: True  # asked for trees every step
    draft = spec.proposer.draft_batch
    spec.proposer.draft_batch = lambda rids, budgets, **kw: draft(rids, [0] * len(rids))
    recorded: list[int] = []
    record_batch, record_idle = spec.stats.record_batch, spec.stats.record_idle

    def recording(rids, trees, accepted, *costs) -> None:
        recorded.append(len(rids))
        record_batch(rids, trees, accepted, *costs)

    def recording_idle(rids) -> None:  # a step that drafted nothing (`record_plain`)
        recorded.append(len(rids))
        record_idle(rids)

    spec.stats.record_batch, spec.stats.record_idle = recording, recording_idle
    requests, modes = _run_checked(tight, prompts, params)
    assert _outputs(requests) == expected
    assert set(modes) == {"decode", "retract"}, "the pool was meant to force retraction"
    assert len(recorded) == modes.count("decode")
    assert tight.spec.stats.total().drafted == 0
    assert_all_free(tight)


def test_requests_at_budget_zero_are_not_proposed_for(assert_all_free):
    """Where every request's budget is 0 (drafting lost it time), a step asks the proposer
    nothing and builds no trees: it decodes, records an idle step, and gives the tokens of
    plain decoding."""
    prompts = _repetitive_prompts(5, 3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = [c.token_ids for c in _tiny().generate(prompts, params)]
    engine = _tiny(speculative=True)
    spec = engine.spec
    spec.stats.budget = lambda rid: 0

    def refuse(*args, **kwargs):
        raise AssertionError("the proposer was asked for trees at budget 0")

    spec.proposer.draft_batch = spec.proposer.may_draft = refuse
    requests, modes = _run_checked(engine, prompts, params)
    assert _outputs(requests) == expected
    assert set(modes) == {"decode"}
    total = spec.stats.total()
    assert total.drafted == 0 and total.steps >= modes.count("decode")
    assert_all_free(engine)


@pytest.mark.parametrize("verify_ahead", [False, True])
def test_drafts_that_wait_for_a_pass_launched_ahead_are_only_probed(verify_ahead, assert_all_free):
    """Where a decode pass launched ahead runs the step, drafts found then wait for the next
    step, which proposes again: the step asks only whether any request drafts (each tree its
    best draft alone), unless the verify pass after it is launched on them (`verify_ahead`:
    whole trees). Greedy outputs stay those of plain decoding."""
    prompts = _repetitive_prompts(7, 3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = [c.token_ids for c in _tiny().generate(prompts, params)]
    engine = _tiny(speculative=True, launch_ahead=True, verify_ahead=verify_ahead)
    spec = engine.spec
    propose = spec.propose
    asked: list[tuple[bool, bool, int]] = []  # (probe, launched ahead, most drafts a tree)

    def noted(running, free_slots, probe=False):
        trees = propose(running, free_slots, probe)
        most = 0 if trees is None else int(trees.sizes.lens.max()) - 1
        asked.append((probe, engine.ahead.launched, most))
        return trees

    spec.propose = noted
    requests, _ = _run_checked(engine, prompts, params)
    assert _outputs(requests) == [tuple(t) for t in expected]
    probes = [most for probe, _, most in asked if probe]
    assert all(probe == (launched and not verify_ahead) for probe, launched, _ in asked)
    assert all(most <= 1 for most in probes)
    if not verify_ahead:
        assert any(most == 1 for most in probes), "no step probed drafts that wait"
    assert any(most > 1 for probe, _, most in asked if not probe)
    assert_all_free(engine)


@pytest.mark.parametrize(
    ("settings", "min_match"),
    [
        (dict(), 2),
        (dict(launch_ahead=True), 2),
        (dict(draft_min_match=3), 3),
        (dict(launch_ahead=True, draft_min_match=4), 4),
        (dict(draft_min_match=9), 9),
    ],
)
def test_the_shortest_match_a_draft_continues(settings, min_match):
    """`draft_min_match` (default 2) reaches the proposer (the longest match tried is at
    least it). A text whose last `min_match` tokens occurred before, followed by a token,
    drafts that token; one whose last `min_match` tokens did not (only a shorter suffix did)
    drafts nothing."""
    spec = _tiny(speculative=True, **settings).spec
    assert spec is not None
    assert spec.config.min_match == spec.proposer.config.min_match == min_match
    assert spec.proposer.config.max_match == max(min_match, 6)
    motif, other = list(range(10, 10 + min_match)), list(range(40, 40 + min_match))
    spec.add_request(1, [3, *motif, 4, *motif])  # its last min_match tokens, then 4, before
    spec.add_request(2, [3, *other[1:], 4, 5, *other])  # only the last min_match - 1 before
    drafted = spec.proposer.propose_batch([1, 2], [4, 4])
    first, second = drafted.sizes.lens.tolist()
    assert first > 1 and drafted.tokens[1] == 4  # request 1's root has 4 below it
    assert second == 1  # request 2's root alone


@pytest.mark.parametrize("prompt_len", [20, 32])
def test_a_request_near_the_pools_size_runs_as_without_speculation(prompt_len, assert_all_free):
    """A pool of 40 slots, alone. 32 prompt tokens: the pool holds them and one more, not a
    whole draft tree (12 + 1): such a request used to wait forever (nothing running, never room
    for its tree). 20: once the pool has fewer free slots than a tree, a verify pass used to
    finish it (alone and too big) where a decode pass goes on. Its drafts are now cut to the
    free slots: the same tokens and finish reason as without speculation."""
    prompt = [7, 8, 9, 10] * (prompt_len // 4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = _tiny(kv_cache_slots=40).generate([prompt], params)[0]
    engine = _tiny(speculative=True, kv_cache_slots=40)
    # bounded: the old livelock (the request never admitted) must fail, not hang
    (request,), _ = _run_checked(engine, [prompt], params, max_steps=200)
    assert tuple(request.output_ids) == expected.token_ids
    assert request.finish_reason.openai == expected.finish_reason
    assert _accepted(engine) > 0
    assert_all_free(engine)


def test_default_model_retraction_with_speculation(references, assert_all_free):
    # Alone, each request fits (at most ~130 + 40 tokens plus a 13-node tree); together not.
    tight = Engine(
        dtype="float32",
        device="cpu",
        speculative=True,
        draft_cost=DRAFT_COST,
        kv_cache_slots=200,
        max_running_requests=3,
    )
    outputs = _outputs(_run_checked(tight, PROMPTS, GREEDY)[0])
    assert outputs == references
    assert tight.stats["retractions"] > 0, "the pool was meant to force retraction"
    assert_all_free(tight)


def test_each_completion_carries_its_acceptance_statistics():
    """Per request, what its verify steps drafted and accepted, handed back when it finishes
    (in the completion and in its last delta); the requests' counts add up to the total."""
    prompts = _repetitive_prompts(5, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = _tiny(speculative=True, draft_cost=0.05)  # budgets independent of timings
    done = engine.generate(prompts, params)
    stats = [c.speculation for c in done]
    assert all(s is not None and s.steps > 0 for s in stats)
    assert all(sum(s.histogram) == s.steps for s in stats)
    total = engine.spec.stats.total()
    assert sum(s.accepted for s in stats) == total.accepted > 0
    assert sum(s.drafted for s in stats) == total.drafted
    assert sum(s.steps for s in stats) == total.steps
    deltas = list(engine.stream(prompts[0], params))
    assert deltas[-1].speculation == engine.generate([prompts[0]], params)[0].speculation
    assert all(d.speculation is None for d in deltas[:-1])
    assert _tiny().generate(prompts[:1], params)[0].speculation is None


# --- (d) sampling ----------------------------------------------------------------------------
def test_seeded_sampling_with_speculation_is_reproducible(spec_engine):
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=1234)
    first = spec_engine.generate([COPY_PROMPTS[0], CHAT_PROMPT], params)
    second = spec_engine.generate([CHAT_PROMPT, COPY_PROMPTS[0]], params)
    assert first[0].token_ids == second[1].token_ids
    assert first[1].token_ids == second[0].token_ids
    tiny = _tiny(speculative=True)
    prompts = _repetitive_prompts(3, 6)
    runs = [
        [
            c.token_ids
            for c in tiny.generate(
                prompts, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
            )
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_seeded_sampling_does_not_depend_on_the_measured_draft_cost(measured_engine, monkeypatch):
    # The measured cost comes from timings; a seeded request's budget must not follow it,
    # or its trees, and so its tokens, would change from run to run.
    seeded = SamplingParams(max_tokens=48, temperature=0.3, seed=5)
    runs, seeded_costs, greedy_costs = [], [], []
    spec = measured_engine.spec
    original = spec.stats._adapt  # given what a request's drafting step cost

    def recording(seen: list[float]):
        return lambda entry, d, a, cost: (seen.append((d, cost)), original(entry, d, a, cost))

    for measured in (0.0, 1.0):
        monkeypatch.setattr(spec.cost, "draft_cost", lambda batch, c=measured: c)
        monkeypatch.setattr(spec.cost, "verify_premium", lambda batch, c=measured: c)
        seen: list[float] = []
        monkeypatch.setattr(spec.stats, "_adapt", recording(seen))
        runs.append([c.token_ids for c in measured_engine.generate(COPY_PROMPTS[:2], seeded)])
        seeded_costs.append({cost for _, cost in seen})
        seen = []
        monkeypatch.setattr(spec.stats, "_adapt", recording(seen))
        measured_engine.generate(COPY_PROMPTS[:1], SamplingParams(max_tokens=24))
        greedy_costs.append(list(seen))
        monkeypatch.setattr(spec.stats, "_adapt", original)
    assert runs[0] == runs[1]
    assert seeded_costs == [{0.0}, {0.0}]  # judged as if drafts were free, whatever is measured
    # greedy requests follow it: alone in its passes, a step of d drafts costs d * c plus the
    # whole premium (1.0 when measured 1.0), a step without drafts nothing
    assert {cost for _, cost in greedy_costs[0]} == {0.0}
    assert any(d for d, _ in greedy_costs[1])
    assert all(cost == (d * 1.0 + 1.0 if d else 0.0) for d, cost in greedy_costs[1])


# --- (e) stops and max_tokens ----------------------------------------------------------------
def test_stop_token_inside_an_accepted_path_ends_the_request_there(spec_engine, references):
    prompt, free_run = COPY_PROMPTS[0], list(references[0])
    steps: list[list[int]] = []
    original = spec_engine.spec.extend

    def recording(uid: int, tokens: list[int]) -> None:
        steps.append(list(tokens))
        original(uid, tokens)

    spec_engine.spec.extend = recording
    try:
        assert spec_engine.generate([prompt], GREEDY)[0].token_ids == tuple(free_run)
    finally:
        del spec_engine.spec.extend
    # A token emitted as an accepted draft (not the bonus), at its first occurrence.
    position, stop_id = None, None
    emitted = len(steps[0])  # the prefill's sampled token
    for tokens in steps[1:]:
        for offset, token in enumerate(tokens[:-1]):
            if position is None and free_run.index(token) == emitted + offset:
                position, stop_id = emitted + offset, token
        emitted += len(tokens)
    assert stop_id is not None, "no accepted draft to stop at"
    stopped = spec_engine.generate(
        [prompt], SamplingParams(max_tokens=40, stop_token_ids=(stop_id,))
    )[0]
    assert list(stopped.token_ids) == free_run[: position + 1]
    assert stopped.finish_reason == "stop"
    spec_engine.check()


def test_max_tokens_is_respected_exactly(spec_engine, references, assert_all_free):
    counts = [1, 2, 5, 13, 19]
    assert len(references[0]) >= max(counts)
    outputs = spec_engine.generate(
        [COPY_PROMPTS[0]] * len(counts),
        [SamplingParams(max_tokens=n, ignore_eos=True) for n in counts],
    )
    for count, output in zip(counts, outputs, strict=True):
        assert output.token_ids == references[0][:count]
        assert output.finish_reason == "length"
    assert_all_free(spec_engine)
