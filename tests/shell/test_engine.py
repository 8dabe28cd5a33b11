"""End-to-end behaviour of the Engine on the default model (CPU, fp32, greedy)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from engine.state import SamplingParams

GREEDY_16 = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village near the mountains, there lived an old baker who",
    "Rain",
    [{"role": "user", "content": "List three colors."}],
]


def test_batch_equals_each_prompt_alone(default_engine, assert_all_free):
    batched = default_engine.generate(PROMPTS, GREEDY_16)
    for prompt, together in zip(PROMPTS, batched, strict=True):
        alone = default_engine.generate([prompt], GREEDY_16)[0]
        assert alone.token_ids == together.token_ids
        assert alone.text == together.text
    assert_all_free(default_engine)


def test_results_come_back_in_input_order_with_usage(default_engine):
    results = default_engine.generate(
        PROMPTS[:2],
        [
            SamplingParams(max_tokens=3, ignore_eos=True),
            SamplingParams(max_tokens=5, ignore_eos=True),
        ],
    )
    assert [len(r.token_ids) for r in results] == [3, 5]
    assert [r.finish_reason for r in results] == ["length", "length"]
    for result in results:
        assert result.usage.completion_tokens == len(result.token_ids)
        assert result.usage.prompt_tokens == len(result.prompt_token_ids) > 0


def test_retraction_keeps_outputs_and_frees_every_slot(
    default_engine, make_engine, assert_all_free
):
    reference = default_engine.generate(PROMPTS, GREEDY_16)
    # Each request alone fits in 64 slots (at most 34 + 16 tokens); together they do not.
    tiny = make_engine(kv_cache_slots=64, max_running_requests=4)
    outputs = tiny.generate(PROMPTS, GREEDY_16)
    assert tiny.stats["retractions"] > 0, "the pool was meant to force retraction"
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert_all_free(tiny)


def test_chunked_prefill_matches_whole_prefill(default_engine, make_engine):
    reference = default_engine.generate(PROMPTS, GREEDY_16)
    chunked = make_engine(chunk_size=5).generate(PROMPTS, GREEDY_16)
    assert [o.token_ids for o in chunked] == [r.token_ids for r in reference]


def test_abort_mid_generation_frees_every_slot(default_engine, assert_all_free):
    engine = default_engine
    engine.submit(PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))
    drop = engine.submit(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.book.slots.num_free < engine.book.slots.capacity
    dropped = engine.by_request_id[drop]
    engine.abort(drop)
    engine.step()
    assert dropped.finish_reason.openai == "abort"
    assert 0 < len(dropped.output_ids) < 50
    engine.check()
    while engine.has_work:
        engine.step()
    assert_all_free(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 2, 10**9], {}, "prompt"),
        ([5] * 9000, {}, "prompt"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"temperature": -0.5}, "temperature"),
        ("hi", {"top_p": 0}, "top_p"),
        ([{"role": "user"}], {}, "messages[0]"),
    ],
)
def test_bad_input_is_rejected_and_the_engine_keeps_serving(
    default_engine, assert_all_free, prompt, params, field
):
    engine = default_engine
    good = engine.submit("The quick brown fox", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    request = engine.by_request_id[good]
    with pytest.raises(InvalidRequest) as info:
        engine.submit(prompt, params)
    assert info.value.field == field
    assert str(info.value)
    while engine.has_work:
        engine.step()
    assert good not in engine.by_request_id
    assert len(request.output_ids) == 4 and request.finish_reason.openai == "length"
    assert_all_free(engine)


def test_stream_equals_generate_and_stop_strings_cut_text(default_engine, assert_all_free):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    whole = default_engine.generate([PROMPTS[1]], params)[0]
    streamed = list(default_engine.stream(PROMPTS[1], params))
    assert "".join(d.text for d in streamed) == whole.text
    assert tuple(t for d in streamed for t in d.token_ids) == whole.token_ids
    assert streamed[-1].finish_reason == "length" and streamed[-1].usage is not None
    # the first delta's usage so far: the prompt's tokens and those sent with it; none between
    first = streamed[0].usage
    assert first.prompt_tokens == whole.usage.prompt_tokens
    assert first.completion_tokens == len(streamed[0].token_ids)
    assert all(d.usage is None for d in streamed[1:-1])
    # A stop string taken from the middle of the text ends the request there, text cut.
    stop = whole.text[len(whole.text) // 2 :][:4]
    cut = default_engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and whole.text.startswith(cut.text)
    streamed_cut = list(
        default_engine.stream(PROMPTS[1], SamplingParams(max_tokens=24, stop=[stop]))
    )
    assert "".join(d.text for d in streamed_cut) == cut.text
    assert_all_free(default_engine)


def test_seeded_sampling_is_reproducible(default_engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    first = default_engine.generate([PROMPTS[0], PROMPTS[2]], params)
    second = default_engine.generate([PROMPTS[2], PROMPTS[0]], params)
    assert first[0].token_ids == second[1].token_ids
    assert first[1].token_ids == second[0].token_ids
    greedy = default_engine.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=12))
    other_seed = default_engine.generate(
        [PROMPTS[0], PROMPTS[2]],
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=4321),
    )
    sampled = [r.token_ids for r in first]
    assert sampled != [r.token_ids for r in greedy]  # the temperature is applied
    assert sampled != [r.token_ids for r in other_seed]  # and the seed matters


def test_sampling_inputs_of_the_same_requests_again_are_those_built_afresh(default_engine):
    """The runtime keeps the last pass's filters: the same requests at their next steps get
    the inputs `SamplingTensors.build` makes (an unseeded request: the engine's seed for
    it), and other rows get their own."""
    import attrs
    import numpy as np
    import torch

    from engine.model.sampling import SamplingTensors

    runtime = default_engine.runtime
    first = [SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=1, seed=5)]
    uids = np.array([101, 102])
    for params, rows, steps in [
        (first, uids, [0, 0]),
        (first, uids, [1, 3]),  # the same requests: only the uniforms are new
        (first[::-1], uids[::-1], [4, 2]),  # other rows: built again
    ]:
        seeds = [
            p.seed if p.seed is not None else runtime._seed(u)
            for p, u in zip(params, rows.tolist(), strict=True)
        ]
        expected = SamplingTensors.build(params, steps, runtime.vocab_size, runtime.device, seeds)
        got = runtime.sampling_inputs(params, rows, steps)
        for field in attrs.fields(SamplingTensors):
            value, want = getattr(got, field.name), getattr(expected, field.name)
            assert torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want


def test_stop_token_ids_and_eos(default_engine):
    free_run = default_engine.generate([PROMPTS[1]], GREEDY_16)[0]
    stop_id = free_run.token_ids[5]
    stopped = default_engine.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(stop_id,))
    )[0]
    first = free_run.token_ids.index(stop_id)
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_a_stop_string_on_the_last_allowed_token_reports_stop(default_engine):
    """max_tokens and a stop string on the same step: the text is cut, so the reason is stop."""
    whole = default_engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    last_piece = whole.text[-3:]
    assert last_piece.strip(), "the last token's text is needed as the stop string"
    cut = default_engine.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True, stop=[last_piece])
    )[0]
    assert cut.finish_reason == "stop"
    assert len(cut.token_ids) == 12  # the stop fell on the last allowed token
    assert last_piece not in cut.text
