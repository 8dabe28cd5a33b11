"""GGUF block weights on CPU: the same fp32 values as gguf's dequantize, bit for bit, and a
kernel whose products agree with F.linear on those values."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from engine import cpu_kernels
from engine.cpu_kernels import KernelStatus
from engine.model import load_model
from engine.model.config import ModelConfig
from engine.ops import blockq
from engine.ops.blockq import BlockWeight

FORMATS = sorted(blockq.FORMATS)


@pytest.fixture(params=["fma", "amx"])
def path(request):
    """The block kernel on each of its two paths (AVX-512 FMAs; AMX tiles where the CPU has
    them), the process's choice put back after."""
    if not cpu_kernels.status().available:
        pytest.skip(cpu_kernels.status().reason)
    before = cpu_kernels.amx()
    if cpu_kernels.amx(request.param == "amx") != (request.param == "amx"):
        cpu_kernels.amx(before)
        pytest.skip("this CPU (or OS) has no AMX tiles")
    yield request.param
    cpu_kernels.amx(before)


def _raw(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    values *= np.float32(0.05) * (1 + np.arange(rows, dtype=np.float32)[:, None] % 7)
    return quantize(values, getattr(gguf.GGMLQuantizationType, type_name))


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded inputs: every run checks the same values against its tolerances."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(raw: np.ndarray, type_name: str) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).copy())


@pytest.mark.parametrize("type_name", FORMATS)
def test_dequantize_equals_gguf_bit_for_bit(type_name):
    raw = _raw(type_name, 37, 96)
    weight = BlockWeight.from_gguf(raw, type_name)
    assert weight.shape == (37, 96)
    assert torch.equal(weight.dequantize(), _reference(raw, type_name))


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("type_name", FORMATS)
def test_kernel_expands_every_weight_exactly(type_name, path):
    # x = I picks out each weight alone: any difference is in the expansion, not the sums
    # in pieces: 1, 2, 5 and 8 rows (weights expanded in registers), 9 and 71 (panels
    # expanded into a buffer; 71 rows in 6 tiles of 11 or 12)
    raw = _raw(type_name, 37, 96, seed=1)
    weight = BlockWeight.from_gguf(raw, type_name)
    eye, pieces, start = torch.eye(96), [], 0
    for rows in (1, 8, 9, 2, 5, 71):
        pieces.append(weight.linear(eye[start : start + rows]))
        start += rows
    assert start == 96
    assert torch.equal(torch.cat(pieces).t(), _reference(raw, type_name))


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 29, 67, 243])
def test_kernel_matches_f_linear(type_name, rows, path):
    # 37 rows of W: a panel of 32 and a short one (5 rows, padded); up to 8 x rows in
    # registers, more in tiles of at most 14 against expanded panels, K = 160: 5 blocks, a
    # whole chunk of 4 and a short one
    raw = _raw(type_name, 37, 160, seed=rows)
    weight = BlockWeight.from_gguf(raw, type_name)
    x = _randn(rows, 160, seed=rows)
    expected = torch.nn.functional.linear(x, _reference(raw, type_name))
    torch.testing.assert_close(weight.linear(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blockq.linear(x, weight), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("type_name", FORMATS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(type_name, path):
    """Every output is summed in one order whatever M is (FMAs: registers up to 8 rows,
    expanded panels in tiles past that, K in chunks; AMX: one 16-row tile alone or tiles in
    groups of 4): a verify pass gives a token the products a decode pass would, bit for bit."""
    weight = BlockWeight.from_gguf(_raw(type_name, 37, 288, seed=3), type_name)
    x = _randn(150, 288, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the reference on one thread, whatever the session's
        whole = weight.linear(x)
        for rows in (1, 2, 7, 8, 9, 13, 14, 15, 16, 17, 29, 43, 64, 65, 129):
            assert torch.equal(weight.linear(x[:rows]), whole[:rows]), rows
        for i in (0, 17, 42, 149):
            assert torch.equal(weight.linear(x[i : i + 1]), whole[i : i + 1]), i
        # nor on the thread count (panels are split over threads; each is one thread's)
        torch.set_num_threads(2)
        for rows in (1, 9, 43, 150):
            assert torch.equal(weight.linear(x[:rows]), whole[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("type_name", FORMATS)
def test_amx_products_are_fp32_accurate(type_name):
    """The tile path splits x into three bf16 planes whose sum is x exactly, so its only
    rounding is fp32 sums: against a float64 product, it is as close as the FMA path is."""
    if not cpu_kernels.status().available:
        pytest.skip(cpu_kernels.status().reason)
    before = cpu_kernels.amx()
    try:
        if not cpu_kernels.amx(True):
            pytest.skip("this CPU (or OS) has no AMX tiles")
        raw = _raw(type_name, 70, 1536, seed=5)  # K of the model's down projection
        weight = BlockWeight.from_gguf(raw, type_name)
        x = _randn(21, 1536, seed=5) * 3
        exact = x.double() @ _reference(raw, type_name).double().t()
        tiles = (weight.linear(x).double() - exact).abs().max().item()
        cpu_kernels.amx(False)
        fmas = (weight.linear(x).double() - exact).abs().max().item()
    finally:
        cpu_kernels.amx(before)
    scale = exact.abs().max().item()
    assert tiles < 1e-6 * scale and fmas < 1e-6 * scale, (tiles, fmas, scale)
    assert tiles <= 2 * fmas, (tiles, fmas)  # a bf16 product of x would be ~1000x worse


@pytest.mark.cpu_kernels
def test_a_cpu_with_amx_gets_the_tile_path():
    """The library falls back to a build without the AMX path where the compiler lacks its
    flags; on a CPU whose kernel reports AMX that must not happen silently."""
    if not cpu_kernels.status().available:
        pytest.skip(cpu_kernels.status().reason)
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    if not {"amx_tile", "amx_bf16"} <= set(flags):
        pytest.skip("this CPU has no AMX tiles")
    libc = ctypes.CDLL(None, use_errno=True)  # ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA
    if libc.syscall(158, 0x1023, 18) != 0:  # 158: SYS_arch_prctl on x86-64
        pytest.skip("the OS does not grant tile state (Linux before 5.16)")
    before = cpu_kernels.amx()
    try:
        assert cpu_kernels.amx(True), "the library was built without the AMX path"
    finally:
        cpu_kernels.amx(before)


@pytest.mark.cpu_kernels
def test_the_environment_can_turn_the_tiles_off():
    if not cpu_kernels.status().available:
        pytest.skip(cpu_kernels.status().reason)
    code = "from engine import cpu_kernels; print(cpu_kernels.amx())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "ENGINE_CPU_AMX": "0"},
        check=True,
    ).stdout
    assert out.strip() == "False"
    before = cpu_kernels.amx()
    try:
        assert cpu_kernels.amx(False) is False and cpu_kernels.amx() is False
    finally:
        cpu_kernels.amx(before)


@pytest.mark.parametrize("type_name", FORMATS)
def test_panels_give_back_the_row_layout(type_name):
    # 37 rows: a panel of 32 and one of 5 padded with zero rows
    raw = _raw(type_name, 37, 96, seed=5)
    weight = BlockWeight.from_gguf(raw, type_name)
    assert weight.quants.shape[0] == 2
    again = BlockWeight(*weight.rows())
    for a, b in zip(
        (weight.quants, weight.scale, weight.offset),
        (again.quants, again.scale, again.offset),
        strict=True,
    ):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(again.dequantize(), _reference(raw, type_name))


@pytest.mark.cpu_kernels
def test_kernel_takes_batched_strided_and_empty_input(path):
    weight = BlockWeight.from_gguf(_raw("Q4_1", 8, 64), "Q4_1")
    dense = weight.dequantize()
    x = _randn(2, 3, 128, seed=11)[..., ::2]  # not contiguous
    torch.testing.assert_close(weight.linear(x), x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert weight.linear(torch.empty(0, 64)).shape == (0, 8)


@pytest.mark.cpu_kernels
def test_fused_rows_keep_their_order():
    parts = [BlockWeight.from_gguf(_raw("Q4_1", n, 64, seed=n), "Q4_1") for n in (5, 3, 4)]
    fused = BlockWeight.cat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(fused.dequantize()[5:8], parts[1].dequantize())
    x = _randn(3, 64, seed=12)
    torch.testing.assert_close(fused.linear(x), torch.cat([p.linear(x) for p in parts], -1))


def test_bad_input_is_refused_with_what_is_allowed():
    weight = BlockWeight.from_gguf(_raw("Q8_0", 4, 64), "Q8_0")
    with pytest.raises(ValueError, match="fp32 CPU input"):
        weight.linear(_randn(2, 64, seed=13, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        weight.linear(_randn(2, 32, seed=14))
    with pytest.raises(ValueError, match="supported: Q4_0, Q4_1, Q8_0"):
        BlockWeight.from_gguf(_raw("Q8_0", 4, 64), "Q5_K")
    with pytest.raises(ValueError, match="do not fit"):
        BlockWeight(torch.zeros(4, 10, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4, 2))
    with pytest.raises(
        ValueError,
        match=r"offsets of shape \(4, 1\) do not fit scales of "
        r"shape \(4, 2\)",
    ):
        BlockWeight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4, 1))
    with pytest.raises(ValueError, match="one block kind"):
        BlockWeight.cat([weight, BlockWeight.from_gguf(_raw("Q4_1", 4, 64), "Q4_1")])


def test_without_the_kernel_linear_says_why(monkeypatch):
    monkeypatch.setattr(
        cpu_kernels, "_build", lambda: (None, KernelStatus(False, "no C++ compiler (test)"))
    )
    weight = BlockWeight.from_gguf(_raw("Q4_1", 4, 64), "Q4_1")
    with pytest.raises(RuntimeError, match=r"CPU kernels are not available: no C\+\+ compiler"):
        weight.linear(_randn(1, 64, seed=15))


@pytest.fixture(scope="module")
def dense_model():
    return load_model(None, torch.float32, "cpu", block_weights=False)[0]


@pytest.mark.cpu_kernels
def test_default_model_keeps_its_blocks_with_the_dense_values(dense_model):
    model, config = load_model(None, torch.float32, "cpu")
    # every matrix of every layer, and the tied lm_head (the file's Q8_0 embedding)
    assert len(model.block_weights) == 4 * config.num_layers + 1
    assert isinstance(model.lm_head, BlockWeight)
    assert model.embed_tokens.shape == (config.vocab_size, config.hidden_size)  # lookups
    for name, weight in model.block_weights.items():
        assert torch.equal(weight.dequantize(), dense_model.dense_weight(name)), name
    assert model.num_bytes() < 0.5 * dense_model.num_bytes()


def test_without_the_kernel_the_loader_dequantizes(monkeypatch, dense_model):
    monkeypatch.setattr(cpu_kernels, "_build", lambda: (None, KernelStatus(False, "no AVX-512")))
    model, _ = load_model(None, torch.float32, "cpu")
    assert not model.block_weights
    assert model.num_bytes() == dense_model.num_bytes()


@pytest.mark.cpu_kernels
def test_a_model_with_block_weights_runs_and_saves_dense(tmp_path):
    from engine.model import LlamaModel, ModelConfig, save_hf_checkpoint

    model = LlamaModel(ModelConfig.tiny()).init_random(seed=3)
    blocks = {}
    for name in ("layers.0.qkv_proj", "layers.1.down_proj", "lm_head"):
        dense = model.dense_weight(name)
        raw = quantize(dense.contiguous().numpy(), gguf.GGMLQuantizationType.Q4_1)
        blocks[name] = BlockWeight.from_gguf(raw, "Q4_1")
    hidden = _randn(5, 64, seed=16)
    model.use_block_weights(blocks)
    assert isinstance(model.layers[0].qkv_proj, BlockWeight)
    assert "layers.0.qkv_proj" not in dict(model.named_parameters())
    torch.testing.assert_close(
        model.logits(hidden), hidden @ blocks["lm_head"].dequantize().t(), rtol=1e-5, atol=1e-5
    )
    save_hf_checkpoint(model, tmp_path)
    loaded, _ = load_model(tmp_path)
    for name in blocks:
        assert torch.equal(loaded.dense_weight(name), blocks[name].dequantize()), name
    with pytest.raises(ValueError, match="has shape"):
        model.use_block_weights({"layers.0.o_proj": blocks["layers.1.down_proj"]})


@pytest.mark.cpu_kernels
def test_engine_gives_the_same_tokens_with_and_without_the_cpu_kernels(monkeypatch):
    """Block weights, paged attention and the fused ops together, in mixed batches with
    speculative verify passes (tree attention), against dense weights and the torch paths."""
    from engine import Engine, SamplingParams
    from engine.backends.torch_backend import TorchBackend

    prompts = [
        "The capital of France is",
        "Repeat: one two three, one two three, one two",
        [{"role": "user", "content": "List three colours."}],
        "def add(a, b):",
    ]
    params = SamplingParams(max_tokens=24)
    # a configured draft cost: the trees (and so the verify passes run) do not follow timings
    fast = Engine(device="cpu", dtype="float32", speculative=True, draft_cost=0.1)
    assert fast.runtime.model.block_weights and fast.runtime.model.op_set == "cpu"
    with_kernels = [o.token_ids for o in fast.generate(prompts, params)]
    assert fast.spec.stats.total().drafting_steps > 0  # verify passes with real trees
    plain = Engine(
        device="cpu", dtype="float32", speculative=True, draft_cost=0.1, block_weights=False
    )
    # the model is shared (cached) with later engines: patched for this test only
    monkeypatch.setattr(plain.runtime.model, "op_set", "reference")
    monkeypatch.setattr(TorchBackend, "use_cpu_kernel", False)
    assert [o.token_ids for o in plain.generate(prompts, params)] == with_kernels


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("then", ["decode", "verify"])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the attention kernel's blocked path
def test_whole_layer_kernel_equals_the_per_op_path(head_dim, then, two_passes, monkeypatch):
    """`cpu_ops.decoder_layer` (one call per layer) runs the per-op path's kernels in the same
    order: bit-identical hidden states, on a random model held in blocks."""
    from engine.model import LlamaModel
    from engine.ops import cpu as cpu_ops

    model = LlamaModel(ModelConfig.tiny(head_dim=head_dim)).init_random(seed=6)
    names = [
        f"layers.{i}.{p}"
        for i in range(model.config.num_layers)
        for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    ]
    model.use_block_weights(
        {
            n: BlockWeight.from_gguf(
                quantize(
                    model.dense_weight(n).contiguous().numpy(), gguf.GGMLQuantizationType.Q4_1
                ),
                "Q4_1",
            )
            for n in names
        }
    )
    assert model.op_set == "cpu"
    calls = []
    real_layer = cpu_ops.decoder_layer

    def counted(*args):
        calls.append(real_layer(*args))
        return calls[-1]

    prompts = [[5, 9, 5, 9, 5, 9, 5], [7, 3, 11, 2], [1, 2, 3], [8] * 9]
    monkeypatch.setattr(cpu_ops, "decoder_layer", counted)
    whole = two_passes(model, prompts, then=then)
    monkeypatch.setattr(cpu_ops, "decoder_layer", lambda *args: None)
    op_by_op = two_passes(model, prompts, then=then)
    for got, expected in zip(whole, op_by_op, strict=True):
        assert torch.equal(got, expected)
    # the prefill's layers ran op by op; the decode's or verify's in one call each
    layers = model.config.num_layers
    assert [c is not None for c in calls] == [False] * layers + [True] * layers


def test_whole_layer_refuses_tables_and_slots_that_do_not_fit():
    from types import SimpleNamespace

    from engine.model import LlamaModel
    from engine.ops import cpu as cpu_ops

    model = LlamaModel(ModelConfig.tiny()).init_random(seed=1)
    layer = model.layers[0]
    model.use_block_weights(
        {
            f"layers.0.{p}": BlockWeight.from_gguf(
                quantize(
                    model.dense_weight(f"layers.0.{p}").contiguous().numpy(),
                    gguf.GGMLQuantizationType.Q8_0,
                ),
                "Q8_0",
            )
            for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        }
    )
    backend = SimpleNamespace(cpu_kernel_attention=lambda index, metadata: (None,) * 7)
    hidden, cos = torch.zeros(2, 64), torch.zeros(2, 16)
    good = SimpleNamespace(out_slots=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"cos must be \[2, >= 8\]"):
        cpu_ops.decoder_layer(layer, hidden, None, cos[:1], cos[:1], good, backend)
    with pytest.raises(ValueError, match=r"out_slots must be int64 \[2\]"):
        cpu_ops.decoder_layer(
            layer,
            hidden,
            None,
            cos,
            cos,
            SimpleNamespace(out_slots=torch.tensor([3, 4]).int()),
            backend,
        )
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        cpu_ops.decoder_layer(layer, hidden.double(), None, cos, cos, good, backend)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 64\]"):  # the matrices' width
        cpu_ops.decoder_layer(layer, hidden[:, :32], None, cos, cos, good, backend)
    # the kernel sizes its buffers from W_qkv and W_down: the other two must agree with them
    real_o = layer.o_proj
    layer.o_proj = BlockWeight.cat([real_o, real_o])  # 128 rows where 64 are needed
    with pytest.raises(
        ValueError,
        match=r"o_proj of shape \(128, 64\) \(N, K\); .* need "
        r"\(64, 64\)",
    ):
        cpu_ops.decoder_layer(layer, hidden, None, cos, cos, good, backend)
    layer.o_proj = real_o
    real_norm = layer.post_attention_layernorm.weight
    layer.post_attention_layernorm.weight = torch.nn.Parameter(real_norm[:32].clone())
    with pytest.raises(
        ValueError,
        match=r"post_attention_layernorm.weight must be contiguous "
        r"\[64\]",
    ):
        cpu_ops.decoder_layer(layer, hidden, None, cos, cos, good, backend)
    layer.post_attention_layernorm.weight = real_norm
    # a layer with a dense matrix, or a pass whose attention is not the kernel's, runs op by op
    assert cpu_ops.decoder_layer(model.layers[1], hidden, None, cos, cos, good, backend) is None
    no_kernel = SimpleNamespace(cpu_kernel_attention=lambda index, metadata: None)
    assert cpu_ops.decoder_layer(layer, hidden, None, cos, cos, good, no_kernel) is None


def test_an_unusable_cache_folder_leaves_the_torch_paths(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(blocked / "cache"))
    build = cpu_kernels._build.__wrapped__  # past the process's cached result
    lib, status = build()
    if "AVX-512" in status.reason or "compiler" in status.reason:
        pytest.skip(status.reason)
    assert lib is None and not status.available
    assert "cannot build or load" in status.reason
