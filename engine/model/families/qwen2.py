"""Qwen2 and Qwen2.5: Llama's layout with biases on the q, k and v projections (stored in
the engine's fused `qkv_bias`, q then k then v)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.config import ModelConfig
from engine.model.families.base import (
    GGUF_LAYER_NAMES,
    LAYER_WEIGHTS,
    Family,
    layer_types_window,
)


def _options(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "sliding_window": layer_types_window(hf)}


def _extra(config: ModelConfig) -> dict[str, Any]:
    window = config.sliding_window
    # max_window_layers 0: every layer slides, as the engine's check assumes
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0,
    }


FAMILY = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_class="Qwen2ForCausalLM",
    gguf_architecture="qwen2",
    layer_weights={
        **LAYER_WEIGHTS,
        "self_attn.q_proj.bias": ("qkv_bias", "q"),
        "self_attn.k_proj.bias": ("qkv_bias", "k"),
        "self_attn.v_proj.bias": ("qkv_bias", "v"),
    },
    gguf_layer_names={
        **GGUF_LAYER_NAMES,
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    hf_options=_options,
    hf_extra=_extra,
    qkv_bias=True,
)
