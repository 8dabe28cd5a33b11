"""Scheduler traces: every state transition the engine makes, as data, one JSON line each.

With `EngineConfig.trace_path` set, the engine calls the transitions through a `Recorder`
instead of `engine.state` (`machine()` picks). Each call is written with its inputs (requests
admitted with their lengths and matched prefix slots, chunk plans, slots handed out, sampled
tokens, accepted paths and bonus tokens, requests retracted, finished or aborted) and its
outputs (the effects, the next `Running`), and whether the engine applied it to its KV book.
`engine replay FILE` (`shell/replay.py`) runs the same transitions again from the inputs.

A trace holds no text. Token ids are in it (replay needs them: the prefix cache matches
them, the finish check compares them with EOS and stop ids, a draft tree's root is its
request's last token), but with `trace_tokens` off each id is written through a random
permutation of the vocabulary drawn per trace and not written. Replay only compares ids for
equality, so it replays the same; the text cannot be read back with the tokenizer. (A
substitution like this hides the text from a reader, not from frequency analysis of a long
trace: treat a trace of private prompts as private.)
"""

from __future__ import annotations

import collections
import json
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import numpy as np

from engine import state
from engine.shell.kv import KVBook
from engine.state import Batch, Effects, FinishReason, FinishRules, Running

FORMAT = "engine-trace"
VERSION = 1

EFFECT_FIELDS = (
    "table_rows",
    "table_cols",
    "table_slots",
    "free_slots",
    "release_rows",
    "release_lens",
    "release_rids",
    "release_shared",
    "release_cached",
    "share_rids",
    "share_rows",
    "share_lens",
    "emitted_rids",
    "emitted_lens",
    "emitted_tokens",
    "finished_rids",
    "finished_reasons",
    "retracted_rids",
)
Tokens = Callable[[Any], list[int]]  # token ids -> the ids a trace holds


# --- the format (the recorder writes it, replay reads it) ---------------------------------------
def ints(values: Any) -> list[int]:
    if isinstance(values, state.SeqLens):
        return values.tolist()
    return np.asarray(values, dtype=np.int64).reshape(-1).tolist()


def same_ids(values: Any) -> list[int]:
    return ints(values)


def encode_effects(effects: Effects, tokens: Tokens = same_ids) -> dict[str, list]:
    """The effects' non-empty columns, by name (`emitted_tokens` through `tokens`)."""
    out: dict[str, list] = {}
    for name in EFFECT_FIELDS:
        value = getattr(effects, name)
        if len(value):
            if name == "release_cached":
                out[name] = [bool(flag) for flag in value.tolist()]
            else:
                out[name] = tokens(value) if name == "emitted_tokens" else ints(value)
    return out


def decode_effects(columns: Mapping[str, list]) -> Effects:
    """The `Effects` that `encode_effects` wrote."""
    fields: dict[str, Any] = {}
    for name, value in columns.items():
        if name.endswith("_lens"):
            fields[name] = state.SeqLens(value)
        elif name == "release_cached":
            fields[name] = np.array(value, dtype=bool)
        else:
            fields[name] = np.array(value, dtype=np.int64)
    return Effects(**fields)


def encode_running(running: Running, tokens: Tokens = same_ids) -> dict[str, list]:
    """The columns a transition changes (the finish rules follow the requests)."""
    return dict(
        rids=ints(running.rids),
        rows=ints(running.rows),
        kv_lens=ints(running.kv_lens),
        token_lens=ints(running.token_lens),
        shared_lens=ints(running.shared_lens),
        last_tokens=tokens(running.last_tokens),
    )


def encode_rules(rules: FinishRules, tokens: Tokens = same_ids) -> dict[str, Any]:
    return dict(
        max_new=ints(rules.max_new),
        min_new=ints(rules.min_new),
        eos=tokens(rules.eos),
        stop_ids=[tokens(row) for row in rules.stop_ids],
    )


def decode_rules(columns: Mapping[str, Any]) -> FinishRules:
    stop_ids = np.array(columns["stop_ids"], dtype=np.int64)
    return FinishRules(
        columns["max_new"],
        columns["min_new"],
        columns["eos"],
        stop_ids.reshape(len(columns["max_new"]), -1),
    )


def encode_result(result: state.Result, tokens: Tokens = same_ids) -> dict[str, Any]:
    return dict(
        effects=encode_effects(result.effects, tokens),
        running=encode_running(result.running, tokens),
    )


class Pseudonyms:
    """Token ids through a random permutation of the vocabulary (ids outside it, and -1,
    the 'none' of EOS and stop ids, stay as they are): equal ids stay equal."""

    def __init__(self, vocab_size: int) -> None:
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        self._perm = rng.permutation(vocab_size).astype(np.int64)

    def __call__(self, values: Any) -> list[int]:
        ids = np.asarray(values, dtype=np.int64).reshape(-1)
        inside = (ids >= 0) & (ids < self._perm.size)
        return np.where(inside, self._perm[np.where(inside, ids, 0)], ids).tolist()


# --- recording ----------------------------------------------------------------------------------
def machine(config: Any, vocab_size: int, book: KVBook, requests: Mapping[int, Any]) -> Any:
    """What the engine calls its transitions on: `engine.state` itself, or with
    `config.trace_path` set, a `Recorder` writing them there. `requests`: the engine's
    requests in flight by uid (their tokens at admission go into the trace)."""
    if config.trace_path is None:
        return state
    header = dict(
        format=FORMAT,
        version=VERSION,
        capacity=book.slots.capacity,
        num_rows=book.table.host.shape[0],
        max_context=book.table.max_context,
        prefix_cache=book.cache is not None,
        token_ids="ids" if config.trace_tokens else "pseudonyms",
    )
    tokens: Tokens = same_ids if config.trace_tokens else Pseudonyms(vocab_size)
    out = open(config.trace_path, "w", buffering=1)  # noqa: SIM115 (open while the engine is)
    return Recorder(out, book, requests, tokens, header)


class Recorder:
    """The transitions of `engine.state`, each call also written to `out` as one JSON line:
    `{"step": n, "op": name, <inputs>, "out": <outputs>}`. A transition whose effects the
    KV book applies is marked `"applied": true` (the book tells: `KVBook.on_apply`); a pass
    whose commit failed before its effects were applied, false. Requests are named by id,
    batches by the step that scheduled them."""

    def __init__(
        self,
        out: TextIO,
        book: KVBook,
        requests: Mapping[int, Any],
        tokens: Tokens,
        header: dict[str, Any],
    ) -> None:
        self._out, self._book, self._requests, self._tokens = out, book, requests, tokens
        self._step = 0
        self._batches: collections.OrderedDict[int, tuple[Batch, int]] = (
            collections.OrderedDict()
        )  # id(batch) -> (batch, step); the batch kept so that its id stays its own
        self._assumed: tuple[Running, int] | None = None
        self._pending: tuple[dict[str, Any], Effects] | None = None
        self._evicted = book.evicted_slots
        book.on_apply = self._applied
        weakref.finalize(self, out.close)  # closed with the engine (each line is flushed)
        self._write(header)

    def close(self) -> None:
        self._flush(applied=False)
        self._out.close()

    # --- writing ----------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self._out.write(json.dumps(record, separators=(",", ":")) + "\n")

    def _flush(self, applied: bool) -> None:
        if self._pending is not None:
            record, _ = self._pending
            self._pending = None
            record["applied"] = applied
            self._write(record)

    def _start(self, op: str, **inputs: Any) -> dict[str, Any]:
        """A new record (the one still waiting for its apply was not applied)."""
        self._flush(applied=False)
        self._step += 1
        record: dict[str, Any] = dict(step=self._step, op=op, **inputs)
        evicted = self._book.evicted_slots - self._evicted
        if evicted:  # the allocation just before this call evicted cached slots
            record["evicted"] = evicted
            self._evicted = self._book.evicted_slots
        return record

    def _run(self, record: dict[str, Any], call: Callable[[], Any]) -> Any:
        """Run the transition; a raise is recorded (replay must raise the same) and re-raised."""
        try:
            return call()
        except Exception as error:
            record["error"] = f"{type(error).__name__}: {error}"
            self._write(record)
            raise

    def _finish(self, record: dict[str, Any], value: Any) -> Any:
        """Record the transition's outputs: a Result or Effects waits for the book's apply."""
        if isinstance(value, state.Result):
            record["out"] = encode_result(value, self._tokens)
            self._pending = (record, value.effects)
        elif isinstance(value, Effects):
            record["out"] = dict(effects=encode_effects(value, self._tokens))
            self._pending = (record, value)
        elif isinstance(value, Batch):
            record["out"] = dict(mode=value.mode.value)
            self._batches[id(value)] = (value, record["step"])
            while len(self._batches) > 16:  # the open pass and the plan are the newest
                self._batches.popitem(last=False)
            self._write(record)
        else:  # a Running (assume_decoded)
            record["out"] = dict(running=encode_running(value, self._tokens))
            self._assumed = (value, record["step"])
            self._write(record)
        return value

    def _applied(self, effects: Effects) -> None:
        """The KV book is applying `effects` (its `on_apply`)."""
        if self._pending is not None and self._pending[1] is effects:
            self._flush(applied=True)
            return
        # effects no recorded transition made: written as data, replay applies them as such
        record = self._start("apply", effects=encode_effects(effects, self._tokens))
        record["applied"] = True
        self._write(record)

    def _batch(self, batch: Batch) -> int:
        found = self._batches.get(id(batch))
        if found is None or found[0] is not batch:
            raise ValueError("the trace met a batch no schedule_* call made")
        return found[1]

    def _rids(self, running: Running, indices: Any = None) -> list[int]:
        return ints(running.rids if indices is None else running.rids[np.asarray(indices)])

    # --- transitions ------------------------------------------------------------------------
    def admit(self, running: Running, entering: Running, prefix_slots: np.ndarray) -> Any:
        tok = self._tokens
        requests = [self._requests[uid] for uid in entering.rids.tolist()]
        # requests that took nothing from the prefix cache by choice (a prompt scored whole)
        whole = [r.uid for r in requests if r.cacheable_prefix().size < r.num_tokens - 1]
        record = self._start(
            "admit",
            running=self._rids(running),
            rids=ints(entering.rids),
            rows=ints(entering.rows),
            token_lens=ints(entering.token_lens),
            prompt_lens=ints(entering.prompt_lens),
            prefix_lens=ints(entering.kv_lens),
            rules=encode_rules(entering.rules, tok),
            tokens=[tok(r.all_ids) for r in requests],
            prefix_slots=ints(prefix_slots),
            **({"computed_whole": whole} if whole else {}),
        )
        call = lambda: state.admit(running, entering, prefix_slots)  # noqa: E731
        return self._finish(record, self._run(record, call))

    def retract(self, running: Running, indices: Any) -> Any:
        record = self._start(
            "retract", running=self._rids(running), rids=self._rids(running, indices)
        )
        return self._finish(record, self._run(record, lambda: state.retract(running, indices)))

    def finish(self, running: Running, indices: Any, reason: FinishReason) -> Any:
        record = self._start(
            "finish",
            running=self._rids(running),
            rids=self._rids(running, indices),
            reason=FinishReason(reason).name,
        )
        call = lambda: state.finish(running, indices, reason)  # noqa: E731
        return self._finish(record, self._run(record, call))

    def abort(self, running: Running, indices: Any) -> Any:
        return self.finish(running, indices, FinishReason.ABORT)

    def share(self, running: Running, indices: Any) -> Any:
        record = self._start(
            "share", running=self._rids(running), rids=self._rids(running, indices)
        )
        return self._finish(record, self._run(record, lambda: state.share(running, indices)))

    def schedule_extend(
        self,
        running: Running,
        chunk_lens: Any,
        input_ids: np.ndarray,
        slots: np.ndarray,
        score_rows: np.ndarray | None = None,
    ) -> Any:
        record = self._start(
            "schedule_extend",
            running=self._rids(running),
            chunk_lens=ints(chunk_lens),
            slots=ints(slots),
            **({} if score_rows is None else {"score_rows": ints(score_rows)}),
        )
        call = lambda: state.schedule_extend(  # noqa: E731
            running, chunk_lens, input_ids, slots, score_rows
        )
        return self._finish(record, self._run(record, call))

    def schedule_decode(self, running: Running, slots: np.ndarray) -> Any:
        record = self._planned(
            self._start("schedule_decode", running=self._rids(running)), running, slots
        )
        call = lambda: state.schedule_decode(running, slots)  # noqa: E731
        return self._finish(record, self._run(record, call))

    def schedule_verify(self, running: Running, trees: state.DraftTrees, slots: np.ndarray) -> Any:
        record = self._start(
            "schedule_verify",
            running=self._rids(running),
            tree_sizes=ints(trees.sizes),
            tree_tokens=self._tokens(trees.tokens),
            tree_parents=ints(trees.parents),
        )
        record = self._planned(record, running, slots)
        call = lambda: state.schedule_verify(running, trees, slots)  # noqa: E731
        return self._finish(record, self._run(record, call))

    def _planned(self, record: dict, running: Running, slots: np.ndarray) -> dict:
        """A decode or verify pass's record with where its Running and slots come from: a
        Running assumed at an earlier step (planned ahead), slots handed on from a pass
        planned ahead, or slots allocated now."""
        if self._assumed is not None and running is self._assumed[0]:
            record["assumed"] = self._assumed[1]  # planned ahead from that step's Running
        given = [step for batch, step in self._batches.values() if batch.out_slots is slots]
        if given:  # the slots of a pass planned ahead, handed on
            record["slots_of"] = given[-1]
        else:
            record["slots"] = ints(slots)
        return record

    def extend(self, batch: Batch, sampled: np.ndarray) -> Any:
        record = self._start("extend", batch=self._batch(batch), sampled=self._tokens(sampled))
        return self._finish(record, self._run(record, lambda: state.extend(batch, sampled)))

    def decode(self, batch: Batch, sampled: np.ndarray) -> Any:
        record = self._start("decode", batch=self._batch(batch), sampled=self._tokens(sampled))
        return self._finish(record, self._run(record, lambda: state.decode(batch, sampled)))

    def verify(self, batch: Batch, accepted_lens: Any, accepted_nodes: Any, bonus: Any) -> Any:
        record = self._start(
            "verify",
            batch=self._batch(batch),
            accepted_lens=ints(accepted_lens),
            accepted_nodes=ints(accepted_nodes),
            bonus=self._tokens(bonus),
        )
        call = lambda: state.verify(batch, accepted_lens, accepted_nodes, bonus)  # noqa: E731
        return self._finish(record, self._run(record, call))

    def decode_writes(self, batch: Batch) -> Any:
        record = self._start("decode_writes", batch=self._batch(batch))
        return self._finish(record, self._run(record, lambda: state.decode_writes(batch)))

    def assume_decoded(self, batch: Batch, accepted: Any = None) -> Any:
        record = self._start("assume_decoded", batch=self._batch(batch))
        if accepted is not None:
            record["accepted"] = ints(accepted)
        call = lambda: state.assume_decoded(batch, accepted)  # noqa: E731
        return self._finish(record, self._run(record, call))

    def narrow(self, batch: Batch, indices: Any) -> Any:
        record = self._start(
            "narrow", batch=self._batch(batch), rids=self._rids(batch.running, indices)
        )
        return self._finish(record, self._run(record, lambda: state.narrow(batch, indices)))

    def abandon(self, batch: Batch, written: bool = False) -> Any:
        record = self._start("abandon", batch=self._batch(batch), written=written)
        return self._finish(record, self._run(record, lambda: state.abandon(batch, written)))

    def __getattr__(self, name: str) -> Any:
        """Everything else of `engine.state` (pure queries, types) as it is."""
        return getattr(state, name)
