"""What the engine tests share: a tiny random-weights engine, a run to the end with the pool
checked at every step, and the check that an engine holds nothing any more."""

from __future__ import annotations

from engine.shell.engine import Engine


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
