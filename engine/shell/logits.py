"""A pass's logits around sampling: each request's bias and penalties, then its grammar's mask,
before it draws, and the log-probabilities of what it drew after, for the requests that ask
(`SamplingParams`).

A decode or extend pass has one logits row per sampling request; a verify pass one per tree
node, where a node's history is its request's plus the drafts on the path down to it, so a
verify pass applies the penalties per position as decoding would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch

from engine.model.sampling import LogitsEdit, Logprobs, host_to_device
from engine.shell.grammar import Grammars, apply_masks
from engine.shell.request import Request, TokenLogprob
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
        """The tokens as a host array (waits for their copy only)."""
        if self.copied is None or self.host is None:
            return self.tokens.cpu().numpy()
        self.copied.synchronize()
        return self.host.numpy().copy()  # the pinned buffer goes back to torch's cache


@attrs.frozen(eq=False)
class PendingLogprobs:
    """Log-probabilities on the device, one row per (request, output token) in order."""

    values: Logprobs
    uids: list[int]
    tops: list[int]  # alternatives each row's request asked for
    tokens: torch.Tensor  # the token each row drew

    def host(self) -> dict[int, list[TokenLogprob]]:
        """uid -> its tokens' entries, in order (read from the device)."""
        chosen, top_ids, top_values = self.values.to_host()
        tokens = self.tokens.cpu().numpy()
        out: dict[int, list[TokenLogprob]] = {}
        for row, (uid, top) in enumerate(zip(self.uids, self.tops, strict=True)):
            ids, values = top_ids[row, :top].tolist(), top_values[row, :top].tolist()
            entry = TokenLogprob(
                int(tokens[row]), float(chosen[row]), tuple(zip(ids, values, strict=True))
            )
            out.setdefault(uid, []).append(entry)
        return out


class LogitsWork:
    """Edits, grammar masks and log-probabilities for the requests in flight (by uid)."""

    def __init__(self, requests: Mapping[int, Request], grammars: Grammars) -> None:
        self.requests = requests
        self.grammars = grammars

    def constrain(self, logits: torch.Tensor, uids: Sequence[int]) -> torch.Tensor:
        """`logits` (one row per uid) with the tokens each constrained request's grammar
        does not allow next at -inf; the same tensor when none is constrained."""
        bitmask = self.grammars.masks(uids) if self.grammars else None
        return logits if bitmask is None else apply_masks(logits, bitmask)

    def constrain_tree(
        self, logits: torch.Tensor, trees: DraftTrees, uids: Sequence[int]
    ) -> torch.Tensor:
        """A verify pass's logits (one row per tree node) with each node's mask: its
        request's grammar after the drafts on the path down to it."""
        bitmask = self.grammars.tree_masks(trees, uids) if self.grammars else None
        return logits if bitmask is None else apply_masks(logits, bitmask)

    def edit(self, logits: torch.Tensor, uids: Sequence[int], edited: set[int]) -> torch.Tensor:
        """`logits` (one row per uid) with each request's bias and penalties applied; the
        same tensor when none of them has any."""
        if not edited or edited.isdisjoint(uids):
            return logits
        rows = [(self.requests[u].params, *self.requests[u].seen_and_output()) for u in uids]
        return LogitsEdit.of(rows, logits.device).apply(logits)

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
