"""`engine replay FILE`: run a trace's transitions again, with no model and no device.

A `Replayer` holds what the engine held (the `Running`, a `KVBook` of the trace's sizes, each
request's tokens, the passes in flight) and takes the trace's records in order: it hands out
slots, matches prefixes and takes rows as the engine did, calls the recorded transition on the
recorded inputs, compares what it gives with what the trace says it gave, applies the effects
the engine applied, and checks every invariant of the book (`KVBook.check`) after every step.
The first difference stops it, as a `Mismatch` naming the step, with both sides.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NoReturn

import attrs
import numpy as np

from engine import state
from engine.shell.kv import KVBook
from engine.shell.trace import (
    FORMAT,
    VERSION,
    decode_effects,
    decode_rules,
    encode_effects,
    encode_result,
    encode_running,
    ints,
)
from engine.state import Batch, FinishReason, Running


class Mismatch(Exception):
    """The first step whose replay differs from the trace (or breaks an invariant)."""

    def __init__(self, step: int, op: str, what: str, recorded: Any = None, replayed: Any = None):
        self.step, self.op, self.what = step, op, what
        self.recorded, self.replayed = recorded, replayed
        message = f"step {step} ({op}): {what}"
        if recorded is not None or replayed is not None:
            message += f"\n  recorded: {_short(recorded)}\n  replayed: {_short(replayed)}"
        super().__init__(message)


class TraceError(ValueError):
    """The file is not a trace this version reads."""


def _short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _first_difference(recorded: Any, replayed: Any, path: str) -> tuple[str, Any, Any] | None:
    """Where two decoded JSON values first differ: (path, recorded part, replayed part)."""
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        for key in sorted(set(recorded) | set(replayed)):
            found = _first_difference(recorded.get(key), replayed.get(key), f"{path}.{key}")
            if found is not None:
                return found
        return None
    return None if recorded == replayed else (path, recorded, replayed)


@attrs.frozen
class Report:
    steps: int
    seconds: float


def read(path: str) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """The trace's header and its records."""
    lines = open(path)  # noqa: SIM115 (read lazily; closed when the generator ends)
    first = lines.readline()
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        lines.close()
        raise TraceError(f"{path} is not an engine trace (its first line has no format header)")
    if header.get("version") != VERSION:
        lines.close()
        raise TraceError(f"{path} is a version {header.get('version')} trace; this reads {VERSION}")

    def records() -> Iterator[dict[str, Any]]:
        with lines:
            for number, line in enumerate(lines, start=2):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise TraceError(f"{path} line {number} is not JSON: {error}") from None

    return header, records()


def replay_file(path: str) -> Report:
    """Replay the trace at `path`; raises `Mismatch` at the first difference."""
    header, records = read(path)
    return Replayer(header).run(records)


class Replayer:
    """The engine's side of the state machine, rebuilt from a trace's header."""

    def __init__(self, header: Mapping[str, Any]) -> None:
        self.book = KVBook(
            header["capacity"],
            header["num_rows"],
            header["max_context"],
            "cpu",
            prefix_cache=header["prefix_cache"],
        )
        self.running = Running.empty(header["max_context"])
        self.tokens: dict[int, list[int]] = {}  # each request's tokens: at admission, then emitted
        self.batches: dict[int, Batch] = {}  # by the step that scheduled them
        self.in_flight: dict[int, Batch] = {}  # passes whose slots no request owns yet
        self.assumed: dict[int, Running] = {}
        self.steps = 0
        self._record: Mapping[str, Any] = {}  # the one being replayed

    def run(self, records: Iterable[dict[str, Any]]) -> Report:
        started = time.perf_counter()
        for record in records:
            self.step(record)
        return Report(self.steps, time.perf_counter() - started)

    # --- one record ---------------------------------------------------------------------------
    def step(self, record: Mapping[str, Any]) -> None:
        """Replay one record: the transition, its outputs compared, its effects applied (where
        the engine applied them), then every invariant checked."""
        op = record.get("op")
        handler = getattr(self, HANDLERS[op]) if op in HANDLERS else None
        if handler is None:
            raise TraceError(f"step {record.get('step')}: unknown op {op!r}")
        self.steps += 1
        self._record = record
        evicted_before = self.book.evicted_slots
        self._check_running(record)
        try:
            value = handler(record)
        except Mismatch:
            raise
        except Exception as error:  # the transition raised: the engine's must have too
            self._raised(record, error)
            return
        if "error" in record:
            self._fail("the engine's transition raised; the replayed one did not", record["error"])
        self._compare_out(record, value)
        evicted = self.book.evicted_slots - evicted_before
        self._compare("counts of cached slots evicted", record.get("evicted", 0), evicted)
        if record.get("applied"):
            try:
                self._apply(record, value)
            except (ValueError, AssertionError) as error:
                self._fail(f"applying its effects failed: {type(error).__name__}: {error}")
        if op == "assume_decoded":  # a value, nothing in the book: nothing to check
            return
        if op == "narrow":  # slots move from a pass to its parts: checked once both are cut
            return
        # The prefix tree (a full scan) and the rows' shared prefixes against the tree's slots
        # for their tokens, the slow parts of the check, only where the tree or a shared
        # prefix changed (the tree changes in nothing else); elsewhere a slot written at a
        # wrong place leaves free + owned + cached short of the pool, which is checked.
        cached = bool(op == "admit" or evicted or self._changed_cache(record, value))
        try:
            self.book.check(
                self.running,
                self._in_flight_slots(),
                self._history() if cached else None,
                tree=cached,
            )
        except AssertionError as error:
            self._fail(f"an invariant broke: {error}")

    @staticmethod
    def _changed_cache(record: Mapping[str, Any], value: Any) -> bool:
        effects = value.effects if isinstance(value, state.Result) else value
        return bool(
            record.get("applied")
            and isinstance(effects, state.Effects)
            and (len(effects.share_rids) or len(effects.release_rows))
        )

    # --- transitions (each as the engine called it) -------------------------------------------
    def _admit(self, record: Mapping[str, Any]) -> state.Result:
        rids, prefix_lens, tokens = record["rids"], record["prefix_lens"], record["tokens"]
        whole = set(record.get("computed_whole", ()))  # matched nothing (a prompt scored)
        prefixes = [
            self.book.acquire(rid, np.array(ids[:0] if rid in whole else ids[:-1], dtype=np.int64))
            for rid, ids in zip(rids, tokens, strict=True)
        ]
        starts = np.concatenate([[0], np.cumsum(prefix_lens)]).astype(int).tolist()
        for i, rid in enumerate(rids):
            self._compare(
                f"matched prefix slots of request {rid}",
                record["prefix_slots"][starts[i] : starts[i + 1]],
                ints(prefixes[i]),
            )
        rows = [self.book.table.alloc_row() for _ in rids]
        self._compare("request-table rows", record["rows"], rows)
        for rid, ids in zip(rids, tokens, strict=True):
            self.tokens[rid] = list(ids)
        entering = Running.admitted(
            rids,
            rows,
            record["token_lens"],
            record["prompt_lens"],
            [ids[-1] for ids in tokens],
            decode_rules(record["rules"]),
            self.running.max_context,
            kv_lens=prefix_lens,
        )
        return state.admit(self.running, entering, np.concatenate(prefixes))

    def _retract(self, record: Mapping[str, Any]) -> state.Result:
        return state.retract(self.running, self._indices(record["rids"]))

    def _finish(self, record: Mapping[str, Any]) -> state.Result:
        reason = FinishReason[record["reason"]]
        return state.finish(self.running, self._indices(record["rids"]), reason)

    def _share(self, record: Mapping[str, Any]) -> state.Result:
        return state.share(self.running, self._indices(record["rids"]))

    def _schedule_extend(self, record: Mapping[str, Any]) -> Batch:
        running = self._batch_running(record)
        slots = self._slots(record)
        chunks = record["chunk_lens"]
        input_ids = [
            token
            for rid, kv, n in zip(
                running.rids.tolist(), running.kv_lens.tolist(), chunks, strict=True
            )
            for token in self.tokens[rid][kv : kv + n]
        ]
        scored = record.get("score_rows")  # rows whose logits scored prompt tokens
        return self._open(record, state.schedule_extend(running, chunks, input_ids, slots, scored))

    def _schedule_decode(self, record: Mapping[str, Any]) -> Batch:
        running = self._batch_running(record)
        return self._open(record, state.schedule_decode(running, self._slots(record)))

    def _schedule_verify(self, record: Mapping[str, Any]) -> Batch:
        running = self._batch_running(record)
        trees = state.DraftTrees(
            state.SeqLens(record["tree_sizes"]), record["tree_tokens"], record["tree_parents"]
        )
        return self._open(record, state.schedule_verify(running, trees, self._slots(record)))

    def _extend(self, record: Mapping[str, Any]) -> state.Result:
        return state.extend(self._batch(record), np.array(record["sampled"], dtype=np.int64))

    def _decode(self, record: Mapping[str, Any]) -> state.Result:
        return state.decode(self._batch(record), np.array(record["sampled"], dtype=np.int64))

    def _verify(self, record: Mapping[str, Any]) -> state.Result:
        return state.verify(
            self._batch(record),
            record["accepted_lens"],
            np.array(record["accepted_nodes"], dtype=np.int64),
            np.array(record["bonus"], dtype=np.int64),
        )

    def _decode_writes(self, record: Mapping[str, Any]) -> state.Effects:
        return state.decode_writes(self._batch(record))

    def _assume_decoded(self, record: Mapping[str, Any]) -> Running:
        accepted = record.get("accepted")
        following = state.assume_decoded(
            self._batch(record), None if accepted is None else np.array(accepted, dtype=np.int64)
        )
        self.assumed = {record["step"]: following}  # only the newest is ever scheduled
        return following

    def _narrow(self, record: Mapping[str, Any]) -> Batch:
        """A pass cut to some of its requests (`state.narrow`): the part holds their slots
        from here, and the pass it was cut from is no longer in flight (its other part is
        cut next, then abandoned)."""
        batch = self._batch(record)
        rids = ints(batch.running.rids)
        missing = [rid for rid in record["rids"] if rid not in rids]
        if missing:
            self._fail(f"cuts requests {missing} from a pass that does not hold them")
        self.in_flight.pop(record["batch"], None)
        return self._open(record, state.narrow(batch, [rids.index(r) for r in record["rids"]]))

    def _abandon(self, record: Mapping[str, Any]) -> state.Effects:
        return state.abandon(self._batch(record), record["written"])

    def _apply_record(self, record: Mapping[str, Any]) -> state.Effects:
        """Effects that no recorded transition made (written as data): applied as they are."""
        return decode_effects(record["effects"])

    # --- effects to the book, as the engine applied them ---------------------------------------
    def _apply(self, record: Mapping[str, Any], value: Any) -> None:
        op = record["op"]
        if isinstance(value, state.Effects):
            self.book.apply(value, history=self._history(value))
            if op == "abandon":
                self.in_flight.pop(record["batch"], None)
            return
        assert isinstance(value, state.Result), f"{op} has no effects to apply"
        running = value.running
        if op in PASS_OPS:  # the requests outside the pass keep running beside it
            batch = self.in_flight.pop(record["batch"])
            rest = self.running.select(~np.isin(self.running.rids, batch.running.rids))
            running = state.merge(rest, running) if len(rest) else running
        effects = value.effects
        self.book.apply(effects, history=self._history(effects))
        for rid, tokens in effects.emitted().items():
            self.tokens[rid].extend(tokens)
        for rid in effects.finished_rids.tolist():
            del self.tokens[rid]
        self.running = running

    # --- helpers --------------------------------------------------------------------------------
    def _compare_out(self, record: Mapping[str, Any], value: Any) -> None:
        if "out" not in record:  # an `apply` record: its effects are its input
            return
        if isinstance(value, state.Result):
            replayed: dict[str, Any] = encode_result(value)
        elif isinstance(value, state.Effects):
            replayed = dict(effects=encode_effects(value))
        elif isinstance(value, Batch):
            replayed = dict(mode=value.mode.value)
        else:
            replayed = dict(running=encode_running(value))
        found = _first_difference(record["out"], replayed, "out")
        if found is not None:
            path, recorded_part, replayed_part = found
            self._fail(f"{path[len('out.') :]} differs", recorded_part, replayed_part)

    def _raised(self, record: Mapping[str, Any], error: Exception) -> None:
        text = f"{type(error).__name__}: {error}"
        if "error" not in record:
            self._fail(f"the replayed transition raised {text}; the engine's did not")
        self._compare("the transitions' errors", record["error"], text)

    def _compare(self, what: str, recorded: Any, replayed: Any) -> None:
        """`what` (a plural) as recorded and as replayed: a `Mismatch` unless equal."""
        if recorded != replayed:
            self._fail(f"{what} differ", recorded, replayed)

    def _fail(self, what: str, recorded: Any = None, replayed: Any = None) -> NoReturn:
        raise Mismatch(
            self._record.get("step", self.steps),
            str(self._record.get("op")),
            what,
            recorded,
            replayed,
        )

    def _check_running(self, record: Mapping[str, Any]) -> None:
        """The requests the transition was called on: all of the engine's, or a pass's."""
        if "running" in record and record["op"] not in SCHEDULES:
            self._compare("running requests", record["running"], ints(self.running.rids))

    def _indices(self, rids: list[int]) -> list[int]:
        try:
            return [self.running.index_of(rid) for rid in rids]
        except KeyError as error:
            self._fail(f"names a request that is not running: {error}")

    def _batch_running(self, record: Mapping[str, Any]) -> Running:
        """A pass's requests: planned ahead from an assumed Running, or running now."""
        if "assumed" in record:
            running = self.assumed.get(record["assumed"])
            if running is None:
                self._fail(f"plans from step {record['assumed']}, whose Running was not kept")
        else:
            rids = record["running"]
            running = self.running
            if ints(running.rids) != rids:
                running = running.select(self._indices(rids))
        self._compare("the pass's requests", record["running"], ints(running.rids))
        return running

    def _slots(self, record: Mapping[str, Any]) -> np.ndarray:
        """The pass's slots: handed on from a pass planned ahead, or allocated now."""
        if "slots_of" in record:
            planned = self.in_flight.pop(record["slots_of"], None)
            if planned is None:
                self._fail(f"takes the slots of step {record['slots_of']}, which holds none")
            return planned.out_slots
        recorded = record["slots"]
        slots = self.book.alloc(len(recorded))
        self._compare("slots handed out", recorded, ints(slots))
        return slots

    def _open(self, record: Mapping[str, Any], batch: Batch) -> Batch:
        self.batches[record["step"]] = batch
        self.in_flight[record["step"]] = batch
        for old in [step for step in self.batches if step not in self.in_flight]:
            if old < record["step"] - 64:
                del self.batches[old]
        return batch

    def _batch(self, record: Mapping[str, Any]) -> Batch:
        batch = self.batches.get(record["batch"])
        if batch is None:
            self._fail(f"names the pass of step {record['batch']}, which no step scheduled")
        return batch

    def _in_flight_slots(self) -> np.ndarray | None:
        if not self.in_flight:
            return None
        return np.concatenate([batch.out_slots for batch in self.in_flight.values()])

    def _history(self, effects: state.Effects | None = None) -> Any:
        emitted = {} if effects is None else effects.emitted()

        def history(rid: int, n: int) -> list[int]:
            tokens = self.tokens[rid]
            return (
                tokens[:n] if n <= len(tokens) else tokens + emitted.get(rid, [])[: n - len(tokens)]
            )

        return history


SCHEDULES = ("schedule_extend", "schedule_decode", "schedule_verify")
PASS_OPS = ("extend", "decode", "verify")
HANDLERS = {
    op: "_" + op
    for op in (*SCHEDULES, *PASS_OPS, "admit", "retract", "finish", "share", "decode_writes")
    + ("assume_decoded", "narrow", "abandon")
} | {"apply": "_apply_record"}
