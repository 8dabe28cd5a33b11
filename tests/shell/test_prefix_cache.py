"""The prefix cache in the engine (tiny random model; on a GPU through Triton): greedy output
with it equals greedy output without it, LPM admission, and every way a request holding a
cached prefix leaves gives its lock back and loses no slot. The default model's multi-turn
chats: test_prefix_cache_model.py."""

from __future__ import annotations

import engine_checks
import numpy as np
import torch
from engine_checks import run, settled

from engine import SamplingParams
from engine.shell.engine import Engine
from engine.shell.failures import Faults

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the tiny model: Triton on a GPU


def tiny(**overrides) -> Engine:
    return engine_checks.tiny(**({"device": DEVICE} | overrides))


def family(seed: int, length: int) -> list[int]:
    """A prompt within the tiny vocabulary; one seed: one shared prefix."""
    return np.random.default_rng(seed).integers(3, 250, size=length).tolist()


def test_mixed_and_extend_only_passes_give_the_same_greedy_tokens():
    prompts = [family(i, 10 + 9 * i) for i in range(6)]
    results = []
    for mixed in (True, False):
        engine = tiny(mixed_passes=mixed, chunk_size=8)
        results.append([c.token_ids for c in engine.generate(prompts, GREEDY)])
        settled(engine)
    assert results[0] == results[1]


def test_a_shared_system_prompt_is_computed_once_and_matched_by_later_requests():
    engine = tiny(chunk_size=64)
    system = family(7, 60)
    prompts = [system + family(100 + i, 5) for i in range(6)]
    reference = tiny(prefix_cache=False).generate(prompts, GREEDY)
    completions = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in completions] == [r.token_ids for r in reference]
    # The first request prefills the system prompt; it enters the cache after that chunk and
    # every request admitted later starts from it.
    assert completions[0].usage.cached_tokens == 0
    assert all(c.usage.cached_tokens >= 60 for c in completions[1:])
    metrics = engine.metrics()
    assert metrics["cached_prompt_tokens"] >= 5 * 60
    assert 0 < metrics["prefix_cache_hit_rate"] < 1
    settled(engine)


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_keeps_arrival_order():
    system = family(3, 40)
    for policy, expected_first in (("lpm", "cached"), ("fcfs", "cold")):
        engine = tiny(schedule_policy=policy, max_running_requests=1)
        engine.generate([system + [9]], SamplingParams(max_tokens=1))  # cache the system prompt
        cold = engine.submit(family(4, 40), GREEDY)
        cached = engine.submit(system + [11, 12], GREEDY)
        engine.step()  # one row: one of them is admitted
        admitted = {engine.requests[int(uid)].request_id for uid in engine.running.rids}
        assert admitted == {cached if expected_first == "cached" else cold}
        run(engine)
        settled(engine)


def test_lpm_does_not_starve_a_request_without_a_cached_prefix():
    system = family(3, 30)
    engine = tiny(max_running_requests=1, max_waited_out=2)
    engine.generate([system + [9]], SamplingParams(max_tokens=1))
    cold_id = engine.submit(family(4, 30), SamplingParams(max_tokens=2, ignore_eos=True))
    order = []
    for i in range(6):
        engine.submit(system + [20 + i], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_work:
        engine.step()
        order.extend(engine.requests[int(u)].request_id for u in engine.running.rids)
    first_seen = list(dict.fromkeys(order))
    assert first_seen.index(cold_id) == 2  # passed over twice, then first
    settled(engine)


# --- every way out gives the lock back -------------------------------------------------------
def test_retraction_under_a_tiny_pool_releases_locks_and_evicts_before_retracting():
    system = family(11, 30)
    prompts = [system + family(200 + i, 4) for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = tiny(prefix_cache=False, kv_cache_slots=4000).generate(prompts, params)
    engine = tiny(kv_cache_slots=96, max_running_requests=4)
    for _ in range(2):  # the second time, the first's KV is cached
        completions = engine.generate(prompts, params)
        assert [c.token_ids for c in completions] == [r.token_ids for r in reference]
        settled(engine)
    assert engine.book.evictions > 0
    assert engine.stats["retractions"] > 0  # 4 requests of 54 tokens do not fit in 96 slots


def test_an_abort_mid_prefill_of_a_matched_prefix_caches_what_was_committed():
    system = family(12, 40)
    engine = tiny(chunk_size=8)
    engine.generate([system + [5]], SamplingParams(max_tokens=1))
    rid = engine.submit(system + family(13, 30), GREEDY)
    engine.step()  # admitted with the 40 cached tokens; its first chunk of 8 runs
    request = engine.by_request_id[rid]
    index = engine.running.index_of(request.uid)
    assert engine.running.shared_lens[index] >= 40
    assert engine.running.pending_lens[index] > 1  # still prefilling
    committed = int(engine.running.kv_lens.lens[index])
    engine.abort(rid)
    engine.step()
    settled(engine)
    assert (
        engine.book.cache.peek(request.id_array()).length == committed
    )  # its progress stays cached


def test_a_failed_pass_releases_the_locks_of_its_requests_and_caches_nothing_new():
    system = family(14, 40)
    engine = tiny()
    engine.generate([system + [5]], SamplingParams(max_tokens=1))
    cached_before = engine.book.cache.num_slots
    engine.faults = Faults.at(forward=[1])
    completion = engine.generate([system + [6, 7, 8]], GREEDY)[0]
    assert completion.finish_reason == "error"
    settled(engine)
    assert engine.book.cache.num_slots == cached_before


def test_requests_that_prefill_one_prompt_together_end_up_sharing_its_slots():
    prompt = family(15, 50)
    engine = tiny(chunk_size=16)
    for _ in range(3):
        engine.submit(prompt + [7], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()  # all three admitted cold: each prefills the same tokens
    while engine.running.pending_lens.max() > 1:
        engine.step()
        engine.check()  # each row starts with the cache's slots for its shared prefix
    rows = engine.book.table.host[engine.running.rows, :50]
    assert (rows == rows[0]).all()  # one copy of the prompt's KV
    run(engine)
    settled(engine)


def test_speculative_drafts_never_enter_the_cache():
    prompt = [5, 17, 23, 42, 9] * 6
    engine = tiny(speculative=True)
    completion = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert completion.speculation is not None and completion.speculation.drafted > 0
    settled(engine)
    # Only the committed tokens are cached (the last output token has no KV yet).
    committed = list(completion.prompt_token_ids + completion.token_ids)[:-1]
    assert engine.book.cache.num_slots == len(committed)
    assert engine.book.cache.peek(committed).length == len(committed)


def test_a_closed_stream_releases_its_lock():
    system = family(16, 30)
    engine = tiny()
    engine.generate([system + [5]], SamplingParams(max_tokens=1))
    stream = engine.stream(system + [6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)
    assert engine.book.cache.holders()
    stream.close()
    settled(engine)


def test_a_prompt_cached_but_for_its_last_token_samples_its_first_token_in_a_decode_pass():
    """A prompt sent again is cached but for its last token: one pending token, a decode
    row, so without speculation it joins the running decode pass (a graph's replay on a GPU)
    instead of starting an extend pass; its tokens are those of computing it, greedy and
    seeded alike. With speculation its first token still comes from an extend pass."""
    prompts = [family(40 + i, 12) for i in range(3)]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=8, ignore_eos=True),
    ]
    reference = [c.token_ids for c in tiny(prefix_cache=False).generate(prompts, params)]
    engine = tiny()
    assert [c.token_ids for c in engine.generate(prompts, params)] == reference
    engine.step_times.clear()
    again = engine.generate(prompts, params)  # every prompt cached now
    assert [c.token_ids for c in again] == reference
    assert all(c.usage.cached_tokens == 11 for c in again)
    assert [mode for mode, _ in engine.step_times].count("extend") == 0
    settled(engine)
    speculative = tiny(speculative=True)
    speculative.generate(prompts[:1], params[0])
    speculative.step_times.clear()
    speculative.generate(prompts[:1], params[0])
    assert [mode for mode, _ in speculative.step_times][0] == "extend"
    settled(speculative)


def test_a_scored_prompt_is_computed_whole_past_the_cache_and_scored_alike_in_chunks():
    """prompt_logprobs: a prompt the cache holds is computed whole again (each token's score
    needs the logits before it), in chunks beside other requests' decodes (on a GPU: eager
    passes beside captured ones), and scores as one whole pass without the cache does."""
    system = family(11, 30)
    prompts = [system + family(200 + i, 6) for i in range(3)]
    scored = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    want = tiny(prefix_cache=False, chunk_size=64).generate(prompts, scored)
    engine = tiny(chunk_size=8)
    engine.generate([system + [5]], GREEDY)  # the shared prefix is cached now
    engine.submit(family(300, 20), SamplingParams(max_tokens=30, ignore_eos=True))
    got = engine.generate(prompts, scored)  # beside the request above
    run(engine)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.usage.cached_tokens == 0 and mine.token_ids == theirs.token_ids
        assert mine.prompt_logprobs[0] is None and theirs.prompt_logprobs[0] is None
        pairs = list(zip(mine.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True))
        assert [a.token_id for a, _ in pairs] == list(mine.prompt_token_ids[1:])
        assert max(abs(a.logprob - b.logprob) for a, b in pairs) < 1e-3
        assert all(len(a.top) == 2 and a.top[0][0] == b.top[0][0] for a, b in pairs)
    settled(engine)
