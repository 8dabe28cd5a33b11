"""Every EOS id of a model ends generation, as HF `generate` and vLLM stop on each: Qwen's
generation_config.json lists <|im_end|> and <|endoftext|>, a GGUF names eos and eot. A tiny
Qwen3 checkpoint; the second id is a token its greedy continuation reaches."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from family_checkpoints import STEPS, Checkpoint, tiny_tokenizer, write_gguf

from engine import Engine, SamplingParams
from engine.model import load_model
from engine.model.families.base import gguf_eos_ids, hf_eos_ids


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    return Checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), tokenizer)


@pytest.fixture
def no_tokenizer_cache(monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", "")


def _second_eos(checkpoint: Checkpoint, tokenizer) -> tuple[int, int]:
    """(a token of the first continuation that does not occur before it, its index >= 3)."""
    tokens = checkpoint.tokens[0]
    assert tokenizer.eos_token_id not in tokens  # <|im_end|> alone would run all the steps
    index = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    return tokens[index], index


def _generate(engine: Engine, prompt: list[int], ignore_eos: bool = False):
    params = SamplingParams(max_tokens=STEPS, ignore_eos=ignore_eos)
    return engine.generate([prompt], params)[0]


def test_every_eos_of_generation_config_stops_as_hf_generate_does(checkpoint, tokenizer, tmp_path):
    second, index = _second_eos(checkpoint, tokenizer)
    prompt = checkpoint.prompts[0]
    directory = tmp_path / "qwen3"  # a path of its own: engines share models by path
    shutil.copytree(checkpoint.directory, directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    generation["eos_token_id"] = [tokenizer.eos_token_id, second]
    (directory / "generation_config.json").write_text(json.dumps(generation))
    _, config = load_model(directory)
    assert config.eos_token_ids == (tokenizer.eos_token_id, second)
    engine = Engine(str(directory), dtype="float32", device="cpu")
    out = _generate(engine, prompt)
    assert list(out.token_ids) == checkpoint.tokens[0][: index + 1]
    assert out.finish_reason == "stop"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=STEPS,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    assert list(out.token_ids) == expected
    ignored = _generate(engine, prompt, ignore_eos=True)  # ignore_eos ignores them all
    assert list(ignored.token_ids) == checkpoint.tokens[0]


def test_every_eos_of_a_gguf_stops(checkpoint, tokenizer, tmp_path, no_tokenizer_cache):
    """eos <|im_end|> and eot the second id: the continuation ends at the second."""
    second, index = _second_eos(checkpoint, tokenizer)
    path = tmp_path / "qwen3.gguf"
    write_gguf(checkpoint, tokenizer, path, eot_token_id=second)
    engine = Engine(str(path), dtype="float32", device="cpu")
    assert engine.runtime.model_config.eos_token_ids == (tokenizer.eos_token_id, second)
    out = _generate(engine, checkpoint.prompts[0])
    assert list(out.token_ids) == checkpoint.tokens[0][: index + 1]
    assert out.finish_reason == "stop"


def test_eos_ids_are_read_in_order_without_repeats():
    assert hf_eos_ids(7, [7, 3], None) == (7, 3)
    assert hf_eos_ids((5,), 9) == (5, 9)
    assert hf_eos_ids(None) == ()
    meta = {"tokenizer.ggml.eos_token_id": 4, "tokenizer.ggml.eom_token_id": 4}
    assert gguf_eos_ids(meta) == (4,)
    meta["tokenizer.ggml.eot_token_id"] = 6
    assert gguf_eos_ids(meta) == (4, 6)
