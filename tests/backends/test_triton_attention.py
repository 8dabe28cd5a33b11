"""Triton decode / extend / verify attention against the torch reference on ragged batches."""

from __future__ import annotations

import pytest
import torch
from backend_cases import (
    DTYPES,
    EXAMPLES,
    MAX_BATCH,
    MAX_NEW,
    MAX_PREFIX,
    MAX_TREE,
    ON_CUDA,
    TOLERANCE,
    clone_pool,
    make_case,
    relative_error,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.backends import extend_policy, triton_extend
from engine.backends.torch_backend import TorchBackend
from engine.backends.triton_backend import TritonBackend

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
SPLITS = [None, 1, 2, 3]
HEAD_DIMS = [64, 128]


@st.composite
def shapes(draw: st.DrawFn, max_new: int) -> dict:
    batch = draw(st.integers(1, MAX_BATCH))
    prefix = draw(st.lists(st.integers(0, MAX_PREFIX), min_size=batch, max_size=batch))
    new = draw(st.lists(st.integers(1, max_new), min_size=batch, max_size=batch))
    return dict(
        prefix_lens=prefix,
        new_lens=new,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3, 4])),
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
        num_splits=draw(st.sampled_from(SPLITS)),
    )


def covering_examples(max_new: int):
    """Explicit examples, run before the drawn ones on every run: each split count, each
    dtype with each head size, each group and KV head count, on a ragged batch (a long
    prefix, none, a short one; the longest new part the test allows)."""
    combos = [(dtype, head_dim) for head_dim in HEAD_DIMS for dtype in DTYPES]
    count = max(len(SPLITS), len(combos))
    cases = [
        dict(
            prefix_lens=[MAX_PREFIX, 0, 17][: 1 + i % 3],  # batches of 1, 2, 3, 1, ...
            new_lens=[max_new, 1, min(3, max_new)][: 1 + i % 3],
            num_kv_heads=1 + i % 2,
            group=[1, 3, 4][i % 3],
            head_dim=combos[i % len(combos)][1],
            dtype=combos[i % len(combos)][0],
            seed=i,
            num_splits=SPLITS[i % len(SPLITS)],
        )
        for i in range(count)
    ]

    def decorate(test):
        for case in reversed(cases):
            test = example(case)(test)
        return test

    return decorate


def check_against_reference(mode: str, shape: dict) -> None:
    shape = dict(shape)  # an explicit example's dict is reused: leave it whole
    num_splits = shape.pop("num_splits")
    case = make_case(mode, **shape)
    ref_pool, tri_pool = clone_pool(case.pool), clone_pool(case.pool)
    ref_backend, tri_backend = TorchBackend(ref_pool), TritonBackend(tri_pool)
    ref = ref_backend.forward(0, case.q, case.k, case.v, ref_backend.plan(case.batch))
    metadata = tri_backend.plan(case.batch, num_splits=num_splits)
    assert metadata.mode == case.batch.mode
    out = torch.full_like(case.q, float("nan"))  # poison: every element must be written
    tri_backend.forward(0, case.q, case.k, case.v, metadata, out=out)
    assert not out.isnan().any(), "some output elements were never written"
    error = relative_error(out, ref)
    assert error < TOLERANCE[shape["dtype"]], f"relative error {error:.2e} for {shape}"
    assert torch.equal(tri_pool.k_cache[0], ref_pool.k_cache[0])
    assert torch.equal(tri_pool.v_cache[0], ref_pool.v_cache[0])


@SETTINGS
@covering_examples(max_new=1)
@given(shapes(max_new=1))
def test_decode_matches_reference(shape: dict) -> None:
    check_against_reference("decode", shape)


@SETTINGS
@covering_examples(max_new=MAX_NEW)
@given(shapes(max_new=MAX_NEW))
def test_extend_matches_reference(shape: dict) -> None:
    check_against_reference("extend", shape)


@SETTINGS
@covering_examples(max_new=MAX_TREE)
@given(shapes(max_new=MAX_TREE))
def test_verify_matches_reference(shape: dict) -> None:
    check_against_reference("verify", shape)


@pytest.mark.parametrize("mode", ["decode", "extend", "verify"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_zero_prefix_single_token(mode: str, group: int) -> None:
    """A request with no prefix and a single new token (its only key is itself)."""
    check_against_reference(
        mode,
        dict(
            prefix_lens=[0],
            new_lens=[1],
            num_kv_heads=1,
            group=group,
            head_dim=64,
            dtype=DTYPES[0],
            seed=group,
            num_splits=None,
        ),
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_splits_more_than_keys(head_dim: int) -> None:
    """More splits than key blocks: the empty splits must merge away without NaN."""
    check_against_reference(
        "decode",
        dict(
            prefix_lens=[3, 70, 0],
            new_lens=[1, 1, 1],
            num_kv_heads=2,
            group=4,
            head_dim=head_dim,
            dtype=DTYPES[-1],
            seed=7,
            num_splits=5,
        ),
    )


def test_rejects_unsupported_head_dim() -> None:
    case = make_case("decode", [4], [1], 1, 1, 64, DTYPES[0], seed=1)
    backend = TritonBackend(case.pool)
    metadata = backend.plan(case.batch)
    bad_q = case.q[:, :, :48].contiguous()
    with pytest.raises(ValueError, match="q must be"):
        backend.forward(0, bad_q, case.k, case.v, metadata)


def _extend_case(prefix, new, dim: int, seed: int, tma: bool, monkeypatch):
    """An extend case of 2 kv heads of 4 q heads in the last dtype; with `tma`, the
    descriptors read as Hopper reads them (the interpreter on a CPU), skipped on a GPU
    without tensor-memory loads."""
    if tma and not ON_CUDA:  # the interpreter reads the descriptors as Hopper's loads do
        monkeypatch.setattr(triton_extend, "tma_ready", lambda *tensors: True)
    case = make_case("extend", prefix, new, 2, 4, dim, DTYPES[-1], seed=seed)
    if tma and not triton_extend.tma_ready(case.q, case.k, case.v):
        pytest.skip("this GPU has no tensor-memory loads")
    return case


def _extend_direct(case):
    """(the reference output, and a function running the extend kernel itself on q, k, v
    with a config into a NaN-filled output) for an extend case, its new K/V in the pool."""
    ref_backend = TorchBackend(clone_pool(case.pool))
    ref = ref_backend.forward(0, case.q, case.k, case.v, ref_backend.plan(case.batch))
    meta = TritonBackend(case.pool).plan(case.batch)
    case.pool.k_cache[0].index_copy_(0, meta.out_slots, case.k)
    case.pool.v_cache[0].index_copy_(0, meta.out_slots, case.v)

    def run(q, k, v, config: dict, offsets: torch.dtype | None = None) -> torch.Tensor:
        """`offsets`: the requests' offsets in that dtype (a CUDA graph's are int64)."""
        out = torch.full_like(case.q, float("nan"))
        kv_indptr, qo_indptr, prefix_lens = (
            t if offsets is None else t.to(offsets)
            for t in (meta.kv_indptr, meta.qo_indptr, meta.prefix_lens)
        )
        triton_extend.extend_attention(
            q,
            k,
            v,
            case.pool.k_cache[0],
            case.pool.v_cache[0],
            meta.kv_indices,
            kv_indptr,
            qo_indptr,
            prefix_lens,
            out,
            meta.max_new_len,
            meta.max_seq_len,
            q.shape[-1] ** -0.5,
            config=config,
        )
        return out

    return ref, run


@pytest.mark.parametrize("sliced", [False, True])
def test_extend_tensor_memory_loads_match_pointer_loads(sliced: bool, monkeypatch) -> None:
    """Extend with the new tokens' q/K/V through TMA descriptors (config TMA=True; on a CPU
    in the interpreter, which reads them as Hopper does) equals the pointer loads and the
    reference, on ragged requests whose tiles run past their own tokens
    into the next request's (masked) and past the last token (zero-filled), with the
    requests' offsets in int32 (an eager pass's) or int64 (a CUDA graph's). `sliced`: q, k,
    v as views of one fused qkv tensor, the layout the model hands over."""
    prefix, new = [300, 0, 7, 64], [70, 129, 1, 64]
    case = make_case("extend", prefix, new, 2, 4, 128, DTYPES[-1], seed=27)
    q, k, v = case.q, case.k, case.v
    if sliced:
        fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = (
            part.unflatten(1, (-1, 128))
            for part in fused.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
        )
        assert not q.is_contiguous()
    if not ON_CUDA:  # the interpreter reads the descriptors as Hopper's loads do
        monkeypatch.setattr(triton_extend, "tma_ready", lambda *tensors: True)
    if not triton_extend.tma_ready(q, k, v):
        pytest.skip("this GPU has no tensor-memory loads")
    ref, run = _extend_direct(case)
    outs = {tma: run(q, k, v, {"TMA": tma}) for tma in (False, True)}
    assert relative_error(outs[True], ref) < TOLERANCE[DTYPES[-1]]
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-3, atol=1e-3)
    # a CUDA graph's offsets are int64: the descriptor loads take them as 32-bit rows
    wide = run(q, k, v, {"TMA": True}, offsets=torch.int64)
    torch.testing.assert_close(wide, outs[True], rtol=0, atol=0)


def test_extend_grid_orders_give_the_same_outputs() -> None:
    """Every order of the extend grid's axes (GRID_ORDER) gives the same bits and matches the
    reference, on ragged requests whose shorter ones own fewer q blocks than the grid has
    (those programs exit); an order that is not one of the axes' is refused. By default one
    request runs "hqr", several "qrh"."""
    assert extend_policy.grid_order(1) == "hqr" and extend_policy.grid_order(3) == "qrh"
    dtype = DTYPES[-1]
    case = make_case("extend", [40, 0, 7], [70, 9, 33], 2, 4, 64, dtype, seed=29)
    ref, run = _extend_direct(case)
    outs = {o: run(case.q, case.k, case.v, {"GRID_ORDER": o}) for o in ("qrh", "hqr", "rhq")}
    assert relative_error(outs["hqr"], ref) < TOLERANCE[dtype]
    for order, out in outs.items():
        torch.testing.assert_close(out, outs["hqr"], rtol=0, atol=0, msg=order)
    for bad in ("qr", "qrr", "qrhx"):
        with pytest.raises(ValueError, match="GRID_ORDER"):
            run(case.q, case.k, case.v, {"GRID_ORDER": bad})
        with pytest.raises(ValueError, match="GRID_ORDER"):  # a pass of no tokens too
            run(case.q[:0], case.k[:0], case.v[:0], {"GRID_ORDER": bad})


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("heads", [2, 4])
def test_extend_heads_a_program_match_one_head(heads: int, tma: bool, monkeypatch) -> None:
    """Extend with HEADS q heads of a kv head a program (their rows interleaved by token in
    one tile, the K/V blocks shared) equals one head a program and the reference, with
    pointer loads and through tensor-memory descriptors ([tokens, heads, dims] q tiles), on
    ragged requests whose tiles run past their own tokens. A HEADS that is not a power of
    two dividing the kv head's q heads is refused, naming what is allowed."""
    dtype = DTYPES[-1]
    case = _extend_case([40, 0, 7], [70, 9, 33], 64, 37, tma, monkeypatch)
    ref, run = _extend_direct(case)
    one = run(case.q, case.k, case.v, {"TMA": tma})
    packed = run(case.q, case.k, case.v, {"TMA": tma, "HEADS": heads})
    assert relative_error(packed, ref) < TOLERANCE[dtype]
    torch.testing.assert_close(packed, one, rtol=1e-3, atol=1e-3)
    for bad in (0, 3, 8, 2.0):
        with pytest.raises(ValueError, match=r"HEADS=.* must be a power of two dividing .*\(4\)"):
            run(case.q, case.k, case.v, {"TMA": tma, "HEADS": bad})
    with pytest.raises(ValueError, match="HEADS=3"):  # a pass of no tokens refuses it too
        run(case.q[:0], case.k[:0], case.v[:0], {"TMA": tma, "HEADS": 3})


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("heads, block_m", [(1, 32), (1, 64), (2, 32)])
def test_extend_diagonal_in_loop_matches_two_stages(
    heads: int, block_m: int, tma: bool, monkeypatch
) -> None:
    """Extend with the diagonal key blocks inside the new keys' loop (`DIAGONAL_IN_LOOP`: one
    pipelined loop, masked on its diagonal blocks by a uniform branch) equals the two loops
    (below the diagonal unmasked, then the diagonal) and the reference, with pointer loads and
    through tensor-memory descriptors, on ragged requests with and without a prefix, with
    tiles of one key block and of two."""
    dtype = DTYPES[-1]
    case = _extend_case([40, 0, 7], [70, 9, 33], 64, 41, tma, monkeypatch)
    ref, run = _extend_direct(case)
    config = {"TMA": tma, "HEADS": heads, "BLOCK_M": block_m, "BLOCK_N": 32}
    two = run(case.q, case.k, case.v, {**config, "DIAGONAL_IN_LOOP": False})
    one = run(case.q, case.k, case.v, {**config, "DIAGONAL_IN_LOOP": True})
    assert relative_error(one, ref) < TOLERANCE[dtype]
    torch.testing.assert_close(one, two, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("heads", [1, 2])
def test_extend_key_blocks_longer_than_tiles(heads: int, tma: bool, monkeypatch) -> None:
    """Key blocks longer than a tile's tokens (BLOCK_N = 2 x BLOCK_M, with the diagonal in
    the loop): a tile's diagonal block starts before its first token and is masked from the
    tile's first row on. Equals the reference and tiles as long as the key blocks, on ragged
    requests with and without a prefix; without the diagonal in the loop it is refused
    (stage 2a reads whole key blocks below the tile)."""
    dtype = DTYPES[-1]
    case = _extend_case([40, 0, 7], [70, 9, 33], 64, 43, tma, monkeypatch)
    ref, run = _extend_direct(case)
    config = {"TMA": tma, "HEADS": heads, "BLOCK_N": 32, "DIAGONAL_IN_LOOP": True}
    short = run(case.q, case.k, case.v, {**config, "BLOCK_M": 16})
    even = run(case.q, case.k, case.v, {**config, "BLOCK_M": 32})
    assert relative_error(short, ref) < TOLERANCE[dtype]
    torch.testing.assert_close(short, even, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="BLOCK_M=16 must be a multiple of BLOCK_N=32"):
        run(case.q, case.k, case.v, {**config, "BLOCK_M": 16, "DIAGONAL_IN_LOOP": False})


@pytest.mark.parametrize("tma", [False, True])
def test_extend_padded_pass_ignores_its_padding_tokens(tma: bool, monkeypatch) -> None:
    """A pass padded to a token count (`TritonBackend.plan(padded_num_tokens=...)`): the
    padding tokens' q/K/V hold whatever the layer before made of them (finite), and the
    requests' outputs equal the unpadded pass's; the padding rows' outputs are zeros (so
    that the next layer's padding K/V are finite: with tensor-memory loads the last
    request's diagonal tile reads them, masked, and 0 x NaN is NaN)."""
    case = _extend_case([5, 0, 37], [9, 20, 3], 128, 31, tma, monkeypatch)
    real, pad = case.q.shape[0], 13
    backend = TritonBackend(case.pool)
    meta = backend.plan(case.batch)
    padded_meta = backend.plan(case.batch, padded_num_tokens=real + pad)
    assert padded_meta.out_slots.shape[0] == real + pad
    generator = torch.Generator(device=case.q.device).manual_seed(5)

    def garbage_after(t):
        noise = torch.randn((pad, *t.shape[1:]), generator=generator, device=t.device)
        return torch.cat([t, (noise * 30).to(t.dtype)])

    def run(q, k, v, metadata):
        out = torch.full_like(q, float("nan"))
        with triton_config(tma):
            backend.forward(0, q, k, v, metadata, scale=128**-0.5, out=out)
        return out

    expected = run(case.q, case.k, case.v, meta)
    padded = run(*(garbage_after(t) for t in (case.q, case.k, case.v)), padded_meta)
    torch.testing.assert_close(padded[:real], expected, rtol=0, atol=0)
    assert not padded[real:].any()  # zeros, where the buffer held NaN


def triton_config(tma: bool):
    """The extend configs (the GPU's and the interpreter's) with tensor-memory loads on or
    off, for the block."""
    import contextlib

    @contextlib.contextmanager
    def switched():
        configs = (extend_policy.EXTEND_CONFIG, extend_policy.INTERPRETER_CONFIG)
        saved = [dict(config) for config in configs]
        for config in configs:
            config["TMA"] = tma
        try:
            yield
        finally:
            for config, before in zip(configs, saved, strict=True):
                config.clear()
                config.update(before)

    return switched()
