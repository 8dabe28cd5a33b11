"""The finish check, in one place: EOS, stop token ids, max_tokens and the context limit."""

from __future__ import annotations

import enum

import numpy as np

from engine.state.running import FinishRules


class FinishReason(enum.IntEnum):
    """Why a request left. NONE marks requests that keep running."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3

    @property
    def openai(self) -> str | None:
        return {0: None, 1: "stop", 2: "length", 3: "abort"}[int(self)]


def first_finish(tokens: np.ndarray, valid: np.ndarray, num_output_before: np.ndarray,
                 token_lens_before: np.ndarray, rules: FinishRules,
                 max_context: int) -> tuple[np.ndarray, np.ndarray]:
    """For (batch, k) tokens appended in order, where each request stops.

    Returns (kept, reason): how many of the k tokens each request keeps (all of its valid ones
    when it does not finish) and its FinishReason code.
    """
    width = tokens.shape[1]
    step = np.arange(1, width + 1, dtype=np.int64)
    num_output = num_output_before[:, None] + step
    token_lens = token_lens_before[:, None] + step
    eos_hit = (tokens == rules.eos[:, None]) & (rules.eos[:, None] >= 0)
    if rules.stop_ids.shape[1]:
        eos_hit |= (tokens[:, :, None] == rules.stop_ids[:, None, :]).any(axis=2)
    stop_hit = valid & eos_hit & (num_output >= rules.min_new[:, None])
    length_hit = valid & ((num_output >= rules.max_new[:, None]) | (token_lens >= max_context))
    hit = stop_hit | length_hit
    finishes = hit.any(axis=1)
    first = hit.argmax(axis=1)
    rows = np.arange(tokens.shape[0])
    kept = np.where(finishes, first + 1, valid.sum(axis=1))
    reason = np.where(~finishes, FinishReason.NONE,
                      np.where(stop_hit[rows, first], FinishReason.STOP, FinishReason.LENGTH))
    return kept.astype(np.int64), reason.astype(np.int8)
