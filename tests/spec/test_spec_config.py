"""SpecConfig: defaults are valid, every field is validated with a message naming it."""

from __future__ import annotations

import re

import pytest

from engine.spec import SpecConfig


def test_defaults_are_valid_and_documented() -> None:
    config = SpecConfig()
    assert config.draft_budget == 12
    assert config.min_match <= config.max_match < config.max_trie_depth
    for field in SpecConfig.__attrs_attrs__:
        assert f"{field.name} (" in SpecConfig.__doc__, f"{field.name} has no documented default"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_trie_depth", 1),
        ("max_trie_depth", 65),
        ("max_trie_depth", 8.0),
        ("draft_budget", -1),
        ("draft_budget", 63),
        ("draft_budget", True),
        ("min_breadth", 0),
        ("max_breadth", 0),
        ("capacity", 100),
        ("capacity", None),
        ("min_match", 0),
        ("min_match", 16),
        ("max_match", 1),
        ("max_match", 16),
        ("adaptive", 1),
        ("adapt_window", 0),
        ("shrink_below", -0.1),
        ("shrink_below", "0.5"),
        ("grow_at_least", 0.5),
        ("probe_interval", 0),
        ("max_probe_interval", 15),
        ("max_probe_interval", 32.0),
        ("max_run_loss", 0),
        ("max_run_loss", float("nan")),
        ("draft_cost", -0.1),
        ("draft_cost", 1.5),
        ("draft_cost", "0.1"),
        ("draft_cost", float("nan")),
        ("shrink_after_loss", 0),
        ("shrink_after_loss", None),
        ("budget_levels", (3, 7)),  # must end at draft_budget
        ("budget_levels", (7, 3, 12)),
        ("budget_levels", (0, 12)),
        ("budget_levels", (3.0, 12)),
        ("budget_levels", 12),
        ("start_budget", 0),
        ("start_budget", 13),
        ("start_budget", 7.0),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    message = re.escape(f"{field}={value!r} is not allowed; {field} must be")
    with pytest.raises(ValueError, match=f"^{message}"):
        SpecConfig(**{field: value})


def test_breadth_is_larger_for_shorter_matches() -> None:
    config = SpecConfig(min_match=1, max_match=5, min_breadth=2, max_breadth=10)
    widths = [config.breadth(match_len) for match_len in range(1, 6)]
    assert widths == [10, 8, 6, 4, 2]
    assert config.breadth(0) == 10 and config.breadth(9) == 2
    assert SpecConfig(min_match=3, max_match=3).breadth(3) == SpecConfig().max_breadth


def test_budget_levels_move_a_budget_a_level_at_a_time() -> None:
    halving = SpecConfig(draft_budget=12)
    assert [halving.lower_budget(b) for b in (12, 6, 3, 1)] == [6, 3, 1, 0]
    assert [halving.higher_budget(b) for b in (1, 2, 3, 6, 7)] == [2, 4, 6, 12, 12]
    assert halving.first_budget == 12
    levels = SpecConfig(draft_budget=12, budget_levels=[3, 7, 12], start_budget=7)
    assert levels.budget_levels == (3, 7, 12)  # a list is taken as a tuple
    assert [levels.lower_budget(b) for b in (12, 7, 3, 2, 1)] == [7, 3, 0, 0, 0]
    assert [levels.higher_budget(b) for b in (1, 2, 3, 5, 7, 11)] == [3, 3, 7, 7, 12, 12]
    assert levels.first_budget == 7


def test_a_start_budget_between_levels_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^start_budget=5 is not allowed; .*one of budget_lev"):
        SpecConfig(budget_levels=(3, 7, 12), start_budget=5)
