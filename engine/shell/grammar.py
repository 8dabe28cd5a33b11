"""Structured output: each constrained request's grammar (llguidance) as a matcher that follows
the request's committed tokens and gives the token mask of its next position. A pass's masks
set every token its grammar does not allow to -inf before sampling; with speculation, drafts
the grammar rejects are cut from their trees and every tree node gets the mask of its path.
"""

from __future__ import annotations

import collections
import enum
import functools
import json
import threading
import time
from collections.abc import Collection, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from engine.errors import InvalidRequest
from engine.model.sampling import greedy_tokens
from engine.shell.masks import POOL, SERIAL, MaskFills, PendingMasks, apply_masks
from engine.spec import prune
from engine.state import DraftTrees, StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stub's type; not at runtime

# JSON comes out compact (no whitespace between tokens): a small model can otherwise spend its
# tokens on newlines. A schema's "x-guidance" options override this.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
COMPILED_KEPT = 256  # compiled grammars kept (by their StructuredOutputs value)
# A greedy row whose checked tokens were refused twice in a row is masked first for its next
# 1, 2, 4, ... passes (a model that rarely follows its grammar pays for a mask, not a redraw
# and a pass launched ahead from the refused token), then checked again; at most this many
# in a row. One refusal alone starts no run: most are alone (a model's first token, before
# the grammar's first character; a space the grammar does not allow), and a masked pass is
# not launched ahead.
MASKED_FIRST_MAX = 64


class Progress(enum.Enum):
    """Where a request's grammar stands after its new tokens."""

    OPEN = "open"  # more tokens may follow
    COMPLETE = "complete"  # the grammar is finished: nothing but EOS may follow
    REJECTED = "rejected"  # a token the grammar does not allow (masks should prevent it)


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of `spec` (not yet checked: `Grammars.compile` checks it)."""
    matcher = llguidance.LLMatcher
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.grammar is not None:
        return matcher.grammar_from_lark(spec.grammar)
    if spec.choice is not None:
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return matcher.grammar_from_json_schema(spec.schema, defaults=JSON_OPTIONS)


class _Bytes:
    """A vocabulary where token id i < 256 is byte i, for engines without a tokenizer
    (random weights): their grammars constrain token ids as bytes. Other ids are special."""

    def __init__(self, vocab_size: int, eos_id: int) -> None:
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        self.special_token_ids = sorted({eos_id, *range(256, vocab_size)})

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.lru_cache(maxsize=8)
def grammar_vocabulary(tokenizer: Any, vocab_size: int, eos_id: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokens (about a second for a 50k vocabulary: kept
    per tokenizer)."""
    if tokenizer is None:
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes(vocab_size, eos_id)))
    eos = eos_id if eos_id >= 0 else tokenizer.eos_token_id
    return llguidance.hf.from_tokenizer(
        tokenizer.hf, n_vocab=max(vocab_size, tokenizer.vocab_size), eos_token=eos
    )


class Grammars:
    """Compiles requests' grammars (any thread) and keeps the matchers of the constrained
    requests in flight, by uid (the loop's thread). `stats` counts the masks computed
    (`grammar_masks`), the host time they took (`grammar_mask_seconds`), the part of it the
    loop waited for (`grammar_mask_wait_seconds`: with a GPU, what the pass's forward did
    not hide), the drafts cut before verify (`grammar_drafts_cut`), and the greedy tokens
    checked, drawn again and masked first (`grammar_tokens_checked`, `_redrawn`,
    `_masked_first`). `parallel`: a pass's masks are filled off the loop's thread while the
    loop goes on (`fills`, a `MaskFills`: how and where they are filled)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_id: int,
        stats: MutableMapping[str, Any] | None = None,  # counts and seconds
        parallel: bool = False,
    ) -> None:
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.stats: MutableMapping[str, Any] = collections.Counter() if stats is None else stats
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        # uid -> [passes still masked first, length of its last masked run] (`checks_first`)
        self._masked_runs: dict[int, list[int]] = {}
        self._vocabulary: llguidance.LLTokenizer | None = None
        # by spec: its grammar and a matcher at its start, which each request's copies
        self._compiled: collections.OrderedDict[
            StructuredOutputs, tuple[str, llguidance.LLMatcher]
        ] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.fills = MaskFills(self.stats, parallel)
        self._builder: threading.Thread | None = None

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (`prepare`); a caller meanwhile waits for it
            if self._vocabulary is None:
                self._vocabulary = grammar_vocabulary(self.tokenizer, self.vocab_size, self.eos_id)
            return self._vocabulary

    @property
    def ready(self) -> bool:
        """Whether the vocabulary is built (a constrained request then starts at once)."""
        return self._vocabulary is not None

    def prepare(self) -> None:
        """Build the vocabulary on a background thread (about a second for a 50k vocabulary),
        so that no request waits for it: an engine calls this when it starts."""
        if self._builder is None:
            self._builder = threading.Thread(
                target=self._build, name="grammar-vocabulary", daemon=True
            )
            self._builder.start()

    def wait_ready(self) -> None:
        """Block until the vocabulary is built (a server, before it takes requests); an error
        building it is left for the first constrained request to raise."""
        self.prepare()
        self._build()

    def _build(self) -> None:
        try:
            self.vocabulary  # noqa: B018 (builds it)
        except Exception:  # noqa: BLE001 (the first request that needs it raises it)
            pass

    def compile(self, spec: StructuredOutputs) -> str:
        """`spec`'s grammar, checked against the vocabulary; InvalidRequest naming the field
        (`structured_outputs.<kind>`) and what is wrong when it does not compile."""
        return self._compile(spec)[0]

    def _compile(self, spec: StructuredOutputs) -> tuple[str, llguidance.LLMatcher]:
        """`spec`'s grammar (`compile`) and a matcher at its start, made once (about half a
        millisecond for a JSON schema, on the submitting thread) and kept with it: a
        request's matcher is a copy (microseconds, on the loop's thread)."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        field = f"structured_outputs.{spec.kind}"
        try:
            text = grammar_text(spec)
        except ValueError as error:
            raise InvalidRequest(field, str(error)) from None
        problem = llguidance.LLMatcher.validate_grammar(text, self.vocabulary)
        if problem:
            raise InvalidRequest(field, f"does not compile: {problem.strip()}")
        start = llguidance.LLMatcher(self.vocabulary, text, log_level=0)
        with self._lock:
            self._compiled[spec] = (text, start)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return text, start

    # --- requests in flight (the loop's thread) ----------------------------------------------
    def __contains__(self, uid: int) -> bool:
        return uid in self.matchers

    def constrains(self, uids: Sequence[int]) -> bool:
        """Whether any of `uids` has a grammar."""
        return not self.matchers.keys().isdisjoint(uids)

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, uid: int, spec: StructuredOutputs, output_ids: Sequence[int] = ()) -> None:
        """Start `uid`'s matcher (past `output_ids`, the tokens it already has): a copy of
        the spec's start (`_compile`)."""
        matcher = self._compile(spec)[1].deep_copy()
        if output_ids:
            matcher.consume_tokens(list(output_ids))
        self.matchers[uid] = matcher

    def remove(self, uid: int) -> None:
        self.matchers.pop(uid, None)
        self._masked_runs.pop(uid, None)

    def checks_first(self, uid: int) -> bool:
        """Whether `uid`'s next greedy token is drawn unmasked and checked after (`allows`),
        rather than masked first: yes unless a refusal (`note_check`) asked for masked
        passes that remain; each call counts one pass."""
        run = self._masked_runs.get(uid)
        if run is None or run[0] == 0:
            return True
        run[0] -= 1
        self.stats["grammar_tokens_masked_first"] += 1
        return False

    def note_check(self, uid: int, allowed: bool) -> None:
        """A checked token's verdict: an allowed one ends `uid`'s masked runs; a refused one
        starts a run twice as long as its last (none after a first refusal, then 1, 2, 4,
        ..., at most `MASKED_FIRST_MAX`)."""
        if allowed:
            self._masked_runs.pop(uid, None)
            return
        last = self._masked_runs.get(uid)
        length = 0 if last is None else min(MASKED_FIRST_MAX, max(1, 2 * last[1]))
        self._masked_runs[uid] = [length, length]  # 0: the next token is checked first too

    def advance(self, uid: int, tokens: Sequence[int]) -> Progress:
        """`uid`'s matcher past its newly committed `tokens`."""
        return self.advance_all({uid: tokens})[uid]

    def advance_all(self, tokens: Mapping[int, Sequence[int]]) -> dict[int, Progress]:
        """Each uid's matcher past its newly committed tokens, by uid (one by one: about a
        microsecond a token, less than a hand-off to llguidance's pool costs)."""
        self.fills.settle()
        progress = {}
        for uid, committed in tokens.items():
            matcher = self.matchers[uid]
            if not matcher.consume_tokens([int(t) for t in committed]):
                progress[uid] = Progress.REJECTED
            else:
                progress[uid] = Progress.COMPLETE if matcher.is_stopped() else Progress.OPEN
        return progress

    def error(self, uid: int) -> str:
        return self.matchers[uid].get_error() or "a token the grammar does not allow"

    # --- masks ---------------------------------------------------------------------------------
    @property
    def words(self) -> int:
        """int32 words of one mask row."""
        return (self.vocabulary.vocab_size + 31) // 32

    def masks(self, uids: Sequence[int]) -> np.ndarray | None:
        """One mask row per uid (bit t of a row: token t allowed; unconstrained rows allow
        every token), None when no uid is constrained."""
        pending = self.start(uids)
        return None if pending is None else pending.host().copy()

    def allows(self, uid: int, token: int) -> bool:
        """Whether `uid`'s grammar allows `token` next (its matcher does not move)."""
        return self._allows(self.matchers[uid], token)

    def _allows(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        if not 0 <= token < self.vocabulary.vocab_size:
            return False  # past the grammar's vocabulary: never allowed (as in a mask)
        if token == self.vocabulary.eos_token:  # where the grammar may end (as in a mask)
            return matcher.is_accepting()
        return matcher.validate_tokens([token]) == 1

    def verify_paths(
        self, trees: DraftTrees, uids: Sequence[int], argmax: np.ndarray, logits: torch.Tensor
    ) -> np.ndarray:
        """A greedy verify pass's argmax per node (`argmax`, from the unmasked `logits`, one
        row per node) as its masked logits would give it along each constrained request's
        accepted path: from the root down, a node's token its grammar allows stands (the
        mask would leave it the maximum), a refused one is drawn again under the node's
        mask; the path goes on to the first child drafting that token. Greedy verification
        reads the argmax of the path's nodes only, so it accepts what it would with every
        node masked. Every draft is one its grammar allows (`prune`)."""
        if not self.constrains(uids):
            return argmax
        self.fills.settle()
        argmax = argmax.copy()
        for tree in _trees(trees, uids, self.matchers):
            self._verify_path(tree, argmax, logits)
        return argmax

    def _verify_path(self, tree: _Tree, argmax: np.ndarray, logits: torch.Tensor) -> None:
        """`verify_paths` for one tree (`argmax` corrected in place); its matcher ends where
        it started."""
        matcher = self.matchers[tree.uid]
        node, depth = 0, 0
        try:
            while True:
                flat = tree.start + node
                token = int(argmax[flat])
                self.stats["grammar_tokens_checked"] += 1
                if not self._allows(matcher, token):
                    self.stats["grammar_tokens_redrawn"] += 1
                    token = argmax[flat] = self._redraw(matcher, logits[flat : flat + 1])
                child = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
                if child is None:
                    return
                if not matcher.consume_token(token):
                    raise RuntimeError(
                        f"a draft its grammar rejects reached verify (request {tree.uid})"
                    )
                node, depth = child, depth + 1
        finally:
            if depth:
                matcher.rollback(depth)

    def _redraw(self, matcher: llguidance.LLMatcher, row: torch.Tensor) -> int:
        """The argmax of one logits row under `matcher`'s mask."""
        started = time.perf_counter()
        bitmask = np.empty((1, self.words), dtype=np.int32)
        llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        self.stats["grammar_masks"] += 1
        self.stats["grammar_mask_seconds"] += time.perf_counter() - started
        return int(greedy_tokens(apply_masks(row, bitmask)).item())

    def start(self, uids: Sequence[int], skip: Collection[int] = ()) -> PendingMasks | None:
        """Start filling a pass's masks (one row per uid, as `masks`; the rows in `skip`
        allow every token), None when no other uid is constrained. With `parallel` they are
        filled off this thread (unless a hand-off costs more) and this returns at once: the
        caller launches the pass's
        forward first, starts its masks, does its other host work, then applies them
        (`PendingMasks.apply`) in sampling."""
        rows = [
            (self.matchers[u], i)
            for i, u in enumerate(uids)
            if u in self.matchers and i not in skip
        ]
        if not rows:
            return None
        bitmask, words = self.fills.take(len(uids), self.words)
        if len(rows) < len(uids):  # the free rows allow everything; the others are filled
            free = np.ones(len(uids), dtype=bool)
            free[[row for _, row in rows]] = False
            bitmask[free] = -1
        fill = functools.partial(self.fills.fill_rows, rows, bitmask)
        return self.fills.submit(fill, bitmask, words, len(rows), self.fills.rows_way)

    def prune(self, trees: DraftTrees, uids: Sequence[int]) -> DraftTrees:
        """`trees` (one per uid) without the drafts a constrained request's grammar rejects
        after the path above them, nor anything below those. A draft that would complete
        the grammar is cut too: the grammar's last token is then always a pass's own
        (sampled) token, after which the request stops, as without speculation (a verify
        pass would add the EOS the grammar allows next)."""
        if not self.constrains(uids) or trees.sizes.total == len(uids):
            return trees
        self.fills.settle()
        keep = np.ones(trees.sizes.total, dtype=bool)
        for tree in _trees(trees, uids, self.matchers):
            _cut(self.matchers[tree.uid], tree, 0, keep)
        pruned = prune(trees, keep)
        self.stats["grammar_drafts_cut"] += trees.sizes.total - pruned.sizes.total
        return pruned

    def tree_masks(self, trees: DraftTrees, uids: Sequence[int]) -> np.ndarray | None:
        """One mask row per tree node (flat, in batch order): the mask after its request's
        tokens and the drafts on the path down to it; None when no uid is constrained.
        Every draft is one its grammar allows (`prune`)."""
        pending = self.start_tree(trees, uids)
        return None if pending is None else pending.host().copy()

    def start_tree(self, trees: DraftTrees, uids: Sequence[int]) -> PendingMasks | None:
        """Fill a verify pass's tree masks (as `tree_masks`) on this thread, after the
        pass's launch (the loop's other work before it verifies is short). A tree that is
        one path (most drafts) is filled by llguidance's pool with the others
        (`fill_next_token_bitmask_par_with_draft_tokens`) where `parallel` and the pool has
        measured faster; a branching one, or any otherwise, by a walk of it."""
        if not self.constrains(uids):
            return None
        fills = self.fills
        bitmask, words = fills.take(trees.sizes.total, self.words)
        bitmask.fill(-1)
        starts = trees.sizes.starts().tolist()
        lens = trees.sizes.lens.tolist()
        way = fills.trees_way.pick() if fills.parallel else SERIAL
        paths: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        branching: list[int] = []
        for i, uid in enumerate(uids):
            if uid not in self.matchers:
                continue
            flat = slice(starts[i], starts[i] + lens[i])
            if way == POOL and np.array_equal(trees.parents[flat], np.arange(-1, lens[i] - 1)):
                paths.append((self.matchers[uid], starts[i], trees.tokens[flat][1:].tolist()))
            else:
                branching.append(i)
        walks = [] if not branching else list(_trees(trees, uids, self.matchers, branching))
        count = sum(len(p) + 1 for _, _, p in paths) + sum(len(t.tokens) for t in walks)

        drafted = [path for path in paths if path[2]]
        roots = [(matcher, row) for matcher, row, drafts in paths if not drafts]

        def fill() -> None:
            started = time.perf_counter()
            if drafted:
                llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(
                    fills.pool(), drafted, bitmask
                )
            if roots:
                llg_numpy.fill_next_token_bitmask_par(fills.pool(), roots, bitmask)
            for tree in walks:
                _fill(self.matchers[tree.uid], tree, 0, bitmask)
            if fills.parallel:
                fills.trees_way.record(way, time.perf_counter() - started, count)

        # filled here: a verify pass has no other host work to do before it needs them
        return fills.submit(fill, bitmask, words, count, None)


@attrs.frozen
class _Tree:
    """One constrained request's draft tree: its uid, flat start, tokens by local node, and
    each node's children."""

    uid: int
    start: int
    tokens: list[int]
    children: list[list[int]]


def _trees(
    trees: DraftTrees, uids: Sequence[int], matchers: dict, among: Sequence[int] | None = None
) -> Iterator[_Tree]:
    """The trees of the constrained requests (of those at indices `among`, where given)."""
    starts = trees.sizes.starts().tolist()
    for i in range(len(uids)) if among is None else among:
        uid = uids[i]
        if uid not in matchers:
            continue
        size = int(trees.sizes.lens[i])
        flat = slice(starts[i], starts[i] + size)
        children: list[list[int]] = [[] for _ in range(size)]
        for local, parent in enumerate(trees.parents[flat].tolist()[1:], start=1):
            children[parent].append(local)
        yield _Tree(uid, starts[i], trees.tokens[flat].tolist(), children)


def _cut(matcher: llguidance.LLMatcher, tree: _Tree, node: int, keep: np.ndarray) -> None:
    """Mark in `keep` the children of `node` (the matcher is at its path's end) that the
    grammar rejects or that complete it, and the same below the others; the matcher ends
    where it started."""
    for child in tree.children[node]:
        if matcher.try_consume_tokens([tree.tokens[child]]) != 1:
            keep[tree.start + child] = False
            continue
        if matcher.is_stopped():
            keep[tree.start + child] = False
        else:
            _cut(matcher, tree, child, keep)
        matcher.rollback(1)


def _fill(matcher: llguidance.LLMatcher, tree: _Tree, node: int, bitmask: np.ndarray) -> None:
    """Fill the mask rows of `node` (the matcher is at its path's end) and of everything
    below it; the matcher ends where it started."""
    llg_numpy.fill_next_token_bitmask(matcher, bitmask, tree.start + node)
    for child in tree.children[node]:
        if not matcher.consume_token(tree.tokens[child]):
            raise RuntimeError(f"a draft its grammar rejects reached verify (request {tree.uid})")
        _fill(matcher, tree, child, bitmask)
        matcher.rollback(1)
