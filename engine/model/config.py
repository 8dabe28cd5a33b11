"""The shape and constants of a Llama-family model, as one frozen value.

Built from an HF config.json dict, from GGUF metadata, or from a preset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

ROPE_SCALING_TYPES = ("linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ModelConfigError(ValueError):
    """A config (HF or GGUF) that this engine cannot run."""


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{attribute.name}={value!r}; it must be an integer >= 1")


def _rope_scaling(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Normalise HF's two spellings ("type" / "rope_type"); "default" means none."""
    if value is None:
        return None
    scaling = dict(value)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)  # HF v5 keeps theta in rope_parameters; we keep it apart
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelConfigError(
            f"rope scaling type {kind!r} is not supported; supported: "
            f"{list(ROPE_SCALING_TYPES)} or none"
        )
    needed = _LLAMA3_KEYS if kind == "llama3" else ("factor",)
    missing = [key for key in needed if key not in scaling]
    if missing:
        raise ModelConfigError(f"{kind} rope scaling needs {list(needed)}; missing {missing}")
    return {"rope_type": kind, **scaling}


@attrs.frozen
class ModelConfig:
    """A decoder-only Llama: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, converter=_rope_scaling)
    max_position_embeddings: int = attrs.field(default=2048, validator=_positive)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ModelConfigError("rope_theta and rms_norm_eps must be > 0")

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # --- constructors ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """From the dict of an HF config.json (transformers 4 or 5 spelling)."""
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ModelConfigError(f"model_type {model_type!r} is not supported; only 'llama'")
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else (eos if isinstance(eos, list) else [eos]),
        )

    @classmethod
    def from_gguf(
        cls,
        meta: Mapping[str, Any],
        vocab_size: int | None = None,
        tie_word_embeddings: bool = True,
    ) -> ModelConfig:
        """From GGUF key/value metadata (`llama.*`, `tokenizer.ggml.*`). `vocab_size` falls back
        to the token list's length; ties follow from whether `output.weight` exists."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ModelConfigError(f"GGUF architecture {arch!r} is not supported; only 'llama'")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"llama.{key}", default)

        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        vocab = get("vocab_size") or vocab_size
        if hidden is None or num_heads is None or vocab is None:
            raise ModelConfigError(
                "GGUF metadata lacks llama.embedding_length, "
                "llama.attention.head_count or a vocabulary size"
            )
        scaling = None
        kind = get("rope.scaling.type", "none")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif kind not in ("none", None):
            raise ModelConfigError(f"GGUF rope scaling {kind!r} is not supported; only linear")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=int(num_heads),
            num_kv_heads=int(get("attention.head_count_kv") or num_heads),
            head_dim=int(get("rope.dimension_count") or hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    # --- presets --------------------------------------------------------------------------
    @classmethod
    def llama3_8b(cls) -> ModelConfig:
        """Llama-3-8B's shape (for GPU benchmarks with random weights)."""
        return cls(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_ids=(128001, 128009),
        )

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        """SmolLM2-135M's shape, the default model's (for GPU benchmarks with random weights,
        where the GGUF is not at hand)."""
        return cls(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rms_norm_eps=9.999999747378752e-06,  # 1e-5 as the GGUF's float32 holds it
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_ids=(2,),
        )

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A few-layer model for tests (GQA with 2 query heads per KV head)."""
        fields = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_ids=(2,),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict for this config (used to write checkpoints)."""
        eos = list(self.eos_token_ids)
        hf = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
        }
        return hf
