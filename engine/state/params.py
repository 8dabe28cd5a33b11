"""Sampling parameters: one frozen, validated value per request."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from engine.state.structured import StructuredOutputs, as_structured


def check_field(field: str, value: object, ok: bool, allowed: str) -> None:
    """Raise ValueError naming the field, its value and what is allowed, unless `ok`."""
    if not ok:
        raise ValueError(f"{field}={value!r} is not allowed; {field} must be {allowed}")


def as_tuple(value: object) -> object:
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


MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's limit)
MAX_N = 64  # samples of one prompt


def _as_bias(value: object) -> object:
    """logit_bias as sorted (token id, bias) pairs, from a dict (JSON keys are strings) or
    pairs; anything else is kept for the validator to name."""
    if isinstance(value, dict):
        try:
            return tuple(sorted((int(k), v) for k, v in value.items()))
        except (TypeError, ValueError):
            return value
    return as_tuple(value)


def _as_ids(value: object) -> object:
    """None, or the ids as a tuple (anything else kept for the validator to name)."""
    return None if value is None else as_tuple(value)


def _as_sequences(value: object) -> object:
    """Token sequences as a tuple of tuples (anything else kept for the validator to name)."""
    outer = as_tuple(value)
    if not isinstance(outer, tuple) or any(isinstance(seq, str) for seq in outer):
        return outer
    return tuple(as_tuple(seq) for seq in outer)


@attrs.frozen
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy. top_k -1 keeps every token. Stop strings are matched on the
    produced text by the engine; stop token ids and EOS are checked by the state core.

    Before sampling, each row's logits get `logit_bias` added and the penalties applied as
    vLLM defines them: `repetition_penalty` divides positive logits (multiplies negative
    ones) of every token in the prompt or the output; `frequency_penalty` subtracts itself
    times a token's count in the output and `presence_penalty` itself once for a token in the
    output; with `allowed_token_ids` (vLLM's), every other token's logit is -inf; and as
    vLLM's `bad_words`, a token that would complete a bad word's token sequence at the end of
    the output is -inf (`bad_word_ids`: the sequences, each word as the tokenizer spells it
    alone and after a space, filled in at submission; or given directly). Then
    temperature, top-k, top-p and `min_p` (tokens below min_p times the most
    likely token's probability are dropped). `logprobs` (None: off) returns, per output
    token, its log-probability under the logits after bias and penalties (before temperature
    and filtering), and that many most likely alternatives (0..20). `prompt_logprobs` (None:
    off) does the same for each prompt token after the first, under the model's logits at the
    position before it (no bias or penalties); such a prompt is computed whole, not taken
    from the prefix cache. `n` samples of the prompt
    are drawn (seeded: sample i from the seed and i).

    `structured_outputs` (None: free text) constrains the output to a JSON schema, a regular
    expression, a Lark grammar or a choice of strings: before each token is drawn, every
    token the grammar does not allow is masked out (greedy or sampled), and the request stops
    once the grammar is complete.

    The output text (vLLM's options): a stop string ends it, and the token that stopped the
    request (EOS or one of `stop_token_ids`) is not in it, unless `include_stop_str_in_output`;
    the output ids keep the stop token either way. `skip_special_tokens` (default) leaves
    special tokens out of the text. `truncate_prompt_tokens` keeps only the prompt's last that
    many tokens (vLLM's left truncation).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 64  # None: up to the context limit (set at submission)
    min_tokens: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_tuple)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)
    structured_outputs: StructuredOutputs | None = attrs.field(
        default=None, converter=as_structured
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_as_ids)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=as_tuple)
    bad_word_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_as_sequences)

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
        check_field(
            "max_tokens", m, m is None or (is_int(m) and m >= 1), "an integer >= 1 (or None)"
        )
        n = self.min_tokens
        check_field(
            "min_tokens",
            n,
            is_int(n) and 0 <= n <= (m if m is not None else n),
            f"an integer in [0, max_tokens={m}]",
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
        keep = self.truncate_prompt_tokens
        check_field(
            "truncate_prompt_tokens",
            keep,
            keep is None or (is_int(keep) and keep >= 1),
            "None or an integer >= 1 (the prompt's last tokens kept)",
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            check_field(name, value, isinstance(value, bool), "a bool")
        s = self.seed
        check_field(
            "seed",
            s,
            s is None or (is_int(s) and 0 <= s < 2**63),
            "None or an integer in [0, 2**63)",
        )

        check_field(
            "n", self.n, is_int(self.n) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]"
        )
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            check_field(
                name,
                lp,
                lp is None or (is_int(lp) and 0 <= lp <= MAX_LOGPROBS),
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            check_field(name, value, is_number(value) and -2 <= value <= 2, "a number in [-2, 2]")
        r = self.repetition_penalty
        check_field(
            "repetition_penalty", r, is_number(r) and 0 < r <= 2, "a number in (0, 2] (1: off)"
        )
        check_field(
            "min_p", self.min_p, is_number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"
        )
        bias = self.logit_bias
        check_field(
            "logit_bias",
            bias,
            isinstance(bias, tuple)
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and is_int(pair[0])
                and pair[0] >= 0
                and is_number(pair[1])
                and -100 <= pair[1] <= 100
                for pair in bias
            )
            and len({pair[0] for pair in bias}) == len(bias),
            "a map of token ids >= 0 to numbers in [-100, 100]",
        )
        allowed = self.allowed_token_ids
        check_field(
            "allowed_token_ids",
            allowed,
            allowed is None
            or (
                isinstance(allowed, tuple)
                and len(allowed) > 0
                and all(is_int(i) and i >= 0 for i in allowed)
            ),
            "None or a non-empty list of token ids >= 0",
        )
        check_field(
            "bad_words",
            self.bad_words,
            isinstance(self.bad_words, tuple)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "a list of words (non-empty strings)",
        )
        check_field(
            "bad_word_ids",
            self.bad_word_ids,
            isinstance(self.bad_word_ids, tuple)
            and all(
                isinstance(seq, tuple) and len(seq) > 0 and all(is_int(t) and t >= 0 for t in seq)
                for seq in self.bad_word_ids
            ),
            "a list of token id sequences (each non-empty, ids >= 0)",
        )
        so = self.structured_outputs
        check_field(
            "structured_outputs",
            so,
            so is None or isinstance(so, StructuredOutputs),
            "None, a StructuredOutputs or a dict of its fields (json, regex, grammar, choice, "
            "json_object)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the logits change before sampling (penalties, a bias, allowed ids or bad
        words)."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.bad_word_ids
        )

    def sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of `n`: one sample each, seeded from the seed
        and the index (sample 0 keeps the seed)."""
        seed = None if self.seed is None else (self.seed + index * 0x9E3779B97F4A7C15) % 2**63
        return attrs.evolve(self, n=1, seed=seed)
