"""The shape and constants of a decoder-only model, as one frozen value.

The families (`engine.model.families`) build it from an HF config.json or GGUF metadata; the
presets here build it for random weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from engine.errors import ConfigError

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")
# the keys each scaling type needs; yarn also takes beta_fast, beta_slow, attention_factor,
# mscale, mscale_all_dim and truncate (HF's defaults where absent)
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


class ModelConfigError(ConfigError):
    """A config (HF or GGUF) that this engine cannot run."""


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{attribute.name}={value!r}; it must be an integer >= 1")


def _positive_or_none(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None:
        _positive(instance, attribute, value)


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
            f"rope_scaling type {kind!r} is not supported; supported: "
            f"{list(ROPE_SCALING_TYPES)} or none"
        )
    needed = _ROPE_SCALING_KEYS[kind]
    missing = [key for key in needed if scaling.get(key) is None]
    if missing:
        raise ModelConfigError(f"{kind} rope_scaling needs {list(needed)}; missing {missing}")
    return {"rope_type": kind, **scaling}


def _token_ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class ModelConfig:
    """A decoder-only transformer of Llama's shape: RMSNorm, RoPE, GQA attention, SwiGLU MLP,
    with the options the families add (q/k/v biases, per-head q/k norms)."""

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
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    # the family (`engine.model.families`): how checkpoints name the weights; the model itself
    # reads only the options below
    architecture: str = "llama"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    # attention window of the checkpoint (None: full); the engine has no sliding-window
    # attention, so it serves such a model only with a context within the window
    sliding_window: int | None = attrs.field(default=None, validator=_positive_or_none)

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

    def check_context(self, max_context: int) -> None:
        """Refuse a context longer than the sliding window: attention over it would differ
        from the checkpoint's (the engine attends to the whole context)."""
        if self.sliding_window is not None and self.sliding_window < max_context:
            raise ModelConfigError(
                f"sliding_window={self.sliding_window} is smaller than "
                f"max_context={max_context}; the engine has no sliding-window attention: "
                f"serve this model with max_context <= {self.sliding_window}"
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
    def qwen3_8b(cls) -> ModelConfig:
        """Qwen3-8B's shape (per-head q/k norms; for GPU benchmarks with random weights)."""
        return cls(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_ids=(151645,),
            architecture="qwen3",
            qk_norm=True,
        )

    @classmethod
    def qwen2_7b(cls) -> ModelConfig:
        """Qwen2.5-7B-Instruct's shape (q/k/v biases; for GPU benchmarks with random weights)."""
        return cls(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_ids=(151645,),
            architecture="qwen2",
            qkv_bias=True,
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
        fields: dict[str, Any] = dict(
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
