"""The model families the engine runs, one module each, found by an HF config's model_type,
a GGUF's general.architecture, or a `ModelConfig`'s architecture. Every family runs on the
one decoder in `engine.model.llama`; a family says how its configs and weight names map
onto it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.config import ModelConfig, ModelConfigError
from engine.model.families import llama, mistral, qwen2, qwen3
from engine.model.families.base import Family

FAMILIES: dict[str, Family] = {
    family.name: family for family in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY)
}


def for_hf(hf: Mapping[str, Any]) -> Family:
    """The family of an HF config.json dict, by its model_type (absent: llama)."""
    model_type = hf.get("model_type", "llama")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    supported = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ModelConfigError(f"model_type {model_type!r} is not supported; supported: {supported}")


def for_gguf(meta: Mapping[str, Any]) -> Family:
    """The family of GGUF metadata, by general.architecture."""
    arch = meta.get("general.architecture")
    for family in FAMILIES.values():
        if family.gguf_architecture is not None and arch == family.gguf_architecture:
            return family
    supported = sorted(f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)
    raise ModelConfigError(
        f"GGUF general.architecture {arch!r} is not supported; supported: {supported}"
    )


def for_config(config: ModelConfig) -> Family:
    """The family of a config, which must have that family's layer options."""
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise ModelConfigError(
            f"architecture {config.architecture!r} is unknown; choose one of {sorted(FAMILIES)}"
        )
    family.check(config)
    return family


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    return for_hf(hf).config_from_hf(hf)


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return for_config(config).to_hf(config)


__all__ = ["FAMILIES", "Family", "config_from_hf", "for_config", "for_gguf", "for_hf", "to_hf"]
