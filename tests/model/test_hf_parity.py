"""The default GGUF model through our loader + torch backend agrees with HF transformers
loading the same GGUF (fp32, CPU): next-token logits, and greedy tokens for 32 steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends import KVPool, get_backend
from engine.model import default_model_path, load_model, load_tokenizer
from engine.shell.kv import KVBook
from engine.state import FinishRules, Running, schedule_extend

pytest.importorskip("accelerate")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three colours of the rainbow."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def ours():
    model, config = load_model(None, torch.float32, "cpu")
    return model, config, load_tokenizer(None)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_config_read_from_gguf(ours, hf_model):
    _, config, tokenizer = ours
    hf = hf_model.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.tie_word_embeddings and config.vocab_size == hf.vocab_size
    assert config.eos_token_id == tokenizer.eos_token_id == 2


def test_chat_template_matches_hf(ours):
    _, _, tokenizer = ours
    for chat in CHATS:
        direct = tokenizer.hf.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert tokenizer.apply_chat_template(chat) == list(direct)


def test_prompt_logits_match_hf(ours, hf_model):
    model, config, tokenizer = ours
    ids = tokenizer.apply_chat_template(CHATS[0])
    book = KVBook(len(ids), 1, len(ids))
    pool = KVPool.allocate(
        config.num_layers,
        len(ids) + 1,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        book.table.device,
    )
    backend = get_backend("torch", pool)
    rules = FinishRules([1], [0], [-1], np.zeros((1, 0), dtype=np.int64))
    running = Running.admitted(
        [0], [book.table.alloc_row()], [len(ids)], [len(ids)], [ids[-1]], rules, len(ids)
    )
    batch = schedule_extend(running, [len(ids)], np.asarray(ids), book.slots.alloc(len(ids)))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), backend.plan(batch), backend)
        logits = model.logits(hidden)
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < 2e-3
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def hf_greedy(ours, hf_model):
    """HF generate's greedy tokens for each chat, 32 new tokens (stopping at EOS)."""
    _, _, tokenizer = ours
    outputs = []
    for chat in CHATS:
        prompt = tokenizer.apply_chat_template(chat)
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=32,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        outputs.append((prompt, out[0, len(prompt) :].tolist()))
    return outputs


def test_greedy_matches_hf_generate(ours, hf_greedy, greedy_runner):
    model, _, tokenizer = ours
    prompts = [prompt for prompt, _ in hf_greedy]
    got = greedy_runner(model, prompts, max_new=32, eos=tokenizer.eos_token_id)
    for tokens, (_, expected) in zip(got, hf_greedy, strict=True):
        assert tokens == expected, tokenizer.decode(tokens)
        assert len(tokens) >= 8


def test_engine_generate_matches_hf_generate(hf_greedy):
    """The whole engine (scheduler, runner, transitions, stop at EOS) equals HF greedy."""
    from engine.shell.engine import Engine
    from engine.state import SamplingParams

    engine = Engine(device="cpu", dtype="float32")
    results = engine.generate(CHATS, SamplingParams(max_tokens=32))
    for result, (prompt, expected) in zip(results, hf_greedy, strict=True):
        assert list(result.prompt_token_ids) == prompt
        # HF keeps the EOS it stops at; so does the engine's token list.
        assert list(result.token_ids) == expected
