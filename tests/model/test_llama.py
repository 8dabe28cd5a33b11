"""A tiny random Llama through the torch backend: batching and chunking do not change logits,
and the forward agrees with a dense causal reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.model import LlamaModel, ModelConfig
from engine.ops.reference import apply_rope


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return LlamaModel(ModelConfig.tiny(), torch.float32, "cpu").init_random(seed=0)


def _dense_reference(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits of every position with plain causal attention over the whole sequence."""
    config = model.config
    n = len(ids)
    hidden = model.embed_tokens[torch.tensor(ids)]
    cos, sin = model.rope(torch.arange(n))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in model.layers:
        q, k, v = F.linear(layer.input_layernorm(hidden), layer.qkv_proj).split(
            [config.q_size, config.kv_size, config.kv_size], dim=-1
        )
        q = apply_rope(q.view(n, config.num_heads, -1), cos, sin).transpose(0, 1)
        group = config.num_heads // config.num_kv_heads
        k = apply_rope(k.view(n, config.num_kv_heads, -1), cos, sin).repeat_interleave(group, 1)
        v = v.view(n, config.num_kv_heads, -1).repeat_interleave(group, 1)
        attn = F.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal
        )
        hidden = hidden + F.linear(attn.transpose(0, 1).reshape(n, -1), layer.o_proj)
        gate, up = F.linear(layer.post_attention_layernorm(hidden), layer.gate_up_proj).chunk(2, -1)
        hidden = hidden + F.linear(F.silu(gate) * up, layer.down_proj)
    return model.logits(model.norm(hidden))


def test_forward_matches_dense_reference(tiny, chunked_logits):
    ids = list(np.random.default_rng(0).integers(0, tiny.config.vocab_size, 23))
    with torch.no_grad():
        expected = _dense_reference(tiny, ids)
    got = chunked_logits(tiny, ids, [23])
    assert got.dtype == torch.float32 and got.shape == (23, tiny.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_gives_the_same_logits(tiny, chunked_logits):
    ids = list(np.random.default_rng(1).integers(0, tiny.config.vocab_size, 30))
    whole = chunked_logits(tiny, ids, [30])
    torch.testing.assert_close(chunked_logits(tiny, ids, [7, 1, 22]), whole, atol=1e-5, rtol=1e-5)


def test_batched_greedy_equals_each_alone(tiny, greedy_runner):
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, 256, n)) for n in (5, 17, 1, 9)]
    together = greedy_runner(tiny, prompts, max_new=6)
    alone = [greedy_runner(tiny, [p], max_new=6)[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 6 for t in together)


def test_bf16_forward_is_finite_and_close(chunked_logits):
    model32 = LlamaModel(ModelConfig.tiny(), torch.float32).init_random(seed=3)
    model16 = LlamaModel(ModelConfig.tiny(), torch.bfloat16)
    model16.load_state_dict(model32.state_dict())
    ids = list(range(3, 19))
    logits32 = chunked_logits(model32, ids, [16])
    logits16 = chunked_logits(model16, ids, [16])
    assert logits16.dtype == torch.float32 and torch.isfinite(logits16).all()
    assert (logits16 - logits32).abs().max() < 0.1 * logits32.abs().max()


def test_tied_embeddings_share_one_tensor():
    model = LlamaModel(ModelConfig.tiny(tie_word_embeddings=True)).init_random(seed=1)
    assert model.lm_head is model.embed_tokens
    untied = LlamaModel(ModelConfig.tiny())
    assert untied.num_bytes() > model.num_bytes()


def test_init_random_is_seeded_and_realistic():
    a = LlamaModel(ModelConfig.tiny()).init_random(seed=4)
    b = LlamaModel(ModelConfig.tiny()).init_random(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert 0.015 < a.layers[0].gate_up_proj.std().item() < 0.025


def test_warm_products_runs_each_distinct_product_at_each_count(tiny, monkeypatch):
    """Through the op set's `linear` (as a pass calls it), once per distinct weight shape and
    token count, and the output layer (the op set's `linear` too) at each logit-row count."""
    from engine import ops as op_sets

    ops = op_sets.load(tiny.op_set)
    seen = []
    linear = ops.linear

    def traced(x, w):
        seen.append((tuple(x.shape), tuple(w.shape), w is tiny.lm_head))
        return linear(x, w)

    monkeypatch.setattr(ops, "linear", traced)
    assert tiny.warm_products([3, 1, 3], [2, 1]) == 4 * 2 + 2
    layer, hidden = tiny.layers[0], tiny.config.hidden_size
    weights = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    shapes = [tuple(w.shape) for w in weights]
    assert len(set(shapes)) == 4
    products = sorted((x, w) for x, w, head in seen if not head)
    assert products == sorted(((rows, s[1]), s) for s in shapes for rows in (1, 3))
    assert [x for x, _, head in seen if head] == [(1, hidden), (2, hidden)]
    with pytest.raises(ValueError, match="at least 1"):
        tiny.warm_products([0, 4], [])


def test_warm_products_refuses_one_ranks_part_of_a_model(tiny):
    from engine.model.loader import shard_of

    part = shard_of(LlamaModel(ModelConfig.tiny()).init_random(seed=0), 0, 2)
    with pytest.raises(ValueError, match="one rank's"):
        part.warm_products([1], [1])
