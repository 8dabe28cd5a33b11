"""Grammar masks on a CUDA device: the words cross to the device (from reused pinned rows)
and unpack there the same as on the host, and an engine on the GPU (its masks on a pool of
host threads, verify passes with one mask per tree node) constrains greedy, sampled and
speculative output exactly, with greedy output the same with speculation. Skipped without
CUDA."""

from __future__ import annotations

import re

import pytest
import torch

from engine import SamplingParams
from engine.shell.engine import Engine
from engine.shell.grammar import Grammars
from engine.shell.masks import apply_masks
from engine.state import StructuredOutputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EOS = 2
PATTERN = rb"(red|green)-[0-9]{2}( (red|green)-[0-9]{2}){2,6}\."
# a prompt that repeats what the pattern allows, so the n-gram proposer drafts from it
PROMPT = list(b"red-12 green-34 red-12 green-34 red-12 green-34 red-12 green-")


def test_device_masks_equal_the_hosts() -> None:
    book = Grammars(None, 256, EOS, parallel=True)
    book.add(0, StructuredOutputs(regex="[a-c]+x"))
    book.add(1, StructuredOutputs(choice=("no", "yes")))
    book.advance(0, list(b"ab"))
    bitmask = book.masks([0, 5, 1])  # a constrained, a free and a constrained row
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    host = apply_masks(logits, bitmask)
    device = apply_masks(logits.cuda(), bitmask)
    assert device.device.type == "cuda"
    assert torch.equal(device.cpu(), host)
    assert torch.isinf(host[0, 256:]).all() and torch.isinf(host[2, 256:]).all()
    allowed = torch.isfinite(host[0]).nonzero().flatten().tolist()
    assert allowed == sorted([*b"abcx"])


def test_started_masks_cross_from_reused_pinned_rows_as_the_host_applies_them() -> None:
    """Pass after pass (the staging rows reused, two in turn, growing once), the masks a
    pass starts reach the device from pinned memory and mask as the host does."""
    book = Grammars(None, 256, EOS, parallel=True)
    assert book.fills.staging.pinned
    for uid in range(80):
        book.add(uid, StructuredOutputs(regex="[a-c]+x" if uid % 2 else "(no|yes)"))
    generator = torch.Generator().manual_seed(1)
    for size in (3, 5, 70, 4, 70, 2):
        uids = list(range(size)) + [1000]  # and a free row
        logits = torch.randn(len(uids), 300, generator=generator)
        reference = apply_masks(logits, book.masks(uids))
        pending = book.start(uids)
        device = pending.apply(logits.cuda())
        assert torch.equal(device.cpu(), reference)


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    settings = dict(random_weights="tiny", device="cuda", dtype="float32", max_context=256)
    return {
        "plain": Engine(**settings),
        "speculative": Engine(**settings, speculative=True, draft_budget=8),
    }


def _outputs(engine: Engine, params: list[SamplingParams]) -> list[bytes]:
    outs = engine.generate([PROMPT] * len(params), params)
    assert all(out.finish_reason in ("stop", "length") for out in outs)
    return [bytes(t for t in out.token_ids if t != EOS) for out in outs]


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_greedy_and_sampled_output_follows_the_grammar(engines, kind: str) -> None:
    engine = engines[kind]
    assert engine.grammars.fills.parallel  # on a GPU the masks come from a pool of host threads
    spec = {"regex": PATTERN.decode()}
    params = [SamplingParams(max_tokens=64, structured_outputs=spec)] + [
        SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured_outputs=spec)
        for s in range(5)
    ]
    for text in _outputs(engine, params):
        assert re.fullmatch(PATTERN, text), text
    assert engine.stats["grammar_masks"] > 0
    if kind == "speculative":
        assert engine.spec.stats_dict()["spec_draft_tokens_total"] > 0  # trees were verified


def test_greedy_under_a_grammar_is_the_same_with_speculation(engines) -> None:
    """Greedy constrained output is the same with speculation; a seeded constrained request
    draws the same tokens alone and beside others."""
    params = [SamplingParams(max_tokens=64, structured_outputs={"regex": PATTERN.decode()})]
    plain = _outputs(engines["plain"], params)
    assert _outputs(engines["speculative"], params) == plain
    spec = {"regex": PATTERN.decode()}
    seeded = [SamplingParams(max_tokens=48, temperature=0.7, seed=9, structured_outputs=spec)]
    alone = _outputs(engines["plain"], seeded)
    beside = _outputs(engines["plain"], seeded + params * 3)
    assert beside[0] == alone[0] and re.fullmatch(PATTERN, alone[0]), alone
