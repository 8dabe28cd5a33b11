"""Qwen3 (dense): Llama's layout with an RMSNorm over each q and k head before RoPE, no
biases, and a head size of its own (head_dim, not hidden_size / heads)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.config import ModelConfig
from engine.model.families.base import (
    GGUF_LAYER_NAMES,
    LAYER_WEIGHTS,
    Family,
    layer_types_window,
    refuse_true,
)


def _options(hf: Mapping[str, Any]) -> dict[str, Any]:
    refuse_true(hf, "qwen3", "attention_bias")  # biases on all four attention projections
    return {"qk_norm": True, "sliding_window": layer_types_window(hf)}


def _extra(config: ModelConfig) -> dict[str, Any]:
    window = config.sliding_window
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0,
        "attention_bias": False,
    }


FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_class="Qwen3ForCausalLM",
    gguf_architecture="qwen3",
    layer_weights={
        **LAYER_WEIGHTS,
        "self_attn.q_norm.weight": ("q_norm.weight", None),
        "self_attn.k_norm.weight": ("k_norm.weight", None),
    },
    gguf_layer_names={
        **GGUF_LAYER_NAMES,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    hf_options=_options,
    hf_extra=_extra,
    qk_norm=True,
)
