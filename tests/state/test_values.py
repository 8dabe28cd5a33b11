"""Property tests for the state values: SeqLens, FinishRules, SamplingParams, first_finish."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from state_builders import VOCAB, Rule, finish_rules, ref_finish, rules_strategy, running_of

from engine import state
from engine.state import FinishReason, FinishRules, SamplingParams, SeqLens, first_finish

fast = settings(max_examples=80, deadline=None)
lens_lists = st.lists(st.integers(0, 50), max_size=12)


@fast
@given(lens=lens_lists, data=st.data())
def test_seqlens_ops_match_python_lists(lens, data):
    seq = SeqLens(lens)
    assert seq.total == sum(lens) and len(seq) == len(lens) and seq.max == max(lens, default=0)
    assert not seq.lens.flags.writeable
    assert seq.indptr().tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert seq.starts().tolist() == seq.indptr().tolist()[:-1]
    assert seq.segment_ids().tolist() == [i for i, n in enumerate(lens) for _ in range(n)]
    assert seq.offsets_within().tolist() == [j for n in lens for j in range(n)]
    deltas = data.draw(st.lists(st.integers(0, 9), min_size=len(lens), max_size=len(lens)))
    grown = seq.grow(deltas)
    assert grown.tolist() == [a + b for a, b in zip(lens, deltas, strict=True)]
    assert grown.total == sum(lens) + sum(deltas) and seq.tolist() == lens
    assert seq.grow(3).total == seq.total + 3 * len(lens)
    assert (seq + SeqLens(deltas)) == grown
    picks = data.draw(st.lists(st.integers(0, max(len(lens) - 1, 0)), max_size=len(lens)))
    picks = picks if lens else []
    assert seq.select(picks).tolist() == [lens[i] for i in picks]  # [] included
    mask = data.draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))
    assert seq.select(np.array(mask, dtype=bool)).total == sum(
        n for n, m in zip(lens, mask, strict=True) if m
    )
    other = data.draw(lens_lists)
    joined = seq.concat(SeqLens(other))
    assert joined.tolist() == lens + other and joined.total == sum(lens) + sum(other)
    assert seq.lens_to("cpu").tolist() == lens


@fast
@given(lens=lens_lists, delta=st.integers(0, 9))
def test_seqlens_indptr_made_once_and_grow_by_an_int(lens, delta):
    seq = SeqLens(lens)
    indptr = seq.indptr()
    assert indptr is seq.indptr() and not indptr.flags.writeable
    assert indptr.tolist() == [0, *np.cumsum(lens, dtype=np.int64).tolist()]
    assert seq.grow(1).indptr().tolist() == SeqLens([n + 1 for n in lens]).indptr().tolist()
    by_int, by_array = seq.grow(delta), seq.grow(np.int64(delta))
    assert by_int == by_array and by_int.total == by_array.total
    assert by_int.lens.dtype == np.int64 and not by_int.lens.flags.writeable


def test_seqlens_rejects_negative_lengths_and_owns_its_array():
    with pytest.raises(ValueError, match=">= 0"):
        SeqLens([1, -1])
    with pytest.raises(ValueError, match=">= 0"):
        SeqLens([1, 2]).grow([-2, 0])
    source = np.array([1, 2, 3])
    seq = SeqLens(source)
    source[0] = 40
    assert seq.total == 6 and seq.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="read-only"):
        seq.lens[0] = 9
    with pytest.raises(AttributeError):
        seq.total = 5  # frozen: the total can never be set after construction


def test_finish_rules_select_concat_and_empty_stop_ids():
    assert len(finish_rules([])) == 0 and FinishRules([], [], [], []).stop_ids.shape == (0, 0)
    empty = FinishRules([5, 6], [0, 1], [2, -1], [])  # no stop ids for any request
    assert empty.stop_ids.shape == (2, 0)
    with_stops = FinishRules([7], [0], [1], [[3, 4, 5]])
    joined = empty.concat(with_stops)
    assert joined.stop_ids.tolist() == [[-1, -1, -1], [-1, -1, -1], [3, 4, 5]]
    assert joined.select(np.array([2, 0])).max_new.tolist() == [7, 5]
    with pytest.raises(ValueError, match="one entry per request"):
        FinishRules([1, 2], [0], [0, 0], np.zeros((2, 0)))


def test_finish_rules_of_stop_on_every_eos_id_unless_ignore_eos():
    """A model's other EOS ids (Qwen's <|endoftext|> beside <|im_end|>) join the stop ids;
    ignore_eos drops them with the EOS; repeats and the EOS itself are not added twice."""
    params = [
        SamplingParams(max_tokens=4, stop_token_ids=(9,)),
        SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,)),
        SamplingParams(max_tokens=4),
    ]
    rules = FinishRules.of(params, 2, (7, 2, 7, 5))
    assert rules.eos.tolist() == [2, -1, 2]
    assert rules.stop_ids.tolist() == [[9, 7, 5], [9, -1, -1], [7, 5, -1]]
    kept, reason = first_finish(
        np.array([[3, 5, 1], [5, 7, 9], [3, 7, 1]]),
        np.ones((3, 3), dtype=bool),
        np.zeros(3, dtype=int),
        np.full(3, 5),
        rules,
        100,
    )
    assert kept.tolist() == [2, 3, 2]
    assert reason.tolist() == [FinishReason.STOP] * 3


BAD_PARAMS = [
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.0),
    ("max_tokens", 0),
    ("max_tokens", 1.0),
    ("min_tokens", -1),
    ("min_tokens", 65),
    ("stop", [""]),
    ("stop", [3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS)
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: value})


def test_sampling_params_accept_good_values():
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        max_tokens=5,
        min_tokens=5,
        stop="END",
        stop_token_ids=[2, 7],
        ignore_eos=True,
        seed=3,
    )
    assert params.stop == ("END",) and params.stop_token_ids == (2, 7) and not params.greedy
    assert SamplingParams().greedy


@st.composite
def finish_cases(draw: st.DrawFn):
    size = draw(st.integers(1, 5))
    width = draw(st.integers(1, 6))
    rules = draw(st.lists(rules_strategy, min_size=size, max_size=size))
    tokens = draw(
        st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=width, max_size=width),
            min_size=size,
            max_size=size,
        )
    )
    valid = draw(st.lists(st.integers(0, width), min_size=size, max_size=size))
    num_output = draw(st.lists(st.integers(0, 20), min_size=size, max_size=size))
    token_lens = [n + draw(st.integers(1, 10)) for n in num_output]
    max_context = draw(st.integers(max(token_lens), max(token_lens) + 8))
    return rules, tokens, valid, num_output, token_lens, max_context


@settings(max_examples=150, deadline=None)
@given(case=finish_cases())
def test_first_finish_matches_the_reference(case):
    """EOS, stop ids, min_tokens, max_tokens and the context limit, token by token."""
    rules, tokens, valid, num_output, token_lens, max_context = case
    width = len(tokens[0])
    valid_mask = np.arange(width)[None, :] < np.array(valid)[:, None]
    kept, reason = first_finish(
        np.array(tokens),
        valid_mask,
        np.array(num_output),
        np.array(token_lens),
        finish_rules(rules),
        max_context,
    )
    for i, rule in enumerate(rules):
        want = ref_finish(tokens[i][: valid[i]], rule, num_output[i], token_lens[i], max_context)
        assert (int(kept[i]), FinishReason(int(reason[i]))) == want


def test_min_tokens_delays_eos_and_ignore_eos_disables_it():
    rules = finish_rules([Rule(10, 3, 1, ()), Rule(10, 0, -1, (1,)), Rule(10, 0, -1, ())])
    tokens = np.array([[1, 1, 1, 1]] * 3)
    kept, reason = first_finish(
        tokens, np.ones((3, 4), dtype=bool), np.zeros(3, dtype=int), np.full(3, 5), rules, 100
    )
    assert kept.tolist() == [3, 1, 4]
    assert reason.tolist() == [FinishReason.STOP, FinishReason.STOP, FinishReason.NONE]


def test_effects_without_emitted_tokens_read_as_empty():
    """Regression: Effects.emitted() raised on retract/finish/abort effects (no emissions)."""
    run = running_of([1], [0], [2], [3], [3], [1], [Rule(5, 0, -1, ())], 16)
    assert state.retract(run, [0]).effects.emitted() == {}
    assert state.abort(run, [0]).effects.emitted() == {}


def test_a_request_with_no_new_tokens_never_samples():
    """Regression: with all its tokens committed and a 0-token chunk, a request used to
    'sample' the logit row of the token before it (its neighbour's, or row -1)."""
    run = running_of([1, 2], [0, 1], [3, 1], [3, 3], [3, 3], [1, 1], [Rule(5, 0, -1, ())] * 2, 16)
    batch = state.schedule_extend(run, [0, 2], [4, 5], [7, 8])
    assert batch.samples.tolist() == [False, True]
    assert batch.logit_rows.tolist() == [1]
