"""The fused split merge (the last split program of each request and kv head merges) against
the two-launch merge and a direct torch reference, on hand-built ragged inputs: requests with
no keys, padding requests with no queries, padding tokens past qo_indptr[-1]."""

from __future__ import annotations

import pytest
import torch
from backend_cases import DEVICE, DTYPES, TOLERANCE, relative_error

from engine.backends import BufferTooSmall
from engine.backends.decode_policy import FUSED_MERGE_MAX_SPLITS, MAX_SPLITS
from engine.backends.triton_decode import decode_attention
from engine.backends.triton_merge import (
    MERGE_VALUES_PER_THREAD,
    counters_needed,
    merge_counters,
    merge_tiles,
)

DTYPE = DTYPES[0]
HEAD_DIM = 32
NUM_KV_HEADS = 2
# (keys, queries) per request: a padding request (no keys, no queries), a request with a
# query and no keys (zero output), non-power-of-two lengths; then padding tokens.
DECODE_REQUESTS = [(37, 1), (0, 0), (90, 1), (0, 1), (5, 1)]
VERIFY_REQUESTS = [(37, 3), (0, 0), (50, 4), (2, 2)]
PADDING_TOKENS = 2


def make_inputs(mode: str, requests: list[tuple[int, int]], group: int, seed: int) -> dict:
    """decode_attention's inputs (verify: each request's queries are its last keys, a tree
    whose node i sees itself and a random set of earlier nodes)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [k for k, _ in requests]
    queries = [q for _, q in requests]
    num_tokens = sum(queries) + PADDING_TOKENS
    num_slots = sum(keys) + 1
    cache_shape = (num_slots, NUM_KV_HEADS, HEAD_DIM)
    bits = []
    for count in queries:
        for node in range(count):
            ancestors = int(torch.randint(0, 1 << node, (1,), generator=gen)) if node else 0
            bits.append((1 << node) | ancestors)
    bits += [0] * PADDING_TOKENS

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)

    def indptr(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)

    return dict(
        q=randn(num_tokens, NUM_KV_HEADS * group, HEAD_DIM),
        k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape),
        kv_indices=(torch.randperm(num_slots - 1, generator=gen) + 1).to(DEVICE, torch.int32),
        kv_indptr=indptr(keys),
        qo_indptr=indptr(queries),
        prefix_lens=torch.tensor(
            [k - q for k, q in requests] if mode == "verify" else [0] * len(requests),
            device=DEVICE,
        ),
        tree_bits=torch.tensor(bits, device=DEVICE) if mode == "verify" else None,
        max_q=max(queries) if mode == "verify" else 1,
    )


def reference(inputs: dict, mode: str) -> torch.Tensor:
    """Attention of every (token, q head) over its request's visible keys; zeros without."""
    q, k_cache, v_cache = (inputs[n].double() for n in ("q", "k_cache", "v_cache"))
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    kv_indptr, qo_indptr = inputs["kv_indptr"].tolist(), inputs["qo_indptr"].tolist()
    for req in range(len(kv_indptr) - 1):
        slots = inputs["kv_indices"][kv_indptr[req] : kv_indptr[req + 1]].long()
        prefix = int(inputs["prefix_lens"][req])
        for token in range(qo_indptr[req], qo_indptr[req + 1]):
            visible = torch.ones(slots.shape[0], dtype=torch.bool, device=q.device)
            if mode == "verify":
                bits = int(inputs["tree_bits"][token])
                for j in range(prefix, slots.shape[0]):
                    visible[j] = bool(bits >> (j - prefix) & 1)
            if not visible.any():
                continue
            for head in range(q.shape[1]):
                keys = k_cache[slots[visible], head // group]
                values = v_cache[slots[visible], head // group]
                weights = torch.softmax(keys @ q[token, head] * HEAD_DIM**-0.5, 0)
                out[token, head] = weights @ values
    return out


def run(inputs: dict, num_splits: int, config: dict, counters: torch.Tensor | None = None):
    out = torch.full_like(inputs["q"], float("nan"))  # poison: every element must be written
    args = {n: v for n, v in inputs.items() if n != "max_q"}
    decode_attention(
        **args,
        out=out,
        num_splits=num_splits,
        max_q=inputs["max_q"],
        sm_scale=HEAD_DIM**-0.5,
        config=config,
        counters=counters,
    )
    return out


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("group", [1, 4])
def test_fused_equals_two_launch_equals_reference(mode: str, num_splits: int, group: int):
    requests = DECODE_REQUESTS if mode == "decode" else VERIFY_REQUESTS
    inputs = make_inputs(mode, requests, group, seed=num_splits * 10 + group)
    ref = reference(inputs, mode)
    two_launch = run(inputs, num_splits, {"FUSED_MERGE": False})
    fused = run(inputs, num_splits, {"FUSED_MERGE": True})
    assert not fused.isnan().any(), "some output elements were never written"
    assert relative_error(two_launch, ref) < TOLERANCE[DTYPE]
    assert relative_error(fused, ref) < TOLERANCE[DTYPE]
    torch.testing.assert_close(fused, two_launch, rtol=1e-5, atol=1e-6)
    assert (fused[-PADDING_TOKENS:] == 0).all(), "padding tokens' outputs are zeros"


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("tile", [32, 256])
def test_fused_merge_in_chunks_and_row_blocks(mode: str, tile: int) -> None:
    """A merge tile too small for all of a program's rows and splits at once: the merge runs
    over blocks of rows and chunks of splits (one split a chunk at tile 32)."""
    requests = DECODE_REQUESTS if mode == "decode" else VERIFY_REQUESTS
    inputs = make_inputs(mode, requests, 4, seed=tile)
    ref = reference(inputs, mode)
    fused = run(inputs, 5, {"FUSED_MERGE": True, "MERGE_TILE": tile})
    assert relative_error(fused, ref) < TOLERANCE[DTYPE]
    assert (fused[-PADDING_TOKENS:] == 0).all()


def test_counters_are_zero_after_each_launch() -> None:
    """One counter buffer over two launches (as every layer and graph replay uses it): each
    launch leaves it at zero, so the second merges as the first did."""
    counters = merge_counters(len(DECODE_REQUESTS) + 3, NUM_KV_HEADS, torch.device(DEVICE))
    for seed in (1, 2):
        inputs = make_inputs("decode", DECODE_REQUESTS, 4, seed=seed)
        fused = run(inputs, 3, {"FUSED_MERGE": True}, counters)
        assert relative_error(fused, reference(inputs, "decode")) < TOLERANCE[DTYPE]
        assert (counters == 0).all(), f"counters left at {counters.tolist()}"


def test_counters_too_small_or_wrong_are_reported() -> None:
    inputs = make_inputs("decode", DECODE_REQUESTS, 1, seed=3)
    needed = counters_needed(len(DECODE_REQUESTS), NUM_KV_HEADS)
    short = torch.zeros(needed - 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(BufferTooSmall, match=f"merge counters hold {needed - 1} entries"):
        run(inputs, 2, {"FUSED_MERGE": True}, short)
    with pytest.raises(ValueError, match="must be int32"):
        run(inputs, 2, {"FUSED_MERGE": True}, short.new_zeros(needed, dtype=torch.int64))


def test_default_fuses_decode_up_to_the_split_limit() -> None:
    """Without a config, decode merges in the split kernel up to FUSED_MERGE_MAX_SPLITS
    splits (the counters are then checked: a short buffer is reported) and in a second
    launch beyond (the counters unused); verify always in a second launch."""
    inputs = make_inputs("decode", DECODE_REQUESTS, 1, seed=4)
    short = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for num_splits in (2, FUSED_MERGE_MAX_SPLITS):
        with pytest.raises(BufferTooSmall, match="merge counters hold 1 entries"):
            run(inputs, num_splits, {}, short)
    out = run(inputs, FUSED_MERGE_MAX_SPLITS + 1, {}, short)
    assert relative_error(out, reference(inputs, "decode")) < TOLERANCE[DTYPE]
    verify = make_inputs("verify", VERIFY_REQUESTS, 1, seed=5)
    out = run(verify, 2, {}, short)
    assert relative_error(out, reference(verify, "verify")) < TOLERANCE[DTYPE]
    assert (short == 0).all()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_warps", [2, 4])
def test_merge_tiles_fit_the_values_a_thread_holds(head_dim: int, num_warps: int) -> None:
    for block_s in (2, 8, MAX_SPLITS):
        for rows in (1, 4, 48):
            row_block, split_chunk = merge_tiles(block_s, rows, head_dim, num_warps)
            assert row_block * split_chunk * head_dim <= MERGE_VALUES_PER_THREAD * 32 * num_warps
            assert 1 <= split_chunk <= block_s and 1 <= row_block <= max(rows, 1) * 2
            assert split_chunk & (split_chunk - 1) == 0 and row_block & (row_block - 1) == 0


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("block_n", [16, 32])
def test_prefetched_key_blocks_give_the_same_attention(mode: str, num_splits: int, block_n: int):
    """PREFETCH (each whole block's K/V loaded before the products of the block before it,
    its slots a block earlier): the outputs of the loop without it and the reference, with
    splits of no whole block, one and several, merged in the kernel and apart."""
    requests = DECODE_REQUESTS if mode == "decode" else VERIFY_REQUESTS
    inputs = make_inputs(mode, requests, 4, seed=num_splits * 7 + block_n)
    ref = reference(inputs, mode)
    for fused in (False, True):
        config = {"FUSED_MERGE": fused, "BLOCK_N": block_n}
        plain = run(inputs, num_splits, config)
        ahead = run(inputs, num_splits, dict(config, PREFETCH=True))
        assert not ahead.isnan().any(), "some output elements were never written"
        assert relative_error(ahead, ref) < TOLERANCE[DTYPE]
        torch.testing.assert_close(ahead, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("fused", [False, True])
def test_attention_with_unwritten_scratch_is_exact(mode: str, fused: bool, monkeypatch) -> None:
    """The partials and log-sums start as NaN (what a graph's pool may hold from an earlier
    layer): the merge reads only what the split programs wrote, an empty split's log-sum
    and partial included. Splits past most requests' keys (8 of them over 0-90 keys),
    padding tokens, a request with no keys."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)  # the split kernel's scratch among them
    requests = DECODE_REQUESTS if mode == "decode" else VERIFY_REQUESTS
    inputs = make_inputs(mode, requests, 4, seed=12)
    out = run(inputs, 8, {"FUSED_MERGE": fused})
    assert not out.isnan().any(), "a NaN partial or log-sum reached the output"
    assert relative_error(out, reference(inputs, mode)) < TOLERANCE[DTYPE]
