"""What the plan-ahead tests share (`test_plan_ahead.py`, `test_verify_ahead.py`): a tiny
engine on either backend with a small pool, a run checking slots after every step, and the
prompts and sampling parameters whose requests leave at different steps."""

from __future__ import annotations

import torch

from engine.shell.engine import Engine
from engine.state import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A configured draft cost: with speculation, which steps verify and which decode (and so the
# plans used and dropped, the retractions, a seeded sampler's batches) do not follow the
# machine's timings, as a measured cost would make them.
DRAFT_COST = 0.1


def prompts_of(count: int) -> list[list[int]]:
    return [[(11 * i + 3 * j) % 240 + 5 for j in range(4 + 3 * i)] for i in range(count)]


def params_of(count: int, stop_token: int | None = None) -> list[SamplingParams]:
    """Staggered lengths (requests leave at different steps), one stop token, one sampler."""
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(count)]
    if stop_token is not None:
        params[0] = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,))
    params[-1] = SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=7)
    return params


def run_all(engine: Engine, prompts: list, params: list, abort_at: int | None = None) -> list:
    """Submit all, step to the end checking slot conservation after every step."""
    requests = [engine._submit(p, q, None, None) for p, q in zip(prompts, params, strict=True)]
    steps = 0
    while engine.has_work:
        engine.step()
        engine.check()
        steps += 1
        if steps == abort_at:
            engine.abort(requests[min(1, len(requests) - 1)].request_id)
    outputs = [(r.output_ids, r.finish_reason) for r in requests]
    engine.check()
    assert engine.book.num_available == engine.book.slots.capacity
    assert engine.book.table.num_free_rows == engine.book.table.host.shape[0]
    return outputs


def tiny_engine(backend: str, **overrides) -> Engine:
    """A tiny random-weight engine with a small pool (a pool sized from free GPU memory
    would exhaust compute-sanitizer's shadow memory)."""
    settings = dict(
        random_weights="tiny",
        attention_backend=backend,
        device=DEVICE,
        dtype="float32",
        max_context=128,
        cuda_graph_max_batch=0,
        kv_cache_slots=256,
        draft_cost=DRAFT_COST,
    )
    return Engine(**{**settings, **overrides})


def greedy_params(count: int, stop_token: int | None = None) -> list[SamplingParams]:
    """Staggered lengths and one stop token: requests leave at different steps, each cut
    from the pass launched ahead of its last one."""
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(count)]
    if stop_token is not None:
        params[0] = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,))
    return params


def run_checking_rows(engine: Engine, prompts: list, params: list) -> list:
    """Submit all and step to the end, checking after every step that no slot is lost and
    that no row holds a slot past its committed length (a failed pass's early table writes
    undone)."""
    requests = [engine._submit(p, q, None, None) for p, q in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
        engine.check()
        table = engine.book.table.host
        for row, committed in zip(
            engine.running.rows.tolist(), engine.running.kv_lens.tolist(), strict=True
        ):
            assert not table[row, committed:].any(), "a slot left past a row's committed length"
    return requests
