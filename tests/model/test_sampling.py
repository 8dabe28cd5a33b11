"""Batched sampling: greedy is argmax, top-k/top-p filter exactly, seeds reproduce."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.sampling import (
    SamplingTensors,
    _filtered_logits,
    _uniform_bits,
    probs_for_verify,
    row_uniforms,
    sample,
    sample_from_probs,
    seeded_uniform,
)
from engine.state import SamplingParams

VOCAB = 50


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _tensors(params: list[SamplingParams], steps: list[int] | None = None) -> SamplingTensors:
    return SamplingTensors.build(params, steps or [0] * len(params), VOCAB)


def test_all_greedy_is_argmax():
    logits = _logits(6)
    sampling = _tensors([SamplingParams()] * 6)
    assert sampling.all_greedy
    assert torch.equal(sample(logits, sampling), logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = _logits(4)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.5, seed=3),
        SamplingParams(),
        SamplingParams(temperature=0.7),
    ]
    sampling = _tensors(params)
    assert not sampling.all_greedy
    tokens = sample(logits, sampling)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_k_one_is_greedy():
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=2.0, top_k=1, seed=i) for i in range(8)]
    for step in range(5):
        tokens = sample(logits, _tensors(params, [step] * 8))
        assert torch.equal(tokens, logits.argmax(-1))


def test_seeded_stream_is_reproducible_and_independent_of_the_batch():
    logits = _logits(3, seed=2)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[1:2], _tensors([seeded], [step])).item() for step in range(20)]
    others = [SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=0.5)]
    in_batch = [
        sample(logits, _tensors([others[0], seeded, others[1]], [7, step, 3]))[1].item()
        for step in range(20)
    ]
    assert alone == in_batch
    assert len(set(alone)) > 1  # steps advance the stream
    other_seed = [
        sample(logits[1:2], _tensors([SamplingParams(temperature=1.0, seed=99)], [step])).item()
        for step in range(20)
    ]
    assert other_seed != alone


def _four_token_logits() -> torch.Tensor:
    return torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))


def test_top_p_keeps_the_smallest_nucleus():
    probs = probs_for_verify(
        _four_token_logits(), torch.tensor([1.0]), torch.tensor([4]), torch.tensor([0.7])
    )
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    full = probs_for_verify(
        _four_token_logits(), torch.tensor([1.0]), torch.tensor([4]), torch.tensor([1.0])
    )
    torch.testing.assert_close(full, torch.tensor([[0.5, 0.3, 0.1, 0.1]]))


def test_top_p_samples_stay_in_the_nucleus_with_its_mass():
    draws = 4000
    logits = _four_token_logits().expand(draws, 4)
    sampling = SamplingTensors.build(
        [SamplingParams(temperature=1.0, top_p=0.7, seed=5)] * draws, list(range(draws)), 4
    )
    tokens = sample(logits, sampling)
    assert set(tokens.tolist()) == {0, 1}
    share = (tokens == 0).float().mean().item()
    sigma = math.sqrt(0.625 * 0.375 / draws)
    assert abs(share - 0.625) < 5 * sigma


def test_temperature_one_matches_softmax_frequencies():
    draws = 6000
    logits = _four_token_logits().expand(draws, 4)
    sampling = SamplingTensors.build(
        [SamplingParams(temperature=1.0, seed=11)] * draws, list(range(draws)), 4
    )
    counts = torch.bincount(sample(logits, sampling), minlength=4).float() / draws
    expected = torch.tensor([0.5, 0.3, 0.1, 0.1])
    sigma = torch.sqrt(expected * (1 - expected) / draws)
    assert ((counts - expected).abs() < 5 * sigma).all(), counts


def test_top_k_and_temperature_in_verify_probs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    probs = probs_for_verify(
        logits, torch.tensor([0.5, 0.0]), torch.tensor([2, 4]), torch.tensor([1.0, 1.0])
    )
    expected = torch.softmax(torch.tensor([4.0, 2.0]), dim=0)
    torch.testing.assert_close(probs[0, :2], expected)
    assert probs[0, 2:].abs().sum() == 0
    assert torch.equal(probs[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))  # greedy row: one-hot


def test_seeded_uniform_is_open_unit_interval_and_flat():
    seeds = torch.tensor([0, 1, 2**62 + 5])
    u = seeded_uniform(seeds, torch.tensor([0, 0, 123456]), 20000)
    assert u.shape == (3, 20000)
    assert (u > 0).all() and (u < 1).all()
    assert (u.mean(dim=1) - 0.5).abs().max() < 0.01
    assert not torch.equal(u[0], u[1])
    assert torch.equal(u, seeded_uniform(seeds, torch.tensor([0, 0, 123456]), 20000))


def test_a_seed_meeting_a_columns_hash_draws_no_extreme_uniform():
    """At step 0 a seed below 2**32 is its row key's input, and seed c * _COLUMN_SALT + 1
    met column c's hash (seed 1: column 0): the two xor to 0, which the finaliser keeps at
    0, a uniform of 2**-25 (it made seed 1's first token the vocabulary's first live one)."""
    from engine.model.sampling import _COLUMN_SALT, _MASK32

    seeds = torch.tensor([(c * _COLUMN_SALT + 1) & _MASK32 for c in range(4)])
    u = seeded_uniform(seeds, torch.zeros(4, dtype=torch.int64), 4)
    assert (u.diagonal() > 2**-20).all()
    assert (row_uniforms(seeds[:2].tolist(), [0, 0]) > 2**-20).all()


def test_row_uniforms_on_the_host_are_the_hashs_first_two_columns():
    """The host's numpy hash gives the torch hash's bits (seeded_uniform's, 24 a column)."""
    seeds, steps = [0, 1, 7, 2**62 + 5, 2**63 - 1], [0, 3, 0, 123456, 2**31]
    ticks = _uniform_bits(torch.tensor(seeds), torch.tensor(steps), torch.arange(2), 3)
    expected = ((ticks[:, 0] * 2**24 + ticks[:, 1]).double() + 0.5) / 2**48
    assert np.array_equal(row_uniforms(seeds, steps, salt=3), expected.numpy())


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**32)), min_size=1, max_size=40
    ),
    salt=st.integers(0, 2**20),
)
def test_row_uniforms_of_a_few_rows_hash_python_ints_to_the_same_bits(rows, salt):
    """Up to `_FEW_ROWS` rows are hashed as Python ints, more as numpy arrays: one value."""
    seeds, steps = [r[0] for r in rows], [r[1] for r in rows]
    bits = _uniform_bits(
        np.array(seeds, dtype=np.int64), np.array(steps, dtype=np.int64), np.arange(2), salt
    )
    expected = ((bits[:, 0] << 24) + bits[:, 1] + 0.5) / float(1 << 48)
    assert np.array_equal(row_uniforms(seeds, steps, salt), expected)


def test_sampling_inputs_at_other_steps_are_built_again():
    """`at_steps` keeps the filters and draws the uniforms `build` would at those steps."""
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1, top_p=0.5)]
    first = SamplingTensors.build(params, [0, 3], VOCAB, seeds=[11, 12])
    later = first.at_steps([11, 12], [1, 4])
    fresh = SamplingTensors.build(params, [1, 4], VOCAB, seeds=[11, 12])
    for field in attrs.fields(SamplingTensors):
        value, built = getattr(later, field.name), getattr(fresh, field.name)
        assert torch.equal(value, built) if isinstance(value, torch.Tensor) else value == built
    assert later.temperature is first.temperature
    with pytest.raises(ValueError, match="2 rows"):
        first.at_steps([11], [1])


def test_sampling_without_filters_skips_them_and_draws_the_same(monkeypatch):
    """No row sets top-k or top-p: the filter (a sort of every row) is skipped, and the
    tokens are those the filter with nothing to filter gives."""
    logits = _logits(6, seed=4)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0.5, 1, 2, 1, 0, 1])]
    from engine.model import sampling as module

    filters = []
    for name in ("_filtered_by_sorting", "_filtered_among_candidates"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, f=original: filters.append(1) or f(*a))
    for step in range(30):
        sampling = _tensors(params, [step] * 6)
        assert not sampling.filtered
        unfiltered = sample(logits, sampling)
        assert not filters  # skipped
        assert torch.equal(unfiltered, sample(logits, attrs.evolve(sampling, filtered=True)))
        assert filters
        filters.clear()
    assert _tensors([SamplingParams(temperature=1.0, top_p=0.9)]).filtered
    assert _tensors([SamplingParams(temperature=1.0, top_k=VOCAB - 1)]).filtered
    assert not _tensors([SamplingParams(temperature=1.0, top_k=VOCAB)]).filtered


def test_top_p_one_keeps_every_token_where_fp32_mass_rounds_up():
    """One token holds all but ~1e-10 of the mass: in fp32 the others' mass before them is
    1.0, and `mass_before < top_p` dropped them at top-p 1 (another row filtering, so the
    batch goes through the filter)."""
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0
    filtered = _filtered_logits(
        logits, torch.ones(2), torch.tensor([1000, 1000]), torch.tensor([1.0, 0.5])
    )
    assert torch.isfinite(filtered[0]).all()
    assert torch.isfinite(filtered[1]).sum() == 1


@pytest.mark.parametrize("batch_seed", [0, 1, 2])
def test_the_cpu_filter_among_candidates_keeps_what_sorting_keeps(batch_seed, monkeypatch):
    """A 49k vocabulary with peaked rows: the 1024 largest logits decide top-k and top-p,
    mixed rows included, and keep the tokens a sort of the whole row keeps. A row they do
    not decide (top-k 2000; a flat row whose candidates hold less than top-p) is sorted."""
    from engine.model import sampling

    generator = torch.Generator().manual_seed(batch_seed)
    vocab = 49152
    logits = torch.randn(6, vocab, generator=generator) * 8
    logits[5] = torch.randn(vocab, generator=generator)  # flat: 1024 hold < 0.9 of the mass
    top_k = torch.tensor([vocab, 50, 40, vocab, 2000, vocab])
    top_p = torch.tensor([0.9, 1.0, 0.8, 1.0, 1.0, 0.9])
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 1.0])
    sorted_rows = []
    by_sorting = sampling._filtered_by_sorting
    monkeypatch.setattr(
        sampling,
        "_filtered_by_sorting",
        lambda s, k, p: sorted_rows.append(len(s)) or by_sorting(s, k, p),
    )
    fast = _filtered_logits(logits, temperature, top_k, top_p)
    assert sorted_rows == [2]  # rows 4 and 5 only
    monkeypatch.setattr(sampling, "_CANDIDATES", vocab)  # no row has more: always sorted
    slow = _filtered_logits(logits, temperature, top_k, top_p)
    assert sorted_rows == [2, 6]
    assert torch.equal(torch.isfinite(fast), torch.isfinite(slow))
    assert torch.isfinite(fast[3]).all() and torch.isfinite(fast[1]).sum() == 50
    assert torch.isfinite(fast[4]).sum() == 2000
    torch.testing.assert_close(fast[torch.isfinite(fast)], slow[torch.isfinite(slow)])


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.0, 0.5, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
            [1e-30, 0.0, 1.0, 0.0, 0.0, 0.0],
        ]
    ).repeat(2000, 1)
    rows = probs.shape[0]
    tokens = sample_from_probs(probs, torch.from_numpy(row_uniforms(range(rows), [0] * rows)))
    assert (probs[torch.arange(rows), tokens] > 0).all()
    first = tokens[0::3]
    assert set(first.tolist()) == {1, 4}
    assert abs((first == 1).float().mean().item() - 0.5) < 5 * math.sqrt(0.25 / 2000)


def test_build_clamps_top_k_and_checks_lengths():
    sampling = SamplingTensors.build([SamplingParams(top_k=10**6), SamplingParams()], [0, 0], 7)
    assert sampling.top_k.tolist() == [7, 7]
    with pytest.raises(ValueError, match="step counters"):
        SamplingTensors.build([SamplingParams()], [0, 1], 7)


def test_greedy_tokens_is_argmax_and_takes_the_first_of_tied_maxima():
    from engine.model.sampling import greedy_tokens

    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    assert greedy_tokens(logits).tolist() == [1, 0, 2] == logits.argmax(-1).tolist()
    wide = torch.randn(8, 49152, generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))


def test_a_pick_that_lands_on_a_dead_token_falls_back_to_the_most_likely():
    """Out-of-order prefix sums (a device's parallel scan) are simulated by a uniform of 1
    (beyond the last live token): the row's most likely token is taken, never a dead one."""
    probs = torch.tensor([[0.2, 0.7, 0.1, 0.0, 0.0]])
    assert sample_from_probs(probs, torch.tensor([1.0], dtype=torch.float64)).item() == 1
    assert sample_from_probs(probs, torch.tensor([0.5], dtype=torch.float64)).item() == 1
    assert sample_from_probs(probs, torch.tensor([0.95], dtype=torch.float64)).item() == 2


# --- bias and penalties (checked on the logits), min_p, logprobs -------------------------------
def test_logits_edit_applies_bias_then_repetition_then_frequency_and_presence():
    from engine.model.logits_edit import LogitsEdit

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplingParams(
        logit_bias={4: 1.5},
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    seen = np.array([0, 1, 4])  # prompt and output tokens, once each
    output = np.array([1, 4, 4])  # token 1 once, token 4 twice
    edited = LogitsEdit.of([(params, seen, output)]).apply(logits)
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # seen, positive: divided
                -1.0 * 2 - (0.5 * 1 + 0.25),  # seen, negative: multiplied; once in the output
                0.5,  # never seen
                3.0,
                (1.0 + 1.5) / 2 - (0.5 * 2 + 0.25),  # biased, then seen, then twice in the output
            ]
        ]
    )
    torch.testing.assert_close(edited, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]]))  # a new tensor
    untouched = LogitsEdit.of([(SamplingParams(), seen, output)]).apply(logits)
    assert torch.equal(untouched, logits)


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probs_for_verify(
        logits, torch.tensor([1.0]), torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.25])
    )
    # 0.25 * 0.5 = 0.125: 0.05 goes, 0.15 stays
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_logprobs_are_the_log_softmax_at_the_drawn_token_with_the_top_alternatives():
    from engine.model.sampling import Logprobs

    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    values = Logprobs.of(logits, torch.tensor([2, 0]), 2)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(values.chosen, reference[[0, 1], [2, 0]])
    assert values.top_ids.tolist() == [[1, 2], [2, 0]]
    torch.testing.assert_close(values.top_values, reference.gather(1, values.top_ids))
    assert values.ranks.tolist() == [2, 2]  # 2.0 after 3.0; 0.0 after 5.0 (ties share 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_edit_and_the_logprobs_rows_reach_the_device_without_waiting_for_it():
    # A copy from pageable memory waits for every queued kernel: the edit and the logprobs
    # rows are built after the pass is launched, and such a wait put the whole host work of
    # the next step (planned during the pass) behind the pass (0.73x throughput on an H200).
    from engine.model.logits_edit import LogitsEdit
    from engine.model.sampling import host_to_device

    logits = torch.randn(4, 1000, device="cuda")
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 1.0})
    rows = [(params, np.arange(5), np.arange(3))] * 4
    pending = torch.tensor([1, 7, 2, 2], device="cuda")  # a launched-ahead pass's input ids
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        edited = LogitsEdit.of(rows, "cuda").apply(logits)
        index = host_to_device(np.array([0, 2], dtype=np.int64), "cuda")
        edited.index_select(0, index)
        LogitsEdit.of(rows, "cuda", pending).apply(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_filtered_draw_never_asks_the_device_whether_a_row_sets_min_p():
    # `bool((min_p > 0).any())` read the device each sampled step with a filter
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, min_p=0.05, seed=2),
    ]
    logits = torch.randn(2, 1000, device="cuda")
    sampling = SamplingTensors.build(params, [0, 0], 1000, "cuda")
    sample(logits, sampling)  # compiled and cached before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, sampling)
        sample(logits, attrs.evolve(sampling, uses_min_p=False))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@st.composite
def edited_rows(draw):
    """Rows of (params, seen, output) over a vocabulary of 12, and a pending token each."""
    vocab, rows, pending = 12, [], []
    for _ in range(draw(st.integers(1, 5))):
        bias = draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-3, 3), max_size=2))
        params = SamplingParams(
            logit_bias=bias,
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.3])),
            presence_penalty=draw(st.sampled_from([0.0, 0.25, 1.1])),
        )
        output = np.array(draw(st.lists(st.integers(0, vocab - 1), max_size=6)), dtype=np.int64)
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        seen = np.union1d(np.array(prompt, dtype=np.int64), output)
        rows.append((params, seen, output))
        pending.append(draw(st.integers(0, vocab - 1)))
    return rows, pending


@settings(max_examples=200, deadline=None)
@given(case=edited_rows(), data=st.data())
def test_an_edit_with_a_pending_token_is_the_edit_of_its_history_with_it(case, data):
    """A pass launched before the running pass's tokens are read edits its logits from
    histories one token short, that token on the device: bit for bit the edit of the
    histories with it (seen or not, in the output or not)."""
    from engine.model.logits_edit import LogitsEdit

    rows, pending = case
    logits = torch.tensor(
        data.draw(
            st.lists(st.floats(-4, 4, width=32), min_size=12 * len(rows), max_size=12 * len(rows))
        )
    ).reshape(len(rows), 12)
    full = [
        (params, np.union1d(seen, [token]), np.append(output, token))
        for (params, seen, output), token in zip(rows, pending, strict=True)
    ]
    expected = LogitsEdit.of(full).apply(logits)
    got = LogitsEdit.of(rows, pending=torch.tensor(pending)).apply(logits)
    assert torch.equal(got, expected)
