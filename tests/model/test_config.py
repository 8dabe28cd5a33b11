"""ModelConfig from HF dicts (both transformers spellings, every family), GGUF metadata and
presets."""

from __future__ import annotations

import pytest
import torch

from engine.model import ModelConfig, ModelConfigError, families

HF_LLAMA31 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def _from_gguf(meta, vocab_size=None, tie_word_embeddings=True):
    return families.for_gguf(meta).config_from_gguf(meta, vocab_size, tie_word_embeddings)


def test_from_hf_llama31():
    config = families.config_from_hf(HF_LLAMA31)
    assert config.head_dim == 128 and config.num_kv_heads == 8
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009) and config.eos_token_id == 128001
    assert config.rope_theta == 500000.0


def test_from_hf_transformers5_rope_parameters():
    hf = {k: v for k, v in HF_LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    hf["eos_token_id"] = 2
    config = families.config_from_hf(hf)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.eos_token_ids == (2,)


def test_to_hf_round_trips():
    for config in (
        families.config_from_hf(HF_LLAMA31),
        ModelConfig.tiny(),
        ModelConfig.llama3_8b(),
    ):
        assert families.config_from_hf(families.to_hf(config)) == config


def test_from_gguf_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.context_length": 8192,
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.dimension_count": 64,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    config = _from_gguf(meta, vocab_size=49152)
    assert (config.vocab_size, config.head_dim, config.num_layers) == (49152, 64, 30)
    assert config.tie_word_embeddings and config.eos_token_id == 2
    linear = _from_gguf(
        {**meta, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        vocab_size=10,
    )
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ModelConfigError, match="general.architecture 'gemma' is not supported"):
        _from_gguf({**meta, "general.architecture": "gemma"}, vocab_size=10)
    with pytest.raises(ModelConfigError, match="vocabulary size"):
        _from_gguf(meta)


def test_invalid_configs_raise_clear_errors():
    with pytest.raises(ModelConfigError, match="multiple of num_kv_heads"):
        ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ModelConfigError, match="rope_scaling type 'dynamic' is not supported"):
        ModelConfig.tiny(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="missing"):
        ModelConfig.tiny(rope_scaling={"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="hidden_size=0"):
        ModelConfig.tiny(hidden_size=0)
    with pytest.raises(ModelConfigError, match="model_type 'gemma'"):
        families.config_from_hf({**HF_LLAMA31, "model_type": "gemma"})


def test_llama3_8b_preset_shape():
    config = ModelConfig.llama3_8b()
    per_layer = (
        config.hidden_size * (config.q_size + 2 * config.kv_size)
        + config.q_size * config.hidden_size
        + 3 * config.hidden_size * config.intermediate_size
    )
    params = config.vocab_size * config.hidden_size * 2 + config.num_layers * per_layer
    assert 8.0e9 < params < 8.1e9


def test_smollm2_preset_is_the_default_models_shape():
    from gguf import GGUFReader

    from engine.model import default_model_path
    from engine.model.loader import gguf_metadata

    reader = GGUFReader(str(default_model_path()))
    config = _from_gguf(
        gguf_metadata(reader),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        tie_word_embeddings=True,
    )
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied, as the preset says
    assert ModelConfig.smollm2_135m() == config


# --- the other families --------------------------------------------------------------------
HF_QWEN25_7B = {  # Qwen2.5-7B-Instruct's config.json, its long-context rope_scaling added
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
HF_QWEN3_8B = {  # Qwen3-8B's config.json
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "attention_bias": False,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "sliding_window": None,
    "use_sliding_window": False,
    "max_window_layers": 36,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
HF_MISTRAL_7B = {  # Mistral-7B-v0.1's config.json
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_from_hf_qwen25_has_qkv_biases_yarn_and_no_window():
    config = families.config_from_hf(HF_QWEN25_7B)
    assert (config.architecture, config.qkv_bias, config.qk_norm) == ("qwen2", True, False)
    assert config.sliding_window is None  # use_sliding_window is false
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert config.head_dim == 128
    windowed = families.config_from_hf({**HF_QWEN25_7B, "use_sliding_window": True})
    assert windowed.sliding_window == 131072


def test_from_hf_qwen3_has_head_norms_and_its_own_head_dim():
    config = families.config_from_hf(HF_QWEN3_8B)
    assert (config.architecture, config.qkv_bias, config.qk_norm) == ("qwen3", False, True)
    assert config == ModelConfig.qwen3_8b()
    small = families.config_from_hf({**HF_QWEN3_8B, "hidden_size": 1024, "num_attention_heads": 16})
    assert small.head_dim == 128 and small.q_size == 2048  # not hidden_size / heads
    layer_types = {**HF_QWEN3_8B, "layer_types": ["full_attention", "sliding_attention"]}
    assert families.config_from_hf({**layer_types, "sliding_window": 4096}).sliding_window == 4096


def test_from_hf_mistral_keeps_its_window_for_the_context_check():
    config = families.config_from_hf(HF_MISTRAL_7B)
    assert (config.architecture, config.qkv_bias, config.sliding_window) == ("mistral", False, 4096)
    config.check_context(4096)
    with pytest.raises(ModelConfigError, match="sliding_window=4096 is smaller than max_context"):
        config.check_context(8192)


def test_hf_rope_defaults_follow_transformers():
    """yarn without original_max_position_embeddings scales from max_position_embeddings, and
    a factor of None is their ratio."""
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8192}
    config = families.config_from_hf({**HF_QWEN3_8B, "rope_scaling": rope})
    assert config.rope_scaling["factor"] == 40960 / 8192
    rope = {"rope_type": "yarn", "factor": 2.0}
    config = families.config_from_hf({**HF_QWEN3_8B, "rope_scaling": rope})
    assert config.rope_scaling["original_max_position_embeddings"] == 40960


@pytest.mark.parametrize(
    ("rope", "max_positions"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        (
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 0.8,
                "mscale_all_dim": 0.5,
            },
            32768,
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.3,
                "truncate": False,
            },
            128,
        ),
    ],
)
def test_yarn_frequencies_and_scale_equal_transformers(rope, max_positions):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.rope import rope_attention_factor, rope_inv_freq

    hf = Qwen3Config(
        head_dim=128,
        max_position_embeddings=max_positions,
        rope_parameters={**rope, "rope_theta": 1000000.0},
    )
    expected_freq, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    config = families.config_from_hf(hf.to_dict())
    assert torch.equal(rope_inv_freq(config), expected_freq.float())
    assert rope_attention_factor(config) == pytest.approx(expected_scale, rel=1e-12)


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig.qwen3_8b(),
        ModelConfig.qwen2_7b(),
        families.config_from_hf(HF_QWEN25_7B),
        families.config_from_hf(HF_MISTRAL_7B),
        ModelConfig.tiny(architecture="qwen2", qkv_bias=True, sliding_window=64),
        ModelConfig.tiny(architecture="qwen3", qk_norm=True, sliding_window=64),
    ],
    ids=["qwen3-8b", "qwen2-7b", "qwen25-yarn", "mistral-window", "qwen2-window", "qwen3-window"],
)
def test_every_family_to_hf_round_trips(config):
    hf = families.to_hf(config)
    assert hf["model_type"] == config.architecture
    assert families.config_from_hf(hf) == config


def test_a_config_must_have_its_familys_layer_options():
    with pytest.raises(ModelConfigError, match="qkv_bias=False does not fit architecture 'qwen2'"):
        families.for_config(ModelConfig.tiny(architecture="qwen2"))
    with pytest.raises(ModelConfigError, match="qk_norm=True does not fit architecture 'llama'"):
        families.for_config(ModelConfig.tiny(qk_norm=True))
    with pytest.raises(ModelConfigError, match="architecture 'gpt2' is unknown"):
        families.for_config(ModelConfig.tiny(architecture="gpt2"))


def _params(config: ModelConfig) -> int:
    per_layer = (
        config.hidden_size * (config.q_size + 2 * config.kv_size)
        + config.q_size * config.hidden_size
        + 3 * config.hidden_size * config.intermediate_size
    )
    return config.vocab_size * config.hidden_size * 2 + config.num_layers * per_layer


def test_qwen_presets_have_their_models_sizes():
    assert 8.18e9 < _params(ModelConfig.qwen3_8b()) < 8.20e9  # Qwen3-8B: 8.19B
    assert 7.6e9 < _params(ModelConfig.qwen2_7b()) < 7.62e9  # Qwen2.5-7B: 7.61B


def test_from_gguf_qwen3_metadata():
    meta = {
        "general.architecture": "qwen3",
        "qwen3.block_count": 28,
        "qwen3.context_length": 40960,
        "qwen3.embedding_length": 1024,
        "qwen3.feed_forward_length": 3072,
        "qwen3.attention.head_count": 16,
        "qwen3.attention.head_count_kv": 8,
        "qwen3.attention.key_length": 128,
        "qwen3.attention.value_length": 128,
        "qwen3.rope.freq_base": 1000000.0,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 32768,
        "tokenizer.ggml.eos_token_id": 151645,
    }
    config = _from_gguf(meta, vocab_size=151936)
    assert (config.architecture, config.qk_norm, config.head_dim) == ("qwen3", True, 128)
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    qwen2 = {k.replace("qwen3.", "qwen2."): v for k, v in meta.items()}
    qwen2["general.architecture"] = "qwen2"
    assert _from_gguf(qwen2, vocab_size=10).qkv_bias
    with pytest.raises(ModelConfigError, match="qwen3.rope.scaling.type 'longrope'"):
        _from_gguf({**meta, "qwen3.rope.scaling.type": "longrope"}, vocab_size=10)


def test_a_family_refuses_gguf_metadata_without_its_architecture():
    """`config_from_gguf` reads every key under general.architecture: metadata without it is
    refused by name (not read as keys under "None.")."""
    with pytest.raises(ModelConfigError, match="general.architecture"):
        families.FAMILIES["llama"].config_from_gguf({"llama.block_count": 2}, None, True)
