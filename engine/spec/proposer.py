"""The n-gram proposer: each request's occurrence index (plus a shared corpus trie) and draft
trees from them.

A draft grows best-first from the longest suffix of the request's tokens that occurred before
with a continuation: each candidate is scored by its path's continuation frequency, children
ranked by count then recency. A request's index costs O(1) a token; the matching is done when a
draft is proposed. The corpus is a `Trie` (built once, bounded by `SpecConfig.capacity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.spec.config import SpecConfig
from engine.spec.grow import Continuations, TrieNodes, grow
from engine.spec.occurrences import OccurrenceIndex
from engine.spec.tree import DraftTree
from engine.spec.trie import Trie
from engine.state.batch import DraftTrees
from engine.state.seqlens import INDEX_DTYPE


class NgramProposer:
    """Draft trees for requests from the n-grams they (and the corpus) have seen."""

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config if config is not None else SpecConfig()
        self._requests: dict[int, OccurrenceIndex] = {}
        self._corpus: TrieNodes | None = None
        self._documents = 0

    # --- histories ----------------------------------------------------------------------
    def add_request(self, rid: int, prompt_tokens: Sequence[int]) -> None:
        if rid in self._requests:
            raise KeyError(f"request {rid} is already known to the proposer")
        cfg = self.config
        history = OccurrenceIndex(
            key_len=min(cfg.min_match, 2),
            depth=cfg.max_trie_depth,
            max_candidates=cfg.capacity // cfg.max_trie_depth,
        )
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
            self._corpus = TrieNodes(Trie(self.config.max_trie_depth, self.config.capacity))
        self._documents += 1
        self._corpus.trie.add(tokens, stream=self._documents)
        self._corpus.trie.close(self._documents)

    def __contains__(self, rid: int) -> bool:
        return rid in self._requests

    def history(self, rid: int) -> list[int]:
        return list(self._history(rid).tokens)

    def _history(self, rid: int) -> OccurrenceIndex:
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

    def may_draft(self, rid: int) -> bool:
        """Whether a draft for the request could match now: its last key occurred before with
        a token after it, or the corpus continues its last `min_match` tokens. False means
        no budget drafts anything (`propose` gives a root alone); one lookup each, so most
        steps of free text end here."""
        history = self._history(rid)
        tokens = history.tokens
        if len(tokens) < self.config.min_match:
            return False
        if history.occurred(tokens):
            return True
        return self._corpus_continues(tokens)

    def _corpus_continues(self, tokens: Sequence[int]) -> bool:
        """Whether the corpus has a continuation of the last `min_match` tokens. Where it has
        none, no longer suffix has one (a window holding a longer suffix and its next token
        holds the shorter suffix and that token too, and is no older)."""
        corpus = self._corpus
        return corpus is not None and corpus.continues(
            corpus.trie.find(tokens[len(tokens) - self.config.min_match :])
        )

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
        trees = self.draft_batch(rids, budgets, total_drafts)
        if trees is None:
            roots = [self._history(int(rid)).tokens[-1] for rid in rids]
            return DraftTrees.roots_only(np.array(roots, dtype=INDEX_DTYPE))
        return trees

    def draft_batch(
        self,
        rids: Sequence[int],
        budgets: Sequence[int] | None = None,
        total_drafts: int | None = None,
    ) -> DraftTrees | None:
        """`propose_batch`, or None where no request drafts (no tree beyond its root is
        built then)."""
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
            return None
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
        self, history: OccurrenceIndex, tokens: Sequence[int], budget: int
    ) -> tuple[list[int], list[int], int] | None:
        """(drafts, their local parents, match length) below the longest matching suffix of
        `tokens`, or None where nothing is drafted (no budget, or no match)."""
        if budget == 0:
            return None
        matched = self._match(history, tokens, budget)
        if matched is None:
            return None
        source, node, match_len = matched
        drafts, parents = grow(source, node, budget, self.config.breadth(match_len))
        return drafts, parents, match_len

    def _match(
        self, history: OccurrenceIndex, tokens: Sequence[int], budget: int
    ) -> tuple[Continuations, Any, int] | None:
        """(source, node, length) of the longest suffix of `tokens` (max_match down to
        min_match) that occurred with a continuation, or None; at equal lengths the
        request's own history before the corpus. A tree of `budget` drafts reads at most
        `budget` tokens after each of the history's occurrences."""
        cfg = self.config
        if len(tokens) < cfg.min_match:
            return None
        longest = min(cfg.max_match, len(tokens))
        own_len, own_ends = history.match(tokens, longest, cfg.min_match)
        corpus = self._corpus
        # most steps of free text look the corpus up once (`_corpus_continues`)
        if corpus is not None and self._corpus_continues(tokens):
            for match_len in range(longest, max(own_len, cfg.min_match - 1), -1):
                node = corpus.trie.find(tokens[len(tokens) - match_len :])
                if corpus.continues(node):
                    return corpus, node, match_len
        if own_len == 0:
            return None
        window = history.window(own_len, own_ends, width=budget)
        return window, window.root, own_len


def _check_rooted(rid: int, tokens: Sequence[int]) -> None:
    if not tokens:
        raise ValueError(f"request {rid} has no tokens to root a draft tree at")
