"""The model families the engine runs, one module each, found by an HF config's model_type,
a GGUF's general.architecture, or a `ModelConfig`'s architecture. Every family runs on the
one decoder in `engine.model.llama`; a family says how its configs and weight names map
onto it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from engine.model.config import ModelConfig, ModelConfigError
from engine.model.families import llama, mistral, qwen2, qwen3
from engine.model.families.base import Family, hf_eos_ids

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


# what the weights of a GGUF fix: an HF config given beside it must agree on each
GGUF_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    "tie_word_embeddings",
)


def config_from_gguf_and_hf(
    from_gguf: ModelConfig, hf: Mapping[str, Any], generation_eos: Any = None
) -> ModelConfig:
    """A GGUF's config with an HF config.json's fields over its metadata (its family, RoPE,
    sliding_window, ...: what llama.cpp leaves out, e.g. Mistral v0.1's window). The shape
    must be the GGUF's; EOS ids are the GGUF's, config.json's and `generation_eos`
    (generation_config.json's eos_token_id), all of them."""
    from_hf = config_from_hf(hf)
    for field in GGUF_SHAPE_FIELDS:
        if getattr(from_hf, field) != getattr(from_gguf, field):
            raise ModelConfigError(
                f"the HF config's {field}={getattr(from_hf, field)!r} does not match the "
                f"GGUF's {field}={getattr(from_gguf, field)!r}; give the config.json of "
                f"the checkpoint the GGUF was converted from"
            )
    eos = hf_eos_ids(from_gguf.eos_token_ids, from_hf.eos_token_ids, generation_eos)
    return attrs.evolve(from_hf, eos_token_ids=eos)


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return for_config(config).to_hf(config)


__all__ = [
    "FAMILIES",
    "Family",
    "config_from_gguf_and_hf",
    "config_from_hf",
    "for_config",
    "for_gguf",
    "for_hf",
    "to_hf",
]
