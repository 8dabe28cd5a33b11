"""Sparse edits of a pass's logits before sampling, each request's as its `SamplingParams`
say: bias, penalties, allowed ids and bad words (`LogitsEdit`)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from engine.model.sampling import host_to_device
from engine.state import SamplingParams


@attrs.frozen(eq=False)
class LogitsEdit:
    """Sparse changes to rows of logits before sampling, as `SamplingParams` defines them:
    each row's `logit_bias` added, then its repetition penalty on every token it has seen
    (positive logits divided, negative ones multiplied), then its frequency and presence
    penalties on its output tokens' counts, then for a row with allowed token ids, -inf at every
    other token, and -inf at each token that completes one of its bad words (`bad_word_ids`)
    at the end of its output. Built on the host (`LogitsEdit.of`), one copy;
    a row's history may lack one token still on the device (`pending`), counted there."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, tokens, values (added)
    repeat: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, tokens, factors
    # rows, tokens, output counts, and per entry the row's frequency and presence penalties
    penalty: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    allowed: tuple[torch.Tensor, torch.Tensor]  # rows, tokens: the only tokens those rows keep
    banned: tuple[torch.Tensor, torch.Tensor]  # rows, tokens: a bad word's last token (-inf)
    # rows, tokens and whether each row's pending token completes the rest of its bad word
    banned_if: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def of(
        cls,
        rows: Sequence[tuple[SamplingParams, np.ndarray, np.ndarray]],
        device: torch.device | str = "cpu",
        pending: torch.Tensor | None = None,
    ) -> LogitsEdit:
        """`rows`: per logits row, its parameters, the tokens it has seen (prompt and
        output, each once) and its output tokens (with repeats). `pending` (on `device`, one
        per row): a token each row has drawn that its history does not hold yet (the running
        pass's, for a pass launched before its tokens are read); the edit is the one its
        history with that token gives, exactly: the repetition penalty is applied to it
        (once, whether seen or not), and its output count is one more."""
        parts: list[list[np.ndarray]] = [[] for _ in range(18)]
        late: list[list[int]] = [[], []]  # rows with a pending token's repeat / penalty entry
        for row, (params, seen, output) in enumerate(rows):
            if params.logit_bias:
                biased, values = zip(*params.logit_bias, strict=True)
                _append(parts[0:3], row, np.array(biased), np.array(values, dtype=np.float64))
            if params.repetition_penalty != 1.0:
                if seen.size:
                    factors = np.full(seen.size, params.repetition_penalty, dtype=np.float64)
                    _append(parts[3:6], row, seen, factors)
                if pending is not None:
                    late[0].append(row)
            if params.frequency_penalty or params.presence_penalty:
                tokens, counts = np.unique(output, return_counts=True)
                if pending is not None:  # its entry, counted on the device (0: in `tokens`)
                    tokens, counts = np.append(tokens, 0), np.append(counts, 0)
                    late[1].append(row)
                if tokens.size:
                    _append(parts[6:9], row, tokens, counts.astype(np.float64))
                    parts[9].append(np.full(tokens.size, params.frequency_penalty))
                    parts[10].append(np.full(tokens.size, params.presence_penalty))
            if params.allowed_token_ids is not None:
                ids = np.array(params.allowed_token_ids, dtype=np.float64)
                parts[11].append(np.full(ids.size, row, dtype=np.float64))
                parts[12].append(ids)
            if params.bad_word_ids:
                bans, bans_after = _bad_word_bans(params.bad_word_ids, output, pending is not None)
                for at, entries in ((13, [(t,) for t in bans]), (15, bans_after)):
                    if entries:
                        columns = np.array(entries, dtype=np.float64).T
                        parts[at].append(np.full(columns.shape[1], row, dtype=np.float64))
                        for k, column in enumerate(columns, start=1):
                            parts[at + k].append(column)
        if late[0]:  # the pending tokens' repetition entries come last (tokens on the device)
            parts[3].append(np.array(late[0], dtype=np.float64))
            parts[4].append(np.zeros(len(late[0])))
            parts[5].append(np.array([rows[row][0].repetition_penalty for row in late[0]]))
        sizes = [sum(p.size for p in part) for part in parts]
        flat = [np.concatenate(p) if p else np.zeros(0, dtype=np.float64) for p in parts]
        # as float64: one copy holds every id exactly
        pieces = list(host_to_device(np.concatenate(flat).astype(np.float64), device).split(sizes))
        bias = (pieces[0].long(), pieces[1].long(), pieces[2].float())
        repeat = [pieces[3].long(), pieces[4].long(), pieces[5].float()]
        penalty = [pieces[6].long(), pieces[7].long(), pieces[8], pieces[9], pieces[10]]
        if pending is not None and late[0]:
            n = len(late[0])
            tail = pending.long().index_select(0, repeat[0][-n:])
            repeat[1] = torch.cat([repeat[1][:-n], tail])
        if pending is not None and late[1]:
            penalty[1], penalty[2] = _count_pending(penalty[0], penalty[1], penalty[2], pending)
        allowed = (pieces[11].long(), pieces[12].long())
        banned = (pieces[13].long(), pieces[14].long())
        banned_rows = pieces[15].long()
        hit = torch.zeros(banned_rows.shape, dtype=torch.bool, device=banned_rows.device)
        if pending is not None and banned_rows.numel():  # the pending token is the one needed
            hit = pending.long().index_select(0, banned_rows) == pieces[17].long()
        banned_if = (banned_rows, pieces[16].long(), hit)
        return cls(bias, tuple(repeat), tuple(penalty), allowed, banned, banned_if)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited logits (fp32, a new tensor)."""
        out = logits.float().clone()
        rows, tokens, values = self.bias
        if rows.numel():
            out.index_put_((rows, tokens), values, accumulate=True)
        rows, tokens, factors = self.repeat
        if rows.numel():  # a token twice in a row (seen, and pending) gets the same value twice
            seen = out[rows, tokens]
            out[rows, tokens] = torch.where(seen > 0, seen / factors, seen * factors)
        rows, tokens, counts, frequency, presence = self.penalty
        if rows.numel():  # in float64, then rounded once: the same values as on the host
            values = torch.where(counts > 0, -(frequency * counts + presence), 0.0)
            out.index_put_((rows, tokens), values.float(), accumulate=True)
        rows, tokens = self.allowed
        if rows.numel():  # rows with allowed ids: -inf but at those
            restricted = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
            restricted[rows] = True
            keep = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
            keep[rows, tokens] = True
            out.masked_fill_(restricted[:, None] & ~keep, float("-inf"))
        rows, tokens = self.banned
        if rows.numel():
            out[rows, tokens] = float("-inf")
        rows, tokens, hit = self.banned_if
        if rows.numel():  # added: a token twice (two bad words) keeps any -inf
            values = torch.where(hit, float("-inf"), 0.0).to(out.dtype)
            out.index_put_((rows, tokens), values, accumulate=True)
        return out


def _count_pending(
    rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, pending: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The penalty entries with each row's pending token counted: one more where the row has
    an entry for it already, else the row's last entry (placed for it, count 0) takes it with
    count 1. Each penalized row's last entry is that placeholder."""
    pending = pending.long()
    last = torch.ones_like(rows, dtype=torch.bool)
    last[:-1] = rows[1:] != rows[:-1]
    wanted = pending.index_select(0, rows)
    found = (tokens == wanted) & ~last
    hits = torch.zeros(pending.shape[0], dtype=torch.long, device=rows.device)
    hits.index_add_(0, rows, found.long())  # no mask indexing: nothing waits for the device
    new = last & (hits.index_select(0, rows) == 0)
    counts = counts + found + new
    tokens = torch.where(last, wanted, tokens)
    return tokens, counts


def _bad_word_bans(
    sequences: tuple[tuple[int, ...], ...], output: np.ndarray, pending: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """A row's bad words as bans on its next token: the last token of each sequence whose
    other tokens end its output (a one-token word always); with a `pending` token (its last
    output token, on the device only), (that last token, the pending token it needs) for
    each sequence whose tokens but those two end the output known here."""
    banned: list[int] = []
    after: list[tuple[int, int]] = []
    history = output.tolist()
    for sequence in sequences:
        head, last = sequence[:-1], sequence[-1]
        known = head[:-1] if pending and head else head
        if len(known) > len(history) or tuple(history[len(history) - len(known) :]) != known:
            continue
        if pending and head:
            after.append((last, head[-1]))
        else:
            banned.append(last)
    return banned, after


def _append(parts: list[list[np.ndarray]], row: int, tokens: np.ndarray, values: np.ndarray):
    parts[0].append(np.full(tokens.size, row, dtype=np.float64))
    parts[1].append(tokens.astype(np.float64))
    parts[2].append(values)
