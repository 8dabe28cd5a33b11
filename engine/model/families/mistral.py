"""Mistral: Llama's layout, with a sliding attention window in some checkpoints (7B v0.1:
4096), which the engine serves only within a context no longer than the window. llama.cpp
writes Mistral GGUFs as `llama`, so they load through that family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.config import ModelConfig
from engine.model.families.base import GGUF_LAYER_NAMES, LAYER_WEIGHTS, Family, refuse_true


def _options(hf: Mapping[str, Any]) -> dict[str, Any]:
    refuse_true(hf, "mistral", "attention_bias", "mlp_bias")
    return {"sliding_window": hf.get("sliding_window")}


def _extra(config: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window}


FAMILY = Family(
    name="mistral",
    hf_model_types=("mistral",),
    hf_class="MistralForCausalLM",
    gguf_architecture=None,
    layer_weights=LAYER_WEIGHTS,
    gguf_layer_names=GGUF_LAYER_NAMES,
    hf_options=_options,
    hf_extra=_extra,
    gguf_permuted_qk=True,
)
