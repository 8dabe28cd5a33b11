"""A verify pass walked along its trees' best paths on the device (`walk_ahead`), the decode
pass after it launched before the host's walk: outputs are those of plain decoding, the
device table ends each step equal to the host's, no slot is lost, a walk the host's
contradicts is dropped, and a pass that fails after the walk leaves nothing in the table.

The engine runs the Triton backend's graph path (uncaptured on CPU, under the interpreter)
with a separate device mirror of the request table, as on CUDA. Its proposer is an oracle
that drafts from a plain run's tokens, so that every outcome is reached whatever the model:
the best path all accepted, a part of it, none of it, and another branch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from plan_cases import DEVICE, tiny_engine

from engine import state
from engine.shell.engine import Engine
from engine.shell.failures import Faults
from engine.shell.graphs import graph_runners
from engine.shell.replay import replay_file
from engine.shell.table import RequestTable
from engine.shell.walk import BestPaths, DeviceWalk
from engine.spec.verify import verify_greedy
from engine.state import DraftTrees, FinishRules, Running, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
PARAMS = [
    SamplingParams(max_tokens=14, ignore_eos=True),
    SamplingParams(max_tokens=9, ignore_eos=True),
]


def _trees(lists: list[tuple[list[int], list[int]]]) -> DraftTrees:
    return DraftTrees.from_lists([t for t, _ in lists], [p for _, p in lists])


def test_best_paths_follow_each_nodes_first_child():
    trees = _trees(
        [
            ([1, 2, 3, 4, 5], [-1, 0, 0, 1, 3]),  # root -> 1 -> 3 -> 4 (2: a sibling)
            ([7], [-1]),  # a root alone
            ([1, 9, 8], [-1, 0, 0]),  # root -> 1
        ]
    )
    paths = BestPaths.of(trees)
    assert paths.nodes.tolist() == [[0, 1, 3, 4], [0, 0, 0, 0], [0, 1, 1, 1]]
    assert paths.lens.tolist() == [3, 0, 1]
    # argmax per node (flat): tree 0 accepts 2 then stops (node 3's argmax is not node 4's
    # token); tree 2 accepts its one draft
    argmax = np.array([2, 4, 0, 6, 0, 0, 9, 0, 0])
    assert paths.accepted(trees, argmax).tolist() == [2, 0, 1]
    assert verify_greedy(trees, argmax).accepted_lens.lens.tolist() == [2, 0, 1]


def _verify_batch(trees: DraftTrees, kv_lens: list[int], rows: list[int]) -> state.Batch:
    count = len(kv_lens)
    rules = FinishRules(
        np.full(count, 50), np.zeros(count), -np.ones(count), np.zeros((count, 0), np.int64)
    )
    kv = np.array(kv_lens)
    roots = trees.tokens[trees.sizes.starts()]
    running = Running(
        np.arange(count), np.array(rows), state.SeqLens(kv), state.SeqLens(kv + 1),
        np.ones(count, dtype=np.int64), roots, rules, 16, np.zeros(count, dtype=np.int64),
    )  # fmt: skip
    slots = np.arange(100, 100 + trees.sizes.total)
    return state.schedule_verify(running, trees, slots)


def test_the_device_walk_writes_the_accepted_slots_and_moves_the_next_pass_on():
    """The walk's next input ids, shift and table writes; what `cleared` clears; `confirmed`
    against the host's walk (None where it took another branch)."""
    trees = _trees([([1, 2, 3, 4], [-1, 0, 1, 2]), ([5, 6, 7], [-1, 0, 0])])
    batch = _verify_batch(trees, [3, 5], [1, 0])
    table = RequestTable(2, 16)
    # tree 0: argmax at root 2 (node 1 accepted), at node 1 3 (node 2), at node 2 9: stop.
    # tree 1: argmax at its root 7: its second child, off the best path (node 1, token 6)
    argmax = np.array([2, 3, 9, 0, 7, 0, 0])
    logits = torch.full((7, 12), -1.0)
    logits[torch.arange(7), torch.from_numpy(argmax)] = 1.0
    walk = DeviceWalk.launch(logits, batch, table)
    assert walk.shift.tolist() == [2, 0] and walk.ids.tolist() == [9, 7]
    assert table.host[1, 4:6].tolist() == [101, 102] and not table.host[1, 6:].any()
    assert not table.host[0].any()  # nothing accepted on tree 1's best path
    assert walk.target().tolist() == argmax.tolist()
    outcome = verify_greedy(trees, argmax)
    assert walk.confirmed(outcome, argmax) is None  # tree 1 accepted node 2, not node 1
    cleared = walk.cleared(outcome.accepted_lens.lens)  # past [2, 1] on paths of [3, 1]
    assert list(zip(cleared.table_rows, cleared.table_cols, strict=True)) == [(1, 6)]
    every = walk.cleared(np.zeros(2, dtype=np.int64))
    assert list(zip(every.table_rows, every.table_cols, strict=True)) == [
        (1, 4),
        (1, 5),
        (1, 6),
        (0, 6),
    ]
    logits[4] = 0.0
    logits[4, 1] = 1.0  # tree 1 now accepts nothing: the host's walk is the device's
    walk = DeviceWalk.launch(logits, batch, RequestTable(2, 16))
    outcome = verify_greedy(trees, walk.target())
    assert walk.confirmed(outcome, walk.target()).tolist() == [2, 0]
    assert walk.ids.tolist() == [9, 1]


def test_assume_decoded_moves_a_verify_pass_on_by_its_accepted_drafts():
    trees = _trees([([1, 2, 3, 4], [-1, 0, 1, 2]), ([5, 6, 7], [-1, 0, 0])])
    batch = _verify_batch(trees, [3, 5], [1, 0])
    following = state.assume_decoded(batch, np.array([2, 0]))
    assert following.kv_lens.lens.tolist() == [6, 6]
    assert following.token_lens.lens.tolist() == [7, 7]  # and each its pending token
    assert state.assume_decoded(batch).kv_lens.lens.tolist() == [4, 6]
    with pytest.raises(ValueError, match="accepted counts"):
        state.assume_decoded(batch, np.array([4, 0]))
    with pytest.raises(ValueError, match="2 requests"):
        state.assume_decoded(batch, np.array([1]))
    decode = state.schedule_decode(following, np.array([9, 10]))
    with pytest.raises(ValueError, match="after a verify pass"):
        state.assume_decoded(decode, np.array([0, 0]))


def _engine(monkeypatch, **overrides) -> Engine:
    """The Triton backend's graph path with a device mirror of the table (CUDA's; forced on
    CPU), passes launched ahead."""
    monkeypatch.setattr(RequestTable.__init__, "__defaults__", ("cpu", True))
    settings = dict(
        kv_cache_slots=512, speculative=True, draft_budget=4, launch_ahead=True, walk_ahead=True
    )
    engine = tiny_engine("triton", **(settings | overrides))
    table, runner = engine.book.table, engine.runner
    runner.graphs = graph_runners(runner.model, runner.backend, 4, 5, DEVICE == "cuda", table)
    return engine


KINDS = ("all", "none", "branch", "part")
# each twice (after a walked verify pass the next drafts wait for the pass launched on it,
# and the proposer is asked again at its commit), after a step that drafts nothing (a walk is
# allowed again after one)
TURNS = tuple(turn for kind in KINDS for turn in ("nothing", kind, kind))


def _oracle(engine: Engine, reference: list[list[int]], turns: tuple = TURNS) -> list[str]:
    """Make `engine`'s proposer draft from `reference` (each of PROMPTS with its plain
    output), in `turns`: nothing; the next three tokens (all accepted); a wrong first draft
    (none); the right token as a second child (another branch); one right, one wrong (a
    part). Returns the kinds drafted, in order."""
    spec = engine.spec
    assert spec is not None
    vocab = engine.runtime.vocab_size
    asked, kinds = [0], []

    def propose(running, free_slots, probe=False):
        # a probe gets the whole tree too: the step that probes asks only whether it is None
        kind = turns[asked[0] % len(turns)]
        asked[0] += 1
        if kind == "nothing" or free_slots < 4 * len(running):
            return None
        kinds.append(kind)
        tokens, parents = [], []
        known_lens = running.token_lens.lens.tolist()  # with the pending token, the root
        for uid, root, known in zip(
            running.rids.tolist(), running.last_tokens.tolist(), known_lens, strict=True
        ):
            full = reference[PROMPTS.index(engine.requests[uid].prompt_ids)]
            nxt = [*full[known : known + 3], *([1, 2, 3])][:3]
            wrong = [(t + 1) % vocab for t in nxt]
            tree = {
                "all": ([root, *nxt], [-1, 0, 1, 2]),
                "none": ([root, wrong[0], nxt[1]], [-1, 0, 1]),
                "branch": ([root, wrong[0], nxt[0], nxt[1]], [-1, 0, 0, 2]),
                "part": ([root, nxt[0], wrong[1]], [-1, 0, 1]),
            }[kind]
            tokens.append(tree[0])
            parents.append(tree[1])
        return DraftTrees.from_lists(tokens, parents)

    spec.propose = propose
    spec.will_draft = lambda running: turns[asked[0] % len(turns)] != "nothing"
    return kinds


def _reference(monkeypatch) -> list[list[int]]:
    """PROMPTS with their outputs from plain decoding on the same graphs."""
    outputs = _engine(monkeypatch, speculative=False, walk_ahead=False).generate(PROMPTS, PARAMS)
    return [p + list(o.token_ids) for p, o in zip(PROMPTS, outputs, strict=True)]


def _run(engine: Engine) -> list:
    """Submit PROMPTS and step to the end, checking after each step that no slot is lost
    and that the device table equals the host's (nothing the device wrote is left)."""
    requests = [engine._submit(p, q, None, None) for p, q in zip(PROMPTS, PARAMS, strict=True)]
    while engine.has_work:
        engine.step()
        engine.check()
        assert np.array_equal(engine.book.table.device.cpu().numpy(), engine.book.table.host)
    return requests


def test_walked_verify_passes_give_plain_decodings_tokens(monkeypatch):
    reference = _reference(monkeypatch)
    engine = _engine(monkeypatch)
    kinds = _oracle(engine, reference)
    confirmed, launched = [], {}  # the walks' outcomes; the passes launched on them
    real = engine._confirm_walk

    def confirm(walk, outcome, target):
        real(walk, outcome, target)
        confirmed.append(walk.confirmed(outcome, target))
        if confirmed[-1] is not None:
            launched[id(engine.ahead.prepared.batch.out_slots)] = int(confirmed[-1].sum())

    engine._confirm_walk = confirm
    # each pass launched on a walk computes the logits of the pass the host would launch
    # after the commit (its input ids, positions and keys)
    take, compared = engine.ahead.take, []

    def checked_take(running):
        prepared = take(running)
        if prepared is not None and id(prepared.batch.out_slots) in launched:
            batch = state.schedule_decode(running, prepared.batch.out_slots)
            eager = engine.runner.forward(batch)
            torch.testing.assert_close(prepared.launched.logits, eager, rtol=1e-4, atol=1e-4)
            compared.append(launched.pop(id(prepared.batch.out_slots)))
        return prepared

    engine.ahead.take = checked_take
    requests = _run(engine)
    assert [
        p + list(r.completion().token_ids) for p, r in zip(PROMPTS, requests, strict=True)
    ] == reference
    assert engine.book.num_available == engine.book.slots.capacity
    assert any(compared)  # a pass moved on by drafts accepted on the device
    stats = engine.stats
    assert {"all", "none", "branch"} <= set(kinds)
    # every walk reached its host's: confirmed, with drafts accepted on the device, or not
    assert len(confirmed) == stats["walks_ahead"]
    assert stats["walks_ahead_dropped"] == sum(c is None for c in confirmed) > 0
    assert any(c is not None and c.any() for c in confirmed)
    assert any(c is not None and not c.any() for c in confirmed)
    # the passes launched on them were taken (cut where a request finished)
    assert stats["plans_ahead_used"] >= sum(c is not None for c in confirmed)


def test_when_the_speculator_lets_a_verify_pass_be_walked():
    """Not after a verify step that accepted drafts (the next most often verifies again),
    nor after a walk whose next step's drafts had to wait for the pass launched on it, until
    a step drafts nothing."""
    spec = Engine(
        random_weights="tiny", device="cpu", speculative=True, launch_ahead=True, walk_ahead=True
    ).spec
    for uid in (1, 2):
        spec.add_request(uid, [5, 6, 7])
    trees = DraftTrees.from_lists([[7, 8], [7, 9]], [[-1, 0], [-1, 0]])
    assert spec.may_walk([1, 2])
    spec.record([1, 2], trees, np.array([1, 0]))
    assert not spec.may_walk([1, 2]) and spec.may_walk([2])
    spec.record_idle(np.array([1]), drafted=True)  # drafts that waited for a plain pass
    assert spec.may_walk([1, 2])
    spec.walked([1, 2])
    spec.record_idle(np.array([1, 2]), drafted=True)  # the drafts waited for the walk's pass
    assert not spec.may_walk([1]) and not spec.may_walk([2])
    spec.record([1, 2], trees, np.array([0, 0]))  # a verify step: still
    assert not spec.may_walk([1])
    spec.record_idle(np.array([1]))  # nothing drafted
    assert spec.may_walk([1]) and not spec.may_walk([1, 2])
    spec.remove(2)
    assert spec.may_walk([1, 2])


def test_verify_passes_are_walked_only_where_the_speculator_lets_them(monkeypatch):
    reference = _reference(monkeypatch)
    engine = _engine(monkeypatch)
    _oracle(engine, reference, ("nothing", *(k for kind in KINDS for k in (kind, kind))))
    walked, real = [], engine._walk_ahead

    def walk_ahead(open_pass, logits, greedy):
        allowed = engine.spec.may_walk(open_pass.batch.running.rids.tolist())
        walk = real(open_pass, logits, greedy)
        walked.append((allowed, walk is not None))
        return walk

    engine._walk_ahead = walk_ahead
    _run(engine)
    assert (False, True) not in walked and (True, True) in walked and (False, False) in walked
    off = _engine(monkeypatch, walk_ahead=False)
    _oracle(off, reference)
    requests = _run(off)
    assert off.stats["walks_ahead"] == 0
    assert [
        p + list(r.completion().token_ids) for p, r in zip(PROMPTS, requests, strict=True)
    ] == reference


def test_a_pass_that_fails_after_its_walk_leaves_nothing_in_the_table(monkeypatch):
    """A verify pass whose commit fails after the device walked it: its requests end with
    'error' (their rows cleared, with what the device wrote), the pass launched on the walk
    is dropped, no slot is lost, and the engine serves the next request."""
    reference = _reference(monkeypatch)
    engine = _engine(monkeypatch)
    _oracle(engine, reference)
    real = engine._confirm_walk
    failed = []

    def confirm(walk, outcome, target):
        real(walk, outcome, target)
        accepted = walk.confirmed(outcome, target)
        if accepted is not None and accepted.any() and not failed:  # the commit right after
            failed.append(True)
            engine.faults = Faults.at(commit=[1])

    engine._confirm_walk = confirm
    requests = _run(engine)
    assert failed
    assert {r.completion().finish_reason for r in requests} == {"error"}
    engine.faults = None
    again = engine.generate(PROMPTS[:1], PARAMS[0])
    assert list(again[0].token_ids) == reference[0][len(PROMPTS[0]) :]
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity


def test_a_run_with_walks_replays_clean(monkeypatch, tmp_path):
    """The trace of a run whose verify passes were walked on the device: the passes launched
    on them laid out for the accepted drafts (`assume_decoded` with them, the plan's slots
    handed on) and the table writes that clear a dropped walk's replay as recorded."""
    reference = _reference(monkeypatch)
    path = tmp_path / "run.jsonl"
    engine = _engine(monkeypatch, trace_path=str(path))
    _oracle(engine, reference)
    _run(engine)
    assert engine.stats["walks_ahead_dropped"] > 0
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert any(r["op"] == "assume_decoded" and any(r.get("accepted", ())) for r in records)
    assert any(r["op"] == "apply" for r in records)  # a dropped walk's writes cleared
    assert replay_file(str(path)).steps == len(records)
