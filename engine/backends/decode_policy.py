"""The launch policy of the decode and verify attention (`triton_decode`): how many splits of
each request's keys, how many warps a decode program, which verify config, and when the
splits merge in the kernel. Pure functions of the shape and the SM count, and the measured
constants they read; the kernels take what these choose.
"""

from __future__ import annotations

import functools
import math

import torch

from engine.backends.triton_merge import pow2_floor
from engine.pdl import AUTO_MAX_ROWS

# The split policy's model of the chip (`choose_num_splits`), fitted on an H200
# (`bench_decode_launches.py --split-grid`: 46 shapes, policy within 1.03x of the best power of
# two).
PROGRAMS_PER_SM = 4  # programs an SM needs resident to stream at its share of the bandwidth
MIN_KEYS_PER_SPLIT = 128  # two key blocks; one block only while the programs leave SMs idle
MAX_SPLITS = 64
# Measured on an H200 (docs/benchmarks.md). num_warps: 4
# where the grid is more than one wave of PROGRAMS_PER_SM programs an SM, else
# ONE_WAVE_WARPS (`choose_decode_warps`).
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# `config={"PREFETCH": True}` (not the default: 1.01-1.18x its time on an H100, docs/
# benchmarks.md "The opt-in variants timed"): the split kernel's whole key blocks
# are loaded a block ahead, into registers, each block's K/V before the products of the block
# before it and its slots a block earlier still. Compiled for sm_90, the key loop as the
# pipeliner makes it keeps one block in flight whatever num_stages (3 and 4: the same code,
# 39 KB of shared memory, every wait for all copies), issued after the block's products, so
# within a program no load overlaps a product. With PREFETCH at 64 keys and 2 warps the
# kernel spills (255 registers); at 32 keys and 2 warps it takes 213, at 64 keys and 4 warps
# 208 (`bench_attention.py --decode` times both beside the defaults).
ONE_WAVE_WARPS = 2
# Verify (BLOCK_M 64 rows) is sensitive to how its programs fill the waves: each config with
# the programs an H200 SM holds at once (compiler report: 148 registers and 49 KB shared -> 3;
# 218 registers and 83 KB -> 2). The one whose last wave is fullest wins (measured); where
# either holds the whole grid in one wave, by the pass's rows (`choose_verify_config`): the
# longest key block up to LONG_BLOCK_MAX_ROWS, the rows whose products `auto` starts beside
# the attention (`pdl.AUTO_MAX_ROWS`).
VERIFY_CONFIGS = (
    ({"BLOCK_N": 32, "num_warps": 4, "num_stages": 4}, 3),
    ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, 2),
)
LONG_BLOCK_MAX_ROWS = AUTO_MAX_ROWS
# Fused merge: the last split program of each (request, kv head) merges its splits, so a
# split pass is one launch, not two (`config={"FUSED_MERGE": ...}` overrides). Decode fuses
# up to FUSED_MERGE_MAX_SPLITS splits. Measured on an H200 (`bench_attention.py
# --fused-merge`): at 2-16 splits the fused pass takes 0.91-0.99 of the two launches' time
# (B=16 L=1024: 0.58 -> 0.64 of the copy ceiling), at 64 splits (B=1 L=8192) 1.34x: the one
# program that merges 64 splits serially costs more than the launch it saves, and merged in
# two levels (groups of 8 splits, then the groups) 1.09x. Verify stays two launches (32
# splits at B=1: 2.9x, in two levels 1.6x; the default model's batch-1 verify passes on an
# H100, `bench_steps.py --verify-attention`, 1.6x the pass): its programs own up to GROUP x
# MAX_Q rows, which one program merges a block at a time where the merge kernel spreads them
# over the grid.
FUSED_MERGE_MAX_SPLITS = 16
INTERPRETER_CONFIG = {
    "BLOCK_N": 16,
    "num_warps": 4,
    "num_stages": 1,  # small tests, all paths
}


@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of each request's keys (a power of two), from a model of a memory-bound kernel
    on `num_sms` SMs (fitted on an H200: `bench_decode_launches.py --split-grid`).

    - Waves: an SM streams at its share of the bandwidth only with PROGRAMS_PER_SM programs
      resident. So split until the programs (requests x kv heads x splits) come nearest
      (in log scale) one full wave of that many per SM, and no further: more programs only
      add their fixed costs and a larger merge.
    - Minimum keys: a split keeps MIN_KEYS_PER_SPLIT keys (two blocks); one block only while
      the programs at two blocks would not cover every SM once. At most MAX_SPLITS.
    - Short contexts: at most MIN_KEYS_PER_SPLIT keys are one split (what a merge would save
      is less than it costs).

    Monotone: never more splits for more requests or kv heads, never fewer for longer
    contexts. Cached: a plan asks once per pass."""
    if batch_size < 0 or max_seq_len < 0 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(
            f"choose_num_splits(batch_size={batch_size}, num_kv_heads={num_kv_heads}, "
            f"max_seq_len={max_seq_len}, num_sms={num_sms}): the batch and the length must "
            "be at least 0, the heads and the SMs at least 1"
        )
    if max_seq_len <= MIN_KEYS_PER_SPLIT:
        return 1
    programs = max(batch_size, 1) * num_kv_heads
    wave = PROGRAMS_PER_SM * num_sms / programs  # splits that make one full wave
    wanted = 1 << max(0, round(math.log2(wave))) if wave >= 1 else 1
    block = DECODE_CONFIG["BLOCK_N"]
    longest = pow2_floor(max_seq_len / MIN_KEYS_PER_SPLIT)
    if programs * longest < num_sms:
        longest = pow2_floor(max_seq_len / block)  # one block a split: SMs would idle
    return min(wanted, longest, MAX_SPLITS)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (1 in the interpreter: as few programs as
    possible), looked up once per device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_decode_warps(programs: int, num_sms: int) -> int:
    """Warps of a decode program: ONE_WAVE_WARPS while the grid (requests x kv heads x
    splits) is at most one wave of PROGRAMS_PER_SM programs an SM, which is what the split
    policy aims at whenever it splits; DECODE_CONFIG's beyond (measured on an H200,
    `bench_attention.py --decode`: 2 warps 5% faster at B=16 L=4096 with 4 splits, 4.5%
    slower at B=256 L=1024 with 2048 programs)."""
    if programs <= PROGRAMS_PER_SM * num_sms:
        return ONE_WAVE_WARPS
    return DECODE_CONFIG["num_warps"]


def choose_verify_config(programs: int, num_sms: int, rows: int) -> dict:
    """The verify config whose programs fill their waves best (ties: the first). Where
    every config holds the whole grid in one wave, no program waits for a slot whichever
    runs, and the choice is by the pass's `rows` (tokens, as the graph pads them): up to
    LONG_BLOCK_MAX_ROWS the longest key block, else the first. A function of the shape
    alone, never of the launch setting: PDL changes when a kernel starts, not what it
    computes (tests/test_pdl.py compares logits bit for bit with and without it), and the
    key block sets the splits' bounds and so the rounding. Measured on an H100
    (`bench_steps.py --verify-attention`, seven machines; docs/benchmarks.md):

    - up to 8 rows `auto` starts the matrix products after the attention beside it (PDL on
      the products, `pdl.for_pass`, for a small model): what a shorter attention saves, the
      products that wait for it take. The default model's batch-1 8-node pass, 192
      programs, took 0.95-1.00 of its 32-key blocks' time with 64-key blocks.
    - past it a program's latency is the pass's: the 13-node pass (products without PDL)
      took 0.93-0.94 of its time with 32-key blocks. Llama-3-8B's batch-1 passes (no PDL at
      any rows) read within 0.2% either way."""

    def wave_fill(per_sm: int) -> float:
        waves = programs / (per_sm * num_sms)
        return waves / max(1, -(-programs // (per_sm * num_sms)))

    if all(programs <= per_sm * num_sms for _, per_sm in VERIFY_CONFIGS):
        if rows <= LONG_BLOCK_MAX_ROWS:
            return max((config for config, _ in VERIFY_CONFIGS), key=lambda c: c["BLOCK_N"])
        return VERIFY_CONFIGS[0][0]
    return max(VERIFY_CONFIGS, key=lambda entry: wave_fill(entry[1]))[0]


def decode_launch(
    on_cpu: bool,
    tree: bool,
    programs: int,
    num_sms: int,
    rows: int,
    num_splits: int,
    config: dict | None,
) -> dict:
    """The settings of one decode (`tree` False) or verify launch of `programs` split
    programs and `rows` rows (tokens) on `num_sms` SMs: INTERPRETER_CONFIG under the CPU's
    interpreter; else DECODE_CONFIG with `choose_decode_warps`' warps, or
    `choose_verify_config`'s config; the merge fused for decode up to FUSED_MERGE_MAX_SPLITS
    splits, never for verify; `config` laid over all of it. Of the shape alone: no launch
    setting (PDL) enters, so a pass computes the same with and without it."""
    if on_cpu:
        base = INTERPRETER_CONFIG  # read at the call: tests patch it
    elif not tree:
        base = {**DECODE_CONFIG, "num_warps": choose_decode_warps(programs, num_sms)}
    else:
        base = choose_verify_config(programs, num_sms, rows)
    fused = not tree and num_splits <= FUSED_MERGE_MAX_SPLITS
    return {"FUSED_MERGE": fused, **base, **(config or {})}
