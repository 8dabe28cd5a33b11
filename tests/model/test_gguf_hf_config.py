"""A GGUF's sliding window: read from `<arch>.attention.sliding_window` where llama.cpp writes
it, and from an HF config given beside the GGUF (`hf_config_path`), whose fields override the
metadata; llama.cpp writes Mistral as `llama` without its window. Tiny GGUFs written by
`gguf`'s writer from a transformers Mistral with a 16-token window."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from family_checkpoints import edit_config, hf_dir, tiny_tokenizer, write_gguf

from engine import Engine, SamplingParams
from engine.model import ModelConfigError, ModelLoadError, ModelNotFoundError, load_model

WINDOW = 16


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(autouse=True)
def no_tokenizer_cache(monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", "")


@pytest.fixture
def mistral(tmp_path, tokenizer):
    """(HF checkpoint directory with a 16-token window, its GGUF without a window key)."""
    directory = hf_dir(tmp_path, tokenizer, "mistral", sliding_window=WINDOW)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    path = tmp_path / "mistral.gguf"
    write_gguf(SimpleNamespace(hf=hf, family="mistral"), tokenizer, path)
    return directory, path, hf


def _hf_tokens(hf, prompt: list[int], count: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=count, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _served_within_the_window(engine: Engine, hf, tokenizer) -> None:
    prompt = tokenizer.encode("the cat in")
    params = SamplingParams(max_tokens=WINDOW - len(prompt), ignore_eos=True)
    got = list(engine.generate([prompt], params)[0].token_ids)
    assert got == _hf_tokens(hf, prompt, WINDOW - len(prompt))


def test_a_mistral_gguf_without_a_window_runs_with_full_attention(mistral):
    """What llama.cpp writes: nothing says there is a window (the gap `hf_config_path`
    closes)."""
    _, path, _ = mistral
    _, config = load_model(path)
    assert (config.architecture, config.sliding_window) == ("llama", None)


def test_the_gguf_window_key_is_read(mistral, tokenizer, tmp_path):
    _, _, hf = mistral
    path = tmp_path / "windowed.gguf"
    write_gguf(SimpleNamespace(hf=hf, family="mistral"), tokenizer, path, sliding_window=WINDOW)
    assert load_model(path)[1].sliding_window == WINDOW
    with pytest.raises(ModelConfigError, match=f"sliding_window={WINDOW} is smaller than"):
        Engine(str(path), dtype="float32", device="cpu")
    engine = Engine(str(path), dtype="float32", device="cpu", max_context=WINDOW)
    _served_within_the_window(engine, hf, tokenizer)


@pytest.mark.parametrize("given", ["directory", "config.json"])
def test_the_hf_config_overrides_the_gguf_metadata(mistral, tokenizer, given):
    directory, path, hf = mistral
    hf_config = directory if given == "directory" else directory / "config.json"
    _, config = load_model(path, hf_config_path=hf_config)
    assert (config.architecture, config.sliding_window) == ("mistral", WINDOW)
    with pytest.raises(ModelConfigError, match=f"sliding_window={WINDOW} is smaller than"):
        Engine(str(path), dtype="float32", device="cpu", hf_config_path=str(hf_config))
    engine = Engine(
        str(path), dtype="float32", device="cpu", hf_config_path=str(hf_config), max_context=16
    )
    assert engine.runtime.model_config.architecture == "mistral"
    _served_within_the_window(engine, hf, tokenizer)


def test_the_hf_configs_fields_win_and_its_eos_ids_join(mistral, tmp_path):
    directory, path, _ = mistral
    other = tmp_path / "edited"
    shutil.copytree(directory, other)
    edit_config(other, rope_theta=5000.0, eos_token_id=[1, 2])
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    gguf_config = load_model(path)[1]
    _, config = load_model(path, hf_config_path=other)
    assert (gguf_config.rope_theta, config.rope_theta) == (10000.0, 5000.0)
    assert config.eos_token_ids == (*gguf_config.eos_token_ids, 1, 2, 3)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_hidden_layers": 3}, "num_layers"),
        ({"num_key_value_heads": 4}, "num_kv_heads"),
        ({"model_type": "qwen2"}, "qkv_bias"),
    ],
)
def test_an_hf_config_of_another_shape_is_refused(mistral, tmp_path, change, field):
    directory, path, _ = mistral
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    edit_config(other, **change)
    with pytest.raises(ModelLoadError, match=f"the HF config's {field}=.* does not match"):
        load_model(path, hf_config_path=other)


def test_hf_config_path_is_refused_where_it_cannot_apply(mistral, tmp_path):
    directory, path, _ = mistral
    with pytest.raises(ModelNotFoundError, match="neither a config.json file nor a directory"):
        load_model(path, hf_config_path=tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="applies to a GGUF model"):
        load_model(directory, hf_config_path=directory)
    with pytest.raises(ValueError, match="applies to a GGUF model; random_weights='tiny'"):
        Engine(random_weights="tiny", device="cpu", hf_config_path=str(directory))
