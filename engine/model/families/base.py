"""What the families share: the `Family` value each family module fills in, Llama's weight
names (HF and GGUF), and the config fields every family spells alike."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from engine.model.config import ModelConfig, ModelConfigError

# HF layer weight (after "model.layers.N.") -> (the engine's parameter, part of a fused one)
LAYER_WEIGHTS: dict[str, tuple[str, str | None]] = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attn.q_proj.weight": ("qkv_proj", "q"),
    "self_attn.k_proj.weight": ("qkv_proj", "k"),
    "self_attn.v_proj.weight": ("qkv_proj", "v"),
    "self_attn.o_proj.weight": ("o_proj", None),
    "mlp.gate_proj.weight": ("gate_up_proj", "gate"),
    "mlp.up_proj.weight": ("gate_up_proj", "up"),
    "mlp.down_proj.weight": ("down_proj", None),
}
# GGUF layer tensor (after "blk.N.") -> HF layer weight
GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

HfOptions = Callable[[Mapping[str, Any]], dict[str, Any]]


@attrs.frozen
class Family:
    """One model family: how its HF config.json and GGUF metadata map onto `ModelConfig`,
    and its weights' names onto the engine's layers."""

    name: str  # ModelConfig.architecture
    hf_model_types: tuple[str, ...]  # config.json's model_type
    hf_class: str  # written to config.json's architectures
    # GGUF general.architecture (None: llama.cpp writes this family under another's)
    gguf_architecture: str | None
    layer_weights: Mapping[str, tuple[str, str | None]]
    gguf_layer_names: Mapping[str, str]
    # ModelConfig fields from the family's own config.json keys (refusing what the engine
    # cannot run, naming the key), and the keys written back for them
    hf_options: HfOptions
    hf_extra: Callable[[ModelConfig], dict[str, Any]] = lambda config: {}
    qkv_bias: bool = False
    qk_norm: bool = False
    # llama.cpp permutes q/k rows for its interleaved RoPE (Llama); not for NeoX-style (Qwen)
    gguf_permuted_qk: bool = False

    # --- HF -------------------------------------------------------------------------------
    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        """From the dict of an HF config.json (transformers 4 or 5 spelling)."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(
                f"hidden_act={act!r} is not supported; the engine runs SwiGLU MLPs ('silu')"
            )
        num_heads = _required(hf, "num_attention_heads")
        hidden = _required(hf, "hidden_size")
        max_positions = hf.get("max_position_embeddings", 2048)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        partial = hf.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor")
        if partial not in (None, 1, 1.0):
            raise ModelConfigError(
                f"partial_rotary_factor={partial!r} is not supported; RoPE turns whole heads"
            )
        return ModelConfig(
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(hf, "intermediate_size"),
            num_layers=_required(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=_hf_rope_scaling(rope, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=hf_eos_ids(hf.get("eos_token_id")),
            architecture=self.name,
            **self.hf_options(hf),
        )

    def to_hf(self, config: ModelConfig) -> dict[str, Any]:
        """The HF config.json dict for `config` (used to write checkpoints)."""
        self.check(config)
        eos = list(config.eos_token_ids)
        return {
            "model_type": self.hf_model_types[0],
            "architectures": [self.hf_class],
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_scaling,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": config.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            **self.hf_extra(config),
        }

    # --- GGUF -----------------------------------------------------------------------------
    def config_from_gguf(
        self, meta: Mapping[str, Any], vocab_size: int | None, tie_word_embeddings: bool
    ) -> ModelConfig:
        """From GGUF key/value metadata (`<arch>.*`, `tokenizer.ggml.*`). `vocab_size` falls
        back to the token list's length; ties follow from whether `output.weight` exists."""
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):  # it prefixes every key below
            raise ModelConfigError(
                f"GGUF metadata lacks general.architecture (a string; got {arch!r})"
            )

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        vocab = get("vocab_size") or vocab_size
        if hidden is None or num_heads is None or vocab is None:
            raise ModelConfigError(
                f"GGUF metadata lacks {arch}.embedding_length, "
                f"{arch}.attention.head_count or a vocabulary size"
            )
        context = int(get("context_length", 2048))
        window = get("attention.sliding_window")
        head_dim = get("attention.key_length") or get("rope.dimension_count")
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=int(num_heads),
            num_kv_heads=int(get("attention.head_count_kv") or num_heads),
            head_dim=int(head_dim or hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(get, arch, context),
            max_position_embeddings=context,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_ids(meta),
            architecture=self.name,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            sliding_window=None if window is None else int(window),
        )

    def gguf_to_hf_name(self, name: str) -> str:
        """The HF name of a GGUF tensor ('blk.3.attn_q.weight' -> 'model.layers.3.
        self_attn.q_proj.weight')."""
        if name in GGUF_GLOBAL_NAMES:
            return GGUF_GLOBAL_NAMES[name]
        match = _GGUF_LAYER.fullmatch(name)
        if match is None or match.group(2) not in self.gguf_layer_names:
            raise ModelConfigError(f"unexpected GGUF tensor {name!r} for a {self.name} model")
        return f"model.layers.{match.group(1)}.{self.gguf_layer_names[match.group(2)]}"

    def check(self, config: ModelConfig) -> None:
        """A config's layer options must be its family's (they decide the weight names)."""
        for option in ("qkv_bias", "qk_norm"):
            if getattr(config, option) != getattr(self, option):
                raise ModelConfigError(
                    f"{option}={getattr(config, option)} does not fit architecture "
                    f"{self.name!r}, whose {option} is {getattr(self, option)}"
                )


# the GGUF keys of tokens that end generation (llama.cpp's end-of-generation set): end of
# sequence, of turn (Qwen's <|im_end|> where eos is <|endoftext|>, Llama 3's <|eot_id|>),
# of message (Llama 3.1's <|eom_id|>)
GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def gguf_eos_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """Every end-of-generation id the GGUF metadata names, eos first, without repeats."""
    ids = (meta.get(key) for key in GGUF_EOS_KEYS)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def hf_eos_ids(*values: Any) -> tuple[int, ...]:
    """The EOS ids of config.json's and generation_config.json's eos_token_id (an int, a
    list or None each), in order, without repeats: HF generate stops on any of them."""
    ids: list[int] = []
    for value in values:
        if value is not None:
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _required(hf: Mapping[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json lacks {key!r}")
    return hf[key]


def _hf_rope_scaling(rope: Mapping[str, Any] | None, max_positions: int) -> dict | None:
    """HF's defaults filled in: llama3 and yarn scale from max_position_embeddings when
    original_max_position_embeddings is absent; yarn's factor is their ratio when None."""
    if rope is None:
        return None
    scaling = dict(rope)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", max_positions)
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return scaling


def _gguf_rope_scaling(get: Callable[..., Any], arch: str, context: int) -> dict | None:
    kind = get("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = get("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(
                get("rope.scaling.original_context_length", context)
            ),
        }
        for key in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{key}") is not None:
                scaling[key] = float(get(f"rope.scaling.yarn_{key}"))
        return scaling
    raise ModelConfigError(
        f"{arch}.rope.scaling.type {kind!r} is not supported; supported: linear, yarn or none"
    )


def refuse_true(hf: Mapping[str, Any], family: str, *keys: str) -> None:
    """Options of HF's config class that this family's layers in the engine do not have."""
    for key in keys:
        if hf.get(key):
            raise ModelConfigError(f"{key}={hf[key]!r} is not supported for {family} models")


def layer_types_window(hf: Mapping[str, Any]) -> int | None:
    """The window of a config whose layers (some or all) use sliding-window attention:
    Qwen's `use_sliding_window` or transformers 5's `layer_types`; None when none do."""
    sliding = hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ())
    return hf.get("sliding_window") if sliding else None
