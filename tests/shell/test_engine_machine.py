"""The engine as a model: hypothesis mixes submissions (greedy and sampled, long prompts that
chunk, prompts from a few shared families, multi-turn continuations of finished requests,
grammar-constrained requests, requests that score their prompts, ban words or allow a few
tokens, a pool small enough to evict cached prefixes and retract), aborts (also mid-prefill of
a matched prefix), streams closed early, speculation, mixed or extend-only passes, and faults
injected into forwards, sampling, verify walks and commits. After every step each slot is free,
owned by one request, or cached with a lock count equal to its holders, every row starts with
its request's cached prefix, and only requests in flight hold a grammar matcher; at the end
every request has finished, nothing is locked, the pool is whole, every constrained output is
one its grammar allows (whole, where it stopped), every prompt scored is scored whole, and no
output holds a word its request banned or a token it did not allow."""

from __future__ import annotations

import llguidance
import numpy as np
import pytest
from engine_checks import holds
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine import SamplingParams
from engine.errors import InvalidRequest
from engine.shell.engine import Engine
from engine.shell.failures import FAULT_POINTS, Faults
from engine.state import StructuredOutputs

MAX_CONTEXT = 96
FAMILIES = 3  # shared prompt prefixes ("system prompts")
GRAMMARS = [  # on random weights, token id i < 256 is byte i
    StructuredOutputs(regex="[a-d]{2,9}"),
    StructuredOutputs(choice=("yes", "no", "maybe not")),
    StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[0-9]/\n'),
    StructuredOutputs(
        json={
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"],
        }
    ),
]


BAD_WORDS = ((254, 254), (156, 254, 254), (100,), (225, 149))
ALLOWED = tuple(range(100, 160))


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.requests: list = []

    @initialize(
        speculative=st.booleans(),
        slots=st.sampled_from([48, 64, 400]),
        chunk=st.sampled_from([6, 64]),
        plan_ahead=st.booleans(),
        launch_ahead=st.booleans(),
        verify_ahead=st.booleans(),
        verify_at_commit=st.booleans(),
        min_match=st.sampled_from([2, 4]),
        prefix_cache=st.sampled_from([True, True, True, False]),
        mixed=st.booleans(),
        policy=st.sampled_from(["lpm", "fcfs"]),
    )
    def start(
        self,
        speculative: bool,
        slots: int,
        chunk: int,
        plan_ahead: bool,
        launch_ahead: bool,
        verify_ahead: bool,
        verify_at_commit: bool,
        min_match: int,
        prefix_cache: bool,
        mixed: bool,
        policy: str,
    ) -> None:
        self.engine = Engine(
            prefix_cache=prefix_cache,
            mixed_passes=mixed,
            schedule_policy=policy,
            max_waited_out=3,
            random_weights="tiny",
            device="cpu",
            dtype="float32",
            max_context=MAX_CONTEXT,
            kv_cache_slots=slots,
            chunk_size=chunk,
            max_running_requests=4,
            speculative=speculative,
            plan_ahead=plan_ahead,
            launch_ahead=launch_ahead,
            # verify passes launched ahead need speculation and launches (refused otherwise)
            verify_ahead=verify_ahead and speculative and launch_ahead,
            verify_at_commit=verify_at_commit,
            draft_min_match=min_match,
            draft_budget=6,
            draft_cost=0.1,
        )
        self.engine.faults = Faults.at()

    def _params(self, max_tokens: int, sampled: bool, seed: int) -> SamplingParams:
        """Sampled or greedy; one request in three with penalties (a pass launched ahead
        counts the running pass's tokens into them on the device); one in four scoring its
        prompt (computed whole, past the prefix cache, and again after a retraction)."""
        extra: dict = dict(frequency_penalty=0.5, repetition_penalty=1.2) if seed % 3 == 0 else {}
        if seed % 4 == 1:
            extra["prompt_logprobs"] = seed % 3
        if seed % 5 == 3:  # tokens the tiny model repeats, in words of one to three
            extra["bad_word_ids"] = BAD_WORDS
        if seed % 7 == 5:
            extra["allowed_token_ids"] = ALLOWED
        if sampled:
            return SamplingParams(
                max_tokens=max_tokens, temperature=0.8, top_k=20, seed=seed, **extra
            )
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)

    def _prompt(self, length: int, seed: int) -> list[int]:
        motif = np.random.default_rng(seed).integers(3, 250, size=5).tolist()
        return (motif * (length // 5 + 1))[:length]  # recurring: the proposer drafts from it

    @rule(
        count=st.integers(1, 3),
        length=st.integers(1, 36),
        max_tokens=st.integers(1, 16),
        sampled=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def submit(self, count: int, length: int, max_tokens: int, sampled: bool, seed: int) -> None:
        for i in range(count):
            params = self._params(max_tokens + i, sampled, seed + i)
            prompt = self._prompt(length + 3 * i, seed + i)
            self.requests.append(self.engine._submit(prompt, params, None, None))

    @rule(
        family=st.integers(0, FAMILIES - 1),
        shared=st.integers(4, 30),
        own=st.integers(0, 8),
        max_tokens=st.integers(1, 12),
        sampled=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def submit_family(
        self, family: int, shared: int, own: int, max_tokens: int, sampled: bool, seed: int
    ) -> None:
        """A prompt that starts with one of a few shared prefixes (cut anywhere)."""
        prompt = self._prompt(30, 1000 + family)[:shared] + self._prompt(own, seed)
        params = self._params(max_tokens, sampled, seed)
        self.requests.append(self.engine._submit(prompt, params, None, None))

    @rule(
        grammar=st.sampled_from(GRAMMARS),
        length=st.integers(1, 24),
        max_tokens=st.integers(1, 16),
        sampled=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def submit_constrained(
        self,
        grammar: StructuredOutputs,
        length: int,
        max_tokens: int,
        sampled: bool,
        seed: int,
    ) -> None:
        """A request whose output its grammar constrains (greedy, or sampled)."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if sampled else 0.0,
            seed=seed,
            structured_outputs=grammar,
        )
        self.requests.append(self.engine._submit(self._prompt(length, seed), params, None, None))

    @precondition(lambda self: any(r.done and r.error is None for r in self.requests))
    @rule(data=st.data(), extra=st.integers(1, 8), max_tokens=st.integers(1, 8))
    def continue_conversation(self, data: st.DataObject, extra: int, max_tokens: int) -> None:
        """The next turn: a finished request's prompt and output, and a new message."""
        done = [r for r in self.requests if r.done and r.error is None]
        previous = data.draw(st.sampled_from(done))
        prompt = previous.all_ids + self._prompt(extra, len(self.requests))
        if len(prompt) + max_tokens > MAX_CONTEXT:
            return
        params = self._params(max_tokens, False, 0)
        if len(prompt) >= self.engine.book.slots.capacity:  # refused whole, nothing held
            with pytest.raises(InvalidRequest, match="the KV pool holds"):
                self.engine._submit(prompt, params, None, None)
            return
        self.requests.append(self.engine._submit(prompt, params, None, None))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self.engine.abort(request.request_id)

    @rule(point=st.sampled_from(FAULT_POINTS), after=st.integers(1, 3))
    def arm_fault(self, point: str, after: int) -> None:
        faults = self.engine.faults
        faults.plan[point] = faults.plan.get(point, frozenset()) | {faults.calls[point] + after}

    @rule(length=st.integers(1, 20), seed=st.integers(0, 2**16))
    def disconnect(self, length: int, seed: int) -> None:
        """A streaming consumer that goes away after its first delta."""
        stream = self.engine.stream(self._prompt(length, seed), self._params(12, False, seed))
        engine, steps = self.engine, []
        real_step = engine.step

        def bounded() -> None:  # the stream steps the engine until a delta comes
            steps.append(1)
            assert len(steps) <= 2000, "no delta in 2000 steps: a livelock"
            real_step()

        engine.step = bounded  # type: ignore[method-assign]
        try:
            first = next(stream)
            stream.close()
        finally:
            del engine.step
        assert first.request_id not in self.engine.by_request_id or first.finish_reason

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.engine.step()
            self.engine.check()

    @invariant()
    def every_slot_is_free_or_owned(self) -> None:
        if self.engine is not None:
            self.engine.check()

    @invariant()
    def only_requests_in_flight_hold_a_matcher(self) -> None:
        if self.engine is not None:
            assert self.engine.grammars.matchers.keys() <= self.engine.requests.keys()

    def teardown(self) -> None:
        engine = self.engine
        if engine is None:
            return
        for _ in range(2000):  # bounded: a livelock fails instead of hanging
            if not engine.has_work:
                break
            engine.step()
            engine.check()
        assert not engine.has_work, "the engine did not finish its work"
        assert all(r.done for r in self.requests), "a request never finished"
        for request in self.requests:
            reason = request.completion().finish_reason
            assert reason in ("stop", "length", "abort", "error")
            assert (reason == "error") == (request.error is not None)
            event(f"a request ended with {reason}")
        event(f"retractions: {min(engine.stats['retractions'], 1)}+")
        assert engine.book.num_available == engine.book.slots.capacity
        assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
        if engine.book.cache is not None:
            assert engine.book.cache.num_locked == 0 and not engine.book.cache.holders()
            event(
                "cached prompt tokens: "
                + ("some" if engine.stats["cached_prompt_tokens"] else "none")
            )
            event("evictions: " + ("some" if engine.book.evictions else "none"))
        for request in self.requests:
            self._check_grammar(request)
            self._check_prompt_scores(request)
            if request.params.bad_word_ids and request.error is None:
                assert not any(holds(request.output_ids, w) for w in BAD_WORDS)
                event("bad words: banned")
            if request.params.allowed_token_ids and request.error is None:
                assert set(request.output_ids) <= set(ALLOWED)
                event("allowed ids: kept to")
        assert not engine.grammars
        engine.faults = None  # and it serves on
        after = engine.generate([self._prompt(8, 0)], self._params(3, False, 0))[0]
        assert after.finish_reason == "length" and len(after.token_ids) == 3

    def _check_prompt_scores(self, request) -> None:
        """A request that asked for its prompt's logprobs and produced a token has every
        prompt token after the first scored, with as many alternatives as it asked for."""
        top = request.params.prompt_logprobs
        if top is None or not request.output_ids:
            return
        scores = request.completion().prompt_logprobs
        assert scores[0] is None and len(scores) == len(request.prompt_ids)
        for token, entry in zip(request.prompt_ids[1:], scores[1:], strict=True):
            assert entry.token_id == token and entry.logprob <= 0 and entry.rank >= 1
            assert len(entry.top) == top
        event("prompt logprobs: scored")

    def _check_grammar(self, request) -> None:
        """A constrained output is one its grammar allows; whole where it stopped."""
        spec = request.params.structured_outputs
        if spec is None:
            return
        if request.error is not None:  # only an injected fault ends a request with an error
            assert request.error.startswith("InjectedFault"), request.error
            return
        grammars = self.engine.grammars
        matcher = llguidance.LLMatcher(grammars.vocabulary, grammars.compile(spec), log_level=0)
        assert matcher.consume_tokens(request.output_ids), matcher.get_error()
        if request.completion().finish_reason == "stop":
            assert matcher.is_accepting()
        event(f"a constrained request ended with {request.completion().finish_reason}")


EngineMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestEngineMachine = EngineMachine.TestCase
