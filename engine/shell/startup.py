"""What a serving process does once its engine is ready."""

from __future__ import annotations

import gc

import attrs

from engine.shell.engine import Engine
from engine.state import SamplingParams

# a prompt that repeats: with speculation its drafts are found, so verify passes run too
WARM_UP_PROMPT = list(range(1, 9)) * 4


def freeze_startup_objects(engine: Engine) -> int:
    """Move every object the process holds once the engine is ready (its model, tokenizer,
    grammar vocabulary, captured graphs' bookkeeping: about 200,000 objects) to the garbage
    collector's permanent generation, as vLLM and SGLang do after start-up. A full
    collection scans every tracked object and holds the engine loop's thread (the device
    waits for the passes it would launch) while it runs: with these in it, about 100 ms on a
    2-CPU VM (`benchmarks/bench_gc.py`). Frozen, they are never scanned again; what serving
    creates is collected as before. For `serve` only: a process that keeps one engine for its
    life (a frozen object in a reference cycle is never freed). Returns how many were frozen.
    """
    engine.grammars.wait_ready()  # built on a thread while the engine warmed up: theirs too
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def warm_up(engine: Engine) -> None:
    """A greedy request and a sampled one through the whole loop before the server listens,
    as SGLang sends one at launch: what a process does on a kernel's first use (Triton
    compiling it or reading its cache, CUDA loading a library's module, lazy set-up: on the
    CPU VM the default model's first 64-token request took 0.66 s against 0.26 s for the
    next, and 0.28 s after a warm-up of 0.78 s, `benchmarks/bench_warm_up.py`) is then not
    the first client's wait. Their prompt (32 tokens, 8 new; shorter where the context is)
    stays in the prefix cache, evictable; `engine.stats` is cleared after them. The engine
    must have no other work (the loop's thread not started)."""
    if engine.has_work:
        raise RuntimeError("warm_up: the engine already has requests; warm up before serving")
    room = min(engine.max_context, engine.book.slots.capacity)  # a small context: shorter
    length = min(len(WARM_UP_PROMPT), room // 2)
    new_tokens = min(8, room - length)
    if length < 1 or new_tokens < 1:
        return  # room for fewer than two tokens: no request can run here
    vocab = engine.runtime.vocab_size
    prompt = [token % vocab for token in WARM_UP_PROMPT[:length]]
    # one after the other: an all-greedy batch samples by argmax alone
    greedy = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt], greedy)
    engine.generate([prompt[::-1]], attrs.evolve(greedy, temperature=1.0))
    engine.stats.clear()
