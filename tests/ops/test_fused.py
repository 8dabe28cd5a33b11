"""The fused op sets against the torch reference ops: the Triton kernels (in the interpreter
on CPU) and, on an AVX-512 CPU, the CPU kernels (`cpu_ops`, fp32); and a whole forward with
each set on equals the forward with TorchOps."""

from __future__ import annotations

import pytest
import torch
from op_cases import DEVICE, assert_close, random_tensor

from engine import cpu_kernels
from engine.model import LlamaModel, ModelConfig
from engine.ops import cpu as cpu_ops
from engine.ops import triton as fused
from engine.ops.reference import TorchOps

POISON = float("nan")
CPU_KERNELS = cpu_kernels.status()


@pytest.fixture(
    params=[
        "triton",
        pytest.param(
            "cpu",
            marks=[
                pytest.mark.cpu_kernels,
                pytest.mark.skipif(DEVICE != "cpu", reason="a CPU device"),
            ],
        ),
    ]
)
def ops(request):
    """The op set under test (the CPU kernels take fp32 only: other dtypes skip)."""
    if (
        request.param == "cpu"
        and request.node.callspec.params.get("dtype", torch.float32) != torch.float32
    ):
        pytest.skip("the CPU kernels are fp32")
    return fused if request.param == "triton" else cpu_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(3, 64), (2, 200), (300, 200)])
def test_rms_norm_matches_reference(ops, dtype, tokens, hidden):
    x = random_tensor(tokens, hidden, dtype=dtype, seed=1) * 3
    weight = random_tensor(hidden, dtype=dtype, seed=2)
    assert_close(ops.rms_norm(x, weight, 1e-5), TorchOps.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(3, 64), (2, 200), (300, 200)])
def test_add_rms_norm_matches_reference_and_leaves_inputs(ops, dtype, tokens, hidden):
    x = random_tensor(tokens, hidden, dtype=dtype, seed=3)
    residual = random_tensor(tokens, hidden, dtype=dtype, seed=4)
    weight = random_tensor(hidden, dtype=dtype, seed=5)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_residual = TorchOps.add_rms_norm(x, residual, weight, 1e-6)
    assert_close(new_residual, expected_residual, dtype)
    assert_close(normed, expected_normed, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (10, 1, 8), (3, 3, 4)])
def test_rope_store_rotates_and_writes_exactly_the_token_slots(
    ops, dtype, num_heads, num_kv_heads, head_dim
):
    tokens, num_slots = 3, 9
    config = ModelConfig.tiny(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random_tensor(tokens, width, dtype=dtype, seed=16)
    cos, sin = LlamaModel(config, dtype, DEVICE, op_set="reference").rope(
        torch.tensor([0, 7, 301], device=DEVICE)
    )
    slots = torch.tensor([5, 0, 2], device=DEVICE)  # 0: a padding token's slot
    caches = [
        random_tensor(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (17, 18)
    ]
    expected_caches = [c.clone() for c in caches]
    expected = TorchOps.rope_qkv(qkv.clone(), cos, sin, num_heads, num_kv_heads, head_dim)
    expected_caches[0].index_copy_(0, slots, expected[1])
    expected_caches[1].index_copy_(0, slots, expected[2])
    got = ops.rope_qkv_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim, *caches, slots)
    assert got[0].data_ptr() == qkv.data_ptr()
    for got_part, expected_part in zip(got, expected, strict=True):
        assert_close(got_part, expected_part, dtype)
    for got_cache, expected_cache in zip(caches, expected_caches, strict=True):
        assert_close(got_cache, expected_cache, dtype)  # the other slots are untouched


def test_rope_store_takes_tables_with_other_row_strides(ops):
    config = ModelConfig.tiny(num_heads=4, num_kv_heads=2, head_dim=16)
    cos, sin = LlamaModel(config, device=DEVICE, op_set="reference").rope(
        torch.tensor([3, 9], device=DEVICE)
    )
    wide_sin = torch.cat([sin, torch.full_like(sin, POISON)], dim=1)[:, :16]  # stride 32
    qkv = random_tensor(2, 8 * 16, dtype=torch.float32, seed=21)
    results = []
    for table in (sin, wide_sin):
        caches = [torch.zeros(4, 2, 16, device=DEVICE) for _ in range(2)]
        q, _, _ = ops.rope_qkv_store(
            qkv.clone(), cos, table, 4, 2, 16, *caches, torch.tensor([1, 3], device=DEVICE)
        )
        results.append((q, *caches))
    for got, expected in zip(results[1], results[0], strict=True):
        assert torch.equal(got, expected)


def test_rope_store_refuses_mismatched_caches_and_slots(ops):
    qkv = torch.zeros(2, (4 + 2 * 2) * 8, device=DEVICE)
    cos = sin = torch.zeros(2, 8, device=DEVICE)
    cache = torch.zeros(6, 2, 8, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match=r"k_cache must be \[slots, 2, 8\]"):
        ops.rope_qkv_store(qkv, cos, sin, 4, 2, 8, cache[:, :1], cache, slots)
    with pytest.raises(ValueError, match="slots must be int64"):
        ops.rope_qkv_store(qkv, cos, sin, 4, 2, 8, cache, cache, slots.int())
    with pytest.raises(ValueError, match="slots must be int64"):
        ops.rope_qkv_store(qkv, cos, sin, 4, 2, 8, cache, cache, slots[:1])


def test_rope_refuses_heads_that_do_not_fit(ops):
    qkv = torch.zeros(2, 48, device=DEVICE)
    cos = sin = torch.zeros(2, 16, device=DEVICE)
    cache = torch.zeros(4, 1, 16, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv must be \[tokens, 96\]"):
        ops.rope_qkv_store(qkv, cos, sin, 4, 1, 16, cache, cache, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(3, 128), (2, 1500), (40, 1000)])
def test_silu_mul_matches_reference(ops, dtype, tokens, inter):
    gate_up = random_tensor(tokens, 2 * inter, dtype=dtype, seed=7) * 4
    assert_close(ops.silu_mul(gate_up), TorchOps.silu_mul(gate_up), dtype)


def test_outputs_are_written_not_left_over(ops, monkeypatch):
    """Every output element is written: allocations that hand back NaN change nothing."""
    x = random_tensor(2, 100, dtype=torch.float32, seed=8)
    weight = random_tensor(100, dtype=torch.float32, seed=9)
    gate_up = random_tensor(2, 300, dtype=torch.float32, seed=10)
    real_empty_like, real_empty = torch.empty_like, torch.empty
    poisoned: list[torch.Tensor] = []

    def poison(allocate):
        def allocate_poisoned(*args, **kwargs):
            poisoned.append(allocate(*args, **kwargs).fill_(POISON))
            return poisoned[-1]

        return allocate_poisoned

    monkeypatch.setattr(torch, "empty_like", poison(real_empty_like))
    monkeypatch.setattr(torch, "empty", poison(real_empty))
    normed, residual = ops.add_rms_norm(x, x, weight, 1e-5)
    outputs = [normed, residual, ops.rms_norm(x, weight, 1e-5), ops.silu_mul(gate_up)]
    monkeypatch.undo()
    assert all(any(out is p for p in poisoned) for out in outputs)
    assert all(torch.isfinite(out).all() for out in outputs)


def test_misshapen_inputs_raise(ops):
    weight = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 64\]"):
        ops.rms_norm(torch.zeros(2, 32, device=DEVICE), weight, 1e-5)
    with pytest.raises(ValueError, match="even width"):
        ops.silu_mul(torch.zeros(2, 7, device=DEVICE))


def test_rope_inv_freq_is_what_the_model_uses():
    config = ModelConfig.tiny()  # no rope scaling: theta ** (-2i / head_dim)
    half = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    expected = (1.0 / config.rope_theta**half).float()
    torch.testing.assert_close(LlamaModel(config, device=DEVICE).inv_freq.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_with_fused_kernels_equals_torch_path(ops, dtype, two_passes):
    model = LlamaModel(ModelConfig.tiny(), dtype, DEVICE, op_set="reference").init_random(seed=4)
    model.op_set = "reference"
    prompts = [list(range(5, 17)), list(range(40, 47))]
    reference = two_passes(model, prompts, DEVICE)
    model.op_set = "triton" if ops is fused else "cpu"
    got = two_passes(model, prompts, DEVICE)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for got_pass, reference_pass in zip(got, reference, strict=True):
        torch.testing.assert_close(got_pass, reference_pass, **tolerance)
    assert [h.shape[0] for h in got] == [19, 2]


def test_fused_is_chosen_by_device():
    config = ModelConfig.tiny()
    assert LlamaModel(config, device="cpu").op_set == (
        "cpu" if CPU_KERNELS.available else "reference"
    )
    assert LlamaModel(config, torch.float16, device="cpu").op_set == "reference"
    assert LlamaModel(config, device="cpu", op_set="triton").op_set == "triton"
    with pytest.raises(ValueError, match="op set 'fast' is unknown"):
        LlamaModel(config, device="cpu", op_set="fast")
