"""The systems benchmarks/bench_spec.py times at batch 1, one prompt at a time: the engine
with and without speculation (`Ours`), the plain engine on the block kernel's FMA path
(`OnFmas`), and HF transformers with and without prompt lookup (`HF`); `timed` runs them in
turns. `variant` reads a variant of the speculative engine from the command line."""

from __future__ import annotations

import argparse
import gc
import json
import re
import time
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import torch

from engine import cpu_kernels
from engine.model import default_model_path
from engine.shell.config import EngineConfig
from engine.shell.engine import Engine
from engine.shell.startup import freeze_startup_objects
from engine.spec import SpecConfig
from engine.state import SamplingParams

# adaptive drafting's and the proposer's settings that are no engine option: set on the
# engine's SpecConfig after it is built
SPEC_FIELDS = {a.name for a in attrs.fields(SpecConfig)} - {
    a.name for a in attrs.fields(EngineConfig)
}


def variant(text: str) -> tuple[str, dict]:
    """`FIELD=VALUE` or `name:FIELD=VALUE,FIELD=VALUE` -> (name, options); values as JSON
    (a bare word as a string; a comma inside a value, as in a list, stays)."""
    name, _, settings = text.rpartition(":")
    options = {}
    for item in re.split(r",(?=\w+=)", settings):
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=VALUE[,FIELD=VALUE]")
        try:
            options[field] = json.loads(value)
        except json.JSONDecodeError:
            options[field] = value
    return name or settings, options


def freeze(engines: list[Engine]) -> int:
    """Every object the process holds now (the models, HF's too) moved to the collector's
    permanent generation, as `engine serve` does after start-up
    (`freeze_startup_objects`): a full collection then scans only what the runs create,
    not the ~250,000 objects of a loaded model (about 0.1 s a collection on a 2-CPU VM,
    `bench_gc.py`). The freeze takes the whole process's objects, so it runs once, after
    every engine's grammar vocabulary (built on a thread) is ready. Returns how many were
    frozen."""
    for engine in engines[:-1]:
        engine.grammars.wait_ready()
    return freeze_startup_objects(engines[-1]) if engines else 0


def override_spec(engine: Engine, options: dict) -> None:
    """The engine's speculation settings with `options` (`SPEC_FIELDS`) in place of its own,
    for its proposer and its adaptive drafting alike; before its first request (a request's
    history and the corpus read their settings when they are made)."""
    spec = engine.spec
    assert spec is not None, "override_spec needs a speculative engine"
    config = attrs.evolve(spec.config, **options)
    spec.config = spec.stats.config = spec.proposer.config = config


def split_options(options: dict) -> tuple[dict, dict]:
    """(the `SPEC_FIELDS` of `options`, the rest: engine options)."""
    spec = {k: v for k, v in options.items() if k in SPEC_FIELDS}
    return spec, {k: v for k, v in options.items() if k not in SPEC_FIELDS}


class Ours:
    """The engine at batch 1, with or without speculation; records accepted lengths."""

    def __init__(
        self,
        speculative: bool,
        block_weights: bool = True,
        draft_cost: float | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        spec_overrides: dict | None = None,
        **options: Any,
    ) -> None:
        """`spec_overrides`: `SpecConfig` fields that are no engine option, in place of the
        engine's (`override_spec`: an A/B of the drafting policy); `options`: more engine
        settings (`EngineConfig` fields)."""
        # on a GPU each engine would size its KV pool from the free memory: three would not fit
        slots = None if device == "cpu" else 16384
        self.engine = Engine(
            dtype=dtype,
            device=device,
            speculative=speculative,
            block_weights=block_weights,
            draft_cost=draft_cost,
            kv_cache_slots=slots,
            **options,
        )
        self.accepted: list[int] = []
        self.boundaries: list[int] = []  # len(accepted) after each request
        self.steps: list[tuple[str, float]] = []  # (mode, seconds) of every step since clear()
        self.decode_seconds: list[float] = []  # per request: its steps after prefill
        self.counted: dict[str, int] = {}  # the engine's counters at clear()
        if speculative:
            override_spec(self.engine, spec_overrides or {})
            assert self.engine.spec is not None  # speculative=True builds one
            stats = self.engine.spec.stats
            original = stats.record_batch

            def record_batch(rids, trees, accepted_lens, *costs) -> None:
                self.accepted.extend(int(a) for a in accepted_lens)
                original(rids, trees, accepted_lens, *costs)

            # counts the accepted lengths, then records the batch as before
            stats.record_batch = record_batch  # type: ignore[method-assign, assignment]

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        self.engine.step_times.clear()
        out = self.engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
        steps = list(self.engine.step_times)
        if len(steps) == self.engine.step_times.maxlen:
            raise RuntimeError("the engine's step log overflowed; ask for fewer tokens")
        self.steps.extend(steps)
        self.decode_seconds.append(sum(sec for mode, sec in steps if mode != "extend"))
        self.boundaries.append(len(self.accepted))
        return list(out.token_ids)

    def clear(self) -> None:
        self.accepted.clear()
        self.boundaries.clear()
        self.steps.clear()
        self.decode_seconds.clear()
        self.counted = dict(self.engine.stats)

    def since_clear(self, counter: str) -> int:
        """How much the engine's `counter` (`Engine.stats`) grew since `clear()`."""
        return self.engine.stats[counter] - self.counted.get(counter, 0)


class OnFmas(Ours):
    """A plain engine on the block kernel's AVX-512 FMA path. Where the CPU has AMX tiles the
    engine multiplies on them (a verify pass's rows cost little more than a decode's, but a
    one-row decode costs more than on FMAs), so this is the fastest plain decoding at batch 1
    there: speculation is also set against it. Only this engine's passes take the FMAs."""

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        before = cpu_kernels.amx()
        cpu_kernels.amx(False)
        try:
            return super().generate(ids, max_tokens)
        finally:
            cpu_kernels.amx(before)


class HF:
    """HF transformers loading the same GGUF: plain greedy, or greedy with prompt lookup."""

    # `model`: an HF causal LM (transformers is imported only where one is loaded)
    def __init__(self, lookup: int | None, model: Any) -> None:
        self.lookup, self.model = lookup, model

    @staticmethod
    def load(device: str = "cpu", dtype: str = "float32") -> Any:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
        )
        return model.to(device).eval()

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        input_ids = torch.tensor([ids], device=self.model.device)
        extra = {} if self.lookup is None else {"prompt_lookup_num_tokens": self.lookup}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.model.config.eos_token_id,
                **extra,
            )
        return out[0, len(ids) :].tolist()


class System(Protocol):
    """What `timed` runs: `Ours`, `HF`."""

    def generate(self, ids: list[int], max_tokens: int) -> list[int]: ...


def timed(
    systems: Mapping[str, System], prompts: list[list[int]], max_tokens: int
) -> dict[str, tuple[list[float], list[list[int]]]]:
    """Per system: (seconds per prompt, outputs), one prompt at a time. The systems take
    turns on each prompt, so a change in machine load hits them all alike; the order of the
    turns is reversed on every other prompt, so that none always runs right after the same
    one (a slow HF run, say). The garbage the last run left is collected before each run,
    outside its time: otherwise a collection that the allocations of one run (HF's, say)
    brought near falls in whichever run comes next (`freeze` keeps it short)."""
    results: dict[str, tuple[list[float], list[list[int]]]] = {k: ([], []) for k in systems}
    for index, ids in enumerate(prompts):
        order = list(systems.items())
        for key, system in order if index % 2 == 0 else reversed(order):
            gc.collect()
            started = time.perf_counter()
            output = system.generate(ids, max_tokens)
            results[key][0].append(time.perf_counter() - started)
            results[key][1].append(output)
    return results
