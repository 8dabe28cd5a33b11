"""Llama (1, 2, 3, 3.1, SmolLM2 and the like): the layout every other family extends."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.families.base import GGUF_LAYER_NAMES, LAYER_WEIGHTS, Family, refuse_true


def _options(hf: Mapping[str, Any]) -> dict[str, Any]:
    refuse_true(hf, "llama", "attention_bias", "mlp_bias")  # biases on o_proj and the MLP
    return {}


FAMILY = Family(
    name="llama",
    hf_model_types=("llama",),
    hf_class="LlamaForCausalLM",
    gguf_architecture="llama",
    layer_weights=LAYER_WEIGHTS,
    gguf_layer_names=GGUF_LAYER_NAMES,
    hf_options=_options,
    gguf_permuted_qk=True,
)
