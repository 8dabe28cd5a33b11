"""What a serving process does once its engine is ready."""

from __future__ import annotations

import gc

from engine.shell.engine import Engine


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
