"""A request's tokens and an occurrence index over them: the n-gram source its drafts grow from.

A token costs O(1) to add (append it, register one key); the matching, and the grouping of
the matched occurrences by the tokens after them, happen when a draft is proposed: in Python
where they are few (up to `ROWS` occurrences, grouped by their distinct runs of tokens after),
with numpy over all the occurrences at once where they are many. The whole history is kept
(no eviction): memory is O(tokens), bounded by the request's context, and a match reaches
back to its first token.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.spec.grow import Continuation

PAD = 64  # -1 entries before the tokens' numpy copy (and at least as many after them)
# numpy's calls cost more than Python's loops over a few dozen occurrences:
SMALL = 8  # occurrences up to this many are grouped in Python by each node's next token (`Few`)
ROWS = 128  # more than SMALL, up to this many: grouped in Python by their runs (`Rows`)
MATCH = 64  # (of the newest max_candidates) up to this many are matched in Python
_TOKEN_LIMIT = 1 << 32


class OccurrenceIndex:
    """A request's tokens (`tokens`); for each `key_len`-gram, the end positions of its
    occurrences that a token follows, oldest first. A match reads the newest
    `max_candidates` occurrences of the suffix's last `key_len` tokens."""

    __slots__ = ("tokens", "depth", "key_len", "max_candidates", "_ends", "_mirror", "_mirrored")

    def __init__(self, key_len: int, depth: int, max_candidates: int) -> None:
        if key_len not in (1, 2) or not 2 <= depth <= PAD or max_candidates < 1:
            raise ValueError(
                f"an occurrence index needs key_len 1 or 2, depth in [2, {PAD}] and "
                f"max_candidates >= 1; got key_len={key_len}, depth={depth}, "
                f"max_candidates={max_candidates}"
            )
        self.tokens = array("q")
        self.depth = depth
        self.key_len = key_len
        self.max_candidates = max_candidates
        self._ends: dict[int, array[int]] = {}
        # tokens[:_mirrored] at PAD.., -1 around them; brought up to date by `_array`
        self._mirror = np.full(2 * PAD, -1, dtype=np.int64)
        self._mirrored = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Append `tokens`; each one registers the key that ends just before it."""
        new = [int(t) for t in tokens]
        if new and (min(new) < 0 or max(new) >= _TOKEN_LIMIT):
            raise ValueError(f"tokens must be in [0, 2**32); got {min(new)}..{max(new)}")
        stream, ends = self.tokens, self._ends
        start = len(stream)
        stream.extend(new)
        pair = self.key_len == 2
        for end in range(max(start, self.key_len) - 1, len(stream) - 1):
            key = (stream[end - 1] << 32) | stream[end] if pair else stream[end]
            found = ends.get(key)
            if found is None:
                ends[key] = array("q", (end,))
            else:
                found.append(end)

    def occurred(self, context: Sequence[int]) -> bool:
        """Whether the last `key_len` tokens of `context` occurred here with a token after
        them: a match needs it (one lookup)."""
        return self._found(context) is not None

    def _found(self, context: Sequence[int]) -> array[int] | None:
        """The ends of the occurrences of the last `key_len` tokens of `context` that a token
        follows, or None (none, or too few tokens)."""
        if len(context) < self.key_len:
            return None
        last = [int(t) for t in context[len(context) - self.key_len :]]
        if not all(0 <= t < _TOKEN_LIMIT for t in last):  # (a key packs two 32-bit tokens)
            return None
        return self._ends.get((last[0] << 32) | last[1] if self.key_len == 2 else last[0])

    def match(self, context: Sequence[int], longest: int, shortest: int) -> tuple[int, Any]:
        """The longest suffix of `context` (`longest` down to `shortest` >= key_len tokens)
        that occurs here followed by a token: its length and the ends of its occurrences
        (ascending: a list of a few, else an array), or 0 and no ends where none does."""
        found = self._found(context)
        if found is None:
            return 0, []
        suffix = [int(t) for t in context[len(context) - longest :]]
        found = found[-self.max_candidates :]
        matched: tuple[int, Any] = (
            self._match_few(found, suffix)
            if len(found) <= MATCH
            else self._match_many(found, suffix)
        )
        return matched if matched[0] >= shortest else (0, [])

    def _match_few(self, found: array[int], suffix: list[int]) -> tuple[int, list[int]]:
        stream = self.tokens
        ends = found.tolist()
        matched = self.key_len
        # Narrow the candidates one token back at a time, while any agrees (as `_match_many`).
        for back in range(self.key_len, len(suffix)):
            token = suffix[~back]
            agree = [end for end in ends if end >= back and stream[end - back] == token]
            if not agree:
                break
            ends = agree
            matched = back + 1
        return matched, ends

    def _match_many(self, found: array[int], suffix: list[int]) -> tuple[int, np.ndarray]:
        ends = np.array(found, dtype=np.int64)
        mirror = self._array()
        matched = self.key_len
        # Narrow the candidates one token back at a time, while any agrees (the -1 before
        # the tokens never does).
        for back in range(self.key_len, len(suffix)):
            same = mirror[PAD - back :][ends] == suffix[~back]
            agree = np.count_nonzero(same)
            if agree == 0:
                break
            if agree < ends.size:
                ends = ends[same]
            matched = back + 1
        return matched, ends

    def window(self, match_len: int, ends: Any, width: int) -> Rows | Few | Window:
        """The occurrences ending at `ends` of a suffix of `match_len` tokens and up to
        `width` tokens after each (fewer past `depth`), as a source of continuations (from
        its `root`)."""
        width = min(width, self.depth - match_len)  # a window holds at most `depth` tokens
        if len(ends) <= SMALL:
            return Few(self.tokens, [end + 1 for end in ends], width, match_len)
        if len(ends) <= ROWS:
            ends = ends if isinstance(ends, list) else ends.tolist()
            return Rows(self.tokens, [end + 1 for end in ends], width, match_len)
        return Window(self._array(), self.tokens, np.asarray(ends) + 1, width, match_len)

    def _array(self) -> np.ndarray:
        """The tokens' numpy copy (padded with -1), brought up to date."""
        size = len(self.tokens)
        if self._mirrored < size:
            if PAD + size + PAD > self._mirror.size:
                grown = np.full(2 * (PAD + size + PAD), -1, dtype=np.int64)
                grown[PAD : PAD + self._mirrored] = self._mirror[PAD : PAD + self._mirrored]
                self._mirror = grown
            self._mirror[PAD + self._mirrored : PAD + size] = self.tokens[self._mirrored :]
            self._mirrored = size
        return self._mirror


class Few:
    """A few occurrences of a matched suffix as a source of continuations, grouped in Python
    (node: the column of the tokens after it, and the positions after its occurrences)."""

    __slots__ = ("stream", "width", "match_len", "root")

    def __init__(
        self, stream: array[int], following: list[int], width: int, match_len: int
    ) -> None:
        self.stream = stream
        self.width = width
        self.match_len = match_len
        self.root = (0, following)

    def ranked(self, node: tuple[int, list[int]], breadth: int) -> tuple[int, list[Continuation]]:
        """`Continuations.ranked`."""
        column, following = node
        if column >= self.width:
            return 0, []
        stream, end = self.stream, len(self.stream) - column
        if len(following) == 1:  # (most nodes of free text's matches: one occurrence)
            position = following[0]
            if position >= end:
                return 0, []
            child = (column + 1, following)
            return 1, [(1, position - self.match_len, stream[position + column], child)]
        groups: dict[int, list[int]] = {}
        for position in following:
            if position >= end:
                break  # ascending: the rest ran past the stream too
            groups.setdefault(stream[position + column], []).append(position)
        total = 0
        ranked = []
        for token, group in groups.items():
            total += len(group)
            ranked.append((len(group), group[-1] - self.match_len, token, (column + 1, group)))
        ranked.sort(key=_count_and_stamp, reverse=True)
        return total, ranked[:breadth]


class Rows:
    """The occurrences of a matched suffix as a source of continuations, grouped in Python:
    the distinct runs of up to `width` tokens after them (shorter where the stream ends), a
    row each with its occurrences' count and newest position, sorted by their bytes. Rows that
    share a prefix are then a range, those that end after it first; a node is (column, first
    row, end row): rows first..end-1 hold its path, and `column` indexes the tokens after it.
    A node whose rows all go on with one token has one continuation (its first and last rows
    agree there), found without a scan."""

    __slots__ = ("rows", "counts", "newest", "width", "match_len", "root")

    def __init__(
        self, stream: array[int], following: list[int], width: int, match_len: int
    ) -> None:
        """`following`: the position after each occurrence (ascending)."""
        found: dict[bytes, list[int]] = {}
        with memoryview(stream) as view:  # (a view held would keep the stream from growing)
            for position in following:
                key = view[position : position + width].tobytes()
                seen = found.get(key)
                if seen is None:
                    found[key] = [position, 1, position]
                else:
                    seen[1] += 1
                    seen[2] = position  # ascending: the newest so far
        keys = sorted(found)
        firsts = [found[key] for key in keys]
        self.rows = [stream[first : first + width] for first, _, _ in firsts]
        self.counts = [count for _, count, _ in firsts]
        self.newest = [newest for _, _, newest in firsts]
        self.width = width
        self.match_len = match_len
        self.root = (0, 0, len(keys))

    def ranked(self, node: tuple[int, int, int], breadth: int) -> tuple[int, list[Continuation]]:
        """`Continuations.ranked`."""
        column, first, end = node
        rows = self.rows
        while first < end and len(rows[first]) <= column:  # rows that ended sort first
            first += 1
        if first == end:
            return 0, []
        counts, newest = self.counts, self.newest
        token = rows[first][column]
        if rows[end - 1][column] == token:
            total = sum(counts[first:end]) if end - first > 1 else counts[first]
            stamp = max(newest[first:end]) - self.match_len
            return total, [(total, stamp, token, (column + 1, first, end))]
        ranked = []
        total = 0
        head = first
        for row in range(first + 1, end + 1):
            if row == end or rows[row][column] != token:
                count = sum(counts[head:row])
                stamp = max(newest[head:row]) - self.match_len
                ranked.append((count, stamp, token, (column + 1, head, row)))
                total += count
                if row < end:
                    head, token = row, rows[row][column]
        ranked.sort(key=_count_and_stamp, reverse=True)
        return total, ranked[:breadth]


# A node below a match: (column, first row, end row, chain): the rows first..end-1 are the
# occurrences of the match and the node's path; `column` indexes the tokens after it. A
# chain (its first column, each column's `ranked`) holds the continuations, computed at
# once, of a run of nodes that each have one.
Chain = tuple[int, list[tuple[int, list[Continuation]]]]
Node = tuple[int, int, int, Chain | None]


class Window:
    """The occurrences of a matched suffix, a row each, and the tokens after each (-1 past the
    stream's end): a source of continuations. A node's rows are a range, kept in the order of
    their positions (oldest first), so its rows whose stream ended are its last ones and its
    newest occurrence is the last that goes on. Expanding a node where its rows part ways
    sorts that range by the next token (stably), which leaves each child's rows a range."""

    __slots__ = ("columns", "following", "stream_end", "match_len", "root", "few")

    def __init__(
        self,
        mirror: np.ndarray,
        stream: array[int],
        following: np.ndarray,
        width: int,
        match_len: int,
    ) -> None:
        """`following`: the position after each occurrence (ascending); `mirror`: the
        `stream`'s tokens at PAD.., -1 around them."""
        self.columns = mirror[PAD + following + np.arange(width)[:, None]]  # [width, rows]
        self.following = following
        self.stream_end = len(stream)
        self.match_len = match_len
        self.root: Node = (0, 0, following.size, None)
        # a node of a few rows, and the nodes below it, are grouped in Python (a `Few` node)
        self.few = Few(stream, [], width, match_len)

    def ranked(self, node: Any, breadth: int) -> tuple[int, list[Continuation]]:
        """`Continuations.ranked` (node: a `Node`, or a `Few` node)."""
        if len(node) == 2:
            return self.few.ranked(node, breadth)
        column, first, end, chain = node
        if end - first <= SMALL and chain is None:
            return self.few.ranked((column, self.following[first:end].tolist()), breadth)
        if chain is not None and column - chain[0] < len(chain[1]):
            return chain[1][column - chain[0]]
        if column >= len(self.columns):
            return 0, []
        rows = self.following[first:end]
        going_on = int(rows.searchsorted(self.stream_end - column))
        if going_on == 0:
            return 0, []
        tokens = self.columns[column, first : first + going_on]
        if np.count_nonzero(tokens == tokens[0]) == going_on:
            return self._chain(column, first, end)[1][0]
        return going_on, self._branch(column, first, going_on, breadth)

    def _chain(self, column: int, first: int, end: int) -> Chain:
        """The continuations of the run of nodes with one continuation each, from `column`
        on (each node's `ranked`, computed at once)."""
        rows = self.following[first:end]
        going_on = rows.searchsorted(self.stream_end - np.arange(column, len(self.columns)))
        block = self.columns[column:, first:end]
        agree = np.count_nonzero(block == block[:, :1], axis=1)
        single = agree == going_on  # (rows that ran out, -1, never agree with a first that goes on)
        run = int(single.size if single.all() else np.argmin(single))
        counts = going_on[:run]
        stamps = (rows[counts - 1] - self.match_len).tolist()
        ranked: list[tuple[int, list[Continuation]]] = []
        chain = (column, ranked)
        for at, (token, count) in enumerate(
            zip(block[:run, 0].tolist(), counts.tolist(), strict=True)
        ):
            child = (column + at + 1, first, first + count, chain)
            ranked.append((count, [(count, stamps[at], token, child)]))
        return chain

    def _branch(self, column: int, first: int, going_on: int, breadth: int) -> list[Continuation]:
        """Sort the node's rows that go on by their next token (stably) and rank the groups."""
        end = first + going_on
        order = np.argsort(self.columns[column, first:end], kind="stable")
        block = self.columns[column:, first:end][:, order]
        self.columns[column:, first:end] = block
        following = self.following[first:end][order]
        self.following[first:end] = following
        # grouped in Python: a few dozen rows cost less in a loop than in numpy calls per group
        tokens, positions = block[0].tolist(), following.tolist()
        ranked = []
        head = 0
        for row in range(1, going_on + 1):
            if row == going_on or tokens[row] != tokens[head]:
                # the group's newest occurrence is its last row (positions ascend in a group)
                stamp = positions[row - 1] - self.match_len
                child = (column + 1, first + head, first + row, None)
                ranked.append((row - head, stamp, tokens[head], child))
                head = row
        ranked.sort(key=_count_and_stamp, reverse=True)
        return ranked[:breadth]


def _count_and_stamp(continuation: Continuation) -> tuple[int, int]:
    return continuation[0], continuation[1]
