"""A family's q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3) inside the RoPE / K-V store
call: the Triton kernel (in the interpreter on CPU) and the CPU op set against the reference's
separate ops, and a Qwen layer launching exactly the ops and kernels of a Llama layer."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model import LlamaModel, ModelConfig
from engine.ops import cpu as cpu_ops
from engine.ops import triton as fused
from engine.ops.reference import QkvExtras, TorchOps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


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
    if (
        request.param == "cpu"
        and request.node.callspec.params.get("dtype", torch.float32) != torch.float32
    ):
        pytest.skip("the CPU kernels are fp32")
    return fused if request.param == "triton" else cpu_ops


def _random(*shape: int, dtype: torch.dtype, seed: int, low: float = -1.0, high: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(*shape, generator=generator) * (high - low) + low
    return values.to(DEVICE, dtype)


def _extras(kind: str, width: int, head_dim: int, dtype: torch.dtype) -> QkvExtras:
    bias = _random(width, dtype=dtype, seed=31) if kind in ("bias", "both") else None
    if kind == "bias":
        return QkvExtras(bias=bias)
    return QkvExtras(
        bias=bias,
        q_norm=_random(head_dim, dtype=dtype, seed=32, low=0.5, high=1.5),
        k_norm=_random(head_dim, dtype=dtype, seed=33, low=0.5, high=1.5),
        eps=1e-6,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["bias", "norm", "both"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 2, 16), (10, 1, 8), (3, 3, 4), (6, 2, 12)]
)
def test_rope_store_with_extras_matches_the_separate_ops(
    ops, dtype, kind, num_heads, num_kv_heads, head_dim
):
    tokens, num_slots = 3, 9
    config = ModelConfig.tiny(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _random(tokens, width, dtype=dtype, seed=16, low=-3.0, high=3.0)
    extras = _extras(kind, width, head_dim, dtype)
    cos, sin = LlamaModel(config, dtype, DEVICE, op_set="reference").rope(
        torch.tensor([0, 7, 301], device=DEVICE)
    )
    slots = torch.tensor([5, 0, 2], device=DEVICE)
    caches = [_random(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (17, 18)]
    expected_caches = [c.clone() for c in caches]
    expected = TorchOps.rope_qkv(qkv.clone(), cos, sin, num_heads, num_kv_heads, head_dim, extras)
    expected_caches[0].index_copy_(0, slots, expected[1])
    expected_caches[1].index_copy_(0, slots, expected[2])
    got = ops.rope_qkv_store(
        qkv, cos, sin, num_heads, num_kv_heads, head_dim, *caches, slots, extras
    )
    for got_part, expected_part in zip(got, expected, strict=True):
        assert got_part.shape == expected_part.shape and got_part.dtype == dtype
        torch.testing.assert_close(got_part.float(), expected_part.float(), **TOLERANCE[dtype])
    for got_cache, expected_cache in zip(caches, expected_caches, strict=True):
        torch.testing.assert_close(got_cache.float(), expected_cache.float(), **TOLERANCE[dtype])


def test_the_extras_change_the_result(ops):
    """Each part counts: leaving the bias or a norm out would show."""
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _random(2, width, dtype=torch.float32, seed=40, low=-3.0, high=3.0)
    cos = torch.ones(2, head_dim, device=DEVICE)  # no rotation: the extras alone
    sin = torch.zeros(2, head_dim, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    results = {}
    for kind in ("none", "bias", "norm", "both"):
        caches = [torch.zeros(2, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)]
        extras = None if kind == "none" else _extras(kind, width, head_dim, torch.float32)
        q, k, v = ops.rope_qkv_store(
            qkv.clone(), cos, sin, num_heads, num_kv_heads, head_dim, *caches, slots, extras
        )
        results[kind] = (q.clone(), k.clone(), v.clone(), *caches)
    bias = _extras("bias", width, head_dim, torch.float32).bias
    assert torch.allclose(results["bias"][2].reshape(2, -1), qkv[:, -32:] + bias[-32:])
    assert torch.equal(results["bias"][4], results["bias"][2])  # the biased v is stored
    for kind in ("bias", "norm", "both"):
        assert not torch.allclose(results[kind][0], results["none"][0])
    assert not torch.allclose(results["both"][0], results["norm"][0])
    q_rms = results["norm"][0].float().div(_extras("norm", width, head_dim, torch.float32).q_norm)
    torch.testing.assert_close(q_rms.pow(2).mean(-1), torch.ones(2, num_heads, device=DEVICE))


def test_rope_store_refuses_extras_that_do_not_fit(ops):
    qkv = torch.zeros(2, (4 + 2 * 2) * 8, device=DEVICE)
    cos = sin = torch.zeros(2, 8, device=DEVICE)
    cache = torch.zeros(6, 2, 8, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    wrong_bias = QkvExtras(bias=torch.zeros(32, device=DEVICE))
    with pytest.raises(ValueError, match=r"extras.bias must be contiguous \[64\]"):
        ops.rope_qkv_store(qkv, cos, sin, 4, 2, 8, cache, cache, slots, wrong_bias)
    ones = torch.ones(8, device=DEVICE)
    wrong_norm = QkvExtras(q_norm=ones, k_norm=torch.ones(16, device=DEVICE)[::2])
    with pytest.raises(ValueError, match=r"extras.k_norm must be contiguous \[8\]"):
        ops.rope_qkv_store(qkv, cos, sin, 4, 2, 8, cache, cache, slots, wrong_norm)
    with pytest.raises(ValueError, match="both q_norm and k_norm or neither"):
        QkvExtras(q_norm=ones)


class _CountOps(TorchDispatchMode):
    """The torch ops a forward runs outside the op set's calls, and those calls, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def wrap(self, name: str, function):
        def counted(*args, **kwargs):
            self.names.append(f"ops.{name}")
            self.inside = True
            try:
                return function(*args, **kwargs)
            finally:
                self.inside = False

        return counted


OP_SET_CALLS = ("rms_norm", "add_rms_norm", "linear", "silu_mul", "rope_qkv_store")


def _decode_ops(config: ModelConfig, two_passes, monkeypatch) -> list[str]:
    model = LlamaModel(config, torch.float32, DEVICE, op_set="triton").init_random(seed=2)
    counter = _CountOps()
    with monkeypatch.context() as patch:
        for name in OP_SET_CALLS:
            patch.setattr(fused, name, counter.wrap(name, getattr(fused, name)))
        with counter:
            two_passes(model, [[5, 9, 5], [7, 3]], DEVICE)
    return counter.names


@pytest.mark.parametrize(
    "family", [dict(architecture="qwen2", qkv_bias=True), dict(architecture="qwen3", qk_norm=True)]
)
def test_a_qwen_layer_runs_the_ops_of_a_llama_layer(family, two_passes, monkeypatch):
    """The bias and the head norms go into the RoPE call: no torch op of their own (each
    was a launch, with the copies and the join before RoPE), no op-set call more."""
    llama = _decode_ops(ModelConfig.tiny(), two_passes, monkeypatch)
    qwen = _decode_ops(ModelConfig.tiny(**family), two_passes, monkeypatch)
    assert llama.count("ops.rope_qkv_store") == 2 * ModelConfig.tiny().num_layers
    assert qwen == llama


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA kernel launches")
@pytest.mark.parametrize(
    "family", [dict(architecture="qwen2", qkv_bias=True), dict(architecture="qwen3", qk_norm=True)]
)
def test_a_qwen_pass_launches_the_kernels_of_a_llama_pass(family, two_passes):
    from torch.profiler import ProfilerActivity, profile

    def kernels(config: ModelConfig) -> int:
        model = LlamaModel(config, torch.bfloat16, DEVICE).init_random(seed=2)
        two_passes(model, [[5, 9, 5], [7, 3]], DEVICE)  # compiled before counting
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            two_passes(model, [[5, 9, 5], [7, 3]], DEVICE)
            torch.cuda.synchronize()
        return sum(1 for event in prof.events() if event.device_type.name == "CUDA")

    llama = kernels(ModelConfig.tiny())
    assert llama > 0 and kernels(ModelConfig.tiny(**family)) == llama
