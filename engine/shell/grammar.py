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
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from engine.errors import InvalidRequest
from engine.model.sampling import host_to_device
from engine.spec import prune
from engine.state import DraftTrees, StructuredOutputs

# JSON comes out compact (no whitespace between tokens): a small model can otherwise spend its
# tokens on newlines. A schema's "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_flexible": False}
COMPILED_KEPT = 256  # compiled grammars kept (by their StructuredOutputs value)


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
    (`grammar_masks`), the host time they took (`grammar_mask_seconds`) and the drafts cut
    before verify (`grammar_drafts_cut`). `parallel`: a
    pass's masks are computed on a pool of host threads (with a GPU, while it runs the pass;
    on a CPU the cores run the model, and a pool's threads wait behind it)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_id: int,
        stats: collections.Counter | None = None,
        parallel: bool = False,
    ) -> None:
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.parallel = parallel
        self.stats = collections.Counter() if stats is None else stats
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[StructuredOutputs, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None
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
        with self._lock:
            self._compiled[spec] = text
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return text

    # --- requests in flight (the loop's thread) ----------------------------------------------
    def __contains__(self, uid: int) -> bool:
        return uid in self.matchers

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, uid: int, spec: StructuredOutputs, output_ids: Sequence[int] = ()) -> None:
        """Start `uid`'s matcher (past `output_ids`, the tokens it already has)."""
        matcher = llguidance.LLMatcher(self.vocabulary, self.compile(spec), log_level=0)
        if output_ids:
            matcher.consume_tokens(list(output_ids))
        self.matchers[uid] = matcher

    def remove(self, uid: int) -> None:
        self.matchers.pop(uid, None)

    def advance(self, uid: int, tokens: Sequence[int]) -> Progress:
        """`uid`'s matcher past its newly committed `tokens`."""
        matcher = self.matchers[uid]
        if not matcher.consume_tokens([int(t) for t in tokens]):
            return Progress.REJECTED
        return Progress.COMPLETE if matcher.is_stopped() else Progress.OPEN

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
        rows = [(self.matchers[u], i) for i, u in enumerate(uids) if u in self.matchers]
        if not rows:
            return None
        started = time.perf_counter()
        bitmask = np.full((len(uids), self.words), -1, dtype=np.int32)
        if self.parallel and len(rows) > 1:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        else:
            for matcher, row in rows:
                llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
        self._count(len(rows), started)
        return bitmask

    def prune(self, trees: DraftTrees, uids: Sequence[int]) -> DraftTrees:
        """`trees` (one per uid) without the drafts a constrained request's grammar rejects
        after the path above them, nor anything below those. A draft that would complete
        the grammar is cut too: the grammar's last token is then always a pass's own
        (sampled) token, after which the request stops, as without speculation (a verify
        pass would add the EOS the grammar allows next)."""
        if self.matchers.keys().isdisjoint(uids) or trees.sizes.total == len(uids):
            return trees
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
        if self.matchers.keys().isdisjoint(uids):
            return None
        started = time.perf_counter()
        bitmask = np.full((trees.sizes.total, self.words), -1, dtype=np.int32)
        rows = 0
        for tree in _trees(trees, uids, self.matchers):
            _fill(self.matchers[tree.uid], tree, 0, bitmask)
            rows += len(tree.tokens)
        self._count(rows, started)
        return bitmask

    def _count(self, masks: int, started: float) -> None:
        self.stats["grammar_masks"] += masks
        self.stats["grammar_mask_seconds"] += time.perf_counter() - started


@attrs.frozen
class _Tree:
    """One constrained request's draft tree: its uid, flat start, tokens by local node, and
    each node's children."""

    uid: int
    start: int
    tokens: list[int]
    children: list[list[int]]


def _trees(trees: DraftTrees, uids: Sequence[int], matchers: dict) -> Iterator[_Tree]:
    starts = trees.sizes.starts().tolist()
    for i, uid in enumerate(uids):
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


def apply_masks(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """`logits` [rows, vocab] with every token its row's mask does not allow at -inf (a new
    tensor). Ids past the grammar's vocabulary are never allowed."""
    if logits.device.type == "cpu":
        allowed = torch.from_numpy(
            np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)
        )
    else:  # the words cross (pinned, without waiting for the pass), then unpack there
        allowed = unpack_words(host_to_device(bitmask, logits.device))
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return torch.where(allowed[:, :vocab], logits, float("-inf"))


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 masks -> [rows, 32 * words] bool (bit b of word w: token 32w + b)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> shifts) & 1).bool().flatten(1)
