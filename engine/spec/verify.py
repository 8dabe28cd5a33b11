"""Verify draft trees against the target model: greedy (argmax match along the tree) and
sampling (rejection sampling, draft probability 1). Results feed `engine.state.verify`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from engine.spec.tree import child_links, parent_flat
from engine.state.batch import DraftTrees
from engine.state.seqlens import INDEX_DTYPE, SeqLens, frozen_array


@attrs.frozen(eq=False)
class VerifyOutcome:
    """Per request: the accepted drafts (local node ids below the root, root to leaf, CSR by
    `accepted_lens`) and the bonus token the target chose after the last accepted node.
    Call `engine.state.verify(batch, o.accepted_lens, o.accepted_nodes, o.bonus)`."""

    accepted_lens: SeqLens
    accepted_nodes: np.ndarray = attrs.field(converter=frozen_array)
    bonus: np.ndarray = attrs.field(converter=frozen_array)

    def __attrs_post_init__(self) -> None:
        if self.accepted_nodes.shape[0] != self.accepted_lens.total:
            raise ValueError(
                f"{self.accepted_nodes.shape[0]} accepted nodes; accepted_lens "
                f"sum to {self.accepted_lens.total}"
            )
        if self.bonus.shape[0] != len(self.accepted_lens):
            raise ValueError(
                f"{self.bonus.shape[0]} bonus tokens for {len(self.accepted_lens)} requests"
            )

    def emitted(self, trees: DraftTrees) -> list[list[int]]:
        """The tokens each request emits: its accepted drafts, then the bonus."""
        starts = trees.sizes.starts()
        bounds = self.accepted_lens.indptr()
        out = []
        for i in range(len(self.accepted_lens)):
            nodes = self.accepted_nodes[bounds[i] : bounds[i + 1]]
            out.append([*trees.tokens[starts[i] + nodes].tolist(), int(self.bonus[i])])
        return out


def _outcome(paths: list[list[int]], bonus: np.ndarray) -> VerifyOutcome:
    nodes = [node for path in paths for node in path]
    return VerifyOutcome(
        SeqLens([len(p) for p in paths]), np.array(nodes, dtype=INDEX_DTYPE), bonus
    )


def _as_numpy(values: object) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def verify_greedy(trees: DraftTrees, target: object) -> VerifyOutcome:
    """Accept, from the root down, the first child whose token is the target's argmax at its
    parent; the bonus is the argmax at the last accepted node. `target`: the target's argmax
    per node [total], or its logits [total, vocab]."""
    # The trees' part first: on a GPU the target is not ready yet. A tree has a few dozen
    # nodes at most, so the walk runs over Python lists: numpy's cost per call is more than
    # a tree's whole work.
    sizes = trees.sizes.lens.tolist()
    tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
    values = _as_numpy(target)
    argmax = values.argmax(axis=-1) if values.ndim == 2 else values.reshape(-1)
    if argmax.shape[0] != len(tokens):
        raise ValueError(
            f"the target gives {argmax.shape[0]} entries; the trees have {len(tokens)} nodes"
        )
    accepted_lens, accepted_nodes, bonus = _walk_greedy(sizes, tokens, parents, argmax.tolist())
    return VerifyOutcome(
        SeqLens.of_valid(frozen_array(accepted_lens)),
        frozen_array(accepted_nodes),
        frozen_array(bonus),
    )


def _walk_greedy(
    sizes: list[int], tokens: list[int], parents: list[int], argmax: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """Per tree, its accepted path's length and local nodes and its bonus token. One scan of
    each tree: every child follows its parent, so the first matching child of the node
    reached so far is the next node of the scan that has it as parent and the wanted token."""
    accepted_lens, accepted_nodes, bonus = [], [], []
    start = 0
    for size in sizes:
        current, wanted, accepted = 0, argmax[start], 0
        for local in range(1, size):
            node = start + local
            if parents[node] == current and tokens[node] == wanted:
                accepted_nodes.append(local)
                accepted += 1
                current, wanted = local, argmax[node]
        accepted_lens.append(accepted)
        bonus.append(wanted)
        start += size
    return accepted_lens, accepted_nodes, bonus


def request_rng(rid: int, seed: int | None) -> np.random.Generator:
    """A request's verify generator: from its seed alone (two requests with one seed draw
    alike), or from its id when it has none, so that a run is reproducible either way."""
    if seed is not None:
        return np.random.default_rng([1, seed])
    return np.random.default_rng([0, rid])


def verify_sampling(
    trees: DraftTrees, target_probs: object, rngs: Sequence[np.random.Generator]
) -> VerifyOutcome:
    """Rejection sampling with draft probability 1: at each node try its children in order,
    accepting token x with probability p(x) / (mass not yet rejected); on rejection remove x.
    If every child is rejected, the bonus is sampled from what remains. `target_probs`:
    [total, vocab] (temperature, top-k and top-p already applied); `rngs`: one per request."""
    probs = (
        target_probs
        if isinstance(target_probs, torch.Tensor)
        else torch.as_tensor(np.asarray(target_probs))
    )
    total = trees.sizes.total
    if probs.ndim != 2 or probs.shape[0] != total:
        raise ValueError(
            f"target_probs has shape {tuple(probs.shape)}; the trees need [{total}, vocab]"
        )
    if len(rngs) != len(trees.sizes):
        raise ValueError(f"{len(rngs)} generators for {len(trees.sizes)} requests")
    parents = parent_flat(trees)
    nonroot = np.flatnonzero(parents >= 0)
    child_probs = np.zeros(total, dtype=np.float64)
    index = torch.as_tensor(parents[nonroot], device=probs.device)
    tokens = torch.as_tensor(trees.tokens[nonroot], device=probs.device)
    child_probs[nonroot] = probs[index, tokens].double().cpu().numpy()
    row_mass = probs.sum(dim=-1, dtype=torch.float32).double().cpu().numpy()
    first_child, next_sibling = child_links(trees)
    paths, final_nodes, rejected = [], [], []
    starts = trees.sizes.starts()
    for request, rng in enumerate(rngs):
        path, final, tried = _walk(
            int(starts[request]),
            trees.tokens,
            child_probs,
            row_mass,
            first_child,
            next_sibling,
            rng,
        )
        paths.append(path)
        final_nodes.append(final)
        rejected.append(tried)
    uniforms = np.array([rng.random() for rng in rngs], dtype=np.float64)
    bonus = _sample_residual(probs, np.array(final_nodes, dtype=INDEX_DTYPE), rejected, uniforms)
    return _outcome(paths, bonus)


def _walk(
    start: int,
    tokens: np.ndarray,
    child_probs: np.ndarray,
    row_mass: np.ndarray,
    first_child: np.ndarray,
    next_sibling: np.ndarray,
    rng: np.random.Generator,
) -> tuple[list[int], int, list[int]]:
    """One request's accepted path (local ids), the node whose residual gives the bonus, and
    the tokens rejected there."""
    path: list[int] = []
    local = 0
    while True:
        node = start + local
        mass = float(row_mass[node])
        tried: list[int] = []
        child = int(first_child[node])
        while child >= 0:
            token = int(tokens[start + child])
            p = 0.0 if token in tried else float(child_probs[start + child])
            draw = rng.random()  # drawn for every child tried: the stream stays aligned
            if p > 0 and draw * mass < p:
                break
            mass -= p
            tried.append(token)
            child = int(next_sibling[start + child])
        if child < 0:
            return path, node, tried
        path.append(child)
        local = child


def _sample_residual(
    probs: torch.Tensor, nodes: np.ndarray, rejected: list[list[int]], uniforms: np.ndarray
) -> np.ndarray:
    """Per request, a token from its node's distribution with the rejected tokens removed,
    by inverse CDF at its uniform draw."""
    if nodes.size == 0:
        return np.zeros(0, dtype=INDEX_DTYPE)
    device = probs.device
    rows = probs.index_select(0, torch.as_tensor(nodes, device=device))  # a copy
    owners = [i for i, tried in enumerate(rejected) for _ in tried]
    if owners:
        flat_tokens = [token for tried in rejected for token in tried]
        owner_index = torch.as_tensor(owners, device=device)
        rows[owner_index, torch.as_tensor(flat_tokens, device=device)] = 0
    cdf = torch.cumsum(rows, dim=-1, dtype=torch.float64)
    mass = cdf[:, -1]
    if bool((mass <= 0).any()):
        empty = torch.nonzero(mass <= 0).flatten().tolist()
        raise ValueError(
            f"requests {empty} have no probability mass left to sample a bonus "
            "token from; target rows must sum to > 0"
        )
    target = torch.as_tensor(uniforms, device=device) * mass
    picked = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    picked = picked.clamp(max=rows.shape[1] - 1)
    # Rounding at the top end may land on a zero-probability token: take the last live one.
    dead = rows.gather(1, picked[:, None]).squeeze(1) <= 0
    if bool(dead.any()):
        live = rows[dead] > 0
        last_live = live.shape[1] - 1 - live.flip(-1).int().argmax(dim=-1)
        picked[dead] = last_live
    return picked.cpu().numpy().astype(INDEX_DTYPE)
