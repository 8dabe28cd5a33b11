"""A toy server loop with `engine.state` as its scheduling core and a fake model (random
tokens, random draft acceptance): admission, chunk-free prefill, decode, speculative verify,
aborts and retraction under memory pressure. The server owns the KV slots and applies each
transition's `Effects`; the state core owns the lengths. Run it:

    python examples/embed_state_machine.py --requests 32 --seed 1
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from engine import state
from engine.state import DraftTrees, FinishReason, FinishRules, Running, SamplingParams

VOCAB, EOS, MAX_CONTEXT = 100, 0, 96


class Pool:
    """The server's side: free KV slots (0 is padding, never handed out), free request-table
    rows, and each row's slots by position. No prefix cache, so no share effects."""

    def __init__(self, capacity: int, rows: int) -> None:
        self.capacity, self.free = capacity, list(range(capacity, 0, -1))
        self.free_rows = list(range(rows - 1, -1, -1))
        self.table: dict[int, dict[int, int]] = {}

    def alloc(self, count: int) -> np.ndarray:
        return np.array([self.free.pop() for _ in range(count)], dtype=np.int64)

    def apply(self, effects: state.Effects) -> None:
        """In the order `Effects` documents: table writes, frees, (shares,) releases."""
        for row, col, slot in zip(
            effects.table_rows, effects.table_cols, effects.table_slots, strict=True
        ):
            self.table.setdefault(int(row), {})[int(col)] = int(slot)
        self.free += effects.free_slots.tolist()
        for row, length in zip(
            effects.release_rows.tolist(), effects.release_lens.tolist(), strict=True
        ):
            slots = self.table.pop(row, {})
            self.free += [slots[col] for col in range(length)]
            self.free_rows.append(row)

    def check(self, running: Running) -> None:
        """Slot conservation and rows: what the running requests own plus the free slots is
        the pool, and each row holds exactly its request's committed slots."""
        for row, length in zip(running.rows.tolist(), running.kv_lens.tolist(), strict=True):
            assert sorted(self.table.get(row, {})) == list(range(length)), "row out of step"
        assert len(self.free) + running.kv_lens.total == self.capacity, "slots leaked"


def serve(num_requests: int, seed: int, capacity: int = 200, verbose: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    pool, running = Pool(capacity, rows=8), Running.empty(MAX_CONTEXT)
    tokens: dict[int, list[int]] = {}  # each request's prompt and output so far
    prompt_lens: dict[int, int] = {}
    waiting = collections.deque(range(num_requests))
    for rid in waiting:
        tokens[rid] = rng.integers(1, VOCAB, size=int(rng.integers(4, 40))).tolist()
        prompt_lens[rid] = len(tokens[rid])
    params = SamplingParams(max_tokens=24)
    ends: collections.Counter = collections.Counter()

    def commit(result: state.Result, rest: Running | None = None) -> Running:
        pool.apply(result.effects)
        for rid, new in result.effects.emitted().items():
            tokens[rid] += new
        ends.update(FinishReason(r).name for r in result.effects.finished_reasons.tolist())
        ends["RETRACTED"] += len(result.effects.retracted_rids)
        return result.running if rest is None else state.merge(rest, result.running)

    while waiting or len(running):
        # admit while a row and the prompt plus a step of each running request fit
        entering = []
        while waiting and len(pool.free_rows) > len(entering):
            need = sum(len(tokens[r]) + 1 for r in [*entering, waiting[0]]) + len(running) * 5
            if need > len(pool.free):
                break
            entering.append(waiting.popleft())
        if entering:
            admitted = Running.admitted(
                entering,
                [pool.free_rows.pop() for _ in entering],
                [len(tokens[r]) for r in entering],
                [prompt_lens[r] for r in entering],
                [tokens[r][-1] for r in entering],
                FinishRules.of([params] * len(entering), EOS),
                MAX_CONTEXT,
            )
            running = commit(state.admit(running, admitted, np.zeros(0, dtype=np.int64)))
        if len(running) and rng.random() < 0.03:  # a client goes away
            running = commit(state.abort(running, [int(rng.integers(len(running)))]))
        if not len(running):
            continue
        pending = running.pending_lens
        prefill = np.flatnonzero(pending > 1)
        if prefill.size:  # whole prompts (and retracted requests) compute their pending tokens
            sub = running.select(prefill)
            rest = running.select(np.flatnonzero(pending <= 1))
            ids = [
                t for r, kv in zip(sub.rids, sub.kv_lens.lens, strict=True) for t in tokens[r][kv:]
            ]
            batch = state.schedule_extend(sub, pending[prefill], ids, pool.alloc(len(ids)))
            sampled = rng.integers(0, VOCAB, size=int(batch.samples.sum()))
            running = commit(state.extend(batch, sampled), rest if len(rest) else None)
            continue
        room = np.minimum(MAX_CONTEXT - running.token_lens.lens, 24 - running.num_output) - 1
        drafts = np.minimum(rng.integers(0, 5, size=len(running)), np.maximum(room, 0))
        if len(running) + drafts.sum() > len(pool.free):  # retract the newest request
            newest = int(np.argmax(running.rids))
            waiting.appendleft(int(running.rids[newest]))
            running = commit(state.retract(running, [newest]))
            continue
        # a chain of random drafts below each pending token; the "model" accepts a prefix
        trees = DraftTrees.from_lists(
            [
                [int(last)] + rng.integers(1, VOCAB, size=k).tolist()
                for last, k in zip(running.last_tokens, drafts, strict=True)
            ],
            [list(range(-1, k)) for k in drafts],
        )
        batch = state.schedule_verify(running, trees, pool.alloc(trees.sizes.total))
        accepted = np.array([int(rng.integers(0, k + 1)) for k in drafts], dtype=np.int64)
        nodes = np.concatenate([np.arange(1, a + 1) for a in accepted] + [np.zeros(0, np.int64)])
        bonus = rng.integers(0, VOCAB, size=len(running))
        running = commit(state.verify(batch, accepted, nodes, bonus))
        pool.check(running)
    pool.check(running)
    if verbose:
        print(f"{num_requests} requests: {dict(ends)}; {len(pool.free)} of {capacity} slots free")
    return dict(ends=ends, free=len(pool.free), capacity=capacity)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    serve(args.requests, args.seed, verbose=True)
