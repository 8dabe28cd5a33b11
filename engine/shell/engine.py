"""The Engine: owns the mutable resources and turns transitions' effects into changes.

One thread runs `step()`. Other threads only `submit` and `abort` through a thread-safe inbox.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from engine import cpu_kernels, state
from engine.shell import scheduler
from engine.shell.admission import Admission
from engine.shell.ahead import PlanAhead
from engine.shell.config import AHEAD_OF_THE_HOST, EngineConfig
from engine.shell.distributed import WorkerFailed
from engine.shell.failures import Faults, Health, OpenPass, PassFailed, describe
from engine.shell.frontend import Frontend
from engine.shell.grammar import Grammars
from engine.shell.inbox import Inbox
from engine.shell.kv import KVBook
from engine.shell.logits import LogitsWork
from engine.shell.outputs import Outputs
from engine.shell.passes import Passes
from engine.shell.prompt_scores import PromptScoring
from engine.shell.request import Request
from engine.shell.runner import PassRunner
from engine.shell.runtime import Runtime, build_runtime
from engine.shell.sharded import JournaledTable, ParallelRunner, start_workers
from engine.shell.spec_steps import SpeculativeSteps
from engine.shell.speculator import Speculator
from engine.shell.textio import PromptInput
from engine.shell.trace import machine
from engine.state import FinishReason, Running

Prompt = PromptInput
log = logging.getLogger(__name__)


class Engine(Frontend, Admission, SpeculativeSteps):
    """generate / stream / submit / abort over one model; `step()` advances every request."""

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        self.config = EngineConfig(model=model).replace(**overrides)
        self.runtime: Runtime = build_runtime(self.config)
        rt = self.runtime
        self.tokenizer = rt.tokenizer
        self.max_context = rt.max_context
        # tensor parallelism: rank 0 (this process) schedules, the workers run its passes too
        self.workers = (
            None if self.config.tensor_parallel_size == 1 else start_workers(self.config, rt)
        )
        try:
            self._build(rt)
        except BaseException:
            self.close()
            raise

    def _build(self, rt: Runtime) -> None:
        """The KV book, the runner (rank 0's, sending each pass to the workers) and the
        rest of the loop's state."""
        table = None
        if self.workers is not None:
            table = JournaledTable(self.config.max_running_requests, rt.max_context, rt.device)
        self.book = KVBook(
            rt.num_slots,
            self.config.max_running_requests,
            rt.max_context,
            rt.device,
            prefix_cache=self.config.prefix_cache,
            table=table,
        )
        local = rt.make_runner(self.book.table)
        runner: PassRunner = local
        if self.workers is not None and table is not None:
            runner = ParallelRunner(local, self.workers, table)
        self.running = Running.empty(rt.max_context)
        self.waiting: collections.deque[Request] = collections.deque()
        self.inbox = Inbox()  # submissions and aborts from any thread
        self.stats = collections.Counter()
        self.step_times: collections.deque = collections.deque(maxlen=1024)
        self.spec = Speculator(rt, self.config) if self.config.speculative else None
        # structured output: matchers, masks
        self.grammars = Grammars(
            rt.tokenizer, rt.vocab_size, rt.eos_id, self.stats, rt.device.type == "cuda"
        )
        self.grammars.prepare()  # the grammar vocabulary, built while the engine warms up
        self.outputs = Outputs(self.tokenizer, self.inbox, self.stats, self.spec, self.grammars)
        self.requests = self.outputs.requests  # in flight, by uid (the loop's thread only)
        # penalties and grammar masks before sampling, logprobs after
        self.logits = LogitsWork(self.requests, self.grammars)
        self.by_request_id = self.outputs.by_request_id
        # the transitions: engine.state, or with config.trace_path a recorder of each call
        self.machine = machine(self.config, rt.vocab_size, self.book, self.requests)
        self.ahead = PlanAhead(self.book, runner, self.stats, self.machine)  # next decode
        self.passes = Passes(rt, runner, self.outputs, self.logits, self.ahead)  # launch to tokens
        launch_ahead = self.config.launch_ahead  # None: where the device runs apart from us
        if launch_ahead is None:
            launch_ahead = rt.device.type == "cuda" and self.config.tensor_parallel_size == 1
        self.launch_ahead: bool = launch_ahead
        for name in AHEAD_OF_THE_HOST:
            if getattr(self.config, name) and not launch_ahead:
                raise ValueError(
                    f"{name}=True with launch_ahead=None on {rt.device.type} (tensor_parallel_"
                    f"size={self.config.tensor_parallel_size}) is not allowed: passes are "
                    "launched ahead by default only on CUDA with one rank; set "
                    "launch_ahead=True (one rank)"
                )
        self.health = Health()
        # on the CPU, each step's thread count (torch's, which the kernels are passed): at most
        # the CPUs others leave free, since a spinning OpenMP team stalls behind a busy neighbour
        self.cpu_threads = cpu_kernels.ThreadGovernor() if rt.device.type == "cpu" else None

    @property
    def runner(self) -> PassRunner:
        """The runner the passes launch on and plans are prepared with (a benchmark or test
        may replace it: both take the new one)."""
        return self.passes.runner

    @runner.setter
    def runner(self, runner: PassRunner) -> None:
        self.passes.runner = self.ahead.runner = runner

    @property
    def faults(self) -> Faults | None:
        """A test tool: passes fail where it says (`failures.Faults`)."""
        return self.passes.faults

    @faults.setter
    def faults(self, faults: Faults | None) -> None:
        self.passes.faults = faults

    # --- the loop (one thread) ----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(len(self.running) or self.waiting or not self.inbox.empty)

    def step(self) -> None:
        """Advance every request by one forward pass (or admit/abort only)."""
        started = time.perf_counter()
        self._drain_inbox()
        self._admit()
        self.ahead.fit(self.running)  # requests came or left: cut or drop it, free slots
        if not len(self.running):
            return
        config = self.config
        plan = scheduler.plan_extend(
            self.running,
            config.chunk_size,
            config.mixed_passes,
            config.mixed_chunk_size,
            first_in_extend=self.spec is not None,
        )
        try:
            with self.cpu_threads.threads() if self.cpu_threads else contextlib.nullcontext():
                mode = self._run_extend(plan) if plan is not None else self._run_decode()
        except PassFailed as failure:
            if isinstance(failure.cause, WorkerFailed):  # the engine cannot go on
                self._fail(failure.uids, failure.cause)
                raise failure.cause from failure
            log.error(
                "a pass failed; its %d requests end with 'error'",
                len(failure.uids),
                exc_info=failure.cause,
            )
            self.health.failed(failure.cause)
            self._fail(failure.uids, failure.cause)
            mode = "error"
        else:
            if mode != "retract":
                self.health.succeeded()
        self.step_times.append((mode, time.perf_counter() - started))

    def _fail(self, uids: np.ndarray, error: BaseException) -> None:
        """Finish the requests of a failed pass with ERROR (their slots are freed)."""
        indices = []
        for uid in uids.tolist():
            request = self.requests.get(uid)
            if request is None or request.done:
                continue
            request.error = describe(error)
            if uid in self.running.rids:
                indices.append(self.running.index_of(uid))
            else:  # it left the batch in the commit that failed: its slots are free
                self.outputs.finish(request, FinishReason.ERROR)
        if indices:
            self._commit(self.machine.finish(self.running, indices, FinishReason.ERROR))

    def _drain_inbox(self) -> None:
        for kind, item in self.inbox.drain():
            if kind == "add":
                self.outputs.add(item)
                self.waiting.append(item)
            else:
                self._abort_now(item)

    def abort_all(
        self, reason: FinishReason = FinishReason.ABORT, error: BaseException | None = None
    ) -> None:
        """End every request, waiting or running: ABORT at shutdown, ERROR (with `error`)
        when the loop itself failed."""
        self.ahead.drop()
        self._drain_inbox()
        if error is not None:
            for request in self.requests.values():
                request.error = describe(error)
        for request in list(self.waiting):
            self.waiting.remove(request)
            self.outputs.finish(request, reason)
        if len(self.running):
            self._commit(self.machine.finish(self.running, np.arange(len(self.running)), reason))

    def _abort_now(self, request_id: str) -> None:
        request = self.by_request_id.get(request_id)
        if request is None or request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            self.outputs.finish(request, FinishReason.ABORT)
            return
        index = self.running.index_of(request.uid)
        self._commit(self.machine.abort(self.running, [index]))

    def _run_extend(self, plan: scheduler.ExtendPlan) -> str:
        if not self._reserve(lambda: plan.num_tokens):
            return "retract"
        sub_index = plan.indices
        sub = self.running.select(sub_index)
        rest = self.running.select(np.setdiff1d(np.arange(len(self.running)), sub_index))
        starts, stops = sub.kv_lens.lens.tolist(), (sub.kv_lens.lens + plan.chunk_lens).tolist()
        input_ids = np.concatenate(
            [
                self.requests[uid].id_array()[start:stop]
                for uid, start, stop in zip(sub.rids.tolist(), starts, stops, strict=True)
            ]
        )
        scoring = PromptScoring.of(self.requests, sub, plan.chunk_lens, self.outputs.scored_uids)
        batch = self.machine.schedule_extend(
            sub,
            plan.chunk_lens,
            input_ids,
            self.book.alloc(plan.num_tokens),
            None if scoring is None else scoring.rows,
        )
        with self._open(batch) as open_pass:
            launched = self.passes.launch(batch, scoring=scoring)
            self._write_early(open_pass)  # while the device runs the pass
            sampled = self.passes.tokens(launched)
            if launched.scores is not None:  # read back with the tokens
                launched.scores.write(self.requests)
            self._commit_pass(open_pass, self.machine.extend(batch, sampled), rest=rest)
        if self.book.cache is not None:
            self._share_prefills(sub.rids[plan.chunk_lens > 1])
        return "extend"

    def _write_early(self, open_pass: OpenPass) -> None:
        """Apply the pass's table writes now, while the device runs it, rather than at its
        commit, whose host work the device waits for (`state.decode_writes`: they do not
        depend on its tokens); undone if the pass fails."""
        open_pass.table_written = True  # set first: a write that fails midway is undone too
        self.book.apply(self.machine.decode_writes(open_pass.batch))

    def _share_prefills(self, uids: np.ndarray) -> None:
        """Prompts that prefilled a chunk enter the prefix cache as far as they got, so that
        requests admitted meanwhile match them before they finish."""
        running = self.running
        idx = np.flatnonzero(
            np.isin(running.rids, uids) & (running.kv_lens.lens > running.shared_lens)
        )
        if idx.size:
            self.ahead.drop()
            self._commit(self.machine.share(running, idx))

    def _run_decode(self) -> str:
        if self.spec is None:
            return self._decode_step()
        return self._speculative_step()

    # --- a pass's slots: committed, or given back ----------------------------------------------
    @contextlib.contextmanager
    def _open(self, batch: state.Batch) -> Iterator[OpenPass]:
        """The one way a pass runs once its slots are handed out: it commits, or its slots go
        back to the pool (and a plan made during it is dropped), and a failure surfaces as
        `PassFailed` naming the pass's requests."""
        open_pass = OpenPass(batch)
        try:
            yield open_pass
        except BaseException as error:
            undo = open_pass.abandon(self.machine)
            if undo is not None:
                self.book.apply(undo)
            self.ahead.drop()
            if isinstance(error, Exception):
                raise PassFailed(batch.running.rids, error) from error
            raise

    # --- effects -> resources and outputs ---------------------------------------------------------
    def _commit_pass(
        self,
        open_pass: OpenPass,
        result: state.Result,
        rest: Running | None = None,
        launch_next: bool = False,
    ) -> None:
        """Commit a pass's transition; from here its slots belong to its requests. With
        `launch_next` (a speculative step's pass), the next pass is launched where it may be
        (`_launch_next`): before the outputs are emitted, so that their host work runs
        beside the device's, unless a request's next pass follows them (a grammar's state,
        the counts of penalties or a bias); a failure there is raised once they are out."""
        self.passes.hit("commit")
        # a verify pass's early writes are its roots': its commit writes its whole paths
        written = open_pass.table_written and state.writes_whole(open_pass.batch)
        emitted = self._apply(result, rest, written)
        open_pass.committed = True
        early = launch_next and self._launches_before_outputs()
        failure = None
        if early:
            try:
                self._launch_next(verify=self.config.verify_at_commit)
            except Exception as error:
                failure = error
        self._emit(result.effects, emitted)
        if failure is not None:
            raise failure
        if launch_next and not early:
            self._launch_next(verify=False)

    def _commit(self, result: state.Result, rest: Running | None = None) -> None:
        """Apply a transition that runs no pass (admission, retraction, finish, abort)."""
        self._emit(result.effects, self._apply(result, rest))

    def _apply(
        self, result: state.Result, rest: Running | None = None, table_written: bool = False
    ) -> dict[int, list[int]]:
        """A transition's effects to the KV book, its snapshot in place, its tokens to the
        proposer's histories. `rest`: the running requests that were not part of the
        transition's batch; `table_written`: its table writes were applied early
        (`PlanAhead.plan`). Returns the tokens it emitted by request (`Effects.emitted`), for
        the outputs."""
        effects = result.effects
        emitted = effects.emitted() if effects.emitted_tokens.shape[0] else {}
        self.book.apply(effects, table_written, self._history(emitted))
        self.running = (
            result.running if rest is None or not len(rest) else state.merge(rest, result.running)
        )
        if self.spec is not None:
            for uid, tokens in emitted.items():  # the proposer's histories
                self.spec.extend(uid, tokens)
        return emitted

    def _history(self, emitted: dict[int, list[int]] | None = None) -> Any:
        """(uid, n) -> the first n tokens of a request, for the KV book: those its record
        holds, then those a transition emits to it (`emitted`, by request: applied to the
        book before the record)."""

        def history(uid: int, n: int) -> np.ndarray | list[int]:
            request = self.requests[uid]
            if n <= request.num_tokens:
                return request.id_array()[:n]
            ids = request.all_ids
            if emitted:
                ids = ids + emitted.get(uid, [])[: n - len(ids)]
            return ids

        return history

    def _emit(self, effects: state.Effects, emitted: dict[int, list[int]]) -> None:
        """A transition's tokens (`emitted`, from `_apply`) and finishes to its requests; a
        stop string's end, or the end of a request's grammar, commits."""
        ending = self.outputs.emit(effects, self.passes.take_logprobs(), emitted)
        if not ending:  # most passes: nobody ends here
            return
        for reason in (FinishReason.STOP, FinishReason.ERROR):
            indices = [self.running.index_of(uid) for uid, r in ending.items() if r == reason]
            if indices:
                self._commit(self.machine.finish(self.running, indices, reason))

    def check(self) -> None:
        """Slot conservation and table integrity, now (raises AssertionError). The slots of
        a pass planned ahead count as in flight; with no request running, no pass may be
        planned. Under tensor parallelism, also every rank's request-table mirror and KV pool
        against rank 0's."""
        if not len(self.running) and self.ahead.prepared is not None:
            raise AssertionError("a pass is planned ahead with no request running")
        self.book.check(self.running, self.ahead.held_slots, self._history())
        if isinstance(self.runner, ParallelRunner):
            self.runner.check()

    def close(self) -> None:
        """Stop and join the tensor-parallel workers (nothing to do with one rank); the
        engine runs no pass after this."""
        if self.workers is not None:
            self.workers.stop(self.config.tensor_parallel_timeout)

    def close_streams(self, error: BaseException) -> None:
        """Last resort when the loop cannot go on: every open request gets its final delta
        with ERROR; the pool is left as it is (the engine is dead)."""
        self.outputs.close_all(describe(error))

    @property
    def healthy(self) -> bool:
        """False after several passes failed in a row (`failures.UNHEALTHY_AFTER`)."""
        return self.health.healthy

    def metrics(self) -> dict[str, Any]:
        cache, book = self.book.cache, self.book
        queried = self.stats["matched_prompt_tokens_queried"]
        prefix = (
            {}
            if cache is None
            else dict(
                prefix_cache_slots=cache.num_slots,
                prefix_cache_locked_slots=cache.num_locked,
                prefix_cache_evicted_slots=book.evicted_slots,
                prefix_cache_evictions=book.evictions,
                prefix_cache_hit_rate=self.stats["cached_prompt_tokens"] / queried
                if queried
                else 0.0,
            )
        )
        return dict(
            pass_failures=self.health.failures,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_slots_total=self.book.slots.capacity,
            kv_slots_free=self.book.slots.num_free,
            kv_slots_used=self.book.slots.capacity - self.book.num_available,
            **dict(self.stats),
            **prefix,
            **(self.spec.stats_dict() if self.spec is not None else {}),
        )
