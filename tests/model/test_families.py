"""Every family (Llama, Qwen2, Qwen3, Mistral) from a tiny checkpoint that transformers writes
with its own config class: the engine's greedy tokens equal HF `generate`'s for 32 steps and its
logits are within 1e-4 (fp32), for one prompt and a mixed batch, with and without speculation,
on the torch ops and on the CPU kernels; the same weights written as a GGUF load to the same
tokens; each checkpoint's own chat template is used; what the engine cannot run is refused at
load, naming the field."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from family_checkpoints import (
    FAMILIES,
    STEPS,
    TEXTS,
    Checkpoint,
    edit_config,
    hf_dir,
    tiny_tokenizer,
    write_gguf,
)

from engine import Engine, SamplingParams, cpu_kernels
from engine.backends import KVPool, get_backend
from engine.backends.torch_backend import TorchBackend
from engine.model import ModelConfigError, ModelLoadError, load_model, load_tokenizer
from engine.shell.kv import KVBook
from engine.state import FinishRules, Running, decode, extend, schedule_decode, schedule_extend

KERNELS = cpu_kernels.status()
OP_SETS = [
    "torch",
    pytest.param(
        "cpu_kernels",
        marks=pytest.mark.skipif(not KERNELS.available, reason=f"CPU kernels: {KERNELS.reason}"),
    ),
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tokenizer, tmp_path_factory):
    return Checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer)


@pytest.fixture
def no_tokenizer_cache(monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", "")  # no converted GGUF tokenizers left behind


def _use_ops(monkeypatch, model, op_set: str) -> None:
    """The torch ops (the reference set and torch attention) or the CPU kernels."""
    monkeypatch.setattr(model, "op_set", "reference" if op_set == "torch" else "cpu")
    monkeypatch.setattr(TorchBackend, "use_cpu_kernel", op_set != "torch")


def _feed_drafts(engine: Engine, checkpoint: Checkpoint) -> None:
    """Random weights seldom repeat themselves, so n-grams would draft nothing: give the
    proposer HF's continuations and a corrupted copy of each, for draft trees with branches
    that verify accepts and rejects."""
    for prompt, tokens in zip(checkpoint.prompts, checkpoint.tokens, strict=True):
        vocab = engine.runtime.vocab_size
        corrupted = [(t + 1) % vocab if i % 5 == 4 else t for i, t in enumerate(tokens)]
        engine.spec.proposer.add_corpus(prompt + tokens)
        engine.spec.proposer.add_corpus(prompt + corrupted)


def _engine_tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    return [list(out.token_ids) for out in engine.generate(prompts, params)]


# --- the checkpoint as the engine reads it --------------------------------------------------
def test_config_is_read_as_the_family(checkpoint):
    _, config = load_model(checkpoint.directory)
    hf = checkpoint.hf.config
    assert config.architecture == checkpoint.family
    assert config.qkv_bias == (checkpoint.family == "qwen2")
    assert config.qk_norm == (checkpoint.family == "qwen3")
    assert config.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert (config.head_dim, config.num_kv_heads) == (hf.head_dim, hf.num_key_value_heads)
    assert config.sliding_window is None


def test_chat_template_is_the_checkpoints_own(checkpoint):
    messages = [{"role": "user", "content": "the hat"}]
    expected = f"<|im_start|>user\nthe hat<|im_end|>\n<|im_start|>assistant ({checkpoint.family})\n"
    assert load_tokenizer(checkpoint.directory).chat_text(messages) == expected


# --- logits against HF's, step by step --------------------------------------------------
@pytest.mark.parametrize("op_set", OP_SETS)
def test_logits_match_hf_in_a_mixed_batch(checkpoint, op_set, monkeypatch):
    """One extend pass over the three prompts, then decode passes fed HF's tokens: every
    step's logits within 1e-4 of HF generate's."""
    model, _ = load_model(checkpoint.directory)
    _use_ops(monkeypatch, model, op_set)
    got = _logits_per_step(model, checkpoint.prompts, checkpoint.tokens)
    for ours, theirs in zip(got, checkpoint.logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _logits_per_step(model, prompts, forced) -> list[torch.Tensor]:
    """[STEPS, vocab] logits per request: the extend's last row, then one row per decode of
    the forced tokens."""
    config, count = model.config, len(prompts)
    lens = [len(p) for p in prompts]
    capacity = sum(lens) + count * STEPS
    book = KVBook(capacity, count, max(lens) + STEPS)
    pool = KVPool.allocate(
        config.num_layers,
        capacity + 1,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        book.table.device,
    )
    backend = get_backend("torch", pool)
    rules = FinishRules([STEPS] * count, [0] * count, [-1] * count, np.zeros((count, 0), np.int64))
    running = Running.admitted(
        list(range(count)),
        [book.table.alloc_row() for _ in prompts],
        lens,
        lens,
        [p[-1] for p in prompts],
        rules,
        max(lens) + STEPS,
    )
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    batch = schedule_extend(running, lens, ids, book.slots.alloc(ids.shape[0]))
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = extend
    for index in range(STEPS):
        with torch.no_grad():
            hidden = model(
                torch.from_numpy(batch.input_ids.copy()),
                torch.from_numpy(batch.positions.copy()),
                backend.plan(batch),
                backend,
            )
            logits = model.logits(hidden[torch.from_numpy(batch.logit_rows.copy())])
        for request in range(count):
            rows[request].append(logits[request])
        tokens = np.asarray([forced[r][index] for r in range(count)], dtype=np.int64)
        result = step(batch, tokens)
        book.apply(result.effects)
        if index + 1 < STEPS:
            batch, step = schedule_decode(result.running, book.slots.alloc(count)), decode
    return [torch.stack(r) for r in rows]


# --- the whole engine: greedy tokens against HF's ------------------------------------------
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("op_set", OP_SETS)
def test_engine_greedy_matches_hf_generate(checkpoint, op_set, speculative, monkeypatch):
    """Batch 1, then the mixed batch (prompts of 13, 4 and 12 tokens), through the engine's
    scheduler and passes; with speculation, verify passes over draft trees."""
    options = dict(speculative=True, draft_cost=0.1) if speculative else {}
    engine = Engine(str(checkpoint.directory), dtype="float32", device="cpu", **options)
    _use_ops(monkeypatch, engine.runtime.model, op_set)
    if speculative:
        _feed_drafts(engine, checkpoint)
    assert _engine_tokens(engine, checkpoint.prompts[:1]) == checkpoint.tokens[:1]
    assert _engine_tokens(engine, checkpoint.prompts) == checkpoint.tokens
    if speculative:  # verify passes over trees, with drafts accepted and rejected
        stats = engine.spec.stats.total()
        assert stats.drafting_steps > 0 and 0 < stats.accepted < stats.drafted


# --- the same weights as a GGUF -------------------------------------------------------------
@pytest.mark.parametrize("op_set", OP_SETS)
def test_gguf_of_the_same_weights_gives_the_same_tokens(
    checkpoint, tokenizer, op_set, tmp_path, monkeypatch, no_tokenizer_cache
):
    path = tmp_path / f"{checkpoint.family}.gguf"
    write_gguf(checkpoint, tokenizer, path)
    engine = Engine(str(path), dtype="float32", device="cpu")
    _use_ops(monkeypatch, engine.runtime.model, op_set)
    assert engine.runtime.model_config.architecture == (
        "llama" if checkpoint.family == "mistral" else checkpoint.family
    )
    assert _engine_tokens(engine, checkpoint.prompts) == checkpoint.tokens
    messages = [{"role": "user", "content": "the hat"}]
    assert engine.tokenizer.chat_text(messages) == (
        load_tokenizer(checkpoint.directory).chat_text(messages)
    )
    assert engine.tokenizer.encode(TEXTS[0]) == checkpoint.prompts[0]


@pytest.mark.cpu_kernels
def test_whole_layer_kernel_runs_the_families_block_weights(
    checkpoint, tokenizer, tmp_path, monkeypatch, no_tokenizer_cache
):
    """Q8_0 matrices held in blocks: decode and verify passes run each layer in one kernel
    call (with the family's bias or head norms) and give the tokens of the torch ops on the
    same weights dequantized."""
    from engine.ops import cpu as cpu_ops

    path = tmp_path / f"{checkpoint.family}.q8_0.gguf"
    write_gguf(checkpoint, tokenizer, path, quant="Q8_0")
    options = dict(dtype="float32", device="cpu", speculative=True, draft_cost=0.1)
    fused = Engine(str(path), **options)
    assert fused.runtime.model.block_weights
    _feed_drafts(fused, checkpoint)
    whole_layers = []
    real_layer = cpu_ops.decoder_layer

    def counted(*args):
        result = real_layer(*args)
        whole_layers.append(result is not None)
        return result

    monkeypatch.setattr(cpu_ops, "decoder_layer", counted)
    got = _engine_tokens(fused, checkpoint.prompts)
    assert any(whole_layers) and fused.spec.stats.total().drafting_steps > 0
    plain = Engine(str(path), block_weights=False, **options)
    _use_ops(monkeypatch, plain.runtime.model, "torch")
    _feed_drafts(plain, checkpoint)
    assert _engine_tokens(plain, checkpoint.prompts) == got


# --- what the engine refuses ----------------------------------------------------------------
def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path, tokenizer):
    """Mistral with a 16-token window: refused at the default context, naming the field;
    served within the window, where attention is the same, with HF's tokens."""
    directory = hf_dir(tmp_path, tokenizer, "mistral", sliding_window=16)
    with pytest.raises(ModelConfigError, match="sliding_window=16 is smaller than max_context"):
        Engine(str(directory), dtype="float32", device="cpu")
    engine = Engine(str(directory), dtype="float32", device="cpu", max_context=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    hf.generation_config.eos_token_id = None
    prompt = tokenizer.encode("the cat in")
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16 - len(prompt), do_sample=False
        )[0, len(prompt) :].tolist()
    params = SamplingParams(max_tokens=16 - len(prompt), ignore_eos=True)
    assert list(engine.generate([prompt], params)[0].token_ids) == expected


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen2", {"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported"),
        ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling type 'dynamic' is not supported",
        ),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
            "sliding_window=8",
        ),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(
    tmp_path, tokenizer, family, change, message
):
    directory = hf_dir(tmp_path, tokenizer, family)
    edit_config(directory, **change)
    with pytest.raises((ModelLoadError, ModelConfigError), match=message):
        Engine(str(directory), dtype="float32", device="cpu")


def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="general.architecture 'gemma' is not supported"):
        load_model(path)


def test_random_weight_presets_include_the_qwen_shapes():
    presets = "['llama3_8b', 'qwen2_7b', 'qwen3_8b', 'smollm2_135m', 'tiny']"
    with pytest.raises(ValueError, match=re.escape(f"choose one of {presets}")):
        Engine(random_weights="qwen4_8b", device="cpu")
