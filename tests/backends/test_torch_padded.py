"""The torch backend's padded all-requests attention, and the CPU kernel it uses for decode
and verify passes, equal its per-request oracle."""

from __future__ import annotations

import pytest
import torch
from backend_cases import make_case

from engine.backends import get_backend
from engine.backends.base import host_metadata
from engine.backends.torch_backend import TorchBackend, build_kv_indices


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.cpu_kernels)])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # 24: masked tails; 64, 128: blocked
@pytest.mark.parametrize("mode", ["extend", "decode", "verify"])
def test_padded_attention_equals_per_request(mode, head_dim, kernel, monkeypatch):
    monkeypatch.setattr(TorchBackend, "use_cpu_kernel", kernel)
    prefix_lens = [0, 7, 30, 1] if mode != "decode" else [3, 7, 30, 1]
    new_lens = [5, 1, 9, 3] if mode == "extend" else [4, 1, 3, 2]  # verify: tree sizes
    case = make_case(
        mode,
        prefix_lens,
        new_lens,
        num_kv_heads=2,
        group=2,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=0,
        device="cpu",
    )
    batch, pool = case.batch, case.pool
    backend = get_backend("torch", pool)
    meta = backend.plan(batch)
    assert bool(meta.extra.get("cpu_kernel")) == (kernel and mode != "extend")
    if mode == "extend":  # a decode among prefill chunks (a mixed pass) is padded apart
        assert len(meta.extra["padded"]) == 2
    # on the CPU the plan builds kv_indices on the host: the same as the tensor version
    tensors, _ = host_metadata(batch, "cpu")
    assert torch.equal(
        meta.kv_indices,
        build_kv_indices(
            pool.req_to_token,
            torch.from_numpy(batch.running.rows.copy()),
            tensors["prefix_lens"],
            tensors["kv_indptr"],
            tensors["qo_indptr"],
            tensors["out_slots"],
            batch.seq_lens.total,
        ),
    )
    q = torch.cat([case.q, case.q], dim=1)[:, 1:5]  # a view: tokens strided, as from qkv
    padded = backend.forward(0, q, case.k, case.v, meta)
    oracle = backend.forward_per_request(0, q, meta, head_dim**-0.5)
    torch.testing.assert_close(padded, oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [3, 5])  # 3: the default model's; 5: 3 tokens a chunk
def test_cpu_kernel_verify_takes_whole_trees_per_kv_head(head_dim, group, monkeypatch):
    """Verify passes run a request's tree tokens together per kv head, in chunks of at most
    16 queries (trees of 13 nodes: several chunks, the last one short)."""
    monkeypatch.setattr(TorchBackend, "use_cpu_kernel", True)
    case = make_case(
        "verify",
        [40, 0, 17],
        [13, 1, 6],
        num_kv_heads=3,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=2,
        device="cpu",
    )
    backend = get_backend("torch", case.pool)
    meta = backend.plan(case.batch)
    assert meta.extra.get("cpu_kernel")
    padded = backend.forward(0, case.q, case.k, case.v, meta)
    oracle = backend.forward_per_request(0, case.q, meta, head_dim**-0.5)
    torch.testing.assert_close(padded, oracle, rtol=1e-5, atol=1e-5)
