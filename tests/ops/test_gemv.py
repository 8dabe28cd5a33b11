"""The Triton matrix-vector kernels (`engine.ops.gemv`) against F.linear and the torch
reference ops: plain products of 1-16 rows, the norm and SiLU*mul inside one-row products,
their launch policy (`engine.ops.gemv_policy`), and a whole forward through an op set that
fuses them."""

from __future__ import annotations

import pytest
import torch
from op_cases import DEVICE, TOLERANCE, assert_close, random_tensor

from engine.model import LlamaModel, ModelConfig
from engine.ops import gemv, gemv_policy
from engine.ops import triton as fused
from engine.ops.reference import TorchOps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 13])
@pytest.mark.parametrize("n,k", [(40, 100), (17, 1030)])
def test_gemv_matches_linear(dtype, rows, n, k):
    x = random_tensor(rows, k, dtype=dtype, seed=19)
    weight = random_tensor(n, k, dtype=dtype, seed=20) * 0.05
    expected = torch.nn.functional.linear(x.float(), weight.float()).to(dtype)
    for config in (
        None,
        dict(gemv_policy.GEMV_CONFIG, LOOP_STAGES=1),  # key steps not pipelined
        dict(BLOCK_N=2, BLOCK_K=128, num_warps=8, all_rows=True),
        gemv_policy.rows_config(n, 2),
        dict(gemv_policy.rows_config(n, 2), LOOP_STAGES=1),
        dict(gemv_policy.rows_config(n, 2), LOAD_3D=True),  # x and the tiles loaded in 3-d blocks
        dict(gemv_policy.ROWS_WIDE_CONFIG, all_rows=True),  # a wide weight's (an output layer's)
    ):
        assert_close(gemv.gemv(x, weight, config), expected, dtype)


def test_linear_takes_the_kernel_where_cublas_is_slower():
    """One row of any dtype up to MAX_WEIGHT_ELEMENTS; float32 up to MAX_ROWS rows (cuBLAS:
    SIMT tiles and a split-K reduce) up to ROWS_MAX_WEIGHT_ELEMENTS, or with the wide launch
    up to ROWS_WIDE_MAX_WEIGHT_ELEMENTS; bf16 from two rows on stays with cuBLAS."""
    small, rows_large, large = (1536, 576), (49152, 576), (gemv_policy.MAX_WEIGHT_ELEMENTS + 1, 1)
    sms = 132
    assert gemv_policy.linear_config(1, torch.bfloat16, small, sms) == gemv_policy.GEMV_CONFIG
    assert gemv_policy.linear_config(1, torch.float32, small, sms) == gemv_policy.GEMV_CONFIG
    assert gemv_policy.linear_config(1, torch.float32, rows_large, sms) == dict(
        gemv_policy.GEMV_CONFIG, LOOP_STAGES=1
    )
    assert gemv_policy.linear_config(13, torch.float32, small, sms) == gemv_policy.rows_config(
        1536, sms
    )
    assert gemv_policy.linear_config(13, torch.float32, rows_large, sms) == dict(
        gemv_policy.ROWS_WIDE_CONFIG, all_rows=True
    )
    assert gemv_policy.linear_config(2, torch.float32, large, sms) is None
    assert gemv_policy.linear_config(gemv_policy.MAX_ROWS + 1, torch.float32, small, sms) is None
    assert gemv_policy.linear_config(13, torch.bfloat16, small, sms) is None
    assert gemv_policy.linear_config(1, torch.float32, large, sms) is None
    # a large model's widest layer product (Llama-3-8B's gate_up): one row in the kernel, its
    # 3584 programs unpipelined; float32 rows on it past the wide launch's limit with cuBLAS
    gate_up = (28672, 4096)
    assert gemv_policy.linear_config(1, torch.bfloat16, gate_up, sms) == dict(
        gemv_policy.GEMV_CONFIG, LOOP_STAGES=1
    )
    assert gemv_policy.linear_config(13, torch.float32, gate_up, sms) is None
    assert gemv_policy.linear_config(0, torch.float32, small, sms) is None


def test_the_rows_limits_stand_apart(monkeypatch):
    """Lowering the one-row limit (MAX_WEIGHT_ELEMENTS) below a weight leaves float32 rows on
    it with the all-rows kernel while it is within ROWS_MAX_WEIGHT_ELEMENTS, or within
    ROWS_WIDE_MAX_WEIGHT_ELEMENTS for the wide launch, whose limit is its own."""
    monkeypatch.setattr(gemv_policy, "MAX_WEIGHT_ELEMENTS", 1536 * 576 - 1)
    assert not gemv_policy.kernel_takes(1, torch.float32, (1536, 576))
    assert gemv_policy.kernel_takes(13, torch.float32, (1536, 576))
    assert gemv_policy.kernel_takes(13, torch.float32, (49152, 576))
    monkeypatch.setattr(gemv_policy, "ROWS_WIDE_MAX_WEIGHT_ELEMENTS", 49152 * 576 - 1)
    assert not gemv_policy.kernel_takes(13, torch.float32, (49152, 576))
    assert gemv_policy.kernel_takes(13, torch.float32, (1536, 576))


def test_wide_weights_of_float32_rows_stay_with_cublas_without_a_wide_launch(monkeypatch):
    """ROWS_WIDE_CONFIG None: float32 rows on a weight past ROWS_MAX_WEIGHT_ELEMENTS go to
    cuBLAS (the rule the wide launch was measured against), narrower ones as before."""
    monkeypatch.setattr(gemv_policy, "ROWS_WIDE_CONFIG", None)
    gemv_policy.linear_config.cache_clear()
    try:
        assert not gemv_policy.kernel_takes(13, torch.float32, (49152, 576))
        assert gemv_policy.linear_config(13, torch.float32, (49152, 576), 132) is None
        assert gemv_policy.linear_config(13, torch.float32, (1536, 576), 132) is not None
        assert gemv_policy.linear_config(1, torch.float32, (49152, 576), 132) is not None
    finally:
        gemv_policy.linear_config.cache_clear()  # its answers above were under the patched rule


def test_the_output_layer_runs_through_the_op_sets_product(monkeypatch):
    """`logits` takes the op set's `linear` (the Triton set's kernels on CUDA, which take a
    small float32 model's output layer at every row count), not F.linear directly."""
    from engine import ops as op_sets

    model = LlamaModel(ModelConfig.tiny(), torch.float32, DEVICE, op_set="reference")
    model.init_random(seed=8)
    seen = []

    def linear(x, weight):
        seen.append((x.shape[0], weight.data_ptr()))
        return torch.nn.functional.linear(x, weight)

    traced_ops = type("Traced", (TorchOps,), {"linear": staticmethod(linear)})
    monkeypatch.setattr(op_sets, "load", lambda name: traced_ops)
    hidden = random_tensor(3, model.config.hidden_size, dtype=torch.float32, seed=9)
    logits = model.logits(hidden)
    assert seen == [(3, model.lm_head.data_ptr())]
    expected = torch.nn.functional.linear(hidden, model.lm_head)
    torch.testing.assert_close(logits, expected)


def test_loop_stages_pipeline_the_key_steps_while_programs_are_few():
    """Key steps in flight (one row 3, all rows 8) below PIPELINE_MAX_PROGRAMS_PER_SM
    programs an SM (measured
    faster at up to 5.8), none beyond (SmolLM2-135M's output layer: 6144 programs on 132
    SMs, measured slower pipelined)."""
    sms = 132
    assert gemv_policy.linear_config(1, torch.float32, (960, 576), sms)["LOOP_STAGES"] == 3
    assert gemv_policy.linear_config(13, torch.float32, (960, 576), sms)["LOOP_STAGES"] == 8
    assert gemv_policy.linear_config(1, torch.bfloat16, (6144, 4096), sms)["LOOP_STAGES"] == 3
    assert gemv_policy.linear_config(1, torch.float32, (49152, 576), sms)["LOOP_STAGES"] == 1
    assert gemv_policy.rows_config(65536, sms)["LOOP_STAGES"] == 1


def test_norm_config_pipelines_short_loops_only_while_programs_are_few():
    """The norm's product runs its key steps unpipelined where they are two or fewer and the
    launch has two or more programs an SM (SmolLM2-135M's gate_up: 384 programs on 132 SMs,
    K 576, measured faster so); otherwise as `linear_config` says."""
    sms = 132
    gate_up = gemv_policy.linear_config(1, torch.float32, (3072, 576), sms)
    assert gemv_policy.norm_config(gate_up, (3072, 576), sms) == dict(gate_up, LOOP_STAGES=1)
    qkv = gemv_policy.linear_config(1, torch.float32, (960, 576), sms)  # 120 programs
    assert gemv_policy.norm_config(qkv, (960, 576), sms) is qkv
    wide = gemv_policy.linear_config(1, torch.bfloat16, (6144, 4096), sms)  # 8 key steps
    assert gemv_policy.norm_config(wide, (6144, 4096), sms) is wide
    assert gemv_policy.norm_config(gate_up, (3072, 1025), sms) is gate_up  # 3 key steps
    assert gate_up["LOOP_STAGES"] == 3  # the cached dict is left as it was


def test_rows_config_takes_the_measured_tiles():
    """The launches measured fastest on the H200 (132 SMs) at SmolLM2-135M's widths and 13
    rows: 8 columns a program by 64 keys, 16 by 32 where SiLU*mul follows (its programs read
    a gate and an up tile), 8 key steps in flight; whatever the width, a tiny one too."""
    for n in (3072, 960, 576, 8):
        plain, silu = (
            gemv_policy.rows_config(n, 132),
            gemv_policy.rows_config(n, 132, silu_mul=True),
        )
        assert (plain["BLOCK_N"], plain["BLOCK_K"], plain["LOOP_STAGES"]) == (8, 64, 8)
        assert (silu["BLOCK_N"], silu["BLOCK_K"], silu["LOOP_STAGES"]) == (16, 32, 8)
        for config in (plain, silu):
            assert config["BLOCK_N"] * config["BLOCK_K"] == gemv_policy.ROWS_PRODUCTS
            assert config["all_rows"]


def test_rows_config_loads_3d_blocks_where_asked(monkeypatch):
    """ENGINE_ROWS_LOAD_3D (read into ROWS_LOAD_3D) gives the all-rows launches the 3-d
    loads: "all" every launch, "plain" those without SiLU*mul; off by default."""
    assert gemv_policy.ROWS_LOAD_3D == "off"
    for mode, plain, silu in (("off", False, False), ("all", True, True), ("plain", True, False)):
        monkeypatch.setattr(gemv_policy, "ROWS_LOAD_3D", mode)
        assert gemv_policy.rows_config(960, 132)["LOAD_3D"] is plain
        assert gemv_policy.rows_config(1536, 132, silu_mul=True)["LOAD_3D"] is silu


def test_the_load_3d_variable_refuses_other_values(monkeypatch):
    for value, mode in (("", "off"), ("0", "off"), ("1", "all"), ("plain", "plain")):
        monkeypatch.setenv("ENGINE_ROWS_LOAD_3D", value)
        assert gemv_policy._load_3d_mode("ENGINE_ROWS_LOAD_3D") == mode
    monkeypatch.delenv("ENGINE_ROWS_LOAD_3D")
    assert gemv_policy._load_3d_mode("ENGINE_ROWS_LOAD_3D") == "off"
    monkeypatch.setenv("ENGINE_ROWS_LOAD_3D", "yes")
    with pytest.raises(ValueError, match="ENGINE_ROWS_LOAD_3D must be 0, 1 or plain"):
        gemv_policy._load_3d_mode("ENGINE_ROWS_LOAD_3D")


def test_the_model_runs_silu_after_gate_up_with_the_silu_launch(monkeypatch):
    """`linear_silu_mul` launches `gemv_silu` with rows_config's SiLU*mul tiles for the
    output's columns (half of gate_up's rows)."""
    seen = []
    monkeypatch.setattr(gemv, "_kernel_config", lambda x, w: gemv_policy.rows_config(w.shape[0], 2))
    monkeypatch.setattr(gemv, "_num_sms", lambda device: 2)
    monkeypatch.setattr(gemv, "gemv_silu", lambda x, w, config: seen.append(config))
    gemv.linear_silu_mul(torch.zeros(13, 64), torch.zeros(2 * 48, 64))
    assert seen == [gemv_policy.rows_config(48, 2, silu_mul=True)]


def test_gemv_refuses_what_it_does_not_serve():
    weight = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="serves 1 to 16 rows; got 17"):
        gemv.gemv(torch.zeros(17, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv.gemv(torch.zeros(1, 15, device=DEVICE), weight)
    with pytest.raises(ValueError, match="unit stride along K"):
        gemv.gemv(torch.zeros(1, 16, device=DEVICE), torch.zeros(16, 8, device=DEVICE).t())


ROWS_CONFIG = dict(BLOCK_N=2, BLOCK_K=64, num_warps=4, all_rows=True)
# the default launch (100 keys in one step), and keys over four steps, pipelined or not
FUSED_CONFIGS = [
    None,
    dict(gemv_policy.GEMV_CONFIG, BLOCK_K=32),
    dict(gemv_policy.GEMV_CONFIG, BLOCK_K=32, LOOP_STAGES=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    "config",
    [
        *FUSED_CONFIGS,
        gemv_policy.rows_config(20, 2),  # the all-rows kernel: 100 keys over two steps
        dict(gemv_policy.rows_config(20, 2), LOAD_3D=True),
    ],
)
def test_norm_gemv_equals_the_norm_then_gemv(dtype, rows, with_residual, config):
    """One launch (either kernel) gives the unfused pair's product (up to rounding: it
    scales by 1 / RMS after the sum) and its residual stream, rounded as the op rounds it;
    the inputs are left unchanged."""
    n, k = 20, 100
    x = random_tensor(rows, k, dtype=dtype, seed=31) * 3
    residual = random_tensor(rows, k, dtype=dtype, seed=32) if with_residual else None
    norm_weight = random_tensor(k, dtype=dtype, seed=33)
    weight = random_tensor(n, k, dtype=dtype, seed=34) * 0.05
    before = (x.clone(), None if residual is None else residual.clone())
    if residual is None:
        normed, stream = fused.rms_norm(x, norm_weight, 1e-5), x
    else:
        normed, stream = fused.add_rms_norm(x, residual, norm_weight, 1e-5)
    out, got_stream = gemv.norm_gemv(x, residual, norm_weight, 1e-5, weight, config)
    assert_close(out, gemv.gemv(normed, weight), dtype)
    _check_stream(got_stream, stream, x, residual, before)
    normed_reference = _reference_norm(x, residual, norm_weight)
    reference = torch.nn.functional.linear(normed_reference.float(), weight.float())
    assert_close(out, reference.to(dtype), dtype)


def _check_stream(got, expected, x, residual, before) -> None:
    """A norm launch's residual stream is the norm op's (x itself without a residual, else a
    new tensor), and x and the residual are as they were (`before`: their clones)."""
    assert torch.equal(got, expected)
    assert got is x if residual is None else got.data_ptr() != x.data_ptr()
    assert torch.equal(x, before[0])
    assert residual is None or torch.equal(residual, before[1])


def _reference_norm(x, residual, norm_weight) -> torch.Tensor:
    if residual is None:
        return TorchOps.rms_norm(x, norm_weight, 1e-5)
    return TorchOps.add_rms_norm(x, residual, norm_weight, 1e-5)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("config", FUSED_CONFIGS)
def test_silu_gemv_equals_silu_mul_then_gemv(dtype, rows, config):
    n, inter = 24, 150
    gate_up = random_tensor(rows, 2 * inter, dtype=dtype, seed=35) * 4
    weight = random_tensor(n, inter, dtype=dtype, seed=36) * 0.01
    out = gemv.silu_gemv(gate_up, weight, config)
    assert_close(out, gemv.gemv(fused.silu_mul(gate_up), weight), dtype)
    reference = torch.nn.functional.linear(TorchOps.silu_mul(gate_up).float(), weight.float())
    assert_close(out, reference.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 13])
@pytest.mark.parametrize(
    "config",
    [
        ROWS_CONFIG,
        dict(ROWS_CONFIG, BLOCK_N=4, BLOCK_K=32, LOOP_STAGES=1),
        gemv_policy.rows_config(150, 2),
        gemv_policy.rows_config(150, 2, silu_mul=True),  # the model's launch
        dict(gemv_policy.rows_config(150, 2, silu_mul=True), LOAD_3D=True),
    ],
)
def test_gemv_silu_equals_gemv_then_silu_mul(dtype, rows, config):
    """The all-rows kernel with SiLU*mul after the products: the gate_up product rounded to
    the dtype, then the op, as the two launches give it (inter 150: ragged column and key
    tiles)."""
    inter, k = 150, 70
    x = random_tensor(rows, k, dtype=dtype, seed=37)
    weight = random_tensor(2 * inter, k, dtype=dtype, seed=38) * 0.2
    out = gemv.gemv_silu(x, weight, config)
    assert out.shape == (rows, inter)
    assert_close(out, fused.silu_mul(gemv.gemv(x, weight, config)), dtype)
    reference = TorchOps.silu_mul(torch.nn.functional.linear(x.float(), weight.float()).to(dtype))
    assert_close(out, reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [2, 13])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    "config",
    [
        dict(ROWS_CONFIG, BLOCK_N=32, LOOP_STAGES=1),
        gemv_policy.rows_config(150, 2, silu_mul=True),
        dict(gemv_policy.rows_config(150, 2, silu_mul=True), LOAD_3D=True),
    ],
)
def test_norm_gemv_silu_equals_the_norm_then_gemv_silu(dtype, rows, with_residual, config):
    """The norm before the gate_up product and SiLU*mul after it, in one launch: the
    products as `norm_gemv` gives them (1 / RMS after the sums), rounded to the dtype, then
    the op; the residual stream as the norm op gives it (inter 150: ragged column and key
    tiles)."""
    inter, k = 150, 70
    x = random_tensor(rows, k, dtype=dtype, seed=41) * 3
    residual = random_tensor(rows, k, dtype=dtype, seed=42) if with_residual else None
    norm_weight = random_tensor(k, dtype=dtype, seed=43)
    weight = random_tensor(2 * inter, k, dtype=dtype, seed=44) * 0.2
    before = (x.clone(), None if residual is None else residual.clone())
    out, stream = gemv.norm_gemv_silu(x, residual, norm_weight, 1e-5, weight, config)
    gate_up, expected_stream = gemv.norm_gemv(x, residual, norm_weight, 1e-5, weight, config)
    assert out.shape == (rows, inter)
    assert_close(out, fused.silu_mul(gate_up), dtype)
    _check_stream(stream, expected_stream, x, residual, before)
    normed = _reference_norm(x, residual, norm_weight)
    products = torch.nn.functional.linear(normed.float(), weight.float()).to(dtype)
    # in float16 a product rounded one step apart (1 / RMS applied after its sum) moves
    # SiLU(gate) * up by up to about twice that step
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), TorchOps.silu_mul(products).float(), **tolerance)


def test_fused_products_refuse_what_they_do_not_serve():
    weight = torch.zeros(8, 16, device=DEVICE)
    norm_weight = torch.ones(16, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm_weight \[16\] and a residual shaped as x"):
        gemv.norm_gemv(x, torch.zeros(3, 16, device=DEVICE), norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match=r"norm_weight \[16\]"):
        gemv.norm_gemv(x, None, torch.ones(15, device=DEVICE), 1e-5, weight)
    with pytest.raises(ValueError, match="all-rows kernel .* no SiLU\\*mul before"):
        gemv.silu_gemv(torch.zeros(2, 32, device=DEVICE), weight, ROWS_CONFIG)
    with pytest.raises(ValueError, match=r"norm_gemv_silu needs norm_weight \[16\]"):
        gemv.norm_gemv_silu(x, None, torch.ones(15, device=DEVICE), 1e-5, weight, ROWS_CONFIG)
    with pytest.raises(ValueError, match=r"norm_gemv_silu needs weight \[2 \* inter, K\]"):
        gemv.norm_gemv_silu(x, None, norm_weight, 1e-5, torch.zeros(7, 16, device=DEVICE), {})
    with pytest.raises(ValueError, match="norm_gemv_silu runs in the all-rows kernel"):
        gemv.norm_gemv_silu(x, None, norm_weight, 1e-5, weight, gemv_policy.GEMV_CONFIG)
    with pytest.raises(ValueError, match=r"gate_up \[M, 2 \* inter\]"):
        gemv.silu_gemv(torch.zeros(1, 15, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"K = 8"):
        gemv.silu_gemv(torch.zeros(1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="serves 1 to 16 rows; got 17"):
        gemv.silu_gemv(torch.zeros(17, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"weight \[2 \* inter, K\]; got \(7, 16\)"):
        gemv.gemv_silu(x, torch.zeros(7, 16, device=DEVICE), ROWS_CONFIG)
    with pytest.raises(ValueError, match="its config needs all_rows"):
        gemv.gemv_silu(x, weight, gemv_policy.GEMV_CONFIG)


def test_fused_products_decline_where_the_kernel_does_not_take_the_product():
    """None (the model runs the ops apart) where `linear_config` keeps cuBLAS (a CPU
    tensor); the norm before a product is fused for one row (at Llama-3-8B's width, 4096,
    too) and for float32 rows from two on (the all-rows kernel), where SiLU*mul after the
    gate_up product joins it; SiLU*mul before a product for one row only."""
    weight, norm_weight = torch.zeros(8, 16), torch.ones(16)
    assert gemv.norm_linear(torch.zeros(1, 16), None, norm_weight, 1e-5, weight) is None
    assert gemv.silu_mul_linear(torch.zeros(1, 32), weight) is None
    assert gemv.linear_silu_mul(torch.zeros(2, 16), weight) is None
    assert gemv.norm_linear_silu_mul(torch.zeros(2, 16), None, norm_weight, 1e-5, weight) is None
    if DEVICE != "cuda":
        return
    weight, norm_weight = weight.cuda(), norm_weight.cuda()
    assert gemv.norm_linear(torch.ones(1, 16, device="cuda"), None, norm_weight, 1e-5, weight)
    assert gemv.silu_mul_linear(torch.ones(1, 32, device="cuda"), weight) is not None
    for rows in (2, 13):
        x = torch.ones(rows, 16, device="cuda")
        assert gemv.norm_linear(x, x, norm_weight, 1e-5, weight)[0].shape == (rows, 8)
        assert gemv.norm_linear_silu_mul(x, x, norm_weight, 1e-5, weight)[0].shape == (rows, 4)
        assert gemv.silu_mul_linear(torch.ones(rows, 32, device="cuda"), weight) is None
        assert gemv.linear_silu_mul(x, weight).shape == (rows, 4)  # float32: all rows
        assert gemv.linear_silu_mul(x.bfloat16(), weight.bfloat16()) is None  # cuBLAS's
        bf16 = (x.bfloat16(), None, norm_weight.bfloat16(), 1e-5, weight.bfloat16())
        assert gemv.norm_linear(*bf16) is None
        assert gemv.norm_linear_silu_mul(*bf16) is None
    one = torch.ones(1, 16, device="cuda")
    assert gemv.linear_silu_mul(one, weight) is None  # one row
    assert gemv.norm_linear_silu_mul(one, None, norm_weight, 1e-5, weight) is None
    wide = torch.zeros(8, 4096, device="cuda", dtype=torch.bfloat16)
    assert gemv.norm_linear(wide[:1], wide[:1], wide[0], 1e-5, wide) is not None


class _KernelProducts(TorchOps):
    """TorchOps with every product of up to MAX_ROWS rows through the fused kernels (the
    kernels' own choice keeps them to CUDA)."""

    @staticmethod
    def norm_linear(x, residual, norm_weight, eps, weight):
        if x.shape[0] > gemv_policy.MAX_ROWS:
            return None
        return gemv.norm_gemv(x, residual, norm_weight, eps, weight.contiguous())

    @staticmethod
    def silu_mul_linear(gate_up, weight):
        if gate_up.shape[0] > gemv_policy.MAX_ROWS:
            return None
        return gemv.silu_gemv(gate_up, weight.contiguous())


def _traced_passes(two_passes, monkeypatch, kernels: type, names: tuple, seed: int) -> list:
    """The tiny model's prefill and two-row decode pass through an op set whose `names`
    are `kernels`'s, traced: checks they equal the reference op set's passes and returns
    the calls, (name, rows) each."""
    from engine import ops as op_sets

    model = LlamaModel(ModelConfig.tiny(), torch.float32, DEVICE, op_set="reference")
    model.init_random(seed=seed)
    prompts = [list(range(5, 17)), list(range(40, 47))]
    reference = two_passes(model, prompts, DEVICE)
    calls = []

    def traced(name):
        def call(*args):
            calls.append((name, args[0].shape[0]))
            return getattr(kernels, name)(*args)

        return staticmethod(call)

    traced_ops = type("Traced", (TorchOps,), {n: traced(n) for n in names})
    monkeypatch.setattr(op_sets, "load", lambda name: traced_ops)
    got = two_passes(model, prompts, DEVICE)
    for got_pass, reference_pass in zip(got, reference, strict=True):
        torch.testing.assert_close(got_pass, reference_pass, atol=1e-4, rtol=1e-4)
    return calls


def test_forward_with_fused_products_equals_torch_path(two_passes, monkeypatch):
    """The layer takes an op set's norm_linear and silu_mul_linear where they apply (the
    decode pass) and runs the ops apart where they return None (the 19-token prefill)."""
    names = ("norm_linear", "silu_mul_linear")
    calls = _traced_passes(two_passes, monkeypatch, _KernelProducts, names, seed=5)
    layers = ModelConfig.tiny().num_layers
    assert calls.count(("norm_linear", 2)) == 2 * layers
    assert calls.count(("silu_mul_linear", 2)) == layers


class _SiluAfterProducts(TorchOps):
    """TorchOps with SiLU*mul inside the gate_up product for 2 to MAX_ROWS rows (the
    all-rows kernel; on CUDA the kernels' own choice)."""

    @staticmethod
    def linear_silu_mul(x, weight):
        if not 1 < x.shape[0] <= gemv_policy.MAX_ROWS:
            return None
        inter = weight.shape[0] // 2
        return gemv.gemv_silu(
            x, weight.contiguous(), gemv_policy.rows_config(inter, 2, silu_mul=True)
        )


def test_forward_with_silu_after_the_product_equals_torch_path(two_passes, monkeypatch):
    """Where the norm is not fused into the gate_up product (here: no norm_linear), the
    layer takes linear_silu_mul for the product and SiLU*mul (the two-row decode pass) and
    runs them apart where it returns None (the prefill)."""
    from engine import ops as op_sets

    model = LlamaModel(ModelConfig.tiny(), torch.float32, DEVICE, op_set="reference")
    model.init_random(seed=6)
    prompts = [list(range(5, 17)), list(range(40, 47))]
    reference = two_passes(model, prompts, DEVICE)
    calls = []

    def call(x, weight):
        calls.append(x.shape[0])
        return _SiluAfterProducts.linear_silu_mul(x, weight)

    traced_ops = type("Traced", (TorchOps,), {"linear_silu_mul": staticmethod(call)})
    monkeypatch.setattr(op_sets, "load", lambda name: traced_ops)
    got = two_passes(model, prompts, DEVICE)
    for got_pass, reference_pass in zip(got, reference, strict=True):
        torch.testing.assert_close(got_pass, reference_pass, atol=1e-4, rtol=1e-4)
    layers = ModelConfig.tiny().num_layers
    assert calls == [19] * layers + [2] * layers


class _NormInAllRows(TorchOps):
    """TorchOps with the norms inside the products of 2 to MAX_ROWS rows, in the all-rows
    kernel (and SiLU*mul after the gate_up product), as a float32 verify pass runs them on
    CUDA."""

    @staticmethod
    def norm_linear(x, residual, norm_weight, eps, weight):
        if not 1 < x.shape[0] <= gemv_policy.MAX_ROWS:
            return None
        config = gemv_policy.rows_config(weight.shape[0], 2)
        return gemv.norm_gemv(x, residual, norm_weight, eps, weight.contiguous(), config)

    @staticmethod
    def norm_linear_silu_mul(x, residual, norm_weight, eps, weight):
        if not 1 < x.shape[0] <= gemv_policy.MAX_ROWS:
            return None
        config = gemv_policy.rows_config(weight.shape[0] // 2, 2, silu_mul=True)
        return gemv.norm_gemv_silu(x, residual, norm_weight, eps, weight.contiguous(), config)


@pytest.mark.parametrize("load_3d", ["off", "all", "plain"])
def test_forward_with_norms_in_the_all_rows_products_equals_torch_path(
    two_passes, monkeypatch, load_3d
):
    """The layer takes norm_linear for qkv and norm_linear_silu_mul for the MLP's gate_up
    where they apply (the two-row decode pass: two launches for the norms, the products and
    SiLU*mul), and runs the ops apart where they return None (the 19-token prefill); with
    the all-rows launches' loads in 3-d blocks too."""
    monkeypatch.setattr(gemv_policy, "ROWS_LOAD_3D", load_3d)
    names = ("norm_linear", "norm_linear_silu_mul")
    calls = _traced_passes(two_passes, monkeypatch, _NormInAllRows, names, seed=7)
    layers = ModelConfig.tiny().num_layers
    assert calls.count(("norm_linear", 2)) == layers  # qkv; the MLP takes the other
    assert calls.count(("norm_linear_silu_mul", 2)) == layers
    assert calls.count(("norm_linear_silu_mul", 19)) == layers  # declined: ops apart
