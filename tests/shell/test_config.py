"""EngineConfig: every field validated with a message naming it; the CLI's flags parse them."""

from __future__ import annotations

import pytest

from engine.cli import build_parser
from engine.shell.config import EngineConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float64"),
        ("attention_backend", "flash"),
        ("max_context", 0),
        ("kv_cache_fraction", 0.0),
        ("kv_cache_fraction", 1.5),
        ("chunk_size", -1),
        ("max_running_requests", 2.0),
        ("cuda_graph_max_batch", -1),
        ("cuda_graph_max_tokens", -1),
        ("draft_budget", 0),
        ("draft_cost", -0.5),
        ("draft_cost", 2),
        ("draft_cost", True),
        ("draft_cost", "0.1"),
        ("draft_min_match", 0),
        ("draft_min_match", 16),
        ("draft_min_match", 2.0),
        ("draft_min_match", True),
        ("draft_min_match", None),
        # a bool is not a count, and a fraction must be a number (these passed, or raised a
        # TypeError that named nothing)
        ("max_running_requests", True),
        ("kv_cache_slots", True),
        ("kv_cache_fraction", "0.5"),
        ("kv_cache_fraction", float("nan")),
        ("kv_cache_fraction", True),
        ("prefix_cache", "no"),
        ("mixed_passes", 0),
        ("speculative", None),
        ("schedule_policy", "lifo"),
        ("max_waited_out", 0),
        ("mixed_chunk_size", 0),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}={value!r} is not allowed"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(
    "settings",
    [
        dict(speculative=False),
        dict(speculative=True, launch_ahead=False),
    ],
)
@pytest.mark.parametrize("name", ["verify_ahead", "walk_ahead"])
def test_passes_ahead_of_the_host_are_refused_where_they_could_never_launch(
    settings: dict, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{name}=True with .* is not allowed: it"):
        EngineConfig(**{name: True}, **settings)
    EngineConfig(**{name: True}, speculative=True)  # launch_ahead None: decided on the device


def test_replace_refuses_unknown_options_and_lists_the_known_ones() -> None:
    config = EngineConfig().replace(draft_cost=0.15)
    assert config.draft_cost == 0.15 and EngineConfig().draft_cost is None
    with pytest.raises(
        TypeError,
        match=r"unknown engine option\(s\) \['draft_costs'\]; known: .*"
        r"draft_cost",
    ):
        EngineConfig().replace(draft_costs=0.1)


def test_cli_flags_parse_to_the_config_types() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--draft-cost", "0.25", "--draft-budget", "6", "--no-block-weights"]
    )
    overrides = EngineConfig.overrides_from(args)
    assert overrides == {"draft_cost": 0.25, "draft_budget": 6, "block_weights": False}
    assert EngineConfig().replace(**overrides).draft_cost == 0.25
    args = build_parser().parse_args(
        ["generate", "hi", "--no-prefix-cache", "--no-mixed-passes", "--schedule-policy", "fcfs"]
    )
    assert EngineConfig.overrides_from(args) == {
        "prefix_cache": False,
        "mixed_passes": False,
        "schedule_policy": "fcfs",
    }


def test_the_errors_a_caller_can_act_on_are_value_errors() -> None:
    """ConfigError (options, models, shards) stays a ValueError, as callers caught before."""
    from engine.errors import ConfigError
    from engine.model.config import ModelConfigError
    from engine.model.loader import ShardError

    assert issubclass(ConfigError, ValueError)
    assert issubclass(ModelConfigError, ConfigError) and issubclass(ShardError, ConfigError)
    with pytest.raises(ConfigError, match="max_context=0"):
        EngineConfig(max_context=0)
