"""What the engine tests share: a tiny random-weights engine, a run to the end with the pool
checked at every step, the check that an engine holds nothing any more, and whether tokens
hold a word."""

from __future__ import annotations

from engine.shell.engine import Engine
from engine.state import DraftTrees


def holds(tokens: list[int] | tuple[int, ...], word: tuple[int, ...]) -> bool:
    """Whether `word` (token ids) occurs in `tokens`, consecutively."""
    n = len(word)
    return any(tuple(tokens[i : i + n]) == tuple(word) for i in range(len(tokens) - n + 1))


def tiny(**overrides) -> Engine:
    """The tiny random model in fp32 on the CPU (unless `device` says otherwise), a small
    pool and a configured draft cost (none is fitted from timings in tests)."""
    settings = dict(
        random_weights="tiny",
        device="cpu",
        dtype="float32",
        max_context=128,
        kv_cache_slots=512,
        max_running_requests=8,
        draft_cost=0.1,
    )
    return Engine(**(settings | overrides))


def settled(engine: Engine) -> None:
    """Every request done, every slot free or cached and unlocked, every row back."""
    engine.check()
    assert not engine.has_work
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    if engine.book.cache is not None:
        assert engine.book.cache.num_locked == 0 and not engine.book.cache.holders()


def run(engine: Engine, steps: int = 10_000) -> None:
    for _ in range(steps):
        if not engine.has_work:
            return
        engine.step()
        engine.check()
    raise AssertionError("the engine did not finish")


def draft_in_turns(engine: Engine, drafts: int = 2, turn: int = 3) -> None:
    """Make `engine`'s proposer draft nothing, then draft `turn` - 1 times, in turns as it is
    asked (a chain of `drafts` guesses a request, its pending token + 1, + 2, ..., which the
    model hardly ever samples; nothing where the pool has no room), whatever tokens the model
    gives (they differ between devices). With `launch_ahead` the step that drafts nothing
    launches the next pass ahead, the first drafts then wait for it (or, with `verify_ahead`,
    are launched after it), and the next are verified at once (launched at the commit of the
    step before). Greedy outputs stay those of plain decoding."""
    spec = engine.spec
    assert spec is not None
    asked = [0]

    def propose(running, free_slots, probe=False):
        asked[0] += 1
        count = len(running)
        if asked[0] % turn == 1 or free_slots < count * (drafts + 1):
            return None
        roots = running.last_tokens.tolist()
        vocab = engine.runtime.vocab_size
        chain = 1 if probe else drafts  # a probe: each tree's best draft alone
        return DraftTrees.from_lists(
            [[r, *((r + k) % vocab for k in range(1, chain + 1))] for r in roots],
            [[-1, *range(chain)]] * count,
        )

    spec.propose = propose
    spec.will_draft = lambda running: (asked[0] + 1) % turn != 1
