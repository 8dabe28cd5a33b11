"""`benchmarks/spec_systems.py`: the variants the speculation benchmarks read from the command
line, and how `timed` keeps one system's garbage out of another's time."""

from __future__ import annotations

import pytest


@pytest.fixture
def systems(bench_script):
    return bench_script("spec_systems")


def test_a_variant_keeps_a_list_whole_and_splits_spec_fields_from_engine_options(systems):
    name, options = systems.variant("lv:draft_budget=12,budget_levels=[3,7,12],start_budget=7")
    assert (name, options) == (
        "lv",
        {"draft_budget": 12, "budget_levels": [3, 7, 12], "start_budget": 7},
    )
    assert systems.variant("walk_ahead=false") == ("walk_ahead=false", {"walk_ahead": False})
    spec, engine = systems.split_options(options)
    assert spec == {"budget_levels": [3, 7, 12], "start_budget": 7}
    assert engine == {"draft_budget": 12}  # an engine option too: the engine takes it


class Instant:
    """A system whose run takes no time; it logs each run."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        self.log.append(self.name)
        return ids[:max_tokens]


def test_garbage_is_collected_before_each_run_outside_its_time(systems, monkeypatch):
    log: list[str] = []
    clock = [0.0]  # a clock that only a collection moves: a run's time is what it paid

    def collect() -> int:
        log.append("collect")
        clock[0] += 1.0
        return 0

    monkeypatch.setattr(systems.gc, "collect", collect)
    monkeypatch.setattr(systems.time, "perf_counter", lambda: clock[0])
    results = systems.timed({"a": Instant("a", log), "b": Instant("b", log)}, [[1, 2], [3]], 4)
    assert log == ["collect", "a", "collect", "b", "collect", "b", "collect", "a"]
    for seconds, outputs in results.values():
        assert seconds == [0.0, 0.0]  # no run paid for a collection
        assert outputs == [[1, 2], [3]]


def test_a_variants_spec_fields_reach_the_proposer_and_the_drafting(systems):
    """A `SpecConfig` field of a variant is the proposer's (breadth) as much as the adaptive
    drafting's (levels): none is taken and then ignored."""
    ours = systems.Ours(
        True, random_weights="tiny", spec_overrides={"max_breadth": 1, "budget_levels": [3, 7, 12]}
    )
    spec = ours.engine.spec
    for config in (spec.config, spec.stats.config, spec.proposer.config):
        assert config.max_breadth == 1 and config.budget_levels == (3, 7, 12)


def test_freeze_waits_for_every_engine_then_collects_and_freezes_once(systems, monkeypatch):
    """The freeze moves the whole process's objects, so one collection and one freeze serve
    every engine (each engine's grammar vocabulary ready first)."""
    from types import SimpleNamespace

    import engine.shell.startup as startup

    calls: list[str] = []
    monkeypatch.setattr(startup.gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(startup.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(startup.gc, "get_freeze_count", lambda: 7)
    engines = [
        SimpleNamespace(grammars=SimpleNamespace(wait_ready=lambda i=i: calls.append(f"ready {i}")))
        for i in range(3)
    ]
    assert systems.freeze(engines) == 7
    assert calls == ["ready 0", "ready 1", "ready 2", "collect", "freeze"]
