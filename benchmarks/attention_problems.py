"""The attention benchmarks' problems and their timing (`bench_attention.py`, `bench_extend.py`,
`bench_extend_order.py`): a shape's batches over one KV pool with slots in random order, many
independent copies of it replayed from one CUDA graph (>= 256 MB of KV in all, so L2 holds
none of it); our kernels and SDPA on contiguous KV as closures over each copy; a plain copy of
as many bytes, timed the same way; the extend shapes (EXTEND) and their rows, each
configuration against SDPA (`extend_rows`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
import triton
from torch.nn.attention.bias import causal_lower_right

from engine.backends import KVPool
from engine.backends.triton_backend import TritonBackend
from engine.backends.triton_decode import decode_attention
from engine.backends.triton_extend import extend_attention
from engine.state import (
    DraftTrees,
    FinishRules,
    Running,
    schedule_decode,
    schedule_extend,
    schedule_verify,
)

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
GROUP = HQ // HKV
SCALE = D**-0.5
COLD_BYTES = 256 << 20
TREE = 12  # draft nodes a request's tree holds in the verify problems
# the extend shapes: (requests, cached prefix, new tokens a request)
EXTEND = [(1, 0, 1024), (1, 0, 4096), (8, 0, 1024), (8, 2048, 512)]
VERIFY = [(1, 4096), (48, 1024), (64, 2048)]  # (requests, keys before the tree)


@dataclasses.dataclass(frozen=True)
class Captured:
    """A CUDA graph of independent copies of one problem, and the closures it ran: their
    tensors (SDPA's contiguous K/V among them) are what the graph reads, so they live as
    long as it does."""

    graph: torch.cuda.CUDAGraph
    fns: tuple[Callable[[], object], ...]

    @property
    def copies(self) -> int:
        return len(self.fns)


def captured(fns: list) -> Captured:
    """fns (independent copies of one problem) run once, captured in one graph and replayed
    three times."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    return Captured(graph, tuple(fns))


def replay_time_us(run: Captured, replays: int) -> float:
    """Per-copy time of a captured graph: the median of `replays` replays."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / run.copies)
    return float(np.median(times))


def graph_time_us(fns: list, replays: int = 20) -> float:
    """Per-call time of fns (independent copies of one problem) replayed from one graph."""
    return replay_time_us(captured(fns), replays)


def turns_time_us(
    runs: dict[str, Captured], rounds: int = 12, replays: int = 5
) -> dict[str, float]:
    """Each captured graph's per-copy time, the graphs timed in turns: `rounds` rounds of
    `replays` replays each, the median of the rounds' medians; a drift in the device's speed
    over the run falls on every graph alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(replay_time_us(run, replays))
    return {name: float(np.median(t)) for name, t in times.items()}


def copy_ceiling_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def ceiling_fraction(nbytes: float, us: float, ceiling_gbs: float) -> float:
    """The fraction of the copy ceiling (GB/s) that moving `nbytes` in `us` reaches."""
    return nbytes / (us * 1e-6) / 1e9 / ceiling_gbs


class Problem:
    """`copies` independent batches of one shape over one pool, with random slot order."""

    def __init__(
        self,
        mode: str,
        batch: int,
        prefix: int,
        new: int,
        kv_bytes: int,
        kv_heads: int = HKV,
        head_dim: int = D,
        q_heads: int = HQ,
    ) -> None:
        self.copies = max(1, min(32, math.ceil(COLD_BYTES / max(kv_bytes, 1))))
        rows, width = self.copies * batch, prefix + new
        table = (torch.randperm(rows * width, device="cuda") + 1).to(torch.int32)
        table = table.view(rows, width)
        host = table.cpu().numpy().astype(np.int64)
        self.pool = KVPool.allocate(1, rows * width + 1, kv_heads, head_dim, DTYPE, table)
        self.pool.k_cache[0].normal_()
        self.pool.v_cache[0].normal_()
        self.backend = TritonBackend(self.pool)
        self.batches = [
            self._batch(mode, np.arange(c * batch, (c + 1) * batch), prefix, new, host)
            for c in range(self.copies)
        ]
        self.metas = [self.backend.plan(b) for b in self.batches]
        tokens = self.batches[0].new_lens.total
        self.q = [
            torch.randn(tokens, q_heads, head_dim, device="cuda", dtype=DTYPE) for _ in self.batches
        ]
        self.k = [self.pool.k_cache[0][m.out_slots] for m in self.metas]
        self.v = [self.pool.v_cache[0][m.out_slots] for m in self.metas]
        self.out = [torch.empty_like(q) for q in self.q]

    @staticmethod
    def _batch(mode: str, rows: np.ndarray, prefix: int, new: int, host: np.ndarray):
        n = rows.shape[0]
        pending = new if mode == "extend" else 1
        rules = FinishRules([1 << 20] * n, [0] * n, [-1] * n, np.zeros((n, 0), np.int64))
        running = Running.admitted(
            rows,
            rows,
            [prefix + pending] * n,
            [prefix + pending] * n,
            np.ones(n, np.int64),
            rules,
            prefix + new,
            kv_lens=[prefix] * n,
        )
        slots = host[rows, prefix : prefix + new].reshape(-1)
        if mode == "decode":
            return schedule_decode(running, slots)
        if mode == "extend":
            return schedule_extend(running, [new] * n, np.ones(n * new, np.int64), slots)
        rng = np.random.default_rng(0)
        parents = [[-1] + [int(rng.integers(0, j)) for j in range(1, new)] for _ in range(n)]
        return schedule_verify(running, DraftTrees.from_lists([[1] * new] * n, parents), slots)

    def contiguous_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, L, D] copies of request KV (for SDPA), in key order."""
        meta, n = self.metas[i], len(self.batches[i].running)
        idx = meta.kv_indices.long().view(n, -1)
        return (
            self.pool.k_cache[0][idx].transpose(1, 2).contiguous(),
            self.pool.v_cache[0][idx].transpose(1, 2).contiguous(),
        )


def ours_decode(
    p: Problem, config: dict | None = None, split_scale: float = 1.0, splits: int | None = None
) -> list:
    """Our decode/verify kernels on each copy (split count scaled from the plan's, or
    `splits` exactly)."""

    def make(i: int):
        m = p.metas[i]
        count = splits or max(1, round(m.extra["num_splits"] * split_scale))
        return lambda: decode_attention(
            p.q[i],
            p.pool.k_cache[0],
            p.pool.v_cache[0],
            m.kv_indices,
            m.kv_indptr,
            m.qo_indptr,
            m.prefix_lens,
            m.tree_bits,
            p.out[i],
            count,
            m.extra["max_q"],
            SCALE,
            config=config,
            counters=m.extra["counters"],  # the backend's: shared by the copies, run in turn
        )

    return [make(i) for i in range(p.copies)]


def ours_extend(p: Problem, config: dict | None = None) -> list:
    def make(i: int):
        m = p.metas[i]
        return lambda: extend_attention(
            p.q[i],
            p.k[i],
            p.v[i],
            p.pool.k_cache[0],
            p.pool.v_cache[0],
            m.kv_indices,
            m.kv_indptr,
            m.qo_indptr,
            m.prefix_lens,
            p.out[i],
            m.max_new_len,
            m.max_seq_len,
            SCALE,
            config,
        )

    return [make(i) for i in range(p.copies)]


def sdpa(
    p: Problem, mode: str, prefix: int, new: int
) -> tuple[list[Callable[[], torch.Tensor]], torch.Tensor]:
    """SDPA closures on contiguous KV and the first copy's output in our [T, Hq, D] layout."""
    fns: list[Callable[[], torch.Tensor]] = []
    first: torch.Tensor | None = None
    for i in range(p.copies):
        k, v = p.contiguous_kv(i)
        n = k.shape[0]
        q = p.q[i].view(n, -1, HQ, D)
        # closures over this copy's values, bound as defaults: called as fn() and layout(out)
        fn: Callable[..., torch.Tensor]
        layout: Callable[..., torch.Tensor]
        mask: torch.Tensor | None  # a CausalBias (a Tensor) for extend
        if mode == "extend":
            k, v = k.repeat_interleave(GROUP, 1), v.repeat_interleave(GROUP, 1)
            qh = q.transpose(1, 2)
            mask = causal_lower_right(new, prefix + new) if prefix else None
            fn = lambda qh=qh, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                qh, k, v, attn_mask=mask, is_causal=mask is None
            )
            layout = lambda o: o.transpose(1, 2).reshape(-1, HQ, D)
        else:  # decode / verify: the G q heads of a kv head become G*new queries of it
            qh = q.view(n, new, HKV, GROUP, D).permute(0, 2, 1, 3, 4).reshape(n, HKV, -1, D)
            mask = None
            if mode == "verify":
                tree_bits = p.metas[i].tree_bits
                assert tree_bits is not None  # a verify pass's plan has its tree
                bits = tree_bits.view(n, new)
                node = torch.arange(new, device="cuda")
                tree = ((bits[:, :, None] >> node) & 1).bool().repeat_interleave(GROUP, 1)
                mask = torch.cat(
                    [torch.ones(n, new * GROUP, prefix, dtype=torch.bool, device="cuda"), tree],
                    dim=2,
                )[:, None]
            fn = lambda qh=qh, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                qh, k, v, attn_mask=mask
            )
            layout = lambda o, n=n: (
                o.view(n, HKV, new, GROUP, D).permute(0, 2, 1, 3, 4).reshape(-1, HQ, D)
            )
        fns.append(fn)
        if first is None:
            first = layout(fn())
    assert first is not None  # at least one copy
    return fns, first


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def kv_bytes(batch: int, prefix: int, new: int, kv_heads: int = HKV, head_dim: int = D) -> int:
    """The bf16 K and V bytes of `batch` requests of prefix + new keys each."""
    return batch * (prefix + new) * kv_heads * head_dim * 2 * 2


def pass_bytes(
    batch: int, prefix: int, new: int, kv_heads: int = HKV, q_heads: int = HQ, head_dim: int = D
) -> int:
    """The bytes an attention pass moves: its K/V (`kv_bytes`) read once, plus q read and the
    output written for the `new` tokens of each of `batch` requests (bf16)."""
    return (
        kv_bytes(batch, prefix, new, kv_heads, head_dim) + 2 * batch * new * q_heads * head_dim * 2
    )


def decode_like_shape(mode: str, batch: int, length: int) -> tuple[int, int, int]:
    """(prefix and new tokens a request, the bytes the pass moves: K/V read once plus q and
    the output) of a decode or verify pass at `length` keys a request."""
    new = 1 if mode == "decode" else TREE
    prefix = length - 1 if mode == "decode" else length
    return prefix, new, pass_bytes(batch, prefix, new)


def decode_like_problem(mode: str, batch: int, length: int) -> tuple[Problem, int, int, int]:
    """(the problem, then `decode_like_shape`'s figures) of a decode or verify pass at
    `length` keys a request."""
    prefix, new, nbytes = decode_like_shape(mode, batch, length)
    return Problem(mode, batch, prefix, new, kv_bytes(batch, prefix, new)), prefix, new, nbytes


def copy_time_us(nbytes: int) -> float:
    """A device-to-device copy moving `nbytes` (half read, half written), timed as the
    problems are: its share of a graph of independent copies past COLD_BYTES."""
    half, copies = max(nbytes // 2, 1), max(1, min(32, math.ceil(COLD_BYTES / nbytes)))
    srcs = [torch.empty(half, dtype=torch.uint8, device="cuda").random_() for _ in range(copies)]
    return graph_time_us([lambda s=s, d=torch.empty_like(s): d.copy_(s) for s in srcs])


def attention_row(
    kind: str,
    shape: str,
    p: Problem,
    mode: str,
    prefix: int,
    new: int,
    nbytes: float,
    flops: float,
    ours_variants: dict,
) -> dict:
    row: dict[str, Any] = dict(kind=kind, shape=shape, bytes=nbytes, flops=flops)
    try:
        fns, ref = sdpa(p, mode, prefix, new)
        row["sdpa_us"] = graph_time_us(fns)
    except RuntimeError as error:  # an SDPA backend refusing the shape: report, keep going
        row["sdpa_us"], ref = None, None
        print(f"  sdpa failed for {kind} {shape}: {str(error).splitlines()[0]}")
    best = None
    for name, fns in ours_variants.items():
        try:
            us = graph_time_us(fns)
        except Exception as error:  # noqa: BLE001  (a variant that fails to build: report it)
            print(f"  {kind} {shape} ours[{name}] failed: {str(error).splitlines()[0][:200]}")
            torch.cuda.synchronize()
            continue
        print(f"  {kind} {shape} ours[{name}] {us:.1f} us")
        row.setdefault("times", {})[name] = us
        if "SKIP_MERGE" in name:
            continue  # a diagnostic, not a candidate
        if best is None or us < best[1]:
            best = (name, us)
        if name == "default":
            row["ours_us"] = us
            row["eager_us"] = (
                triton.testing.do_bench(fns[0], warmup=10, rep=50, return_mode="median") * 1e3
            )
            if ref is not None:
                row["err"] = rel_err(p.out[0], ref)
    row["best_us"], row["best_cfg"] = (best[1], best[0]) if best else (None, "none ran")
    return row


def extend_rows(sweep: list[dict[str, Any]]) -> list:
    """A row a shape of EXTEND (`attention_row`): SDPA, the default configuration and each
    of `sweep`."""
    rows = []
    for batch, prefix, new in EXTEND:
        p = Problem("extend", batch, prefix, new, kv_bytes(batch, prefix, new))
        variants = {"default": ours_extend(p)}
        variants.update({str(c): ours_extend(p, c) for c in sweep})
        visible = batch * (new * prefix + new * (new + 1) / 2)
        nbytes = pass_bytes(batch, prefix, new)
        rows.append(
            attention_row(
                "extend",
                f"B={batch} prefix={prefix} new={new}",
                p,
                "extend",
                prefix,
                new,
                nbytes,
                4.0 * HQ * D * visible,
                variants,
            )
        )
        del p
        torch.cuda.empty_cache()
    return rows
