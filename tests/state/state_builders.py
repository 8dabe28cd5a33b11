"""Shared builders for the state-core tests: small Running values, random draft trees, a
plain-Python finish check, and a recorder that proves snapshots never change."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from hypothesis import strategies as st

from engine.state import FinishReason, FinishRules, Running, SeqLens

VOCAB = 8  # a tiny vocabulary so EOS and stop ids are hit often


@attrs.frozen
class Rule:
    """One request's finish rule, as plain Python."""

    max_new: int
    min_new: int
    eos: int  # -1: ignore EOS
    stops: tuple[int, ...]


rules_strategy = st.builds(
    lambda max_new, min_frac, eos, stops: Rule(max_new, min(max_new, min_frac), eos, stops),
    st.integers(1, 20),
    st.integers(0, 4),
    st.integers(-1, VOCAB - 1),
    st.lists(st.integers(0, VOCAB - 1), max_size=2, unique=True).map(tuple),
)


def finish_rules(rules: Sequence[Rule]) -> FinishRules:
    width = max((len(r.stops) for r in rules), default=0)
    stops = np.full((len(rules), width), -1, dtype=np.int64)
    for i, rule in enumerate(rules):
        stops[i, : len(rule.stops)] = rule.stops
    return FinishRules(
        [r.max_new for r in rules], [r.min_new for r in rules], [r.eos for r in rules], stops
    )


def ref_finish(
    tokens: Sequence[int], rule: Rule, num_output: int, token_len: int, max_context: int
) -> tuple[int, FinishReason]:
    """Append `tokens` one by one; (how many are kept, why the request stopped)."""
    for kept, token in enumerate(tokens, start=1):
        num_output += 1
        token_len += 1
        is_stop = (token == rule.eos and rule.eos >= 0) or token in rule.stops
        if is_stop and num_output >= rule.min_new:
            return kept, FinishReason.STOP
        if num_output >= rule.max_new or token_len >= max_context:
            return kept, FinishReason.LENGTH
    return len(tokens), FinishReason.NONE


def running_of(
    rids: Sequence[int],
    rows: Sequence[int],
    kv_lens: Sequence[int],
    token_lens: Sequence[int],
    prompt_lens: Sequence[int],
    last_tokens: Sequence[int],
    rules: Sequence[Rule],
    max_context: int,
) -> Running:
    return Running(
        rids,
        rows,
        SeqLens(kv_lens),
        SeqLens(token_lens),
        prompt_lens,
        last_tokens,
        finish_rules(rules),
        max_context,
    )


@st.composite
def tree_lists(draw: st.DrawFn, root: int, max_size: int = 8) -> tuple[list[int], list[int]]:
    """(tokens, parents) of one random draft tree rooted at `root`."""
    size = draw(st.integers(1, max_size))
    tokens = [root] + draw(
        st.lists(st.integers(0, VOCAB - 1), min_size=size - 1, max_size=size - 1)
    )
    parents = [-1] + [draw(st.integers(0, node - 1)) for node in range(1, size)]
    return tokens, parents


def random_tree(rng: np.random.Generator, root: int, size: int) -> tuple[list[int], list[int]]:
    tokens = [root] + rng.integers(0, VOCAB, size - 1).tolist()
    parents = [-1] + [int(rng.integers(0, node)) for node in range(1, size)]
    return tokens, parents


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Local node ids from the root's child down to `node` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def arrays_of(value: object, prefix: str = "") -> dict[str, np.ndarray]:
    """Every numpy array reachable through attrs fields (SeqLens, Running, Batch, Effects...),
    but caches (fields marked eq=False: filled when first asked, not part of the value)."""
    found: dict[str, np.ndarray] = {}
    if isinstance(value, np.ndarray):
        found[prefix] = value
    elif attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            if field.eq:
                found.update(arrays_of(getattr(value, field.name), f"{prefix}.{field.name}"))
    return found


class SnapshotRecorder:
    """Keeps the last `keep` snapshots with copies of their arrays; `check()` proves that
    none changed and all are read-only, and that every SeqLens total equals its sum."""

    def __init__(self, keep: int = 12) -> None:
        self.keep = keep
        self.kept: list[tuple[object, dict[str, np.ndarray]]] = []

    def record(self, *values: object) -> None:
        for value in values:
            arrays = arrays_of(value)
            self.kept.append((value, {name: a.copy() for name, a in arrays.items()}))
            check_totals(value)
        del self.kept[: -self.keep]

    def check(self) -> None:
        for value, saved in self.kept:
            arrays = arrays_of(value)
            assert arrays.keys() == saved.keys()
            for name, array in arrays.items():
                assert not array.flags.writeable, f"{type(value).__name__}{name} is writeable"
                assert np.array_equal(array, saved[name]), f"{type(value).__name__}{name} changed"
            check_totals(value)


def check_totals(value: object) -> None:
    """total == sum for every SeqLens reachable from `value`, and indptr ends at the total."""
    if isinstance(value, SeqLens):
        assert value.total == sum(value.tolist()), value
        assert int(value.indptr()[-1]) == value.total
        return
    if attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            check_totals(getattr(value, field.name))
