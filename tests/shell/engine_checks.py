"""Checks the engine tests share: a run to the end with the pool checked at every step, and an
engine left with nothing running and nothing locked."""

from __future__ import annotations

from engine.shell.engine import Engine


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
