"""The fused op sets against the torch reference ops: the Triton kernels (in the interpreter
on CPU) and, on an AVX-512 CPU, the CPU kernels (`cpu_ops`, fp32); and a whole forward with
each set on equals the forward with TorchOps."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.model import LlamaModel, ModelConfig
from engine.ops import cpu as cpu_ops
from engine.ops import gemv
from engine.ops import triton as fused
from engine.ops.reference import TorchOps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = float("nan")
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
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


def _random(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(3, 64), (2, 200), (300, 200)])
def test_rms_norm_matches_reference(ops, dtype, tokens, hidden):
    x = _random(tokens, hidden, dtype=dtype, seed=1) * 3
    weight = _random(hidden, dtype=dtype, seed=2)
    _close(ops.rms_norm(x, weight, 1e-5), TorchOps.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(3, 64), (2, 200), (300, 200)])
def test_add_rms_norm_matches_reference_and_leaves_inputs(ops, dtype, tokens, hidden):
    x = _random(tokens, hidden, dtype=dtype, seed=3)
    residual = _random(tokens, hidden, dtype=dtype, seed=4)
    weight = _random(hidden, dtype=dtype, seed=5)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_residual = TorchOps.add_rms_norm(x, residual, weight, 1e-6)
    _close(new_residual, expected_residual, dtype)
    _close(normed, expected_normed, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (10, 1, 8), (3, 3, 4)])
def test_rope_store_rotates_and_writes_exactly_the_token_slots(
    ops, dtype, num_heads, num_kv_heads, head_dim
):
    tokens, num_slots = 3, 9
    config = ModelConfig.tiny(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _random(tokens, width, dtype=dtype, seed=16)
    cos, sin = LlamaModel(config, dtype, DEVICE, op_set="reference").rope(
        torch.tensor([0, 7, 301], device=DEVICE)
    )
    slots = torch.tensor([5, 0, 2], device=DEVICE)  # 0: a padding token's slot
    caches = [_random(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (17, 18)]
    expected_caches = [c.clone() for c in caches]
    expected = TorchOps.rope_qkv(qkv.clone(), cos, sin, num_heads, num_kv_heads, head_dim)
    expected_caches[0].index_copy_(0, slots, expected[1])
    expected_caches[1].index_copy_(0, slots, expected[2])
    got = ops.rope_qkv_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim, *caches, slots)
    assert got[0].data_ptr() == qkv.data_ptr()
    for got_part, expected_part in zip(got, expected, strict=True):
        _close(got_part, expected_part, dtype)
    for got_cache, expected_cache in zip(caches, expected_caches, strict=True):
        _close(got_cache, expected_cache, dtype)  # the other slots are untouched


def test_rope_store_takes_tables_with_other_row_strides(ops):
    config = ModelConfig.tiny(num_heads=4, num_kv_heads=2, head_dim=16)
    cos, sin = LlamaModel(config, device=DEVICE, op_set="reference").rope(
        torch.tensor([3, 9], device=DEVICE)
    )
    wide_sin = torch.cat([sin, torch.full_like(sin, POISON)], dim=1)[:, :16]  # stride 32
    qkv = _random(2, 8 * 16, dtype=torch.float32, seed=21)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 13])
@pytest.mark.parametrize("n,k", [(40, 100), (17, 1030)])
def test_gemv_matches_linear(dtype, rows, n, k):
    x = _random(rows, k, dtype=dtype, seed=19)
    weight = _random(n, k, dtype=dtype, seed=20) * 0.05
    expected = torch.nn.functional.linear(x.float(), weight.float()).to(dtype)
    for config in (
        None,
        dict(gemv.GEMV_CONFIG, LOOP_STAGES=1),  # key steps not pipelined
        dict(BLOCK_N=2, BLOCK_K=128, num_warps=8, all_rows=True),
        gemv.rows_config(n, 2),
        dict(gemv.rows_config(n, 2), LOOP_STAGES=1),
    ):
        _close(gemv.gemv(x, weight, config), expected, dtype)


def test_linear_takes_the_kernel_where_cublas_is_slower():
    """One row of any dtype up to MAX_WEIGHT_ELEMENTS; float32 up to MAX_ROWS rows (cuBLAS:
    SIMT tiles and a split-K reduce) up to ROWS_MAX_WEIGHT_ELEMENTS; bf16 from two rows on
    stays with cuBLAS."""
    small, rows_large, large = (1536, 576), (49152, 576), (gemv.MAX_WEIGHT_ELEMENTS + 1, 1)
    sms = 132
    assert gemv.linear_config(1, torch.bfloat16, small, sms) == gemv.GEMV_CONFIG
    assert gemv.linear_config(1, torch.float32, small, sms) == gemv.GEMV_CONFIG
    assert gemv.linear_config(1, torch.float32, rows_large, sms) == dict(
        gemv.GEMV_CONFIG, LOOP_STAGES=1
    )
    assert gemv.linear_config(13, torch.float32, small, sms) == gemv.rows_config(1536, sms)
    assert gemv.linear_config(13, torch.float32, rows_large, sms) is None
    assert gemv.linear_config(gemv.MAX_ROWS + 1, torch.float32, small, sms) is None
    assert gemv.linear_config(13, torch.bfloat16, small, sms) is None
    assert gemv.linear_config(1, torch.float32, large, sms) is None
    assert gemv.linear_config(0, torch.float32, small, sms) is None


def test_loop_stages_pipeline_the_key_steps_while_programs_are_few():
    """Key steps in flight (one row 3, all rows 4) below PIPELINE_MAX_PROGRAMS_PER_SM
    programs an SM (measured
    faster at up to 5.8), none beyond (SmolLM2-135M's output layer: 6144 programs on 132
    SMs, measured slower pipelined)."""
    sms = 132
    assert gemv.linear_config(1, torch.float32, (960, 576), sms)["LOOP_STAGES"] == 3
    assert gemv.linear_config(13, torch.float32, (960, 576), sms)["LOOP_STAGES"] == 4
    assert gemv.linear_config(1, torch.bfloat16, (6144, 4096), sms)["LOOP_STAGES"] == 3
    assert gemv.linear_config(1, torch.float32, (49152, 576), sms)["LOOP_STAGES"] == 1
    assert gemv.rows_config(65536, sms)["LOOP_STAGES"] == 1


def test_rows_config_keeps_the_programs_per_sm():
    """The launches measured fastest on the H200 (132 SMs) at SmolLM2-135M's widths: 8
    columns a program for 3072, 4 for 960, 2 for 576 (256 products a key step, 4 steps in
    flight); a tiny width still runs."""
    picks = {n: gemv.rows_config(n, 132) for n in (3072, 960, 576, 8)}
    assert [picks[n]["BLOCK_N"] for n in (3072, 960, 576, 8)] == [8, 4, 2, 2]
    assert [picks[n]["BLOCK_K"] for n in (3072, 960, 576)] == [32, 64, 128]
    assert [picks[n]["LOOP_STAGES"] for n in (3072, 960, 576)] == [4, 4, 4]
    for config in picks.values():
        assert config["BLOCK_N"] * config["BLOCK_K"] == gemv.ROWS_PRODUCTS


def test_gemv_refuses_what_it_does_not_serve():
    weight = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="serves 1 to 16 rows; got 17"):
        gemv.gemv(torch.zeros(17, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv.gemv(torch.zeros(1, 15, device=DEVICE), weight)
    with pytest.raises(ValueError, match="unit stride along K"):
        gemv.gemv(torch.zeros(1, 16, device=DEVICE), torch.zeros(16, 8, device=DEVICE).t())


ROWS_CONFIG = dict(BLOCK_N=2, BLOCK_K=64, num_warps=4, all_rows=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_gemv_equals_the_norm_then_gemv(dtype, rows, with_residual):
    """One launch gives the unfused pair's product (the normed row rounded as the RMSNorm
    op rounds it) and its residual stream; the inputs are left unchanged."""
    n, k = 20, 100
    x = _random(rows, k, dtype=dtype, seed=31) * 3
    residual = _random(rows, k, dtype=dtype, seed=32) if with_residual else None
    norm_weight = _random(k, dtype=dtype, seed=33)
    weight = _random(n, k, dtype=dtype, seed=34) * 0.05
    before = (x.clone(), None if residual is None else residual.clone())
    if residual is None:
        normed, stream = fused.rms_norm(x, norm_weight, 1e-5), x
    else:
        normed, stream = fused.add_rms_norm(x, residual, norm_weight, 1e-5)
    out, got_stream = gemv.norm_gemv(x, residual, norm_weight, 1e-5, weight)
    _close(out, gemv.gemv(normed, weight), dtype)
    assert torch.equal(got_stream, stream)
    assert got_stream is x if residual is None else got_stream.data_ptr() != x.data_ptr()
    assert torch.equal(x, before[0])
    assert residual is None or torch.equal(residual, before[1])
    normed_reference = (
        TorchOps.rms_norm(x, norm_weight, 1e-5)
        if residual is None
        else TorchOps.add_rms_norm(x, residual, norm_weight, 1e-5)[0]
    )
    reference = torch.nn.functional.linear(normed_reference.float(), weight.float())
    _close(out, reference.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4])
def test_silu_gemv_equals_silu_mul_then_gemv(dtype, rows):
    n, inter = 24, 150
    gate_up = _random(rows, 2 * inter, dtype=dtype, seed=35) * 4
    weight = _random(n, inter, dtype=dtype, seed=36) * 0.01
    out = gemv.silu_gemv(gate_up, weight)
    _close(out, gemv.gemv(fused.silu_mul(gate_up), weight), dtype)
    reference = torch.nn.functional.linear(TorchOps.silu_mul(gate_up).float(), weight.float())
    _close(out, reference.to(dtype), dtype)


def test_fused_products_refuse_what_they_do_not_serve():
    weight = torch.zeros(8, 16, device=DEVICE)
    norm_weight = torch.ones(16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm_weight \[16\] and a residual shaped as x"):
        gemv.norm_gemv(x, torch.zeros(3, 16, device=DEVICE), norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match=r"norm_weight \[16\]"):
        gemv.norm_gemv(x, None, torch.ones(15, device=DEVICE), 1e-5, weight)
    wide = torch.zeros(16, 16385, device=DEVICE)
    with pytest.raises(ValueError, match="rows of at most 16384 elements"):
        gemv.norm_gemv(torch.zeros(1, 16385, device=DEVICE), None, wide[0], 1e-5, wide)
    with pytest.raises(ValueError, match="all-rows kernel .* plain products only"):
        gemv.norm_gemv(x, None, norm_weight, 1e-5, weight, ROWS_CONFIG)
    with pytest.raises(ValueError, match="all-rows kernel .* plain products only"):
        gemv.silu_gemv(torch.zeros(2, 32, device=DEVICE), weight, ROWS_CONFIG)
    with pytest.raises(ValueError, match=r"gate_up \[M, 2 \* inter\]"):
        gemv.silu_gemv(torch.zeros(1, 15, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"K = 8"):
        gemv.silu_gemv(torch.zeros(1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="serves 1 to 16 rows; got 17"):
        gemv.silu_gemv(torch.zeros(17, 32, device=DEVICE), weight)


def test_fused_products_decline_where_the_kernel_does_not_take_the_product():
    """None (the model runs the ops apart) where `linear_config` keeps cuBLAS (a CPU
    tensor), for more than one row (the all-rows kernel with the op inside measured slower),
    and for norm rows wider than FUSED_NORM_MAX_K (measured slower at Llama-3-8B's 4096);
    one row on CUDA is fused."""
    weight, norm_weight = torch.zeros(8, 16), torch.ones(16)
    assert gemv.norm_linear(torch.zeros(1, 16), None, norm_weight, 1e-5, weight) is None
    assert gemv.silu_mul_linear(torch.zeros(1, 32), weight) is None
    if DEVICE != "cuda":
        return
    weight, norm_weight = weight.cuda(), norm_weight.cuda()
    assert gemv.norm_linear(torch.ones(1, 16, device="cuda"), None, norm_weight, 1e-5, weight)
    assert gemv.silu_mul_linear(torch.ones(1, 32, device="cuda"), weight) is not None
    for rows in (2, 13):
        x = torch.ones(rows, 16, device="cuda")
        assert gemv.norm_linear(x, x, norm_weight, 1e-5, weight) is None
        assert gemv.silu_mul_linear(torch.ones(rows, 32, device="cuda"), weight) is None
    wide = torch.zeros(8, gemv.FUSED_NORM_MAX_K + 1, device="cuda")
    assert gemv.norm_linear(wide[:1], None, wide[0], 1e-5, wide) is None
    at_limit = torch.zeros(8, gemv.FUSED_NORM_MAX_K, device="cuda")
    assert gemv.norm_linear(at_limit[:1], None, at_limit[0], 1e-5, at_limit) is not None


class _KernelProducts(TorchOps):
    """TorchOps with every product of up to MAX_ROWS rows through the fused kernels (the
    kernels' own choice keeps them to CUDA)."""

    @staticmethod
    def norm_linear(x, residual, norm_weight, eps, weight):
        if x.shape[0] > gemv.MAX_ROWS:
            return None
        return gemv.norm_gemv(x, residual, norm_weight, eps, weight.contiguous())

    @staticmethod
    def silu_mul_linear(gate_up, weight):
        if gate_up.shape[0] > gemv.MAX_ROWS:
            return None
        return gemv.silu_gemv(gate_up, weight.contiguous())


def test_forward_with_fused_products_equals_torch_path(two_passes, monkeypatch):
    """The layer takes an op set's norm_linear and silu_mul_linear where they apply (the
    decode pass) and runs the ops apart where they return None (the 19-token prefill)."""
    from engine import ops as op_sets

    model = LlamaModel(ModelConfig.tiny(), torch.float32, DEVICE, op_set="reference")
    model.init_random(seed=5)
    prompts = [list(range(5, 17)), list(range(40, 47))]
    reference = two_passes(model, prompts, DEVICE)
    calls = []

    def traced(name):
        def call(*args):
            calls.append((name, args[0].shape[0]))
            return getattr(_KernelProducts, name)(*args)

        return staticmethod(call)

    traced_ops = type(
        "Traced", (TorchOps,), {n: traced(n) for n in ("norm_linear", "silu_mul_linear")}
    )
    monkeypatch.setattr(op_sets, "load", lambda name: traced_ops)
    got = two_passes(model, prompts, DEVICE)
    for got_pass, reference_pass in zip(got, reference, strict=True):
        torch.testing.assert_close(got_pass, reference_pass, atol=1e-4, rtol=1e-4)
    layers = ModelConfig.tiny().num_layers
    assert calls.count(("norm_linear", 2)) == 2 * layers
    assert calls.count(("silu_mul_linear", 2)) == layers


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
    gate_up = _random(tokens, 2 * inter, dtype=dtype, seed=7) * 4
    _close(ops.silu_mul(gate_up), TorchOps.silu_mul(gate_up), dtype)


def test_outputs_are_written_not_left_over(ops, monkeypatch):
    """Every output element is written: allocations that hand back NaN change nothing."""
    x = _random(2, 100, dtype=torch.float32, seed=8)
    weight = _random(100, dtype=torch.float32, seed=9)
    gate_up = _random(2, 300, dtype=torch.float32, seed=10)
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
