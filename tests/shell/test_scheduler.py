"""The scheduling policy's pure decisions: chunked and mixed pass plans, admission, LPM."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.shell.scheduler import (
    admission_order,
    count_admissible,
    most_extend_tokens,
    newest,
    plan_extend,
)
from engine.state import FinishRules, Running


def _running(kv_lens, token_lens, prompt_lens=None) -> Running:
    """Requests past their first sample (prompt_lens 1) unless `prompt_lens` says so."""
    n = len(kv_lens)
    rules = FinishRules([99] * n, [0] * n, [-1] * n, np.zeros((n, 0), dtype=np.int64))
    prompt_lens = [1] * n if prompt_lens is None else prompt_lens
    return Running.admitted(
        range(n), range(n), token_lens, prompt_lens, [1] * n, rules, 512, kv_lens=kv_lens
    )


def test_extend_plan_chunks_pending_tokens_under_the_budget_in_order():
    running = _running([0, 10, 4, 0], [30, 11, 20, 5])  # pending 30, 1, 16, 5
    plan = plan_extend(running, token_budget=40, mixed=False)
    assert plan.indices.tolist() == [0, 2]  # request 1 waits for its decode; request 3 too
    assert plan.chunk_lens.tolist() == [30, 10]
    assert plan.num_tokens == 40
    assert plan_extend(_running([3, 7], [4, 8]), 40) is None  # all ready to decode


def test_a_mixed_plan_carries_every_decode_inside_the_budget():
    running = _running([0, 10, 4, 0, 6], [30, 11, 20, 5, 7])  # pending 30, 1, 16, 5, 1
    plan = plan_extend(running, token_budget=40)
    assert plan.indices.tolist() == [0, 1, 2, 4]  # batch order; request 3 waits
    assert plan.chunk_lens.tolist() == [30, 1, 8, 1]  # 38 prefill tokens + 2 decodes
    assert plan.num_tokens == 40
    assert plan_extend(_running([3, 7], [4, 8]), 40) is None  # only decodes: a decode pass


def test_full_mixed_passes_keep_one_token_count_however_many_requests_decode():
    for decoding in range(0, 30, 7):
        running = _running([0] * 3 + [5] * decoding, [200] * 3 + [6] * decoding)
        assert plan_extend(running, 64, mixed_budget=256).num_tokens == 64


def test_decodes_past_half_the_budget_leave_the_prompts_half_of_it():
    running = _running([0] + [5] * 12, [30] + [6] * 12)  # 12 decodes, a budget of 8
    assert plan_extend(running, 8).chunk_lens.tolist() == [4] + [1] * 12
    assert plan_extend(running, 8, mixed_budget=3).chunk_lens.tolist() == [3] + [1] * 12
    assert plan_extend(running, 8, mixed=False).chunk_lens.tolist() == [8]
    assert plan_extend(running, 20).chunk_lens.tolist() == [10] + [1] * 12
    assert plan_extend(running, 30).chunk_lens.tolist() == [18] + [1] * 12


def test_a_mixed_plan_prefills_at_most_its_own_budget_while_requests_decode():
    decoding = _running([0, 10], [30, 11])  # pending 30, then a decode
    assert plan_extend(decoding, 40, mixed_budget=8).chunk_lens.tolist() == [8, 1]
    assert plan_extend(decoding, 40, mixed=False, mixed_budget=8).chunk_lens.tolist() == [30]
    alone = _running([0], [30])  # nobody decodes: the whole budget
    assert plan_extend(alone, 40, mixed_budget=8).chunk_lens.tolist() == [30]
    # a burst: three prompts waiting for their first token get 8 tokens each in all
    burst = _running([0, 0, 0, 10], [30, 30, 30, 11], prompt_lens=[30, 30, 30, 1])
    plan = plan_extend(burst, 40, mixed_budget=8)
    assert plan.indices.tolist() == [0, 3] and plan.chunk_lens.tolist() == [24, 1]


def test_a_request_whose_prompt_was_cached_samples_its_first_token_in_an_extend_pass():
    # Request 0's prompt of 9 was cached but for its last token; request 1 is decoding.
    running = _running([8, 6], [9, 7], prompt_lens=[9, 3])
    plan = plan_extend(running, token_budget=40)
    assert plan.indices.tolist() == [0, 1] and plan.chunk_lens.tolist() == [1, 1]
    plan = plan_extend(running, token_budget=40, mixed=False)
    assert plan.indices.tolist() == [0] and plan.chunk_lens.tolist() == [1]
    # without speculation it joins the decode pass: one pending token each, a decode
    assert plan_extend(running, token_budget=40, first_in_extend=False) is None
    assert plan_extend(running, 40, mixed=False, first_in_extend=False) is None
    # a longer pending prompt still prefills, and the decodes ride along when mixed
    pending = _running([4, 6], [9, 7], prompt_lens=[9, 3])
    plan = plan_extend(pending, token_budget=40, first_in_extend=False)
    assert plan.indices.tolist() == [0, 1] and plan.chunk_lens.tolist() == [5, 1]


def test_admission_is_fcfs_and_counts_each_requests_next_step():
    # 10 free slots, nothing running: 4 + 1 and 4 + 1 fit; the third does not.
    assert (
        count_admissible([4, 4, 4], free_rows=8, free_slots=10, reserved_slots=0, token_budget=100)
        == 2
    )
    # A request is never admitted when only its prompt fits: its first decode would retract
    # it again (the livelock this rule prevents).
    assert (
        count_admissible([9], free_rows=8, free_slots=10, reserved_slots=1, token_budget=100) == 0
    )
    assert (
        count_admissible([8], free_rows=8, free_slots=10, reserved_slots=1, token_budget=100) == 1
    )
    # With speculation each request's next step needs room for its draft tree too...
    assert count_admissible([4, 4], 8, 20, 0, 100, step_slots=13) == 1
    # ...except the first with nothing running: room for one more token is enough (its
    # drafts are cut to the pool), or a request the pool holds would wait forever.
    assert count_admissible([30], 8, 40, 0, 100, step_slots=13) == 1
    assert count_admissible([39], 8, 40, 0, 100, step_slots=13) == 1  # 39 + 1 fill the pool
    assert count_admissible([40], 8, 40, 0, 100, step_slots=13) == 0
    assert count_admissible([27], 8, 40, 1, 100, step_slots=13) == 0
    # Rows, and the budget after the first request, also bound admission.
    assert (
        count_admissible([1, 1, 1], free_rows=2, free_slots=99, reserved_slots=0, token_budget=100)
        == 2
    )
    assert count_admissible([50, 60], 8, 999, 0, token_budget=40) == 1


def test_admission_counts_the_evictable_slots_a_cached_prefix_locks():
    # 10 slots available, 6 of them evictable cached ones that the first request's prefix
    # would lock: its 3 pending tokens + 1 + 6 locked fit; a second one's 3 + 1 do not.
    assert count_admissible([3, 3], 8, 10, 0, 100, locked_slots=[6, 0]) == 1
    assert count_admissible([3, 3], 8, 10, 0, 100, locked_slots=[0, 0]) == 2
    assert count_admissible([3], 8, 10, 0, 100, locked_slots=[7]) == 0


def test_lpm_orders_by_cached_prefix_and_aged_requests_go_first():
    assert admission_order([0, 50, 10, 50], [False] * 4) == [1, 3, 2, 0]  # ties: queue order
    assert admission_order([0, 50, 10, 50], [False, False, True, False]) == [2, 1, 3, 0]


def test_the_newest_request_is_retracted_first():
    assert newest(np.array([5, 9, 2])) == 1


def test_request_token_views_equal_the_joined_history():
    from engine.shell.request import Request
    from engine.state import SamplingParams

    request = Request("r", [1, 2, 3], SamplingParams(), output_ids=[4, 5])
    joined = request.all_ids
    assert request.num_tokens == len(joined) and request.last_token == joined[-1]
    for start in range(len(joined) + 1):
        for stop in range(start, len(joined) + 1):
            assert request.token_slice(start, stop) == joined[start:stop]
    assert Request("q", [7], SamplingParams()).last_token == 7


def test_a_prompt_still_prefilling_keeps_out_a_newcomer_it_would_retract():
    """A running request prefilling its prompt in chunks needs the rest of it: admission
    reserves each running request's pending tokens (not one slot each), or a newcomer is
    admitted, retracted by the chunk that follows, admitted again, and so on for ever (found
    by the engine state machine: a 48-slot pool, 6-token chunks, two prompts of 25 and 28
    tokens and a one-token one)."""
    from engine_checks import tiny

    from engine.state import SamplingParams

    engine = tiny(
        max_context=64,
        kv_cache_slots=48,
        chunk_size=6,
        max_running_requests=4,
        prefix_cache=True,
        mixed_passes=True,
        plan_ahead=False,
    )

    def prompt(length: int, seed: int) -> list[int]:
        motif = np.random.default_rng(seed).integers(3, 250, size=5).tolist()
        return (motif * (length // 5 + 1))[:length]

    prompts = [prompt(25, 0), prompt(28, 1), prompt(1, 0)]
    requests = [
        engine._submit(p, SamplingParams(max_tokens=n, ignore_eos=True), None, None)
        for p, n in zip(prompts, [1, 2, 4], strict=True)
    ]
    for _ in range(60):
        if not engine.has_work:
            break
        engine.step()
        engine.check()
    assert not engine.has_work, (
        f"still running after 60 steps: {engine.stats['retractions']} retractions"
    )
    assert all(r.finish_reason.openai == "length" for r in requests)


@settings(max_examples=200, deadline=None)
@given(
    pending=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    sampled=st.data(),
    budget=st.integers(1, 256),
    mixed=st.booleans(),
    mixed_budget=st.one_of(st.none(), st.integers(1, 64)),
)
def test_no_extend_pass_is_longer_than_the_bound_graphs_are_captured_to(
    pending, sampled, budget, mixed, mixed_budget
):
    """`most_extend_tokens` bounds every plan (the extend graphs stop there), and is reached:
    a full budget of prompt tokens, or half of it beside every other request's decode."""
    n = len(pending)
    kv = [5] * n
    first = sampled.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    prompt_lens = [k + p if f else 1 for k, p, f in zip(kv, pending, first, strict=True)]
    running = _running(kv, [k + p for k, p in zip(kv, pending, strict=True)], prompt_lens)
    plan = plan_extend(running, budget, mixed, mixed_budget)
    assert plan is None or plan.num_tokens <= most_extend_tokens(budget, n)
    # reached: one long prompt beside n - 1 decodes
    widest = _running([0] + [5] * (n - 1), [500] + [6] * (n - 1))
    assert plan_extend(widest, budget).num_tokens == most_extend_tokens(budget, n)
