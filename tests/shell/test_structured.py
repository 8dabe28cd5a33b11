"""Structured output on the default model: seeded samples under a JSON schema all validate,
with and without speculation; a regex, a Lark grammar and a choice constrain the output
exactly; greedy output under a grammar is the same with speculation; a grammar that cannot
finish ends with "length", one that is complete stops; specs that do not compile are refused
before anything is allocated."""

from __future__ import annotations

import json
import math
import re

import attrs
import jsonschema
import pytest
from engine_checks import settled

from engine import SamplingParams
from engine.errors import InvalidRequest
from engine.shell import grammar
from engine.shell.engine import Engine

ANIMAL = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["id", "kind", "point", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe an animal as JSON."}]
DOCUMENT = {"id": 42, "kind": "bird", "point": {"x": -3, "y": 7}, "tags": ["a", "c"]}
COPY = [
    {
        "role": "user",
        "content": "Repeat this JSON exactly: " + json.dumps(DOCUMENT, separators=(",", ":")),
    }
]


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    settings = dict(dtype="float32", device="cpu", max_running_requests=50)
    return {
        "plain": Engine(**settings),
        "speculative": Engine(**settings, speculative=True),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_fifty_seeded_samples_all_validate(engines: dict[str, Engine], kind: str) -> None:
    engine = engines[kind]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs={"json": ANIMAL})
        for i in range(50)
    ]
    outs = engine.generate([ASK] * 50, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), ANIMAL)
    assert len({out.text for out in outs}) > 10  # sampled, not one answer 50 times
    settled(engine)
    if kind == "plain":  # seeded: the same tokens alone as in a batch of 50
        alone = engine.generate([ASK] * 2, [params[7], params[31]])
        assert [a.token_ids for a in alone] == [outs[7].token_ids, outs[31].token_ids]


def test_greedy_under_a_schema_is_the_same_with_speculation(engines: dict[str, Engine]) -> None:
    params = SamplingParams(max_tokens=48, structured_outputs={"json": ANIMAL})
    plain = engines["plain"].generate(COPY, params)[0]
    spec = engines["speculative"].generate(COPY, params)[0]
    assert spec.token_ids == plain.token_ids
    assert plain.finish_reason == "stop"
    jsonschema.validate(json.loads(plain.text), ANIMAL)
    assert spec.speculation.accepted > 0  # drafts the grammar allowed were taken
    settled(engines["speculative"])


def test_a_regex_constrains_the_whole_output(default_engine: Engine) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outs = default_engine.generate(
        [ASK] * 4,
        [
            SamplingParams(
                max_tokens=16, temperature=1.0, seed=s, structured_outputs={"regex": pattern}
            )
            for s in range(4)
        ],
    )
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":  # the regex can go on (2 to 4 letters) or stop
            assert re.fullmatch(pattern, out.text), out.text
        else:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{0,4}", out.text)


def test_a_lark_grammar_constrains_the_whole_output(default_engine: Engine) -> None:
    grammar = 'start: "[" num ("," num)* "]"\nnum: /[0-9]{1,2}/\n'
    out = default_engine.generate(
        "Numbers: ", SamplingParams(max_tokens=24, structured_outputs={"grammar": grammar})
    )[0]
    if out.finish_reason == "stop":
        assert re.fullmatch(r"\[[0-9]{1,2}(,[0-9]{1,2})*\]", out.text), out.text
    else:
        assert re.fullmatch(r"\[[0-9]{1,2}(,[0-9]{1,2})*,?[0-9]{0,2}", out.text), out.text


def test_a_choice_returns_one_of_its_items(default_engine: Engine) -> None:
    choices = ["sunny", "rainy weather", "snow"]
    outs = default_engine.generate(
        [[{"role": "user", "content": "How is the weather?"}]] * 3,
        [
            SamplingParams(
                max_tokens=8, temperature=1.0, seed=s, structured_outputs={"choice": choices}
            )
            for s in range(3)
        ],
    )
    assert all(out.text in choices and out.finish_reason == "stop" for out in outs)


def test_a_complete_grammar_stops_even_where_eos_is_ignored(default_engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=20, ignore_eos=True, min_tokens=10, structured_outputs={"choice": ["yes"]}
    )
    out = default_engine.generate("Answer: ", params)[0]
    assert out.text == "yes" and out.finish_reason == "stop" and len(out.token_ids) < 10


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(
    default_engine: Engine,
) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]{40}"})
    out = default_engine.generate("Letters: ", params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert re.fullmatch("[a-z]+", out.text)


def test_a_stream_under_a_schema_adds_up_to_valid_json(default_engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, structured_outputs={"json": ANIMAL})
    deltas = list(default_engine.stream(ASK, params))
    assert deltas[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(d.text for d in deltas)), ANIMAL)


def test_logprobs_under_a_grammar_are_the_models_before_the_mask(default_engine: Engine) -> None:
    free = SamplingParams(max_tokens=3, logprobs=3)
    constrained = attrs.evolve(free, structured_outputs={"choice": ["Zebra crossing"]})
    out = default_engine.generate(ASK, constrained)[0]
    assert out.text == "Zebra crossing"
    for entry in out.logprobs:  # finite (no -inf for what the mask removed), unrenormalised
        assert math.isfinite(entry.logprob) and len(entry.top) == 3
        assert all(math.isfinite(value) for _, value in entry.top)
        assert entry.top[0][1] >= entry.logprob
    first = default_engine.generate(ASK, free)[0].logprobs[0]  # as without the grammar:
    assert [t for t, _ in out.logprobs[0].top] == [t for t, _ in first.top]
    pairs = zip(out.logprobs[0].top, first.top, strict=True)
    assert max(abs(a - b) for (_, a), (_, b) in pairs) < 1e-4


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "json"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_before_anything_runs(
    default_engine: Engine, spec: dict, field: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        default_engine.submit(ASK, SamplingParams(structured_outputs=spec))
    assert caught.value.field == f"structured_outputs.{field}"
    assert not default_engine.has_work and not default_engine.grammars


def test_random_weights_constrain_token_ids_as_bytes(assert_all_free) -> None:
    engine = Engine(random_weights="tiny", device="cpu", dtype="float32", max_context=64)
    pattern = rb"(red|green)-[0-9]{2}"
    outs = engine.generate(
        [[5, 6, 7]] * 3,
        [
            SamplingParams(
                max_tokens=12,
                temperature=1.0,
                seed=s,
                structured_outputs={"regex": pattern.decode()},
            )
            for s in range(3)
        ],
    )
    for out in outs:
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, bytes(t for t in out.token_ids if t != 2))
    assert_all_free(engine)


def test_greedy_rows_are_masked_only_where_their_grammar_refuses_the_models_token(
    monkeypatch,
) -> None:
    """A greedy constrained row draws its token without its mask and is masked only if its
    grammar refuses that token: the same tokens as masking first (a request that asks for
    logprobs is masked first), with a mask computed only for the refused tokens (every token
    checked first: no masked runs after a refusal)."""
    monkeypatch.setattr(grammar, "MASKED_FIRST_MAX", 0)
    settings = dict(random_weights="tiny", device="cpu", dtype="float32", max_context=64)
    pattern = r"[ -~]{6,10}"  # printable ASCII: some of what the model draws, not all
    prompts = [[5 + i, 6, 7 * i % 200] for i in range(6)]

    def run(logprobs: int | None) -> tuple[list[list[int]], Engine]:
        engine = Engine(**settings)
        params = SamplingParams(
            max_tokens=14, logprobs=logprobs, structured_outputs={"regex": pattern}
        )
        outs = engine.generate(prompts, params)
        for out in outs:
            text = bytes(t for t in out.token_ids if t != 2).decode()
            assert re.fullmatch(pattern, text) or out.finish_reason == "length", text
        settled(engine)
        return [out.token_ids for out in outs], engine

    checked, engine = run(None)
    masked_first, reference = run(0)
    assert checked == masked_first
    stats = engine.stats
    assert stats["grammar_tokens_checked"] == stats["generated_tokens"]
    assert 0 < stats["grammar_tokens_redrawn"] < stats["grammar_tokens_checked"]
    assert stats["grammar_masks"] == stats["grammar_tokens_redrawn"]
    assert reference.stats["grammar_masks"] == reference.stats["generated_tokens"]
    assert reference.stats["grammar_tokens_checked"] == 0


def test_a_greedy_copy_under_a_schema_needs_few_masks(engines: dict[str, Engine]) -> None:
    engine = engines["plain"]
    before = dict(engine.stats)
    params = SamplingParams(max_tokens=48, structured_outputs={"json": ANIMAL})
    out = engine.generate(COPY, params)[0]
    jsonschema.validate(json.loads(out.text), ANIMAL)
    masks = engine.stats["grammar_masks"] - before.get("grammar_masks", 0)
    checked = engine.stats["grammar_tokens_checked"] - before.get("grammar_tokens_checked", 0)
    first = engine.stats["grammar_tokens_masked_first"] - before.get(
        "grammar_tokens_masked_first", 0
    )
    assert checked + first == len(out.token_ids) and first < checked / 4
    assert masks < checked / 2  # the model copies what the schema allows


@pytest.mark.parametrize(
    "pattern", [r"(red|green)-[0-9]{2}( (red|green)-[0-9]{2}){2,6}\.", r"[ -~]{6,40}"]
)
def test_a_greedy_verify_masks_only_the_refused_tokens_of_its_paths(
    pattern: str, monkeypatch
) -> None:
    """All greedy, a verify pass checks the argmax along each tree's accepted path against
    its grammar and masks only the nodes that refuse theirs: the same tokens as without
    speculation (where every token is the masked argmax; every decode checked first)."""
    monkeypatch.setattr(grammar, "MASKED_FIRST_MAX", 0)
    settings = dict(random_weights="tiny", device="cpu", dtype="float32", max_context=256)
    prompt = list(b"red-12 green-34 red-12 green-34 red-12 green-34 red-12 green-")
    prompts = [prompt, prompt[3:], prompt[7:], list(b"abcabcabcabcabcabc")]
    params = SamplingParams(max_tokens=40, structured_outputs={"regex": pattern})
    plain = Engine(**settings).generate(prompts, params)
    engine = Engine(**settings, speculative=True, draft_budget=8)
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.spec.stats_dict()["spec_accepted_tokens_total"] > 0
    stats = engine.stats
    assert 0 < stats["grammar_tokens_redrawn"] <= stats["grammar_tokens_checked"]
    if pattern.startswith("[ -~]"):  # the model draws printable bytes too: not all redrawn
        assert stats["grammar_tokens_redrawn"] < stats["grammar_tokens_checked"]
    assert stats["grammar_masks"] == stats["grammar_tokens_redrawn"]  # no tree masked whole
    settled(engine)


def test_a_row_its_grammar_keeps_refusing_is_masked_first_in_growing_runs() -> None:
    """The tiny model almost never draws a digit: after each refused check but the first
    its row is masked first for 1, 2, 4, ... passes, so few tokens are checked (and drawn
    twice), and the tokens are those of masking every one first (a request with logprobs)."""
    settings = dict(random_weights="tiny", device="cpu", dtype="float32", max_context=64)
    prompts = [[5 + i, 6, 7 * i % 200] for i in range(3)]
    engines, outputs = {}, {}
    for logprobs in (None, 0):
        engines[logprobs] = engine = Engine(**settings)
        params = SamplingParams(
            max_tokens=40, logprobs=logprobs, structured_outputs={"regex": "[0-9]{30}"}
        )
        outputs[logprobs] = [o.token_ids for o in engine.generate(prompts, params)]
        settled(engine)
    assert outputs[None] == outputs[0]
    assert engines[0].stats["grammar_tokens_checked"] == 0  # logprobs: masked first
    stats = engines[None].stats
    tokens = stats["generated_tokens"]
    runs = 7  # per request: checks before runs of 0, 1, 2, 4, 8, 16 masked passes, one more
    assert stats["grammar_tokens_checked"] + stats["grammar_tokens_masked_first"] == tokens
    assert 0 < stats["grammar_tokens_redrawn"] <= stats["grammar_tokens_checked"] <= 3 * runs
