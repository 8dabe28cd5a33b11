"""The Engine: owns the mutable resources and turns transitions' effects into changes.

One thread runs `step()`. Other threads only `submit` and `abort` through a thread-safe inbox.
"""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine import state
from engine.errors import InvalidRequest
from engine.shell import scheduler
from engine.shell.ahead import PlanAhead
from engine.shell.config import EngineConfig
from engine.shell.kv import KVBook
from engine.shell.request import Completion, Delta, Request
from engine.shell.runtime import Runtime, build_runtime
from engine.shell.textio import PromptInput, TextOutput, as_prompt_list, prompt_to_ids, to_params
from engine.state import FinishReason, FinishRules, Running, SamplingParams

Prompt = PromptInput


class Engine:
    """generate / stream / submit / abort over one model; `step()` advances every request."""

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        self.config = EngineConfig(model=model).replace(**overrides)
        self.runtime: Runtime = build_runtime(self.config)
        rt = self.runtime
        self.tokenizer = rt.tokenizer
        self.max_context = rt.max_context
        self.book = KVBook(
            rt.num_slots, self.config.max_running_requests, rt.max_context, rt.device
        )
        self.runner = rt.make_runner(self.book)
        self.running = Running.empty(rt.max_context)
        self.waiting: collections.deque[Request] = collections.deque()
        self.requests: dict[int, Request] = {}
        self.by_request_id: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sampling_uids: set[int] = set()  # requests with temperature > 0
        self.text = TextOutput(self.tokenizer)
        self.stats = collections.Counter()
        self.step_times: collections.deque = collections.deque(maxlen=1024)
        self.spec = rt.make_speculator(self.config) if self.config.speculative else None
        self.ahead = PlanAhead(self.book, self.runner, self.stats)  # the next decode pass

    # --- submission (any thread) ------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        sink: queue.SimpleQueue | None = None,
    ) -> str:
        """Validate and queue one request; raises InvalidRequest, allocating nothing."""
        return self._submit(prompt, params, request_id, sink).request_id

    def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None,
        request_id: str | None,
        sink: queue.SimpleQueue | None,
    ) -> Request:
        params = to_params(params)
        ids = prompt_to_ids(self.tokenizer, prompt)
        self._validate(ids)
        if request_id is not None and request_id in self.by_request_id:
            raise InvalidRequest(
                "request_id", f"{request_id!r} is already in use by a request that has not finished"
            )
        return self._enqueue(ids, params, request_id, sink)

    def _enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        sink: queue.SimpleQueue | None,
    ) -> Request:
        """Queue a request whose prompt and parameters are already validated."""
        request = Request(request_id or "", ids, params, sink=sink)
        if not request.request_id:
            request.request_id = f"req-{request.uid}"
        self._inbox.put(("add", request))
        return request

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its slots are freed at the next step."""
        self._inbox.put(("abort", request_id))

    def _validate(self, ids: list[int]) -> None:
        vocab = self.runtime.vocab_size
        if not ids:
            raise InvalidRequest("prompt", "is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                "prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) >= self.max_context:
            raise InvalidRequest(
                "prompt",
                f"prompt has {len(ids)} tokens; max_context is "
                f"{self.max_context} (room for one output token is needed)",
            )
        if len(ids) + 1 > self.book.slots.capacity:
            raise InvalidRequest(
                "prompt",
                f"prompt has {len(ids)} tokens; the KV pool holds {self.book.slots.capacity}",
            )

    # --- the loop (one thread) ----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(len(self.running) or self.waiting or not self._inbox.empty())

    def step(self) -> None:
        """Advance every request by one forward pass (or admit/abort only)."""
        started = time.perf_counter()
        self._drain_inbox()
        self._admit()
        self.ahead.drop_unless_fits(self.running)  # requests came or left: free its slots
        if not len(self.running):
            return
        plan = scheduler.plan_extend(self.running, self.config.chunk_size)
        mode = self._run_extend(plan) if plan is not None else self._run_decode()
        self.step_times.append((mode, time.perf_counter() - started))

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            kind, item = self._inbox.get()
            if kind == "add":
                self.requests[item.uid] = item
                if not item.params.greedy:
                    self._sampling_uids.add(item.uid)
                self.by_request_id[item.request_id] = item
                self.waiting.append(item)
                self.stats["prompt_tokens"] += len(item.prompt_ids)
            else:
                self._abort_now(item)

    def abort_all(self) -> None:
        """Abort every request, waiting or running (shutdown, or a failed step)."""
        self.ahead.drop()
        self._drain_inbox()
        for request in list(self.waiting):
            self.waiting.remove(request)
            self._finish_request(request, FinishReason.ABORT)
        if len(self.running):
            self._commit(state.abort(self.running, np.arange(len(self.running))))

    def _abort_now(self, request_id: str) -> None:
        request = self.by_request_id.get(request_id)
        if request is None or request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            self._finish_request(request, FinishReason.ABORT)
            return
        index = self.running.index_of(request.uid)
        self._commit(state.abort(self.running, [index]))

    def _admissible(self) -> int:
        """How many waiting requests `_admit` would take now. The slots of a pass planned
        ahead count as free: admitting drops that plan."""
        if not self.waiting:
            return 0
        step_slots = 1 + (self.config.draft_budget if self.spec else 0)
        return scheduler.count_admissible(
            (r.num_tokens for r in self.waiting),
            self.book.table.num_free_rows,
            self.book.slots.num_free + self.ahead.num_held,
            len(self.running) * step_slots,
            self.config.chunk_size,
            step_slots,
        )

    def _admit(self) -> None:
        count = self._admissible()
        if count == 0:
            return
        self.ahead.drop()
        entering = [self.waiting.popleft() for _ in range(count)]
        rows = [self.book.table.alloc_row() for _ in entering]
        rules = FinishRules.of([r.params for r in entering], self.runtime.eos_id)
        admitted = Running.admitted(
            [r.uid for r in entering],
            rows,
            [r.num_tokens for r in entering],
            [len(r.prompt_ids) for r in entering],
            [r.last_token for r in entering],
            rules,
            self.max_context,
        )
        self.running = state.merge(self.running, admitted)
        if self.spec is not None:
            for r in entering:  # a seeded sampling request's trees must not follow timings
                self.spec.add_request(
                    r.uid, r.all_ids, r.params.seed is not None and not r.params.greedy
                )

    def _reserve(self, tokens_needed: Any) -> bool:
        """Make `tokens_needed()` slots free by retracting the newest requests.

        Returns False when the step's own batch changed (the caller re-plans)."""
        while tokens_needed() > self.book.slots.num_free:
            index = scheduler.newest(self.running.rids)
            request = self.requests[int(self.running.rids[index])]
            if len(self.running) == 1:
                # Alone and still too big for the pool: it can never finish.
                self._commit(state.finish(self.running, [index], FinishReason.LENGTH))
            else:
                self.stats["retractions"] += 1
                self._commit(state.retract(self.running, [index]))
                self.waiting.appendleft(request)
            return False
        return True

    def _run_extend(self, plan: scheduler.ExtendPlan) -> str:
        if not self._reserve(lambda: plan.num_tokens):
            return "retract"
        sub_index = plan.indices
        sub = self.running.select(sub_index)
        rest = self.running.select(np.setdiff1d(np.arange(len(self.running)), sub_index))
        input_ids = np.concatenate(
            [
                self.requests[int(uid)].token_slice(kv, kv + n)
                for uid, kv, n in zip(sub.rids, sub.kv_lens.lens, plan.chunk_lens, strict=True)
            ]
        )
        batch = state.schedule_extend(
            sub, plan.chunk_lens, input_ids, self.book.slots.alloc(plan.num_tokens)
        )
        sampled = self._forward_and_sample(batch)
        self._commit(state.extend(batch, sampled), rest=rest)
        return "extend"

    def _run_decode(self) -> str:
        if self.spec is not None:
            return self.spec.run_verify(self)
        return self._decode_step()

    def _decode_step(self, during: Any = None) -> str:
        """One decode pass; `during()`, if given, runs on the host while the device runs it
        (with the planning of the next pass), once nothing can retract the step any more."""
        prepared = self.ahead.take(self.running)
        if prepared is not None:  # planned during the last pass: only the tokens are new
            batch = state.schedule_decode(self.running, prepared.batch.out_slots)
        else:
            if not self._reserve(lambda: len(self.running)):
                return "retract"
            batch = state.schedule_decode(self.running, self.book.slots.alloc(len(self.running)))
        tokens = self._launch_and_sample(batch, prepared)
        try:
            if during is not None:
                during()
            written = self._prepare_next(batch)  # host work while the device runs this pass
            sampled = tokens.cpu().numpy()
        except BaseException:  # the early table writes, if any, are undone with the slots
            self.book.apply(state.abandon(batch, written=True))
            raise
        self._commit(state.decode(batch, sampled), table_written=written)
        self.ahead.drop_unless_fits(self.running)  # a request finished: the plan does not fit
        return "decode"

    # --- planning the next decode pass while this one runs ----------------------------------
    def _prepare_next(self, batch: state.Batch) -> bool:
        """Plan the decode pass after `batch` while it runs (`PlanAhead`), unless the next
        step will change the batch anyway. Returns whether `batch`'s table writes were
        applied (its commit then skips them). With speculation, `batch` is a step where
        nothing was drafted; the next one is most often the same (the plan is used), and a
        verify pass instead drops the plan."""
        if not self.config.plan_ahead or not self._inbox.empty() or self._admissible():
            return False  # the next step changes the batch: a plan would be dropped
        return self.ahead.plan(batch)

    # --- one forward pass and its tokens ------------------------------------------------------
    def _forward(self, batch: state.Batch) -> torch.Tensor:
        """Logits of the pass; if it fails, the slots handed to it go back to the pool."""
        try:
            return self.runner.forward(batch)
        except BaseException:
            self.book.apply(state.abandon(batch))
            raise

    def _launch_and_sample(self, batch: state.Batch, prepared: Any = None) -> torch.Tensor:
        """Launch the pass and its sampling; the tokens stay on the device until `_fetch`.
        If either fails, the slots handed to the pass go back to the pool."""
        try:
            inputs = None  # all greedy: no per-request work
            if self._sampling_uids:  # built before the launch (see Runtime.sampling_inputs)
                uids = batch.running.rids[batch.samples]
                params = [self.requests[int(u)].params for u in uids]
                steps = [len(self.requests[int(u)].output_ids) for u in uids]
                inputs = self.runtime.sampling_inputs(params, uids, steps)
            logits = (
                self.runner.forward(batch)
                if prepared is None
                else self.runner.launch(prepared, batch)
            )
            return self.runtime.sample(logits, inputs)
        except BaseException:
            self.book.apply(state.abandon(batch))
            raise

    def _fetch(self, batch: state.Batch, tokens: torch.Tensor) -> np.ndarray:
        try:
            return tokens.cpu().numpy()
        except BaseException:
            self.book.apply(state.abandon(batch))
            raise

    def _forward_and_sample(self, batch: state.Batch) -> np.ndarray:
        return self._fetch(batch, self._launch_and_sample(batch))

    # --- effects -> resources and outputs ---------------------------------------------------------
    def _commit(
        self, result: state.Result, rest: Running | None = None, table_written: bool = False
    ) -> None:
        """Apply a transition: its effects to the KV book, its tokens to the requests.
        `rest`: the running requests that were not part of the transition's batch;
        `table_written`: its table writes were applied early (`PlanAhead.plan`)."""
        effects = result.effects
        self.book.apply(effects, table_written)
        self.running = (
            result.running if rest is None or not len(rest) else state.merge(rest, result.running)
        )
        finished = effects.finished()
        emitted = effects.emitted()
        stopped: list[int] = []  # a stop string matched: they leave with STOP below
        for uid, tokens in emitted.items():
            request = self.requests[uid]
            request.output_ids.extend(tokens)
            self.stats["generated_tokens"] += len(tokens)
            if self.spec is not None:
                self.spec.extend(uid, tokens)
            if self.text.update(request, tokens):
                if uid in finished:  # the text was cut at a stop string: that is why it ended
                    finished[uid] = FinishReason.STOP
                else:
                    stopped.append(uid)
        for uid, reason in finished.items():
            self._finish_request(self.requests[uid], reason)
        for uid in self.requests.keys() & set(emitted) - set(finished) - set(stopped):
            self._publish(self.requests[uid])
        if stopped:
            indices = [self.running.index_of(uid) for uid in stopped]
            self._commit(state.finish(self.running, indices, FinishReason.STOP))

    def _finish_request(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        self.text.finish(request)
        self.stats["finished"] += 1
        if self.spec is not None:
            request.speculation = self.spec.remove(request.uid)
        self._publish(request)
        self.requests.pop(request.uid, None)
        self.by_request_id.pop(request.request_id, None)
        self._sampling_uids.discard(request.uid)

    def _publish(self, request: Request) -> None:
        if request.sink is None:
            return
        delta = request.take_delta(self.text.streamable_chars(request))
        if delta is not None:
            request.sink.put(delta)

    # --- convenience API (drives the loop itself) ---------------------------------------------
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | dict | list | None = None,
    ) -> list[Completion]:
        """Results in input order; one params value or one per prompt."""
        batch_prompts = as_prompt_list(prompts)
        params = (
            list(sampling_params)
            if isinstance(sampling_params, list)
            else [sampling_params] * len(batch_prompts)
        )
        if len(params) != len(batch_prompts):
            raise InvalidRequest(
                "sampling_params",
                f"{len(params)} values for "
                f"{len(batch_prompts)} prompts; give one, or one per prompt",
            )
        # Validate everything first, so a bad prompt rejects the call before anything runs.
        checked = [
            (prompt_to_ids(self.tokenizer, p), to_params(sp))
            for p, sp in zip(batch_prompts, params, strict=True)
        ]
        for ids, _ in checked:
            self._validate(ids)
        requests = [self._enqueue(ids, sp, None, None) for ids, sp in checked]
        while not all(r.done for r in requests):
            self.step()
        return [r.completion() for r in requests]

    def stream(
        self, prompt: Prompt, params: SamplingParams | dict | None = None
    ) -> Iterator[Delta]:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(prompt, params, sink=sink)
        while True:
            while sink.empty():
                self.step()
            delta = sink.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def check(self) -> None:
        """Slot conservation and table integrity, now (raises AssertionError). The slots of
        a pass planned ahead count as in flight."""
        self.book.check(self.running, self.ahead.held_slots)

    def metrics(self) -> dict[str, Any]:
        return dict(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_slots_total=self.book.slots.capacity,
            kv_slots_free=self.book.slots.num_free,
            kv_slots_used=self.book.slots.capacity - self.book.slots.num_free,
            **dict(self.stats),
            **(self.spec.stats_dict() if self.spec is not None else {}),
        )
