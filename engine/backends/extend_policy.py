"""The launch policy of the extend attention (`triton_extend`): which tiles, how many q heads
a program, the grid's order. Pure functions of the pass's shape and the measured constants
they read; the kernel takes what these choose, as the decode and verify kernels take
`decode_policy`'s choices.
"""

from __future__ import annotations

# Measured on an H200 (`bench_extend.py --grid`, docs/benchmarks.md): the lowest
# geometric mean over the extend shapes of its time against the best configuration at each.
# TMA: the new tokens' q, K and V tiles come through tensor-memory descriptors (Hopper on,
# bf16 and fp16: `tma_ready`), the cached prefix through kv_indices as before.
# GRID_ORDER: the grid's axes from the fastest-varying, of q blocks (q), requests (r) and
# q heads (h); None: `grid_order` chooses by the request count.
# HEADS: q heads of one kv head a program, each K/V block loaded once for all of them (a
# power of two dividing the group); `choose_extend_config` takes 2 for short prompts.
# DIAGONAL_IN_LOOP: the new keys in one loop, the diagonal blocks masked by a uniform branch,
# so that their K/V loads are pipelined with the blocks before them and a tile waits once
# fewer. Timed in turns on an H100 (`bench_extend.py --turns`, docs/benchmarks.md):
# 0.91-0.99 of the two loops' time at each of six shapes, in four runs. With it BLOCK_N may
# also be a multiple of BLOCK_M (a tile's diagonal block then starts before its first token);
# without it BLOCK_M must be a multiple of BLOCK_N.
EXTEND_CONFIG = {
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "num_warps": 4,
    "num_stages": 3,
    "TMA": True,
    "GRID_ORDER": None,
    "HEADS": 1,
    "DIAGONAL_IN_LOOP": True,
}
INTERPRETER_CONFIG = {
    "BLOCK_M": 32,
    "BLOCK_N": 32,
    "num_warps": 4,
    "num_stages": 1,
    "TMA": False,
    "GRID_ORDER": None,
    "HEADS": 1,
    "DIAGONAL_IN_LOOP": True,  # as on a GPU
}
GRID_AXES = "qrh"
# Many short prompts: 32 x 32 tiles of two q heads. A tile's fixed cost (offsets, q, the
# pipeline's fill, the output) is paid once for both heads' rows, and the smaller tiles keep
# the registers of 64 rows (no spills, where 64 x 64 tiles of two heads spill with 4 warps).
# Timed in turns on an H100 (docs/benchmarks.md): 0.89x the default's time at 16 prompts of
# 512 tokens, 0.96x at 8 of 1024; 1.08x at 4 of 2048, 1.09x at one of 1024, 1.08x at 8 of
# 512 after 2048 cached keys.
SHORT_PROMPTS_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "HEADS": 2}
SHORT_PROMPT_KEYS = 1024  # the most keys (cached and new) of a request in a short-prompts pass


def grid_order(num_requests: int) -> str:
    """The extend grid's axis order: "hqr" for one request, "qrh" for several. Q blocks run
    from the longest (causal: a block's work grows with its index). In "qrh" a head's blocks
    run together and the heads in turn, so with one request the last head's longest block
    starts last and ends the pass alone; "hqr" runs each block across every head at once.
    Measured on an H200 (`bench_extend_order.py`, docs/benchmarks.md), four runs: with one
    request (1024-4096 new tokens, with or without a cached prefix) "hqr" took 0.77-0.95 of
    "qrh"'s time, but for one run's 4096-token prompt, where "qrh" read 289 us against
    310-317 (1.03); with 2-16 requests no order won in every run (0.91-1.08 against "qrh"),
    so they keep "qrh"."""
    return "hqr" if num_requests == 1 else "qrh"


def choose_extend_config(num_requests: int, max_seq_len: int, group: int) -> dict:
    """The extend launch's settings over `EXTEND_CONFIG` for a pass of `num_requests`
    requests whose longest holds `max_seq_len` keys (prefix and new), `group` q heads a kv
    head: `SHORT_PROMPTS_CONFIG` for several requests of at most `SHORT_PROMPT_KEYS` keys
    where a program may hold two heads of a kv head, else none."""
    if num_requests > 1 and max_seq_len <= SHORT_PROMPT_KEYS and group % 2 == 0:
        return dict(SHORT_PROMPTS_CONFIG)
    return {}


def extend_launch(
    on_cpu: bool, num_requests: int, max_seq_len: int, group: int, config: dict | None
) -> dict:
    """The settings of one extend launch, checked: `INTERPRETER_CONFIG` under the CPU's
    interpreter, else `EXTEND_CONFIG` with `choose_extend_config`'s choice over it; `config`
    replaces that choice (over either base). GRID_ORDER comes resolved (`grid_order` where
    the settings leave it None). Settings the kernel cannot run raise ValueError."""
    if on_cpu:
        cfg = {**INTERPRETER_CONFIG, **(config or {})}  # read at the call: tests patch it
    elif config is None:
        cfg = {**EXTEND_CONFIG, **choose_extend_config(num_requests, max_seq_len, group)}
    else:
        cfg = {**EXTEND_CONFIG, **config}
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if block_m % block_n and not (cfg["DIAGONAL_IN_LOOP"] and block_n % block_m == 0):
        raise ValueError(
            f"BLOCK_M={block_m} must be a multiple of BLOCK_N={block_n} (stage 2a reads "
            "whole key blocks), or divide it with DIAGONAL_IN_LOOP (a tile's diagonal block "
            "then starts before its first token)"
        )
    heads = cfg["HEADS"]
    if type(heads) is not int or heads < 1 or heads & (heads - 1) or group % heads:
        raise ValueError(
            f"HEADS={heads!r} must be a power of two dividing the q heads a kv head serves "
            f"({group}): a program's heads share their K/V"
        )
    order = cfg["GRID_ORDER"] or grid_order(num_requests)
    if sorted(order) != sorted(GRID_AXES):
        raise ValueError(
            f"GRID_ORDER={order!r} must order the letters of {GRID_AXES!r} (q blocks, "
            "requests, q heads), the fastest-varying axis first"
        )
    return {**cfg, "GRID_ORDER": order}
