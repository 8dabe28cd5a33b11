"""The families' layer options on every op set: q/k/v biases (Qwen2), per-head q/k norms and
yarn RoPE (Qwen3). The fused sets (Triton in the interpreter on CPU, the CPU kernels) agree
with the reference ops, and the CPU's whole-layer kernel gives the per-op path's hidden
states bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import gguf
import pytest
import torch
from gguf.quants import quantize
from torch import nn

from engine.model import LlamaModel, ModelConfig
from engine.ops import cpu as cpu_ops
from engine.ops.blockq import BlockWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    "qwen2": ModelConfig.tiny(architecture="qwen2", qkv_bias=True, tie_word_embeddings=True),
    "qwen3": ModelConfig.tiny(architecture="qwen3", qk_norm=True, head_dim=32, rope_scaling=YARN),
}
PROMPTS = [[5, 9, 5, 9, 5, 9, 5], [7, 3, 11, 2], [1, 2, 3], [8] * 9]


def _model(family: str, device: str = "cpu", head_dim: int | None = None) -> LlamaModel:
    config = CONFIGS[family]
    if head_dim is not None:
        config = attrs.evolve(config, head_dim=head_dim)
    model = LlamaModel(config, torch.float32, device).init_random(seed=5)
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():  # norms away from one, so that leaving one out shows
        for layer in model.layers:
            for norm in (layer.q_norm, layer.k_norm):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5, generator=generator)
    return model


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize(
    "op_set",
    ["triton", pytest.param("cpu", marks=pytest.mark.cpu_kernels)],
)
def test_fused_op_sets_equal_the_reference(family, op_set, two_passes):
    if op_set == "cpu" and DEVICE != "cpu":
        pytest.skip("the CPU kernels run on a CPU device")
    model = _model(family, DEVICE)
    model.op_set = "reference"
    reference = two_passes(model, PROMPTS[:2], DEVICE)
    model.op_set = op_set
    got = two_passes(model, PROMPTS[:2], DEVICE)
    for got_pass, reference_pass in zip(got, reference, strict=True):
        torch.testing.assert_close(got_pass, reference_pass, atol=1e-4, rtol=1e-4)


def _in_blocks(model: LlamaModel) -> LlamaModel:
    names = [
        f"layers.{i}.{p}"
        for i in range(model.config.num_layers)
        for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    ]
    kind = gguf.GGMLQuantizationType.Q4_1
    model.use_block_weights(
        {
            n: BlockWeight.from_gguf(
                quantize(model.dense_weight(n).contiguous().numpy(), kind), "Q4_1"
            )
            for n in names
        }
    )
    return model


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("then", ["decode", "verify"])
@pytest.mark.parametrize(("family", "head_dim"), [("qwen2", 16), ("qwen3", 32), ("qwen3", 64)])
def test_whole_layer_kernel_equals_the_per_op_path(family, head_dim, then, two_passes, monkeypatch):
    """The bias and the head norms inside `cpu_decoder_layer` round as the per-op path does."""
    model = _in_blocks(_model(family, head_dim=head_dim))
    assert model.op_set == "cpu"
    calls = []
    real_layer = cpu_ops.decoder_layer

    def counted(*args):
        calls.append(real_layer(*args))
        return calls[-1]

    monkeypatch.setattr(cpu_ops, "decoder_layer", counted)
    whole = two_passes(model, PROMPTS, then=then)
    monkeypatch.setattr(cpu_ops, "decoder_layer", lambda *args: None)
    op_by_op = two_passes(model, PROMPTS, then=then)
    for got, expected in zip(whole, op_by_op, strict=True):
        assert torch.equal(got, expected)
    layers = model.config.num_layers
    assert [c is not None for c in calls] == [False] * layers + [True] * layers


@pytest.mark.cpu_kernels
def test_whole_layer_refuses_a_bias_or_norm_that_does_not_fit():
    """Checked before the kernel reads them: it reads as many floats as the heads say."""
    backend = SimpleNamespace(cpu_kernel_attention=lambda index, metadata: (None,) * 7)
    metadata = SimpleNamespace(out_slots=torch.tensor([3, 4]))
    hidden = torch.zeros(2, 64)
    layer = _in_blocks(_model("qwen2")).layers[0]
    layer.qkv_bias = nn.Parameter(torch.zeros(8), requires_grad=False)
    cos = torch.zeros(2, 16)
    with pytest.raises(ValueError, match=r"qkv_bias must be contiguous \[128\]"):
        cpu_ops.decoder_layer(layer, hidden, None, cos, cos, metadata, backend)
    layer = _in_blocks(_model("qwen3")).layers[1]
    layer.k_norm.weight = nn.Parameter(torch.ones(16), requires_grad=False)
    cos = torch.zeros(2, 32)
    with pytest.raises(ValueError, match=r"k_norm.weight must be contiguous \[32\]"):
        cpu_ops.decoder_layer(layer, hidden, None, cos, cos, metadata, backend)
