"""Batched sampling from logits with per-request temperature, top-k, top-p and seed.

Randomness is counter-based: a row's uniform is a hash of (request seed, step), computed on
the host, so a seeded request's stream is the same whatever batch it runs in, and nothing needs
a host sync or a per-request generator. A token is drawn by inverse CDF at that uniform.
Greedy rows are an exact argmax.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from engine.state import SamplingParams

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31 keep every 32-bit x * c product inside int64 (no overflow).
_MUL1, _MUL2 = 0x7FEB352D, 0x1B873593
_STEP_SALT, _COLUMN_SALT = 0x9E3779B9, 0x632BE5AB
# Added after the row key meets a column's hash: where the two are equal (seed 1 at step 0
# met column 0's), the xor is 0, which the finaliser maps to 0: a uniform of 2**-25.
_MEET = 0x85EBCA6B


def _mix32(x: Any) -> Any:
    """A 32-bit integer finaliser (xorshift-multiply), on int64 tensors or numpy arrays
    holding 32-bit values (in place on a copy of `x`), or on Python ints."""
    x = x & _MASK32
    x ^= x >> 16
    x *= _MUL1
    x &= _MASK32
    x ^= x >> 15
    x *= _MUL2
    x &= _MASK32
    x ^= x >> 16
    return x


def _uniform_bits(seeds: Any, steps: Any, columns: Any, salt: int) -> Any:
    """[B, columns] 24-bit ints, a pure function of (seed, step, column, salt); numpy int64
    arrays or torch int64 tensors alike (the same operations, the same bits)."""
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(low ^ _mix32(high ^ _mix32(steps * _STEP_SALT + salt)))
    return _mix32((key[:, None] ^ _mix32(columns * _COLUMN_SALT + 1)[None, :]) + _MEET) >> 8


def seeded_uniform(
    seeds: torch.Tensor, steps: torch.Tensor, width: int, salt: int = 0
) -> torch.Tensor:
    """[B, width] fp32 uniforms in (0, 1), a pure function of (seed, step, column, salt), on
    the seeds' device (`row_uniforms` combines the first two columns on the host). `salt`
    separates independent streams of one step."""
    columns = torch.arange(width, device=seeds.device, dtype=torch.int64)
    bits = _uniform_bits(seeds, steps, columns, salt)
    return bits.float().add_(0.5).mul_(1.0 / (1 << 24))


_FEW_ROWS = 16  # up to this many rows, `row_uniforms` hashes Python ints (see there)
# the hashes of columns 0 and 1, which every row's key meets (`_uniform_bits`)
_COLUMN_HASHES = tuple(_mix32(column * _COLUMN_SALT + 1) for column in range(2))


def row_uniforms(seeds: Sequence[int], steps: Sequence[int], salt: int = 0) -> np.ndarray:
    """One float64 uniform in (0, 1) per row with 48 bits: `seeded_uniform`'s first two
    columns as one number. Computed on the host: on a GPU the hash is ~70 tiny kernels. A
    few rows are hashed as Python ints, the same operations (no product leaves int64, so
    the bits are the same): numpy's ~50 operations on arrays of a few entries cost more."""
    if len(seeds) == len(steps) <= _FEW_ROWS:
        return np.array(
            [
                _row_uniform(int(seed), int(step), salt)
                for seed, step in zip(seeds, steps, strict=True)
            ],
            dtype=np.float64,
        )
    bits = _uniform_bits(
        np.asarray(seeds, dtype=np.int64),
        np.asarray(steps, dtype=np.int64),
        np.arange(2, dtype=np.int64),
        salt,
    )
    return ((bits[:, 0] << 24) + bits[:, 1] + 0.5) / float(1 << 48)


def _row_uniform(seed: int, step: int, salt: int) -> float:
    """`row_uniforms` of one row, on Python ints (`_uniform_bits`, then the two columns)."""
    low, high = seed & _MASK32, (seed >> 32) & _MASK32
    key = _mix32(low ^ _mix32(high ^ _mix32(step * _STEP_SALT + salt)))
    first, second = (_mix32((key ^ column) + _MEET) >> 8 for column in _COLUMN_HASHES)
    return ((first << 24) + second + 0.5) / float(1 << 48)


@attrs.frozen(eq=False)
class SamplingTensors:
    """Per-row sampling inputs on the logits' device, from one host-to-device copy. top_k is
    clamped to the vocabulary (disabled = vocab size); unseeded rows get a fresh random seed
    when built."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64 in [1, V]
    top_p: torch.Tensor  # [B] fp32 in (0, 1]
    min_p: torch.Tensor  # [B] fp32 in [0, 1]
    uniform: torch.Tensor  # [B] fp64 in (0, 1): row_uniforms(seed, tokens sampled before)
    all_greedy: bool
    filtered: bool = True  # some row keeps fewer tokens than the vocabulary (needs_filter)
    uses_min_p: bool = True  # some row sets min-p (decided on the host: nothing waits)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        seeds: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """`seeds`: each row's seed in place of its params' (the engine's for a request that
        gave none); without them, an unseeded row gets a fresh random one."""
        if len(params) != len(steps):
            raise ValueError(f"{len(params)} sampling params for {len(steps)} step counters")
        if seeds is None:
            seeds = [p.seed if p.seed is not None else random.getrandbits(63) for p in params]
        elif len(seeds) != len(params):
            raise ValueError(f"{len(params)} sampling params for {len(seeds)} seeds")
        rows = _on_device([*_filter_values(params, vocab_size), row_uniforms(seeds, steps)], device)
        return cls(
            temperature=rows[0],
            top_k=rows[1],
            top_p=rows[2],
            min_p=rows[3],
            uniform=rows[4],
            all_greedy=all(p.greedy for p in params),
            filtered=needs_filter(params, vocab_size),
            uses_min_p=uses_min_p(params),
        )

    def at_steps(self, seeds: Sequence[int], steps: Sequence[int]) -> SamplingTensors:
        """The same rows' inputs at other steps (`seeds`: theirs, as `build` took them):
        only the uniforms are new, in one copy; the filters are shared (read, never
        written)."""
        if not len(seeds) == len(steps) == self.uniform.shape[0]:
            raise ValueError(
                f"{self.uniform.shape[0]} rows; got {len(seeds)} seeds and {len(steps)} steps"
            )
        uniform = torch.from_numpy(row_uniforms(seeds, steps))
        return attrs.evolve(self, uniform=uniform.to(self.uniform.device, non_blocking=True))


def _on_device(rows: list, device: torch.device | str) -> list[torch.Tensor]:
    """Per-row values (temperature, top_k, top_p, min_p, then any more) in one host-to-device
    copy (float64 holds every top_k exactly): temperature, top_p and min_p as fp32, top_k as
    int64, the others float64."""
    packed = torch.from_numpy(np.array(rows, dtype=np.float64)).to(device, non_blocking=True)
    return [packed[0].float(), packed[1].long(), packed[2].float(), packed[3].float(), *packed[4:]]


def _filter_values(
    params: Sequence[SamplingParams], vocab_size: int
) -> tuple[list[float], list[int], list[float], list[float]]:
    """Per row: temperature, top_k clamped to the vocabulary (disabled = the vocabulary
    size), top_p and min_p."""
    return (
        [float(p.temperature) for p in params],
        [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params],
        [float(p.top_p) for p in params],
        [float(p.min_p) for p in params],
    )


def filter_tensors(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: temperature (fp32), top_k clamped to the vocabulary (int64; disabled = the
    vocabulary size), top_p and min_p (fp32), what `_filtered_logits` reads; one copy."""
    temperature, top_k, top_p, min_p = _on_device(list(_filter_values(params, vocab_size)), device)
    return temperature, top_k, top_p, min_p


def needs_filter(params: Sequence[SamplingParams], vocab_size: int) -> bool:
    """Whether some row sets top-k below the vocabulary, top-p below 1 or min-p above 0.
    Without one, the filter (a sort of every row's logits: most of a sampled step's time on
    a CPU) is skipped."""
    return any(0 <= p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0 for p in params)


def uses_min_p(params: Sequence[SamplingParams]) -> bool:
    """Whether some row sets min-p (known on the host: asking the device would wait)."""
    return any(p.min_p > 0 for p in params)


def _filtered_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    filtered: bool = True,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits / temperature with tokens outside top-k or the top-p nucleus, or below min-p
    times the most likely token's probability, set to -inf (the most likely token is always
    kept). Greedy rows (temperature 0) use temperature 1. `filtered` False: no row filters
    (`needs_filter`), the scaled logits are returned. `min_p` None: no row sets it (the
    caller knows on the host; asking the device would wait for it)."""
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / safe_temperature[:, None]
    if not filtered:
        return scaled
    if top_k is None or top_p is None:
        raise ValueError("filtered logits need top_k and top_p; filtered=False takes neither")
    if scaled.device.type == "cpu" and scaled.shape[-1] > _CANDIDATES:
        kept = _filtered_among_candidates(scaled, top_k, top_p)
    else:
        kept = _filtered_by_sorting(scaled, top_k, top_p)
    if min_p is not None:
        # p(x) >= min_p * p(best)  <=>  logit(x) >= logit(best) + log(min_p)
        floor = kept.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        kept = kept.masked_fill(kept < floor, -math.inf)
    return kept


def _filtered_by_sorting(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    keep_sorted = rank < top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    keep_sorted &= _in_nucleus(sorted_probs, rank, top_p)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def _in_nucleus(
    sorted_probs: torch.Tensor, rank: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per sorted token: whether the mass before it is below top-p (the first token always;
    top-p 1 every token: in fp32 the last tokens' mass before them can round up to 1)."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return (mass_before < top_p[:, None]) | (rank == 0) | (top_p >= 1.0)[:, None]


_CANDIDATES = 1024  # the most likely tokens a CPU filter looks at before sorting a whole row


def _filtered_among_candidates(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`_filtered_logits` from each row's `_CANDIDATES` largest logits, where they decide it
    (on a CPU, sorting a 49k vocabulary took ~3 ms a row; the candidates ~0.4): a row keeps
    everything, or its top-k is among them, or (top-k off) they hold at least its top-p
    mass. The same tokens as sorting the row, up to rounding at the nucleus' edge (the
    probabilities are normalised over the row, not the sorted row) and which of tied logits
    at the edge stay (topk and sort order ties apart differently). The other rows are
    sorted."""
    vocab = scaled.shape[-1]
    values, order = scaled.topk(_CANDIDATES, dim=-1)  # descending
    rank = torch.arange(_CANDIDATES)[None, :]
    keep_sorted = rank < top_k[:, None]
    among = top_k <= _CANDIDATES
    # normalised over the row's top-k tokens: among the candidates, or every token (top-k off)
    log_total = torch.logsumexp(values.masked_fill(~keep_sorted, -math.inf), dim=-1)
    if not bool(among.all()):  # a whole row's sum only where it is needed
        log_total = torch.where(among, log_total, torch.logsumexp(scaled, dim=-1))
    probs = torch.exp(values - log_total[:, None]).masked_fill_(~keep_sorted, 0.0)
    keep_sorted &= _in_nucleus(probs, rank, top_p)
    everything = (top_k >= vocab) & (top_p >= 1.0)
    decided = among | everything | ((top_k >= vocab) & (probs.sum(dim=-1) >= top_p))
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(-1, order, keep_sorted)
    filtered = scaled.masked_fill(~(keep | everything[:, None]), -math.inf)
    if not bool(decided.all()):
        rest = torch.nonzero(~decided).flatten()
        filtered[rest] = _filtered_by_sorting(scaled[rest], top_k[rest], top_p[rest])
    return filtered


def probs_for_verify(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    filtered: bool = True,
) -> torch.Tensor:
    """The target distribution [B, V] fp32 each row samples from; a greedy row (temperature
    0) is one-hot at its argmax. Used for rejection sampling in speculative decoding.
    `filtered`: as for `_filtered_logits`."""
    probs = torch.softmax(
        _filtered_logits(logits, temperature, top_k, top_p, filtered, min_p), dim=-1
    )
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where((temperature > 0)[:, None], probs, one_hot)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inverse CDF: the first token whose cumulative
    mass (float64) exceeds uniform * total (`uniform`: [B] in (0, 1), `row_uniforms`). A
    zero-probability token adds nothing to the sum, so it is never drawn. One uniform per
    row, where an exponential race needs one per token: on a CPU that was ~1 ms a row for a
    49k vocabulary, this ~0.1 ms."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    picked.clamp_(max=probs.shape[-1] - 1)
    # A device's parallel prefix sum may round two sums out of order; should that ever land
    # on a zero-probability token, the row's most likely token is taken (no host sync)
    live = probs.gather(1, picked[:, None]).squeeze(1) > 0
    return torch.where(live, picked, probs.argmax(dim=-1))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: the first index of each row's maximum (argmax). On CPU through
    `max`, which returns the same index and is ~3x faster there than `argmax` (8 x 49152
    fp32: 85 vs 258 us on the 2-core test machine, a step's worth at batch 8)."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """[B, V] logits -> [B] int64 tokens. An all-greedy batch is a plain argmax; on a GPU a
    batch no row of which filters is drawn in one launch (`engine.ops.draw`)."""
    if sampling.all_greedy:
        return greedy_tokens(logits)
    if logits.device.type != "cpu" and not sampling.filtered:
        from engine.ops.draw import draw  # a Triton kernel: imported where a GPU draws

        return draw(logits.contiguous(), sampling.temperature, sampling.uniform)
    return draw_unfused(
        logits,
        sampling.temperature,
        sampling.uniform,
        sampling.top_k,
        sampling.top_p,
        sampling.min_p if sampling.uses_min_p else None,
        sampling.filtered,
    )


def draw_unfused(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    filtered: bool = False,
) -> torch.Tensor:
    """The draw in torch operations (every draw on a CPU; a filtered batch on a GPU): the
    filter (`_filtered_logits`), softmax, the inverse-CDF pick; greedy rows their argmax."""
    probs = torch.softmax(
        _filtered_logits(logits, temperature, top_k, top_p, filtered, min_p), dim=-1
    )
    drawn = sample_from_probs(probs, uniform)
    return torch.where(temperature > 0, drawn, greedy_tokens(logits))


# --- before sampling: biases and penalties; after it: log-probabilities ----------------------
def host_to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`array` on `device`. To a GPU through pinned memory, asynchronously: a copy from
    pageable memory would first wait for every kernel queued (the pass these values follow)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@attrs.frozen(eq=False)
class Logprobs:
    """Per row: the chosen token's log-probability and its rank (1: the most likely; ties
    share the best rank), and the `top` most likely tokens with theirs (fp32 log-softmax of
    the logits the row sampled from, before temperature and filtering), still on the
    device."""

    chosen: torch.Tensor  # [R] fp32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, top] int64
    top_values: torch.Tensor  # [R, top] fp32

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, top: int) -> Logprobs:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, tokens.long()[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        values, ids = (
            logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], tokens[:, None][:, :0])
        )
        return cls(chosen, ranks, ids.long(), values)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.chosen, self.ranks, self.top_ids, self.top_values

    def to_host(self) -> tuple[np.ndarray, ...]:
        """chosen, ranks, top_ids, top_values on the host."""
        return tuple(t.cpu().numpy() for t in self.tensors())
