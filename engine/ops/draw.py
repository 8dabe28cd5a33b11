"""A token per row in one launch: temperature, softmax and the inverse-CDF draw of
`engine.model.sampling.sample` for rows without a top-k, top-p or min-p filter.

The unfused draw is a dozen launches a step (scale, softmax, a float64 prefix sum of the whole
vocabulary, a search, checks); with a small model the host's launch work is most of a decode
step. Here one program walks its row three times: the maximum (and its first index: the
greedy token, for rows at temperature 0), the sum of exp((x - max) / T), then the first token
whose running sum exceeds uniform x sum. Sums are float64 over float32 terms, as the unfused
draw's prefix sum; it divides each term by the fp32 sum first, so the two draw different tokens
only where the uniform falls within rounding of a boundary between two tokens. A token of zero
probability adds nothing to the running sum, so it is never drawn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.pdl import enter

DRAW_BLOCK = 4096  # a row's tokens a loop step
DRAW_WARPS = 16


@triton.jit
def _draw_kernel(
    logits,
    temperature,
    uniform,
    out,
    vocab,
    stride,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    cols = tl.arange(0, BLOCK)
    # 1. the maximum and its first index, lane by lane, then across lanes
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        better = x > best  # strictly: a lane keeps its first index of its maximum
        best_at = tl.where(better, idx, best_at)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    greedy = tl.min(tl.where(best == top, best_at, vocab), axis=0)
    t = tl.load(temperature + row)
    picked = greedy
    if t > 0:
        scaled_top = top / t  # division is monotone: the scaled row's maximum
        # 2. the sum of the unnormalised probabilities
        total = tl.zeros([BLOCK], tl.float64)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            total += tl.exp(x / t - scaled_top).to(tl.float64)
        target = tl.load(uniform + row).to(tl.float64) * tl.sum(total, axis=0)
        # 3. the first token whose running sum exceeds the target
        running = tl.full([], 0.0, tl.float64)
        found = vocab
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            terms = tl.exp(x / t - scaled_top).to(tl.float64)
            passed = (running + tl.cumsum(terms, axis=0)) > target
            first = tl.min(tl.where(passed & (idx < vocab), idx, vocab), axis=0)
            found = tl.minimum(found, first)
            running += tl.sum(terms, axis=0)
        # rounding left the target at the very end: the most likely token, as the unfused draw
        picked = tl.where(found < vocab, found, greedy)
    tl.store(out + row, picked.to(tl.int64))


def draw(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B, V] logits (any float dtype, rows contiguous), [B] temperatures (0: the row's argmax)
    and [B] uniforms in (0, 1) -> [B] int64 tokens, in one launch."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"draw: logits must be [B, V] with contiguous rows, got {logits.shape}")
    rows, vocab = logits.shape
    if temperature.shape != (rows,) or uniform.shape != (rows,):
        raise ValueError(
            f"draw: temperature {tuple(temperature.shape)} and uniform "
            f"{tuple(uniform.shape)} must both be ({rows},)"
        )
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(DRAW_BLOCK, triton.next_power_of_2(vocab))
        _draw_kernel[(rows,)](
            logits,
            temperature,
            uniform,
            out,
            vocab,
            logits.stride(0),
            BLOCK=block,
            num_warps=DRAW_WARPS if block >= 2048 else 4,
            **pdl.launch(logits.device, "draw"),
        )
    return out
