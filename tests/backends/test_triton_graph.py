"""The CUDA-graph path: plans filled in place into static buffers, batches padded to the
captured size; checked against the reference (and replayed from a real graph on CUDA)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from backend_cases import (
    DTYPES,
    ON_CUDA,
    TOLERANCE,
    clone_pool,
    make_case,
    random_trees,
    relative_error,
)

from engine import pdl
from engine.backends import BufferTooSmall, triton_backend
from engine.backends.torch_backend import TorchBackend
from engine.backends.triton_backend import TritonBackend
from engine.backends.triton_decode import decode_attention
from engine.state import PADDING_SLOT, schedule_decode, schedule_verify

DTYPE = DTYPES[-1]


def padded(tensor: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randn(rows - tensor.shape[0], *tensor.shape[1:], generator=gen)
    return torch.cat([tensor, extra.to(tensor.device, tensor.dtype)])


def run_padded(
    mode: str,
    prefix: list[int],
    new: list[int],
    batch_size: int,
    tokens: int,
    num_splits: int | None,
) -> None:
    case = make_case(mode, prefix, new, 2, 3, 64, DTYPE, seed=sum(prefix) + len(new))
    ref_pool = clone_pool(case.pool)
    ref = TorchBackend(ref_pool).forward(
        0, case.q, case.k, case.v, TorchBackend(ref_pool).plan(case.batch)
    )
    backend = TritonBackend(case.pool)
    buffers = backend.graph_buffers(
        max_batch=8, max_tokens=40, max_kv_tokens=1024, max_tree_nodes=8
    )
    meta = backend.plan(
        case.batch,
        buffers=buffers,
        padded_batch_size=batch_size,
        padded_num_tokens=tokens,
        num_splits=num_splits,
    )
    real = case.q.shape[0]
    q, k, v = (padded(t, tokens, seed) for seed, t in enumerate((case.q, case.k, case.v)))
    out = torch.full_like(q, float("nan"))
    backend.forward(0, q, k, v, meta, out=out)
    assert relative_error(out[:real], ref) < TOLERANCE[DTYPE]
    assert (out[real:] == 0).all(), "padding requests have no keys: their output is zero"
    assert not out.isnan().any()
    assert (buffers.merge_counters == 0).all(), "the fused merge leaves its counters at zero"
    kept = torch.ones(case.pool.num_slots, dtype=torch.bool, device=q.device)
    kept[PADDING_SLOT] = False
    assert torch.equal(case.pool.k_cache[0][kept], ref_pool.k_cache[0][kept])
    assert torch.equal(case.pool.v_cache[0][kept], ref_pool.v_cache[0][kept])


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_padded_decode_matches_reference(num_splits: int | None) -> None:
    run_padded("decode", [5, 40, 0], [1, 1, 1], batch_size=6, tokens=6, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padded_verify_matches_reference(num_splits: int) -> None:
    run_padded("verify", [12, 3], [5, 3], batch_size=4, tokens=13, num_splits=num_splits)


def test_plans_at_one_padded_size_share_addresses_and_launch_shape() -> None:
    case = make_case("decode", [7, 30, 2, 19, 64], [1] * 5, 1, 4, 64, DTYPE, seed=21)
    running, slots = case.batch.running, case.batch.out_slots
    backend = TritonBackend(case.pool)
    buffers = backend.graph_buffers(max_batch=8, max_tokens=8, max_kv_tokens=256)
    plans = [
        backend.plan(
            schedule_decode(running.select(idx), slots[idx]), buffers=buffers, padded_batch_size=4
        )
        for idx in ([0, 2], [1, 3, 4])
    ]
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "prefix_lens", "out_slots"):
        first, second = getattr(plans[0], name), getattr(plans[1], name)
        assert first.data_ptr() == second.data_ptr() and first.shape == second.shape, name
    assert plans[0].extra == plans[1].extra and plans[0].max_new_len == plans[1].max_new_len


def test_graph_buffers_too_small_are_reported_and_untouched() -> None:
    case = make_case("verify", [20, 9], [4, 2], 1, 1, 64, DTYPE, seed=22)
    backend = TritonBackend(case.pool)
    total = case.batch.seq_lens.total
    buffers = backend.graph_buffers(max_batch=4, max_tokens=16, max_kv_tokens=total - 1)
    with pytest.raises(BufferTooSmall, match=f"seq_lens.total = {total}"):
        backend.plan(case.batch, buffers=buffers)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "out_slots", "tree_bits"):
        assert (getattr(buffers, name) == 0).all(), name
    with pytest.raises(BufferTooSmall, match="hold 4 requests"):
        backend.plan(case.batch, buffers=backend.graph_buffers(4, 16, 64), padded_batch_size=5)
    with pytest.raises(BufferTooSmall, match="hold 16 tokens"):
        backend.plan(case.batch, buffers=backend.graph_buffers(4, 16, 64), padded_num_tokens=17)


def test_padded_extend_matches_reference() -> None:
    """An extend pass (cached prefixes, several requests) planned into graph buffers, padded
    in requests and tokens: its attention runs a grid of all the padded tokens a request and
    zeroes the padding rows."""
    run_padded("extend", [12, 0, 3], [5, 9, 2], batch_size=4, tokens=24, num_splits=None)


def test_extend_launch_policy_sees_a_bound_on_every_replays_keys(monkeypatch) -> None:
    """The extend kernel chooses its launch by the longest request's keys: an eager pass
    tells it its batch's, a graph's pass the request table's width, since the launch it
    captures serves every pass it replays (the capture's batch holds one key a request)."""
    case = make_case("extend", [12, 0, 3], [5, 9, 2], 2, 3, 64, DTYPE, seed=7)
    seen = []
    kernel = triton_backend.extend_attention

    def spy(*args, **kwargs):
        seen.append(args[11])  # max_seq_len
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "extend_attention", spy)
    backend = TritonBackend(case.pool)
    backend.forward(0, case.q, case.k, case.v, backend.plan(case.batch))
    buffers = backend.graph_buffers(max_batch=8, max_tokens=40, max_kv_tokens=1024)
    meta = backend.plan(case.batch, buffers=buffers, padded_batch_size=4, padded_num_tokens=24)
    q, k, v = (padded(t, 24, seed) for seed, t in enumerate((case.q, case.k, case.v)))
    backend.forward(0, q, k, v, meta, out=torch.empty_like(q))
    assert seen == [12 + 5, case.pool.req_to_token.shape[1]]


def test_graph_buffers_refuse_large_trees() -> None:
    verify_case = make_case("verify", [3], [6], 1, 1, 64, DTYPE, seed=24)
    backend = TritonBackend(verify_case.pool)
    with pytest.raises(ValueError, match="at most 4"):
        backend.plan(verify_case.batch, buffers=backend.graph_buffers(2, 8, 64, 4))


def test_kv_indices_built_in_the_pass_are_the_plans() -> None:
    """A graph plan with `indices_in_pass` stages its arrays and leaves kv_indices alone;
    `build_kv_indices` then fills them as the plan without it does. Eager plans refuse
    both (their indices are built by the plan)."""
    case = make_case("decode", [7, 30, 2], [1] * 3, 1, 4, 64, DTYPE, seed=27)
    backend = TritonBackend(case.pool)
    built = backend.graph_buffers(max_batch=4, max_tokens=4, max_kv_tokens=256)
    reference = backend.plan(case.batch, buffers=built, padded_batch_size=4)
    expected = reference.kv_indices[: case.batch.seq_lens.total].clone()
    buffers = backend.graph_buffers(max_batch=4, max_tokens=4, max_kv_tokens=256)
    meta = backend.plan(case.batch, buffers=buffers, padded_batch_size=4, indices_in_pass=True)
    assert (buffers.kv_indices == 0).all(), "the plan built kv indices"
    backend.build_kv_indices(meta)
    assert torch.equal(buffers.kv_indices[: case.batch.seq_lens.total], expected)
    with pytest.raises(ValueError, match="an eager plan builds them"):
        backend.plan(case.batch, indices_in_pass=True)
    with pytest.raises(ValueError, match="this plan is eager"):
        backend.build_kv_indices(backend.plan(case.batch))


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_replay_with_a_new_plan(mode: str) -> None:
    """Capture at padded size 4 with one batch, re-plan another batch into the same buffers
    and replay (a real CUDA graph on CUDA; the same in-place forward elsewhere)."""
    case = make_case(mode, [7, 30, 2, 19, 64], [3, 1, 2, 4, 1], 2, 4, 64, DTYPE, seed=25)
    ref_pool = clone_pool(case.pool)
    backend = TritonBackend(case.pool)
    buffers = backend.graph_buffers(max_batch=8, max_tokens=32, max_kv_tokens=512, max_tree_nodes=8)
    batches = [_sub_batch(case.batch, idx) for idx in ([0, 2], [1, 3, 4])]
    tokens = 4 if mode == "decode" else 16
    static = [
        torch.zeros(tokens, *t.shape[1:], dtype=t.dtype, device=t.device)
        for t in (case.q, case.k, case.v)
    ]
    out = torch.zeros_like(static[0])
    meta = backend.plan(batches[0], buffers=buffers, padded_batch_size=4, padded_num_tokens=tokens)
    backend.forward(0, *static, meta, out=out)  # compiles outside any capture
    graph = _capture(lambda: backend.forward(0, *static, meta, out=out))
    second = batches[1]
    meta = backend.plan(second, buffers=buffers, padded_batch_size=4, padded_num_tokens=tokens)
    flat = _token_index(case.batch, [1, 3, 4])
    for target, source in zip(static, (case.q, case.k, case.v), strict=True):
        target.zero_()
        target[: flat.shape[0]] = source[flat]
    out.fill_(float("nan"))
    graph() if graph is not None else backend.forward(0, *static, meta, out=out)
    ref_backend = TorchBackend(ref_pool)
    ref = ref_backend.forward(0, case.q[flat], case.k[flat], case.v[flat], ref_backend.plan(second))
    assert relative_error(out[: flat.shape[0]], ref) < TOLERANCE[DTYPE]
    assert not out.isnan().any()


def _sub_batch(batch, idx: list[int]):
    running = batch.running.select(idx)
    slots = batch.out_slots[_token_index(batch, idx).cpu().numpy()]
    if batch.trees is None:
        return schedule_decode(running, slots)
    sizes = batch.new_lens.lens[idx].tolist()
    trees = random_trees(np.random.default_rng(5), sizes, running.last_tokens)
    return schedule_verify(running, trees, slots)


def _token_index(batch, idx: list[int]) -> torch.Tensor:
    starts, lens = batch.new_lens.starts(), batch.new_lens.lens
    flat = [s + j for i in idx for s, n in [(starts[i], lens[i])] for j in range(n)]
    return torch.tensor(flat, dtype=torch.long, device="cuda" if ON_CUDA else "cpu")


def _capture(fn):
    """A replay function for fn captured in a CUDA graph; None off CUDA, or when PyTorch's
    caching allocator is off (the suite's memcheck run), since capture then cannot allocate."""
    if not ON_CUDA or os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@pytest.mark.skipif(not ON_CUDA, reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("launch", sorted(pdl.MODES))
def test_programmatic_launch_merge_matches_reference(mode: str, launch: str) -> None:
    """The split kernel and then the merge kernel (not fused), in each programmatic dependent
    launch mode, eagerly and replayed from a graph."""
    with pdl.using(launch):
        _check_split_then_merge(mode)


def _check_split_then_merge(mode: str) -> None:
    case = make_case(mode, [300, 1000, 7], [4, 9, 1], 2, 4, 128, DTYPE, seed=26)
    ref_backend = TorchBackend(clone_pool(case.pool))
    ref = ref_backend.forward(0, case.q, case.k, case.v, ref_backend.plan(case.batch))
    backend = TritonBackend(case.pool)
    meta = backend.plan(case.batch, num_splits=6)
    case.pool.k_cache[0].index_copy_(0, meta.out_slots, case.k)
    case.pool.v_cache[0].index_copy_(0, meta.out_slots, case.v)
    out = torch.full_like(case.q, float("nan"))

    def run() -> None:
        decode_attention(
            case.q,
            case.pool.k_cache[0],
            case.pool.v_cache[0],
            meta.kv_indices,
            meta.kv_indptr,
            meta.qo_indptr,
            meta.prefix_lens,
            meta.tree_bits,
            out,
            6,
            meta.extra["max_q"],
            128**-0.5,
            config={"FUSED_MERGE": False},
        )

    run()
    assert relative_error(out, ref) < TOLERANCE[DTYPE]
    replay = _capture(run)
    if replay is None:
        return
    out.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    assert relative_error(out, ref) < TOLERANCE[DTYPE]
