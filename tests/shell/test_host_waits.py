"""The host never waits for the device where it need not: planning (and launching) the next
decode pass while one runs, an eager (extend) pass's copies, and a pass that sampled no row.
On CUDA each is checked under torch's sync debug mode "error" or by watching the waits."""

from __future__ import annotations

import attrs
import pytest
import torch
from engine_checks import tiny

from engine.shell.logits import Sampled
from engine.state import Mode, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[(11 * i + 3 * j) % 240 + 5 for j in range(4 + 3 * i)] for i in range(3)]


def _tiny(**overrides):
    """The tiny model on the Triton backend with small CUDA graphs and a small pool."""
    settings = dict(
        attention_backend="triton",
        device=DEVICE,
        max_running_requests=64,
        kv_cache_slots=256,
        cuda_graph_max_batch=4,
    )
    return tiny(**(settings | overrides))


@pytest.mark.skipif(DEVICE != "cuda", reason="host-device synchronisation exists only on CUDA")
@pytest.mark.parametrize("launch_ahead", [False, True])
def test_planning_ahead_never_waits_for_the_running_pass(monkeypatch, launch_ahead):
    """The plan is made (and with launch_ahead the pass launched) while the last pass runs:
    nothing in it may synchronise with the device (a table write once copied from pageable
    memory, which waited for the pass)."""
    engine = _tiny(launch_ahead=launch_ahead)
    prepare_next = engine._prepare_next
    planned = []

    def strict(open_pass, launched, *rest):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = prepare_next(open_pass, launched, *rest)
            planned.append(open_pass.table_written)
            return launched
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine, "_prepare_next", strict)
    engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert any(planned) and engine.stats["plans_ahead_used"] > 3
    assert (engine.stats["launches_ahead"] > 3) == launch_ahead


@pytest.mark.skipif(DEVICE != "cuda", reason="host-device synchronisation exists only on CUDA")
def test_an_eager_pass_never_waits_for_the_device(monkeypatch):
    """Extend (prefill) passes run eagerly: their plan and launch copy the snapshot's arrays
    to the device without waiting for the passes queued before them (a copy from pageable
    memory, `torch.tensor(array, device=...)`, waited for them: the host could not queue
    the next pass, or the rest of this one, while the device ran). A prompt's chunk before
    its last samples nothing: its pass is not waited for either."""
    engine = _tiny(chunk_size=8)
    runner, modes, waits = engine.runner, [], []
    fetch = engine.passes.fetch

    def watched_fetch(sampled):  # the rows of each pass whose tokens the host waited for
        copied = sampled.copied

        class Watched:
            def synchronize(self):
                waits.append(sampled.tokens.numel())
                copied.synchronize()

        return fetch(attrs.evolve(sampled, copied=Watched()))

    monkeypatch.setattr(engine.passes, "fetch", watched_fetch)

    def strictly(call, batch_of):
        def strict(*args, **kwargs):
            modes.append(batch_of(args).mode)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return call(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return strict

    monkeypatch.setattr(runner, "prepare", strictly(runner.prepare, lambda a: a[0]))
    monkeypatch.setattr(runner, "launch", strictly(runner.launch, lambda a: a[1]))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([list(range(5, 35))], params)  # alone, in chunks of 8, 8, 8 and 6
    assert modes.count(Mode.EXTEND) == 2 * 4  # each pass prepared, then launched
    engine.generate(PROMPTS, params)
    assert Mode.DECODE in modes
    assert waits and min(waits) > 0, f"waited for passes that sampled {waits} rows"


def test_a_pass_that_sampled_no_row_is_not_waited_for():
    """A prompt's chunk before its last samples no row: reading its (no) tokens does not wait
    for the pass (the host queues the next chunk meanwhile); a pass with rows does."""

    class Running:  # the copy's event of a pass still on the device
        def synchronize(self):
            raise AssertionError("waited for the pass")

    empty = torch.zeros(0, dtype=torch.int64)
    assert Sampled(empty, None, empty, Running()).tokens_on_host().shape == (0,)
    one = torch.tensor([7])
    with pytest.raises(AssertionError, match="waited"):
        Sampled(one, None, one, Running()).tokens_on_host()
