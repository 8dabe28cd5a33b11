"""The n-gram proposer: per-request tries (plus a shared corpus) and draft trees from them.

A draft grows best-first from the node matching the request's latest suffix: each candidate
is scored by its path's continuation frequency, children ranked by count then recency.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from engine.spec.config import SpecConfig
from engine.spec.tree import DraftTree
from engine.spec.trie import Trie
from engine.state.batch import DraftTrees
from engine.state.seqlens import INDEX_DTYPE


class _RequestHistory:
    __slots__ = ("tokens", "trie")

    def __init__(self, config: SpecConfig) -> None:
        self.tokens: list[int] = []
        self.trie = Trie(config.max_trie_depth, config.capacity)

    def add(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if tokens and (min(tokens) < 0 or max(tokens) >= 1 << 32):
            raise ValueError(f"tokens must be in [0, 2**32); got {min(tokens)}..{max(tokens)}")
        self.trie.add(tokens)
        self.tokens.extend(tokens)


class NgramProposer:
    """Draft trees for requests from the token windows they (and the corpus) have seen."""

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config if config is not None else SpecConfig()
        self._requests: dict[int, _RequestHistory] = {}
        self._corpus: Trie | None = None
        self._documents = 0

    # --- histories ----------------------------------------------------------------------
    def add_request(self, rid: int, prompt_tokens: Sequence[int]) -> None:
        if rid in self._requests:
            raise KeyError(f"request {rid} is already known to the proposer")
        history = _RequestHistory(self.config)
        history.add(prompt_tokens)
        self._requests[rid] = history

    def extend(self, rid: int, new_tokens: Sequence[int]) -> None:
        """Append tokens the request gained (its emitted tokens, bonus included)."""
        self._history(rid).add(new_tokens)

    def remove(self, rid: int) -> None:
        self._history(rid)
        del self._requests[rid]

    def add_corpus(self, tokens: Sequence[int]) -> None:
        """Add one document to the shared corpus (windows never span two documents)."""
        if self._corpus is None:
            self._corpus = Trie(self.config.max_trie_depth, self.config.capacity)
        self._documents += 1
        self._corpus.add(tokens, stream=self._documents)
        self._corpus.close(self._documents)

    def __contains__(self, rid: int) -> bool:
        return rid in self._requests

    def history(self, rid: int) -> list[int]:
        return list(self._history(rid).tokens)

    def trie(self, rid: int) -> Trie:
        return self._history(rid).trie

    def _history(self, rid: int) -> _RequestHistory:
        history = self._requests.get(rid)
        if history is None:
            raise KeyError(f"request {rid} is not known to the proposer; add_request() first")
        return history

    # --- drafting -----------------------------------------------------------------------
    def propose(
        self, rid: int, context: Sequence[int] | None = None, budget: int | None = None
    ) -> DraftTree:
        """A draft tree rooted at the last token of `context` (default: the request's history)
        with at most `budget` drafts (default: config.draft_budget)."""
        history = self._history(rid)
        tokens = history.tokens if context is None else context
        _check_rooted(rid, tokens)
        budget = self._checked_budget(budget)
        grown = self._draft(history, tokens, budget)
        if grown is None:
            return DraftTree.root_only(int(tokens[-1]))
        drafts, parents, match_len = grown
        return DraftTree([int(tokens[-1]), *drafts], [-1, *parents], match_len)

    def propose_batch(
        self,
        rids: Sequence[int],
        budgets: Sequence[int] | None = None,
        total_drafts: int | None = None,
    ) -> DraftTrees:
        """The batch form of one tree per request of `rids`, in order (each rooted at its
        request's last known token, which must be its pending token). `total_drafts`: at
        most this many drafts in all, handed out in order, so that what one request's tree
        does not use (no match, a short one) goes to the next."""
        if budgets is not None and len(budgets) != len(rids):
            raise ValueError(f"{len(budgets)} budgets for {len(rids)} requests")
        if total_drafts is not None and total_drafts < 0:
            raise ValueError(f"total_drafts={total_drafts} is not allowed; need >= 0 or None")
        nobody = total_drafts == 0 or (budgets is not None and not any(budgets))
        # The batch's flat columns directly, one tree after another (no per-request tree
        # values to check and concatenate).
        sizes: list[int] = []
        tokens: list[int] = []
        parents: list[int] = []
        left = total_drafts
        for i, rid in enumerate(rids):
            history = self._history(int(rid))
            _check_rooted(rid, history.tokens)
            tokens.append(history.tokens[-1])
            parents.append(-1)
            parts = None
            if not nobody:
                budget = self._checked_budget(None if budgets is None else int(budgets[i]))
                parts = self._draft(
                    history, history.tokens, budget if left is None else min(budget, left)
                )
            if parts is None:
                sizes.append(1)
                continue
            drafts, draft_parents, _ = parts
            tokens += drafts
            parents += draft_parents
            sizes.append(1 + len(drafts))
            if left is not None:
                left -= len(drafts)
        if len(tokens) == len(sizes):  # most steps of free text: roots only
            return DraftTrees.roots_only(np.array(tokens, dtype=INDEX_DTYPE))
        return DraftTrees.from_flat(sizes, tokens, parents)

    def _checked_budget(self, budget: int | None) -> int:
        if budget is None:
            return self.config.draft_budget
        if not 0 <= budget <= self.config.draft_budget:
            raise ValueError(
                f"budget={budget} is not allowed; budget must be in "
                f"[0, draft_budget={self.config.draft_budget}]"
            )
        return budget

    def _draft(
        self, history: _RequestHistory, tokens: Sequence[int], budget: int
    ) -> tuple[list[int], list[int], int] | None:
        """(drafts, their local parents, match length) below the longest matching suffix of
        `tokens`, or None where nothing is drafted (no budget, or no match)."""
        if budget == 0:
            return None
        trie, node, match_len = self._match(history.trie, tokens)
        if trie is None:
            return None
        drafts, parents = _grow(trie, node, budget, self.config.breadth(match_len))
        return drafts, parents, match_len

    def _match(self, trie: Trie, tokens: Sequence[int]) -> tuple[Trie | None, int, int]:
        """The trie and node of the longest suffix (max_match down to min_match) with a
        continuation; the request's own trie first, then the corpus."""
        cfg = self.config
        tries = (trie,) if self._corpus is None else (trie, self._corpus)
        # Most steps of free text match nothing: when the shortest suffix has no continuation,
        # no longer one has (a window holding a longer suffix and its next token holds the
        # shorter suffix and that token too, and is no older), so the search ends at once.
        if len(tokens) < cfg.min_match or not any(
            _continues(source, tokens[len(tokens) - cfg.min_match :]) for source in tries
        ):
            return None, -1, 0
        for match_len in range(min(cfg.max_match, len(tokens)), cfg.min_match - 1, -1):
            suffix = tokens[len(tokens) - match_len :]
            for source in tries:
                node = source.find(suffix)
                if node >= 0 and source.first_child[node] >= 0:
                    return source, node, match_len
        return None, -1, 0


def _check_rooted(rid: int, tokens: Sequence[int]) -> None:
    if not tokens:
        raise ValueError(f"request {rid} has no tokens to root a draft tree at")


def _continues(trie: Trie, suffix: Sequence[int]) -> bool:
    node = trie.find(suffix)
    return node >= 0 and trie.first_child[node] >= 0


def _ranked(trie: Trie, node: int, breadth: int) -> tuple[int, list[tuple[int, int, int]]]:
    """The children's counts summed (the windows through `node` that go on), and (count,
    stamp, id) of the `breadth` most frequent children (newest first among equals)."""
    count, stamp, next_sibling = trie.count, trie.stamp, trie.next_sibling
    child = trie.first_child[node]
    if next_sibling[child] < 0:
        only = count[child]
        return only, [(only, stamp[child], child)]
    ranked = []
    total = 0
    while child >= 0:
        child_count = count[child]
        total += child_count
        ranked.append((child_count, stamp[child], child))
        child = next_sibling[child]
    if len(ranked) <= 2 * breadth:
        ranked.sort(reverse=True)
        return total, ranked[:breadth]
    return total, heapq.nlargest(breadth, ranked)


def _grow(trie: Trie, matched: int, budget: int, breadth: int) -> tuple[list[int], list[int]]:
    """Best-first expansion below node `matched`: (draft tokens, their local parents), where
    local 0 is the root; every parent precedes its children."""
    drafts: list[int] = []
    parents: list[int] = []
    # Heap entries: (-path frequency, push order, node id, parent local id).
    frontier: list[tuple[float, int, int, int]] = []
    pushed = 0
    first_child, token = trie.first_child, trie.token

    def push_children(node: int, local: int, path_score: float) -> None:
        nonlocal pushed
        child_total, ranked = _ranked(trie, node, breadth)
        scale = path_score / child_total
        for count, _, child in ranked:
            heapq.heappush(frontier, (-scale * count, pushed, child, local))
            pushed += 1

    push_children(matched, 0, 1.0)
    while frontier and len(drafts) < budget:
        negative_score, _, node, parent_local = heapq.heappop(frontier)
        drafts.append(token[node])
        parents.append(parent_local)
        if first_child[node] >= 0:
            push_children(node, len(drafts), -negative_score)
    return drafts, parents
