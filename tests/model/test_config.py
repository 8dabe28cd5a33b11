"""ModelConfig from HF dicts (both transformers spellings), GGUF metadata and presets."""

from __future__ import annotations

import pytest

from engine.model import ModelConfig, ModelConfigError

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


def test_from_hf_llama31():
    config = ModelConfig.from_hf(HF_LLAMA31)
    assert config.head_dim == 128 and config.num_kv_heads == 8
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009) and config.eos_token_id == 128001
    assert config.rope_theta == 500000.0


def test_from_hf_transformers5_rope_parameters():
    hf = {k: v for k, v in HF_LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    hf["eos_token_id"] = 2
    config = ModelConfig.from_hf(hf)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.eos_token_ids == (2,)


def test_to_hf_round_trips():
    for config in (ModelConfig.from_hf(HF_LLAMA31), ModelConfig.tiny(), ModelConfig.llama3_8b()):
        assert ModelConfig.from_hf(config.to_hf()) == config


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
    config = ModelConfig.from_gguf(meta, vocab_size=49152)
    assert (config.vocab_size, config.head_dim, config.num_layers) == (49152, 64, 30)
    assert config.tie_word_embeddings and config.eos_token_id == 2
    linear = ModelConfig.from_gguf(
        {**meta, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        vocab_size=10,
    )
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ModelConfigError, match="only 'llama'"):
        ModelConfig.from_gguf({**meta, "general.architecture": "qwen2"}, vocab_size=10)
    with pytest.raises(ModelConfigError, match="vocabulary size"):
        ModelConfig.from_gguf(meta)


def test_invalid_configs_raise_clear_errors():
    with pytest.raises(ModelConfigError, match="multiple of num_kv_heads"):
        ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ModelConfigError, match="not supported"):
        ModelConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="missing"):
        ModelConfig.tiny(rope_scaling={"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="hidden_size=0"):
        ModelConfig.tiny(hidden_size=0)
    with pytest.raises(ModelConfigError, match="model_type 'gemma'"):
        ModelConfig.from_hf({**HF_LLAMA31, "model_type": "gemma"})


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
    config = ModelConfig.from_gguf(
        gguf_metadata(reader),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        tie_word_embeddings=True,
    )
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied, as the preset says
    assert ModelConfig.smollm2_135m() == config
