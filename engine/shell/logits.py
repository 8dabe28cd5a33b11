"""A pass's logits around sampling: each request's bias and penalties, then its grammar's mask,
before it draws, and the log-probabilities of what it drew after, for the requests that ask
(`SamplingParams`).

A decode or extend pass has one logits row per sampling request; a verify pass one per tree
node, where a node's history is its request's plus the drafts on the path down to it, so a
verify pass applies the penalties per position as decoding would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from engine.model.logits_edit import LogitsEdit
from engine.model.sampling import (
    Logprobs,
    SamplingTensors,
    greedy_tokens,
    host_to_device,
)
from engine.shell.grammar import Grammars
from engine.shell.masks import PendingMasks
from engine.shell.request import Request, TokenLogprob
from engine.spec.tree import prune
from engine.state import DraftTrees


@attrs.frozen(eq=False)
class Sampled:
    """A pass's tokens on the device, and the log-probabilities it computed (or None).
    On CUDA `host` is a pinned copy of the tokens, being made in stream order right after the
    sampling; `copied` is recorded after it (a later pass queued meanwhile is not waited
    for)."""

    tokens: torch.Tensor
    logprobs: PendingLogprobs | None = None
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None

    @classmethod
    def copying(cls, tokens: torch.Tensor, logprobs: PendingLogprobs | None) -> Sampled:
        """The tokens, with their copy to the host started now on CUDA."""
        if tokens.device.type != "cuda":
            return cls(tokens, logprobs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, logprobs, host, copied)

    def tokens_on_host(self) -> np.ndarray:
        """The tokens as a host array (waits for their copy only; a pass that sampled no
        row, a prompt's chunk before its last, is not waited for: the host plans and queues
        the next chunk while it runs, and a device error in it surfaces where a later pass
        is read)."""
        if self.tokens.numel() == 0:
            return np.zeros(self.tokens.shape, dtype=np.int64)
        if self.copied is None or self.host is None:
            return self.tokens.cpu().numpy()
        self.copied.synchronize()
        return self.host.numpy().copy()  # the pinned buffer goes back to torch's cache


@attrs.frozen(eq=False)
class Launched:
    """A launched pass before its sampling: its logits (edited) on the device, the uid of
    each row, its sampling inputs (None: all greedy), its grammar masks being filled (None:
    no row masked: none constrained, or each drawn unmasked and checked after), and its
    tokens where it was sampled at once (no masks to wait for)."""

    logits: torch.Tensor
    uids: list[int]
    inputs: SamplingTensors | None
    masks: PendingMasks | None = None
    sampled: Sampled | None = None
    checked: list[int] = attrs.Factory(list)  # rows drawn unmasked, checked after (`recheck`)
    # the checked rows' logits, copied before a pass launched ahead may write over `logits`
    # (a CUDA graph's output buffer is every replay's; `Engine._prepare_next`)
    checked_logits: torch.Tensor | None = None
    # the prompt tokens it scored (`PromptScoring.launch`: a `PendingScores`), or None
    scores: Any = None

    def select(self, rows: np.ndarray) -> Launched | None:
        """This pass's `rows` only (in that order), for a pass launched ahead whose other
        requests left before it was taken (`PlanAhead.fit`); None where its tokens are not
        sampled yet (masks pending: its sampling inputs are per row). Its logits, tokens
        and logprobs are gathered on the device in stream order, so later passes may reuse
        their buffers."""
        if self.sampled is None:
            return None
        assert self.checked_logits is None  # kept only once the pass is taken
        index = host_to_device(np.asarray(rows, dtype=np.int64), self.logits.device)
        renumbered = {int(old): new for new, old in enumerate(rows)}
        uids = [self.uids[int(row)] for row in rows]
        logprobs = self.sampled.logprobs
        logits, tokens = _take_rows(index, self.logits, self.sampled.tokens)
        return Launched(
            logits,
            uids,
            None,  # spent: the pass is sampled
            sampled=Sampled.copying(
                tokens, None if logprobs is None else logprobs.select(set(uids))
            ),
            checked=[renumbered[row] for row in self.checked if row in renumbered],
        )


@attrs.frozen(eq=False)
class VerifyLaunched:
    """A verify pass launched for the next step: ahead (`PlanAhead.plan` with trees), or at
    a commit (`plan_committed` with trees). Its logits (on the device, one row per node) and
    each tree's guess for its root (-1: a root alone, or a root known at its launch), the
    token its drafts were proposed after. It is never cut to fewer requests (`select`):
    where some leave before it is taken, it is dropped."""

    logits: torch.Tensor
    guesses: np.ndarray
    seconds: float = 0.0  # host time of its launch where the device waited for it

    @property
    def guessed(self) -> bool:
        """Whether any root was guessed (a pass launched at a commit guessed none)."""
        return bool((self.guesses >= 0).any())

    def select(self, keep: np.ndarray) -> None:
        return None

    def missed(self, trees: DraftTrees) -> np.ndarray:
        """Per tree (its root known now): whether it drafted and its root is not its guess."""
        return (self.guesses >= 0) & (trees.tokens[trees.sizes.starts()] != self.guesses)

    def recorded(self, trees: DraftTrees, accepted: np.ndarray) -> DraftTrees:
        """`trees` (their roots known now) as speculation's statistics count them: a tree
        whose root is not its guess, and that had nothing accepted, drafted nothing (its
        drafts were for another token)."""
        if not self.guessed:  # every root was known at its launch: none missed
            return trees
        missed = self.missed(trees) & (np.asarray(accepted) == 0)
        if not missed.any():
            return trees
        return prune(trees, ~missed[trees.sizes.segment_ids()])


def _take_rows(index: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor's rows `index` names, in that order (gathered on the device)."""
    return tuple(t.index_select(0, index) for t in tensors)


def warm_row_gathers(device: torch.device, vocab_size: int, max_rows: int) -> None:
    """Run `Launched.select`'s gathers (a pass's fp32 logits and int64 tokens, by row) keeping
    each row count from 1 to max_rows - 1 of one more. Torch's kernel for them depends on
    the count, and its first use loads it while the device waits for the pass launched
    ahead: in `profile_steps.py --prefill` runs on an H200 the first 63-of-64 gather left
    the device idle 8-14 ms after the warm-up had run a 1-of-2 one (`startup.warm_up` runs
    this before serving)."""
    logits = torch.zeros(max_rows, vocab_size, device=device)
    tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
    for kept in range(1, max_rows):
        index = torch.arange(kept, device=device)
        _take_rows(index, logits[: kept + 1], tokens[: kept + 1])


@attrs.frozen(eq=False)
class PendingLogprobs:
    """Log-probabilities on the device, one row per (request, output token) in order."""

    values: Logprobs
    uids: list[int]
    tops: list[int]  # alternatives each row's request asked for
    tokens: torch.Tensor  # the token each row drew

    def select(self, uids: set[int]) -> PendingLogprobs:
        """The rows of the requests in `uids` only (in order), gathered on the device."""
        rows = [i for i, uid in enumerate(self.uids) if uid in uids]
        index = host_to_device(np.array(rows, dtype=np.int64), self.tokens.device)
        values = Logprobs(*(t.index_select(0, index) for t in self.values.tensors()))
        return PendingLogprobs(
            values,
            [self.uids[i] for i in rows],
            [self.tops[i] for i in rows],
            self.tokens.index_select(0, index),
        )

    def host(self) -> dict[int, list[TokenLogprob]]:
        """uid -> its tokens' entries, in order (read from the device)."""
        chosen, ranks, top_ids, top_values = self.values.to_host()
        tokens = self.tokens.cpu().numpy()
        out: dict[int, list[TokenLogprob]] = {}
        for row, (uid, top) in enumerate(zip(self.uids, self.tops, strict=True)):
            ids, values = top_ids[row, :top].tolist(), top_values[row, :top].tolist()
            entry = TokenLogprob(
                int(tokens[row]),
                float(chosen[row]),
                tuple(zip(ids, values, strict=True)),
                int(ranks[row]),
            )
            out.setdefault(uid, []).append(entry)
        return out


class LogitsWork:
    """Edits, grammar masks and log-probabilities for the requests in flight (by uid)."""

    def __init__(self, requests: Mapping[int, Request], grammars: Grammars) -> None:
        self.requests = requests
        self.grammars = grammars

    def start(self, uids: Sequence[int], skip: Sequence[int] = ()) -> PendingMasks | None:
        """Start the masks of a pass with one logits row per uid (`Grammars.start`; the rows
        in `skip` are left unmasked): called once its forward is launched, so that the host
        fills them while the device runs it."""
        return self.grammars.start(uids, frozenset(skip)) if self.grammars else None

    def checked_rows(self, uids: Sequence[int], asked: set[int]) -> list[int]:
        """The rows of a pass (one per uid) drawn without their mask and checked against
        their grammar after (`recheck`): those of greedy constrained requests that asked for
        no logprobs. The first index of a row's maximum is the same with and without its
        mask whenever the grammar allows that token (the mask only sets other tokens to
        -inf), so a row needs its mask only when its grammar refuses the unmasked token.
        A request whose grammar refused its last checked token is masked first for a while
        (`Grammars.checks_first`)."""
        if not self.grammars:
            return []
        return [
            row
            for row, uid in enumerate(uids)
            if uid in self.grammars
            and uid not in asked
            and self.requests[uid].params.greedy
            and self.grammars.checks_first(uid)
        ]

    @staticmethod
    def keep_checked(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor | None:
        """A copy of the span of `logits` from the first of `rows` (ascending) to the last
        (None without rows), for `recheck`: one device copy, no index sent to the device."""
        if not rows:
            return None
        return logits[rows[0] : rows[-1] + 1].clone()

    def recheck(
        self,
        logits: torch.Tensor,
        uids: Sequence[int],
        rows: Sequence[int],
        tokens: np.ndarray,
        kept: torch.Tensor | None = None,
    ) -> np.ndarray:
        """`tokens` (one per logits row, on the host) with each of `rows` (`checked_rows`)
        that its grammar refuses drawn again greedily under its mask; the same array when
        every one is allowed. `kept`: the span of logits from the first of `rows` copied
        before a pass was launched ahead (`keep_checked`), read in place of `logits`. Counts
        the tokens checked (`grammar_tokens_checked`) and those drawn again
        (`grammar_tokens_redrawn`)."""
        if not rows:
            return tokens
        stats = self.grammars.stats
        stats["grammar_tokens_checked"] += len(rows)
        refused = []
        for i, row in enumerate(rows):
            allowed = self.grammars.allows(uids[row], int(tokens[row]))
            self.grammars.note_check(uids[row], allowed)
            if not allowed:
                refused.append(i)
        if not refused:
            return tokens
        stats["grammar_tokens_redrawn"] += len(refused)
        refused_uids = [uids[rows[i]] for i in refused]
        source = logits if kept is None else kept
        first = rows[0] if kept is not None else 0  # the row `source` starts at
        picks = [rows[i] - first for i in refused]
        index = host_to_device(np.array(picks, dtype=np.int64), source.device)
        masks = self.grammars.start(refused_uids)
        assert masks is not None  # every refused row is constrained
        masked = masks.apply(source.index_select(0, index))
        tokens = tokens.copy()
        tokens[[rows[i] for i in refused]] = greedy_tokens(masked).cpu().numpy()
        return tokens

    def start_tree(self, trees: DraftTrees, uids: Sequence[int]) -> PendingMasks | None:
        """Start a verify pass's masks, one per tree node (`Grammars.start_tree`)."""
        return self.grammars.start_tree(trees, uids) if self.grammars else None

    @staticmethod
    def constrain(
        logits: torch.Tensor, uids: Sequence[int], masks: PendingMasks | None
    ) -> torch.Tensor:
        """`logits` (one row per uid) with the tokens each constrained request's grammar
        does not allow next at -inf (`masks`, from `start`: None when no row is masked);
        the same tensor when none is masked."""
        return logits if masks is None else masks.apply(logits)

    @staticmethod
    def constrain_tree(logits: torch.Tensor, masks: PendingMasks | None) -> torch.Tensor:
        """A verify pass's logits (one row per tree node) with each node's mask applied
        (`masks`, from `start_tree`: None when no node is masked)."""
        return logits if masks is None else masks.apply(logits)

    def edit(
        self,
        logits: torch.Tensor,
        uids: Sequence[int],
        edited: set[int],
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`logits` (one row per uid) with each request's bias and penalties applied; the
        same tensor when none of them has any. `pending`: one token per row on the device
        that its request's history does not hold yet (`LogitsEdit.of`)."""
        if not edited or edited.isdisjoint(uids):
            return logits
        rows = [(self.requests[u].params, *self.requests[u].seen_and_output()) for u in uids]
        return LogitsEdit.of(rows, logits.device, pending).apply(logits)

    def edit_tree(
        self, logits: torch.Tensor, trees: DraftTrees, uids: Sequence[int], edited: set[int]
    ) -> torch.Tensor:
        """A verify pass's logits (one row per tree node) with each node's request's bias and
        penalties applied, its history extended by the drafts on its path."""
        if not edited or edited.isdisjoint(uids):
            return logits
        rows = []
        starts = trees.sizes.starts().tolist()
        for i, uid in enumerate(uids):
            request = self.requests[uid]
            seen, output = request.seen_and_output()
            paths: list[list[int]] = []
            for local in range(int(trees.sizes.lens[i])):
                flat = starts[i] + local
                parent = int(trees.parents[flat])
                path = [] if parent < 0 else [*paths[parent], int(trees.tokens[flat])]
                paths.append(path)
                drafts = np.array(path, dtype=np.int64)
                rows.append(
                    (
                        request.params,
                        np.union1d(seen, drafts) if path else seen,
                        np.concatenate([output, drafts]) if path else output,
                    )
                )
        return LogitsEdit.of(rows, logits.device).apply(logits)

    def logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, uids: Sequence[int], asked: set[int]
    ) -> PendingLogprobs | None:
        """The log-probabilities of `tokens` (one per logits row, of request `uids[row]`) for
        the requests that asked."""
        if not asked or asked.isdisjoint(uids):
            return None
        rows = [i for i, u in enumerate(uids) if u in asked]
        tops = [self.requests[uids[i]].params.logprobs or 0 for i in rows]
        index = host_to_device(np.array(rows, dtype=np.int64), logits.device)
        picked = tokens.index_select(0, index)
        values = Logprobs.of(logits.index_select(0, index), picked, max(tops))
        return PendingLogprobs(values, [uids[i] for i in rows], tops, picked)

    def tree_logprobs(
        self,
        logits: torch.Tensor,
        trees: DraftTrees,
        uids: Sequence[int],
        accepted_lens: np.ndarray,
        accepted_nodes: np.ndarray,
        bonus: np.ndarray,
        asked: set[int],
    ) -> PendingLogprobs | None:
        """A verify pass's emitted tokens' log-probabilities: the token after each node of a
        request's accepted path (its accepted drafts, then the bonus) from that node's row."""
        if not asked or asked.isdisjoint(uids):
            return None
        starts = trees.sizes.starts()
        bounds = np.concatenate([[0], np.cumsum(accepted_lens)])
        rows: list[int] = []
        tokens: list[int] = []
        row_uids: list[int] = []
        for i, uid in enumerate(uids):
            if uid not in asked:
                continue
            accepted = (starts[i] + accepted_nodes[bounds[i] : bounds[i + 1]]).tolist()
            path = [int(starts[i]), *accepted]
            rows.extend(path)
            tokens.extend([int(trees.tokens[n]) for n in accepted] + [int(bonus[i])])
            row_uids.extend([uid] * len(path))
        tops = [self.requests[u].params.logprobs or 0 for u in row_uids]
        index = host_to_device(np.array(rows, dtype=np.int64), logits.device)
        picked = host_to_device(np.array(tokens, dtype=np.int64), logits.device)
        values = Logprobs.of(logits.index_select(0, index), picked, max(tops))
        return PendingLogprobs(values, row_uids, tops, picked)
