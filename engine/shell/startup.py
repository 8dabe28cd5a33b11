"""What a serving process does once its engine is ready."""

from __future__ import annotations

import gc

import attrs

from engine.shell.engine import Engine
from engine.shell.logits import warm_row_gathers
from engine.shell.runner import TOKEN_ALIGN
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
    """What a serving process does once before it listens, so that a kernel's first use
    (Triton compiling it or reading its cache, CUDA loading a library's module, lazy set-up)
    is not a client's wait, nor time the device idles inside a pass, as SGLang sends one
    request at launch (on the CPU VM the default model's first 64-token request took 0.66 s
    against 0.26 s for the next, and 0.28 s after a warm-up of 0.78 s,
    `benchmarks/bench_warm_up.py`):

    - two greedy requests in one batch, one stopping two tokens before the other: a pass
      launched ahead then loses a row (`Launched.select`, gathered on the device; on CUDA
      its gathers also run at every row count, `logits.warm_row_gathers`);
    - a sampled request;
    - on one CUDA device, every product at every token count an eager pass can have
      (`LlamaModel.warm_products`: multiples of the runner's TOKEN_ALIGN, to which eager
      passes are padded, up to the most a pass can carry; the output layer at each request
      count): cuBLAS loads a kernel the first time it chooses it for a shape, 3-4 ms on an
      H200 with the device idle (`benchmarks/bench_first_use.py`). About 2 s for
      Llama-3-8B's shapes with an 8192-token `chunk_size`.

    The prompt (32 tokens, 8 new; shorter where the context is) stays in the prefix cache,
    evictable; `engine.stats` is cleared after. The engine must have no other work (the
    loop's thread not started)."""
    if engine.has_work:
        raise RuntimeError("warm_up: the engine already has requests; warm up before serving")
    room = min(engine.max_context, engine.book.slots.capacity)  # a small context: shorter
    length = min(len(WARM_UP_PROMPT), room // 2)
    new_tokens = min(8, room - length)
    if length < 1 or new_tokens < 1:
        return  # room for fewer than two tokens: no request can run here
    vocab = engine.runtime.vocab_size
    prompt = [token % vocab for token in WARM_UP_PROMPT[:length]]
    greedy = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    shorter = attrs.evolve(greedy, max_tokens=max(1, new_tokens - 2))
    # an all-greedy batch samples by argmax alone: the sampled request runs by itself
    engine.generate([prompt, prompt[1:] + prompt[:1]], [greedy, shorter])
    engine.generate([prompt[::-1]], attrs.evolve(greedy, temperature=1.0))
    engine.stats.clear()
    config, runtime = engine.config, engine.runtime
    if runtime.device.type == "cuda" and config.tensor_parallel_size == 1:
        requests = config.max_running_requests
        # a mixed pass: up to the budget and the decodes; a verify pass: every draft tree
        trees = requests * (1 + config.draft_budget) if config.speculative else 0
        most = max(config.chunk_size + requests, trees)
        runtime.model.warm_products(
            range(TOKEN_ALIGN, most + TOKEN_ALIGN, TOKEN_ALIGN), range(1, requests + 1)
        )
        warm_row_gathers(runtime.device, runtime.vocab_size, requests)
