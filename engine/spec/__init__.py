"""N-gram speculative decoding: draft trees from token windows and the verify math."""

from engine.spec.config import SpecConfig
from engine.spec.cost import PassCost
from engine.spec.proposer import NgramProposer
from engine.spec.stats import AcceptanceStats, SpecStats
from engine.spec.tree import (
    DraftTree,
    ancestor_mask,
    child_links,
    parent_flat,
    positions,
    prune,
    stack,
)
from engine.spec.verify import VerifyOutcome, request_rng, verify_greedy, verify_sampling

__all__ = [
    "AcceptanceStats",
    "DraftTree",
    "NgramProposer",
    "PassCost",
    "SpecConfig",
    "SpecStats",
    "VerifyOutcome",
    "ancestor_mask",
    "child_links",
    "parent_flat",
    "positions",
    "prune",
    "request_rng",
    "stack",
    "verify_greedy",
    "verify_sampling",
]
