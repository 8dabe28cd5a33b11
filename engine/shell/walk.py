"""A verify pass's greedy walk along each tree's best path, on the device, so that the decode
pass after it launches before the host has read anything.

Greedy acceptance is the host's walk (`spec.verify_greedy`): from the root, the first child
whose token is the target's argmax at its parent. Along one path, the best (each node's
first child: the proposer ranks siblings best first), it is a prefix comparison of the
path's draft tokens with the argmax at their parents, which the device can do right after
the verify pass: `a`, the drafts it accepts there, gives the next decode pass's input (the
argmax at the last accepted node), its position and its keys (the accepted nodes' slots,
written to the request's row on the device). The pass planned during the verify pass, for
the outcome in which nothing is accepted, is launched moved on by `a` (`shift`). The host
then walks as always: where its accepted path is the device's, the launched pass is laid out
for it (`state.assume_decoded` with the accepted counts); where another branch was accepted
(the best path's drafts are the ones accepted in nearly every verify step), the pass is
dropped and the row entries the device wrote past the host's path are cleared (`cleared`).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from engine import state
from engine.backends.base import upload
from engine.model.sampling import greedy_tokens
from engine.shell.logits import Sampled
from engine.shell.table import RequestTable
from engine.spec.tree import child_links
from engine.spec.verify import VerifyOutcome
from engine.state import PADDING_SLOT, DraftTrees


@attrs.frozen(eq=False)
class BestPaths:
    """Each tree's best path: from the root, each node's first child (the lowest id). `nodes`
    [trees, depth + 1]: local ids, the root's first, padded with each path's last node (a
    child's id is above its parent's, so a path's steps are where its ids change)."""

    nodes: np.ndarray

    @classmethod
    def of(cls, trees: DraftTrees) -> BestPaths:
        first_child, _ = child_links(trees)
        starts = trees.sizes.starts()
        node = np.zeros(len(trees.sizes), dtype=np.int64)  # each path's last node so far
        path = [node]
        while True:  # one step down every path at once, as deep as the deepest
            child = first_child[starts + node]
            going = child >= 0
            if not going.any():
                break
            node = np.where(going, child, node)
            path.append(node)
        return cls(np.stack(path, axis=1))

    @property
    def lens(self) -> np.ndarray:
        """Each path's drafts (0: a root alone)."""
        return np.count_nonzero(np.diff(self.nodes, axis=1), axis=1)

    @property
    def depth(self) -> int:
        """The longest path's drafts."""
        return self.nodes.shape[1] - 1

    def accepted(self, trees: DraftTrees, argmax: np.ndarray) -> np.ndarray:
        """Per tree, the drafts a greedy walk accepts along its best path (`argmax`: the
        target's per node): the host's count of what the device found."""
        flat = self.nodes + trees.sizes.starts()[:, None]
        match = trees.tokens[flat[:, 1:]] == argmax[flat[:, :-1]]
        match &= np.arange(1, self.depth + 1) <= self.lens[:, None]
        return np.cumprod(match, axis=1).sum(axis=1)


@attrs.frozen(eq=False)
class DeviceWalk:
    """A verify pass walked along its best paths on the device (`launch`): `argmax` (its
    copy to the host started), `ids` and `shift` (the next decode pass's input tokens and
    the drafts each request accepted, on the device), for verify pass `batch`."""

    batch: state.Batch
    paths: BestPaths
    argmax: Sampled
    ids: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def launch(cls, logits: torch.Tensor, batch: state.Batch, table: RequestTable) -> DeviceWalk:
        """Walk verify pass `batch` (its `logits`, one row per node, on the device) along its
        best paths, queued on the device after it; the accepted drafts' slots are written
        to their requests' rows on the device (`table`), at their positions (the positions
        past them on each best path keep their entries)."""
        trees = batch.trees
        assert trees is not None
        paths = BestPaths.of(trees)
        run = batch.running
        starts = trees.sizes.starts()
        flat = paths.nodes + starts[:, None]
        depth = paths.depth
        below = np.arange(1, depth + 1)
        on_path = below <= paths.lens[:, None]
        # each draft's place in its row (the root's place past a path's end: rewritten as is)
        cols = run.kv_lens.lens[:, None] + np.where(on_path, below, 0)
        places = run.rows[:, None].astype(np.int64) * table.max_context + cols
        on_device = upload(
            logits.device,
            {
                "flat": flat.reshape(-1),
                "tokens": np.where(on_path, trees.tokens[flat[:, 1:]], -1).reshape(-1),
                "places": places.reshape(-1),
                "slots": batch.out_slots[flat[:, 1:]].astype(np.int64).reshape(-1),
            },
        )
        argmax = greedy_tokens(logits)
        copied = Sampled.copying(argmax, None)
        nodes = on_device["flat"].view(len(run), depth + 1)
        match = argmax[nodes[:, :-1]] == on_device["tokens"].view(len(run), depth)
        shift = match.cumprod(dim=1).sum(dim=1)  # int64: the drafts accepted
        ids = argmax[nodes.gather(1, shift[:, None]).squeeze(1)]
        keep = torch.arange(1, depth + 1, device=logits.device)[None, :] <= shift[:, None]
        table.write_on_device(on_device["places"], on_device["slots"], keep.reshape(-1))
        return cls(batch, paths, copied, ids, shift)

    def target(self) -> np.ndarray:
        """The verify pass's argmax per node on the host (the host's walk reads it)."""
        return self.argmax.tokens_on_host()

    def confirmed(self, outcome: VerifyOutcome, target: np.ndarray) -> np.ndarray | None:
        """The drafts each request accepted, where the host's walk (`outcome`, of `target`)
        accepted the paths the device's did; None where a request accepted another
        branch."""
        trees = self.batch.trees
        assert trees is not None
        counts = self.paths.accepted(trees, target)
        # the device's paths, in the outcome's layout (each request's nodes below its root)
        on_path = np.arange(1, self.paths.depth + 1) <= counts[:, None]
        if not np.array_equal(counts, outcome.accepted_lens.lens) or not np.array_equal(
            self.paths.nodes[:, 1:][on_path], outcome.accepted_nodes
        ):
            return None
        return counts

    def cleared(self, accepted: np.ndarray) -> state.Effects:
        """Table writes that clear what the device may have written past each request's
        accepted path (`accepted`: the host's counts): its best path's places after it, back
        to the padding slot."""
        run = self.batch.running
        counts = np.asarray(accepted)
        below = np.arange(1, self.paths.depth + 1)
        past = (below > counts[:, None]) & (below <= self.paths.lens[:, None])
        rows, at = np.nonzero(past)
        return state.Effects(
            table_rows=run.rows[rows].astype(np.int64),
            table_cols=run.kv_lens.lens[rows] + below[at],
            table_slots=np.full(rows.size, PADDING_SLOT, dtype=np.int64),
        )
