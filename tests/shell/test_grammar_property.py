"""Masks never block the only way on: over random small JSON schemas, a walk that draws each
token at random among those its mask allows (on the byte vocabulary and the default model's)
always has a token to draw, reaches the end of its grammar, and its output validates."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.tokenizer import load_tokenizer
from engine.shell.grammar import Grammars, Progress
from engine.state import StructuredOutputs

MAX_STEPS = 400  # bounded schemas end well before this: compact JSON, short strings

NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
LEAVES = st.one_of(
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),
    st.lists(
        st.text(alphabet="xyz _", min_size=1, max_size=4), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
    st.just({"type": "boolean"}),
    st.integers(0, 4).map(lambda most: {"type": "string", "maxLength": most}),
)


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    def with_required(properties: dict) -> st.SearchStrategy:
        return st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            }
        )

    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(with_required)


def _arrays(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(
        lambda items, most: {"type": "array", "items": items, "maxItems": most},
        children,
        st.integers(0, 3),
    )


SCHEMAS = st.recursive(LEAVES, lambda c: st.one_of(_objects(c), _arrays(c)), max_leaves=6)


@pytest.fixture(scope="module")
def vocabularies() -> dict[str, Grammars]:
    tokenizer = load_tokenizer()
    return {
        "bytes": Grammars(None, 256, 2),
        "default model": Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_id),
    }


def _walk(book: Grammars, schema: dict, seed: int) -> bytes:
    """Draw tokens at random among those each mask allows until the grammar is complete."""
    rng = np.random.default_rng(seed)
    book.add(0, StructuredOutputs(json=schema))
    tokens: list[int] = []
    try:
        for _ in range(MAX_STEPS):
            bits = np.unpackbits(book.masks([0]).view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: book.vocabulary.vocab_size])
            assert allowed.size, f"no token allowed after {tokens}"
            token = int(rng.choice(allowed))
            progress = book.advance(0, [token])
            assert progress is not Progress.REJECTED, book.error(0)
            if progress is Progress.COMPLETE:
                return book.vocabulary.decode_bytes(
                    [t for t in tokens + [token] if t != book.eos_id]
                )
            tokens.append(token)
        raise AssertionError(f"the grammar did not end in {MAX_STEPS} tokens: {tokens}")
    finally:
        book.remove(0)


@pytest.mark.parametrize("vocabulary", ["bytes", "default model"])
@settings(max_examples=60)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_every_random_walk_under_a_schema_ends_valid(
    vocabularies: dict[str, Grammars], vocabulary: str, schema: dict, seed: int
) -> None:
    output = _walk(vocabularies[vocabulary], schema, seed)
    jsonschema.validate(json.loads(output.decode()), schema)
