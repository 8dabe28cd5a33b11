"""Sampling parameters: one frozen, validated value per request."""

from __future__ import annotations

from collections.abc import Iterable

import attrs


def check_field(field: str, value: object, ok: bool, allowed: str) -> None:
    """Raise ValueError naming the field, its value and what is allowed, unless `ok`."""
    if not ok:
        raise ValueError(f"{field}={value!r} is not allowed; {field} must be {allowed}")


def _as_tuple(value: object) -> object:
    """A string or an iterable as a tuple; anything else is kept for the validator to name."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        return value
    try:
        return tuple(value)
    except TypeError:  # e.g. a 0-d array: iterable by type, not by value
        return value


def is_int(value: object) -> bool:
    """An int that is not a bool (True is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@attrs.frozen
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy. top_k -1 keeps every token. Stop strings are matched on the
    produced text by the engine; stop token ids and EOS are checked by the state core.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    min_tokens: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        t = self.temperature
        check_field(
            "temperature",
            t,
            isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0,
            "a number >= 0 (0 means greedy)",
        )
        p = self.top_p
        check_field(
            "top_p",
            p,
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1,
            "in (0, 1]",
        )
        k = self.top_k
        check_field(
            "top_k", k, is_int(k) and (k == -1 or k >= 1), "-1 (disabled) or an integer >= 1"
        )
        m = self.max_tokens
        check_field("max_tokens", m, is_int(m) and m >= 1, "an integer >= 1")
        n = self.min_tokens
        check_field(
            "min_tokens", n, is_int(n) and 0 <= n <= m, f"an integer in [0, max_tokens={m}]"
        )
        check_field(
            "stop",
            self.stop,
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            "a list of non-empty strings",
        )
        ids = self.stop_token_ids
        check_field(
            "stop_token_ids",
            ids,
            isinstance(ids, tuple) and all(is_int(i) and i >= 0 for i in ids),
            "a list of integers >= 0",
        )
        check_field("ignore_eos", self.ignore_eos, isinstance(self.ignore_eos, bool), "a bool")
        s = self.seed
        check_field(
            "seed",
            s,
            s is None or (is_int(s) and 0 <= s < 2**63),
            "None or an integer in [0, 2**63)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
