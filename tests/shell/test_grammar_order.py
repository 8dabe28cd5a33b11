"""Where a pass's grammar masks are filled, on a timeline of the loop's calls (random tiny
weights on the CPU, the masks filled as with a GPU: by the filler thread): after the forward is
launched, alongside the loop's other host work for the pass (the next pass's plan, during a
decode), and before the sampling that applies them; a verify pass's tree masks after its
forward and before the verification. Output still follows the grammar."""

from __future__ import annotations

import re
import threading

import pytest

from engine import SamplingParams
from engine.shell import grammar, masks
from engine.shell.engine import Engine
from engine.state import StructuredOutputs

EOS = 2
PATTERN = rb"(red|green)-[0-9]{2}( (red|green)-[0-9]{2}){2,6}\."
PROMPT = list(b"red-12 green-34 red-12 green-34 red-12 green-34 red-12 green-")


class Timeline:
    """Records (event, thread) in call order from the engine's runner, grammars, planner
    and logits work (where sampling applies the masks)."""

    def __init__(self, engine: Engine) -> None:
        self.events: list[tuple[str, threading.Thread]] = []
        self.main = threading.current_thread()
        self._wrap(engine.runner, "forward", "forward")
        self._wrap(engine.runner, "launch", "forward")
        self._wrap(engine.grammars.fills, "fill_rows", "fill")
        self._wrap(engine.grammars.fills, "submit", "start")
        self._wrap(engine.ahead, "plan", "plan")
        self._wrap(engine.logits, "constrain", "apply")  # in sampling: waits for the fill
        self._wrap(engine.logits, "constrain_tree", "apply")
        self._wrap(engine.logits, "start_tree", "tree")

    def _wrap(self, owner: object, name: str, event: str) -> None:
        inner = getattr(owner, name)

        def recorded(*args, **kwargs):
            self.events.append((event, threading.current_thread()))
            return inner(*args, **kwargs)

        setattr(owner, name, recorded)

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


@pytest.fixture(params=["plain", "speculative"])
def engine(request, monkeypatch) -> Engine:
    monkeypatch.setattr(masks, "HANDOFF_SECONDS", 0.0)  # every fill handed off, however cheap
    settings = dict(random_weights="tiny", device="cpu", dtype="float32", max_context=256)
    if request.param == "speculative":
        settings.update(speculative=True, draft_budget=8)
    engine = Engine(**settings)
    engine.grammars.fills.parallel = True  # as on a GPU: masks filled by a pool thread
    return engine


def _passes(names: list[str]) -> list[list[str]]:
    """The timeline cut at each forward (one pass each)."""
    cuts = [i for i, name in enumerate(names) if name == "forward"] + [len(names)]
    return [names[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def test_masks_are_filled_while_the_pass_runs_and_applied_in_its_sampling(engine) -> None:
    timeline = Timeline(engine)
    spec = {"regex": PATTERN.decode()}
    # sampled rows: their masks are applied before they draw (a greedy row's are computed
    # only where its grammar refuses its unmasked token, after the pass)
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=spec)
        for s in range(2)
    ]
    outs = engine.generate([PROMPT] * 2, params)
    for out in outs:
        text = bytes(t for t in out.token_ids if t != EOS)
        assert re.fullmatch(PATTERN, text) or out.finish_reason == "length", text
    filled = [thread for name, thread in timeline.events if name == "fill"]
    assert filled and all(thread is not timeline.main for thread in filled)
    passes = _passes(timeline.names())
    planned = 0
    for events in passes:
        if "start" not in events:
            continue
        if "plan" in events:  # the next pass planned before this one is sampled
            assert events.index("start") < events.index("plan") < events.index("apply")
            planned += 1
        assert events.index("start") > 0  # started after the forward's launch
        assert events.index("start") < events.index("apply")
    assert planned > 0  # decode passes planned their successor while masks were filled
    if engine.spec is not None:
        assert engine.spec.stats_dict()["spec_draft_tokens_total"] > 0
        assert any("tree" in events and "start" in events for events in passes)


def test_masks_cheaper_than_the_hand_off_are_filled_on_the_loops_thread() -> None:
    """Once the fill is measured cheaper than `HANDOFF_SECONDS`, a pass's masks are filled
    where they are started; before that (nothing measured) they are handed off."""
    book = grammar.Grammars(None, 256, EOS, parallel=True)
    book.add(0, StructuredOutputs(regex="[ab]+"))
    main = threading.current_thread()
    filled_on = []
    fill = book.fills.fill_rows

    def recorded(rows, bitmask):
        filled_on.append(threading.current_thread())
        fill(rows, bitmask)

    book.fills.fill_rows = recorded
    book.start([0]).host()
    book.fills.rows_way.mean = {masks.SERIAL: masks.HANDOFF_SECONDS / 4}
    pending = book.start([0, 1, 2])  # one constrained row: a quarter of the hand-off
    assert pending.done and filled_on[1] is main
    book.fills.rows_way.mean = {masks.SERIAL: masks.HANDOFF_SECONDS * 2}
    book.start([0]).host()
    assert filled_on[0] is not main and filled_on[2] is not main
