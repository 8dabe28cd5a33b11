"""The sampling fields in the engine (default model, fp32): logprobs against HF's logits, with
and without speculation; n samples; penalties and biases in decode and verify passes alike;
seeded sampling with penalties whatever the batch; parameters that do not fit are refused."""

from __future__ import annotations

import pytest
import torch
from engine_checks import holds, settled

from engine import SamplingParams
from engine.errors import InvalidRequest
from engine.model import default_model_path
from engine.shell import prompt_scores

pytest.importorskip("accelerate")

PROMPT = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat."}]
COPY = "a b c d e f g h a b c d e f g h a b c d e f g h a b c d"


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _reference_logprobs(hf_model, completion) -> torch.Tensor:
    """HF's log-softmax at each output position: [len(output), vocab]."""
    ids = list(completion.prompt_token_ids) + list(completion.token_ids)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    start = len(completion.prompt_token_ids) - 1
    return torch.log_softmax(logits[start : start + len(completion.token_ids)], dim=-1)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_logprobs_equal_hf_log_softmax(make_engine, hf_model, speculative):
    engine = make_engine(speculative=speculative, draft_cost=0.1)
    params = SamplingParams(max_tokens=24, logprobs=3, ignore_eos=True)
    completions = engine.generate([PROMPT, COPY], params)
    for completion in completions:
        reference = _reference_logprobs(hf_model, completion)
        assert len(completion.logprobs) == len(completion.token_ids)
        for position, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            assert entry.token_id == token
            assert abs(entry.logprob - reference[position, token].item()) < 1e-4
            top_values, top_ids = reference[position].topk(3)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert (
                max(abs(v - r) for (_, v), r in zip(entry.top, top_values.tolist(), strict=True))
                < 1e-4
            )
    if speculative:  # the copy prompt's drafts were accepted: their logprobs were checked
        assert completions[1].speculation.accepted > 0
    settled(engine)


def test_streamed_logprobs_add_up_to_the_completions(default_engine):
    params = SamplingParams(max_tokens=10, logprobs=1)
    whole = default_engine.generate([PROMPT], params)[0]
    deltas = list(default_engine.stream(PROMPT, params))
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in streamed] == list(whole.token_ids)
    # the second run reads the prompt's KV from the prefix cache: equal up to rounding
    assert (
        max(abs(a.logprob - b.logprob) for a, b in zip(streamed, whole.logprobs, strict=True))
        < 1e-4
    )


def test_n_seeded_samples_are_reproducible_and_differ(default_engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4)
    first = default_engine.generate([PROMPT], params)
    again = default_engine.generate([PROMPT], params)
    assert len(first) == 4
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({c.token_ids for c in first}) > 1
    # sample 0 is the seed's own draw
    alone = default_engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    )
    assert alone[0].token_ids == first[0].token_ids
    with pytest.raises(InvalidRequest, match="n=4"):
        default_engine.submit(PROMPT, params)


PENALTIES = [
    dict(frequency_penalty=1.2),
    dict(presence_penalty=2.0),
    dict(repetition_penalty=1.6),
    dict(logit_bias=" dog"),  # a bias of 6 on the token " dog"
]


def test_penalties_change_greedy_output_the_same_with_and_without_speculation(make_engine):
    plain = make_engine()
    spec = make_engine(speculative=True, draft_cost=0.1)
    dog = plain.tokenizer.encode(" dog")[0]
    unpenalized = plain.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    accepted = 0
    for penalty in PENALTIES:
        if "logit_bias" in penalty:
            penalty = dict(logit_bias={dog: 6.0})
        params = SamplingParams(max_tokens=24, ignore_eos=True, **penalty)
        want = plain.generate([PROMPT], params)[0]
        got = spec.generate([PROMPT], params)[0]
        assert got.token_ids == want.token_ids, penalty
        assert want.token_ids != unpenalized.token_ids, penalty
        accepted += got.speculation.accepted
    assert accepted > 0  # verify passes applied them to accepted drafts too
    settled(plain)
    settled(spec)


def test_a_strong_bias_decides_every_token(default_engine):
    token = default_engine.tokenizer.encode(" sea")[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={token: 100})
    assert default_engine.generate([PROMPT], params)[0].token_ids == (token,) * 6


def test_seeded_sampling_with_penalties_does_not_depend_on_the_batch(default_engine):
    params = SamplingParams(
        max_tokens=16, temperature=0.9, seed=11, frequency_penalty=0.7, repetition_penalty=1.2
    )
    alone = default_engine.generate([PROMPT], params)[0]
    others = SamplingParams(max_tokens=20, temperature=1.0, presence_penalty=0.5)
    batched = default_engine.generate([COPY, PROMPT, "Hello"], [others, params, others])[1]
    assert batched.token_ids == alone.token_ids


def test_max_tokens_none_fills_the_context_and_too_many_are_refused(make_engine):
    engine = make_engine(max_context=64)
    ids = engine.tokenizer.encode("Count: one two three")
    done = engine.generate([ids], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(ids) + len(done.token_ids) == 64 and done.finish_reason == "length"
    with pytest.raises(InvalidRequest, match="leaves room for"):
        engine.submit(ids, SamplingParams(max_tokens=64 - len(ids) + 1))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.submit(ids, SamplingParams(max_tokens=8, logit_bias={10**7: 1.0}))
    settled(engine)


def test_the_stop_tokens_text_is_left_out_unless_included(default_engine):
    """As vLLM: a request stopped by a token (EOS, or one of stop_token_ids) keeps the token in
    its ids but not its text (the text ended with it before); `include_stop_str_in_output`
    keeps it, and a stop string too; `skip_special_tokens=False` spells special tokens."""
    free = default_engine.generate([PROMPT], SamplingParams(max_tokens=40))[0]
    stop_id = free.token_ids[4]
    tokenizer = default_engine.tokenizer

    def run(**fields):
        params = SamplingParams(**{"max_tokens": 40, "stop_token_ids": (stop_id,), **fields})
        return default_engine.generate([PROMPT], params)[0]

    cut, kept = run(), run(include_stop_str_in_output=True)
    assert cut.token_ids == kept.token_ids == free.token_ids[:5]
    assert cut.text == tokenizer.decode(free.token_ids[:4])
    assert kept.text == tokenizer.decode(free.token_ids[:5])
    assert free.finish_reason == "stop" and free.token_ids[-1] == tokenizer.eos_token_id
    spelled = run(skip_special_tokens=False, include_stop_str_in_output=True, stop_token_ids=())
    assert spelled.text == tokenizer.decode(free.token_ids, skip_special_tokens=False)
    assert spelled.text.endswith("<|im_end|>") and not free.text.endswith("<|im_end|>")
    word = tokenizer.decode(free.token_ids[2:4]).strip()
    by_string = default_engine.generate([PROMPT], SamplingParams(max_tokens=40, stop=(word,)))
    with_string = default_engine.generate(
        [PROMPT], SamplingParams(max_tokens=40, stop=(word,), include_stop_str_in_output=True)
    )
    assert with_string[0].text == by_string[0].text + word
    settled(default_engine)


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens"])
def test_the_text_options_take_bools(field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: 1})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(make_engine):
    """vLLM's left truncation: a prompt longer than the context runs on its last tokens, as
    those tokens alone would (refused without it)."""
    engine = make_engine(max_context=64)
    ids = [(7 * i) % 500 + 10 for i in range(100)]
    with pytest.raises(InvalidRequest, match="max_context is 64"):
        engine.generate([ids], SamplingParams(max_tokens=4))
    cut = engine.generate([ids], SamplingParams(max_tokens=4, truncate_prompt_tokens=20))[0]
    alone = engine.generate([ids[-20:]], SamplingParams(max_tokens=4))[0]
    assert cut.prompt_token_ids == tuple(ids[-20:]) and cut.token_ids == alone.token_ids
    streamed = list(engine.stream(ids, SamplingParams(max_tokens=4, truncate_prompt_tokens=20)))
    assert streamed[-1].prompt_token_ids == tuple(ids[-20:])
    with pytest.raises(ValueError, match="^truncate_prompt_tokens=0 is not allowed"):
        SamplingParams(truncate_prompt_tokens=0)
    settled(engine)


def _assert_prompt_logprobs_match(hf_model, completion, top: int) -> None:
    """A completion's prompt logprobs: None for the first token, then HF's log-softmax at the
    position before each prompt token, its rank and the `top` most likely there."""
    ids = list(completion.prompt_token_ids)
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    scores = completion.prompt_logprobs
    assert scores is not None and len(scores) == len(ids) and scores[0] is None
    for position in range(1, len(ids)):
        entry, row = scores[position], reference[position - 1]
        assert entry.token_id == ids[position]
        assert abs(entry.logprob - row[ids[position]].item()) < 1e-4
        assert entry.rank == int((row > row[ids[position]]).sum()) + 1
        values, top_ids = row.topk(top)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert (
            max(
                (abs(v - r) for (_, v), r in zip(entry.top, values.tolist(), strict=True)),
                default=0,
            )
            < 1e-4
        )


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_prompt_logprobs_equal_hf_in_chunks_beside_others_and_past_the_cache(
    make_engine, hf_model, speculative, monkeypatch
):
    """Every prompt token after the first is scored by the logits before it, whether the
    prompt prefills whole or in chunks beside other requests (a mixed pass), and though the
    prefix cache holds the prompt (a scored prompt is computed whole, then cached); the
    scores of a pass's rows computed a few rows at a time."""
    monkeypatch.setattr(prompt_scores, "SCORE_SLICE", 3)
    engine = make_engine(chunk_size=8, speculative=speculative, draft_cost=0.1)
    ids = engine.tokenizer.encode(COPY)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    scored = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    others = engine.generate([ids, PROMPT], plain)  # the prompt is in the cache now
    done = engine.generate([PROMPT, ids, "Hello there"], [plain, scored, scored])
    for completion in done[1:]:
        _assert_prompt_logprobs_match(hf_model, completion, 2)
    assert done[1].token_ids == others[0].token_ids[:6]
    assert done[0].prompt_logprobs is None and done[1].usage.cached_tokens == 0
    again = engine.generate([ids], plain)[0]  # the scored prompt entered the cache
    assert again.usage.cached_tokens > 0
    streamed = list(engine.stream(ids, SamplingParams(max_tokens=3, prompt_logprobs=0)))
    assert streamed[0].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in streamed[1:])
    first = streamed[0].prompt_logprobs
    assert [e.token_id for e in first[1:]] == ids[1:] and all(not e.top for e in first[1:])
    samples = engine.generate(
        [ids], SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=5, prompt_logprobs=1)
    )
    assert [c.prompt_logprobs for c in samples] == [samples[0].prompt_logprobs] * 3  # scored once
    _assert_prompt_logprobs_match(hf_model, samples[0], 1)
    with pytest.raises(ValueError, match="^prompt_logprobs=21 is not allowed"):
        SamplingParams(prompt_logprobs=21)
    settled(engine)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_allowed_token_ids_keep_only_those_tokens(make_engine, hf_model, speculative):
    """vLLM's allowed_token_ids: greedy picks the most likely allowed token at each step (HF's
    logits, the others set to -inf), in decode and verify passes alike; a token id outside
    the vocabulary, or none, is refused."""
    engine = make_engine(speculative=speculative, draft_cost=0.1)
    ids = engine.tokenizer.encode(COPY)
    allowed = sorted(set(ids[:6]))  # the copy prompt's words: drafts of them are proposed
    params = SamplingParams(max_tokens=10, ignore_eos=True, allowed_token_ids=allowed, logprobs=2)
    done = engine.generate([ids], params)[0]
    history = list(ids)
    for token, entry in zip(done.token_ids, done.logprobs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([history])).logits[0, -1].float()
        assert token == allowed[int(logits[allowed].argmax())]
        assert {t for t, _ in entry.top} <= set(allowed)
        history.append(token)
    if speculative:  # verify passes applied the mask to accepted drafts too
        assert done.speculation.accepted > 0
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        engine.submit(ids, SamplingParams(allowed_token_ids=[10**7]))
    with pytest.raises(ValueError, match="^allowed_token_ids=\\(\\) is not allowed"):
        SamplingParams(allowed_token_ids=[])
    # bad words that ban every allowed token leave nothing to draw: refused, not sampled
    words = [engine.tokenizer.decode([t]) for t in allowed]
    for banned in (dict(bad_word_ids=[[t] for t in allowed]), dict(bad_words=words)):
        with pytest.raises(
            InvalidRequest,
            match="^allowed_token_ids: each of its \\d+ tokens is a one-token bad word",
        ):
            engine.submit(ids, SamplingParams(allowed_token_ids=allowed, **banned))
    kept = SamplingParams(max_tokens=4, allowed_token_ids=allowed, bad_word_ids=[allowed[:1]])
    assert allowed[0] not in engine.generate([ids], kept)[0].token_ids
    settled(engine)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_bad_words_never_end_the_output(make_engine, speculative):
    """vLLM's bad_words: a token that would complete a bad word (as the tokenizer spells it
    alone or after a space) is never drawn; the output runs as without them up to there, and
    equally with speculation (verify passes ban per position)."""
    plain = make_engine()
    engine = plain if not speculative else make_engine(speculative=True, draft_cost=0.1)
    free = plain.generate([COPY], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    words = plain.tokenizer.decode(free.token_ids[2:4]).split()  # words it would write
    params = SamplingParams(max_tokens=16, ignore_eos=True, bad_words=words)
    want = plain.generate([COPY], params)[0]
    got = engine.generate([COPY], params)[0]
    assert got.token_ids == want.token_ids != free.token_ids
    for word in words:
        for spelled in (word, " " + word):
            ids = tuple(plain.tokenizer.encode(spelled, add_special_tokens=False))
            assert not holds(got.token_ids, ids)
    first = next(
        i for i, (a, b) in enumerate(zip(got.token_ids, free.token_ids, strict=True)) if a != b
    )
    assert first >= 2
    if speculative:
        assert got.speculation.accepted > 0
    with pytest.raises(ValueError, match="^bad_word_ids="):
        SamplingParams(bad_word_ids=[[]])
    with pytest.raises(InvalidRequest, match="bad_word_ids"):
        plain.submit(COPY, SamplingParams(bad_word_ids=[[10**7]]))
    settled(engine)
