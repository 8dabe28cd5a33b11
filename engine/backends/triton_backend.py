"""The Triton attention backend: kv-index construction, split-KV decode, extend, tree verify.

Eager use: `plan(batch)` sizes every buffer from the snapshot's exact totals. CUDA-graph use
(decode, verify and extend): `buffers = backend.graph_buffers(max_batch, max_tokens,
max_kv_tokens)` once, then before each capture or replay `plan(batch, buffers=buffers,
padded_batch_size=P, padded_num_tokens=T)`, which fills the buffers in place (outside the
graph) and returns metadata whose tensors are views at fixed addresses. Padding requests
(P - B of them) own no keys and no tokens; the T - new_lens.total padding tokens belong to no
request: their outputs are zeros and their K/V go to padding slot 0. The launch shape depends
only on (P, T, buffers.max_tree_nodes), so a graph captured at (P, T) replays for any batch
planned at (P, T); an extend pass's attention runs a grid of T new tokens a request (its
programs past a request's tokens return at once) and zeroes all T output rows first.
Keep q/k/v/out of a captured forward at fixed addresses as usual.

Split-KV decode passes of up to `decode_policy.FUSED_MERGE_MAX_SPLITS` splits merge them in
the split kernel, counting arrivals in int32 counters that every launch leaves at zero: the
graph buffers own one set (fixed address, for every replay), the backend another for eager
plans.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import triton

from engine.backends import triton_index
from engine.backends.base import (
    AttentionBackend,
    BufferTooSmall,
    ForwardMetadata,
    KVPool,
    host_metadata,
    register,
)
from engine.backends.decode_policy import choose_num_splits
from engine.backends.decode_policy import num_sms as _num_sms
from engine.backends.triton_decode import decode_attention
from engine.backends.triton_extend import extend_attention
from engine.backends.triton_index import build_kv_indices_into
from engine.backends.triton_merge import counters_needed, merge_counters
from engine.state import MAX_TREE_NODES, PADDING_SLOT, Batch, Mode

_NO_BITS = np.zeros(0, dtype=np.int64)

# The arrays a plan stages, in their order in the staging buffers, and their capacities as
# functions of (max_batch, max_tokens).
_STAGED = (
    ("qo_indptr", lambda b, t: b + 1),
    ("kv_indptr", lambda b, t: b + 1),
    ("prefix_lens", lambda b, t: b),
    ("rows", lambda b, t: b),
    ("out_slots", lambda b, t: t),
    ("tree_bits", lambda b, t: t),
)


@attrs.frozen(eq=False)
class GraphBuffers:
    """Static device inputs of captured passes (sizes are capacities).

    The int64 arrays are fixed views of one device tensor, `staging_device`, laid out as
    `staging_host` (pinned on CUDA): a plan packs its host arrays into `staging_host` and one
    host-to-device copy fills them all, with no device-side copies."""

    qo_indptr: torch.Tensor  # [max_batch + 1] int64
    kv_indptr: torch.Tensor  # [max_batch + 1] int64
    prefix_lens: torch.Tensor  # [max_batch] int64
    rows: torch.Tensor  # [max_batch] int64
    out_slots: torch.Tensor  # [max_tokens] int64
    tree_bits: torch.Tensor  # [max_tokens] int64
    kv_indices: torch.Tensor  # [max_kv_tokens] int32
    merge_counters: torch.Tensor  # int32 (`merge_counters`), zero between launches
    max_tree_nodes: int
    staging_host: torch.Tensor  # int64, pinned on CUDA: every host array of a plan, packed
    staging_device: torch.Tensor  # int64: the arrays above are views of it
    offsets: dict  # name -> start of its region in the staging buffers
    staged: torch.cuda.Event | None  # recorded after each staging copy (CUDA only)

    # the views `used` made, by (padded batch, padded tokens). A cache: not part of the value.
    _used: dict = attrs.field(factory=dict, init=False, repr=False)

    @property
    def max_batch(self) -> int:
        return int(self.prefix_lens.shape[0])

    def used(self, padded: int, num_tokens: int) -> dict[str, torch.Tensor]:
        """The staged arrays' parts a pass of `padded` requests and `num_tokens` tokens
        uses (views; made once per shape: each graph's pass has one)."""
        key = (padded, num_tokens)
        if key not in self._used:
            sizes = dict(qo_indptr=padded + 1, kv_indptr=padded + 1, prefix_lens=padded)
            sizes.update(rows=padded, out_slots=num_tokens, tree_bits=num_tokens)
            self._used[key] = {name: getattr(self, name)[:size] for name, size in sizes.items()}
        return self._used[key]

    @property
    def max_tokens(self) -> int:
        return int(self.out_slots.shape[0])


@register("triton")
class TritonBackend(AttentionBackend):
    pads_eager_tokens = True  # `plan(batch, padded_num_tokens=...)` without graph buffers

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        # the fused merge's counters for eager passes, grown to the largest batch planned
        self._merge_counters = self._new_counters(0)

    def _new_counters(self, max_batch: int) -> torch.Tensor:
        return merge_counters(max_batch, self.pool.num_kv_heads, self.pool.req_to_token.device)

    def _eager_counters(self, num_requests: int) -> torch.Tensor:
        """The eager counters, reallocated (zeroed) when a batch outgrows them; launches on
        one stream share them, each leaving them at zero."""
        if self._merge_counters.numel() < counters_needed(num_requests, self.pool.num_kv_heads):
            self._merge_counters = self._new_counters(triton.next_power_of_2(num_requests))
        return self._merge_counters

    def graph_buffers(
        self, max_batch: int, max_tokens: int, max_kv_tokens: int, max_tree_nodes: int = 16
    ) -> GraphBuffers:
        """Buffers for captured passes of up to max_batch requests, max_tokens new tokens
        and max_kv_tokens keys in all; verify trees of at most max_tree_nodes nodes."""
        if not 1 <= max_tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_tree_nodes={max_tree_nodes}; allowed 1..{MAX_TREE_NODES}")
        device = self.pool.req_to_token.device
        offsets, size = {}, 0
        for name, capacity in _STAGED:
            offsets[name] = size
            size += capacity(max_batch, max_tokens)
        staging_device = torch.zeros(size, dtype=torch.int64, device=device)
        views = {
            name: staging_device[offsets[name] : offsets[name] + capacity(max_batch, max_tokens)]
            for name, capacity in _STAGED
        }
        return GraphBuffers(
            **views,
            kv_indices=torch.zeros(max_kv_tokens, dtype=torch.int32, device=device),
            merge_counters=self._new_counters(max_batch),
            max_tree_nodes=max_tree_nodes,
            staging_host=torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda"),
            staging_device=staging_device,
            offsets=offsets,
            staged=torch.cuda.Event() if device.type == "cuda" else None,
        )

    def plan(
        self,
        batch: Batch,
        buffers: GraphBuffers | None = None,
        padded_batch_size: int | None = None,
        padded_num_tokens: int | None = None,
        num_splits: int | None = None,
        indices_in_pass: bool = False,
    ) -> ForwardMetadata:
        """Metadata for one pass; with `buffers`, filled in place for a CUDA graph.
        `padded_num_tokens` (eager too): the pass runs that many tokens, its padding tokens
        after the batch's (their K/V to the padding slot, their outputs zeros).
        `num_splits` overrides the decode/verify split count (tests, tuning).
        `indices_in_pass` (with `buffers`): kv_indices is not built here but by the pass
        itself (`build_kv_indices`, captured in its graph: no launch from the host a pass)."""
        table = self.pool.req_to_token
        if batch.running.max_context > table.shape[1]:
            raise ValueError(
                f"batch max_context {batch.running.max_context} exceeds the "
                f"request table width {table.shape[1]}"
            )
        if buffers is not None:
            return self._plan_into(
                batch, buffers, padded_batch_size, padded_num_tokens, num_splits, indices_in_pass
            )
        if indices_in_pass:
            raise ValueError("indices_in_pass applies to graph buffers; an eager plan builds them")
        if padded_batch_size is not None:
            raise ValueError("padded_batch_size applies to graph buffers; an eager plan has none")
        device = table.device
        meta, more = host_metadata(
            batch, device, {"rows": batch.running.rows.astype(np.int64)}, padded_num_tokens
        )
        rows = more["rows"]
        total = batch.seq_lens.total
        kv_indices = torch.empty(total, dtype=torch.int32, device=device)
        build_kv_indices_into(
            table,
            rows,
            meta["prefix_lens"],
            meta["kv_indptr"],
            meta["qo_indptr"],
            meta["out_slots"],
            kv_indices,
            total,
            batch.seq_lens.max,
        )
        max_q = triton.next_power_of_2(batch.new_lens.max) if batch.mode == Mode.VERIFY else 1
        if num_splits is None:
            num_splits = choose_num_splits(
                len(batch.running),
                self.pool.num_kv_heads,
                batch.seq_lens.max,
                _num_sms(device),
            )
        extra = {
            "num_splits": num_splits,
            "max_q": max_q,
            "counters": self._eager_counters(len(batch.running)),
            "new_tokens": batch.new_lens.total,  # the rest are padding
        }
        return ForwardMetadata(kv_indices=kv_indices, extra=extra, **meta)

    def _plan_into(
        self,
        batch: Batch,
        buffers: GraphBuffers,
        padded_batch_size: int | None,
        padded_num_tokens: int | None,
        num_splits: int | None,
        indices_in_pass: bool,
    ) -> ForwardMetadata:
        mode = batch.mode
        real = len(batch.running)
        padded = real if padded_batch_size is None else padded_batch_size
        num_tokens = padded_num_tokens
        if num_tokens is None:
            num_tokens = batch.new_lens.total + (padded - real)
        # the most new tokens a request may have: an extend pass's may have all of them
        per_request = {Mode.DECODE: 1, Mode.VERIFY: buffers.max_tree_nodes}.get(mode, num_tokens)
        if not real <= padded <= buffers.max_batch:
            raise BufferTooSmall(
                f"{real} requests padded to {padded}; the graph buffers hold "
                f"{buffers.max_batch} requests"
            )
        if not batch.new_lens.total <= num_tokens <= buffers.max_tokens:
            raise BufferTooSmall(
                f"{batch.new_lens.total} tokens padded to {num_tokens}; the "
                f"graph buffers hold {buffers.max_tokens} tokens"
            )
        if batch.new_lens.max > per_request:
            raise ValueError(
                f"a draft tree has {batch.new_lens.max} nodes; these graph buffers "
                f"allow at most {per_request}"
            )
        total = batch.seq_lens.total
        if total > buffers.kv_indices.numel():
            raise BufferTooSmall(
                f"kv_indices holds {buffers.kv_indices.numel()} entries; this "
                f"batch needs seq_lens.total = {total}"
            )
        views = self._fill(buffers, batch, padded, num_tokens)
        if not indices_in_pass:
            build_kv_indices_into(
                self.pool.req_to_token,
                views["rows"],
                views["prefix_lens"],
                views["kv_indptr"],
                views["qo_indptr"],
                views["out_slots"],
                buffers.kv_indices,
                total,
                batch.seq_lens.max,
            )
        rows = views.pop("rows")
        tree_bits = views.pop("tree_bits")
        # the most keys a request may have: a captured launch serves every pass it replays
        max_keys = self.pool.req_to_token.shape[1]
        if mode == Mode.EXTEND:  # every output row zeroed, then the requests' written
            extra = {"graph": True, "rows": rows, "new_tokens": 0}
            return ForwardMetadata(
                mode=mode,
                kv_indices=buffers.kv_indices,
                tree_bits=None,
                max_new_len=num_tokens,
                max_seq_len=max_keys,
                extra=extra,
                **views,
            )
        if num_splits is None:
            num_splits = choose_num_splits(
                padded, self.pool.num_kv_heads, max_keys, _num_sms(buffers.kv_indices.device)
            )
        return ForwardMetadata(
            mode=mode,
            kv_indices=buffers.kv_indices,
            tree_bits=tree_bits if mode == Mode.VERIFY else None,
            max_new_len=per_request,
            max_seq_len=max_keys,
            extra={
                "num_splits": num_splits,
                "max_q": per_request,
                "graph": True,
                "counters": buffers.merge_counters,
                "rows": rows,
            },
            **views,
        )

    def build_kv_indices(self, metadata: ForwardMetadata) -> None:
        """Fill a graph plan's kv_indices (planned with `indices_in_pass`) on the device, from
        its staged arrays and the request table. Its launch shape depends only on the padded
        batch and the table's width, so a captured pass does it at each replay."""
        if not metadata.extra.get("graph"):
            raise ValueError("build_kv_indices fills a graph plan's kv_indices; this plan is eager")
        table = self.pool.req_to_token
        triton_index.launch_kv_indices(
            table,
            metadata.extra["rows"],
            metadata.prefix_lens,
            metadata.kv_indptr,
            metadata.qo_indptr,
            metadata.out_slots,
            metadata.kv_indices,
            metadata.kv_indices.numel(),
            table.shape[1],  # the longest a request can be: any replay's lengths fit
        )

    def shift_plan(self, metadata: ForwardMetadata, shift: torch.Tensor) -> None:
        """Move a graph plan's first `shift.shape[0]` requests `shift` tokens further on (on
        the device, in stream order: counts the host does not know yet): each request's
        prefix grows by its shift, and so do its kv range and those after it. Their new
        tokens stay where they were (`out_slots`); the request table must hold the keys of
        the positions they move over before the pass reads it."""
        if not metadata.extra.get("graph"):
            raise ValueError("shift_plan moves a graph plan's requests; this plan is eager")
        real = shift.shape[0]
        if not 0 < real < metadata.kv_indptr.shape[0]:
            raise ValueError(
                f"{real} shifts for a plan of {metadata.kv_indptr.shape[0] - 1} requests"
            )
        ends = torch.cumsum(shift, 0)
        metadata.prefix_lens[:real] += shift
        metadata.kv_indptr[1 : real + 1] += ends
        metadata.kv_indptr[real + 1 :] += ends[-1]  # padding requests: the total repeated

    def apply_table_writes(self, writes: torch.Tensor) -> None:
        """Apply staged request-table writes (`triton_index.launch_table_writes`) on the
        device, in stream order: a captured pass does it before it reads the table."""
        triton_index.launch_table_writes(self.pool.req_to_token, writes)

    def _fill(
        self, buffers: GraphBuffers, batch: Batch, padded: int, num_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Write the padded host arrays into the staging buffer, each at its region, and
        copy them to the device in one copy; return views of the used parts. Padding
        requests own no keys and no tokens (an indptr repeats its total); padding tokens
        belong to no request (the padding slot, no tree bits)."""
        real = len(batch.running)
        bits = batch.trees.ancestor_bits if batch.trees is not None else _NO_BITS
        _wait_for_staging(buffers)  # the last plan's copy must have read the staging buffer
        packed = buffers.staging_host.numpy()
        offsets, end = buffers.offsets, 0
        for name, lens in (("qo_indptr", batch.new_lens), ("kv_indptr", batch.seq_lens)):
            start = offsets[name]
            packed[start] = 0
            np.cumsum(lens.lens, out=packed[start + 1 : start + real + 1])
            packed[start + real + 1 : start + padded + 1] = lens.total
            end = max(end, start + padded + 1)
        for name, values, size, fill in (
            ("prefix_lens", batch.prefix_lens.lens, padded, 0),
            ("rows", batch.running.rows, padded, 0),
            ("out_slots", batch.out_slots, num_tokens, PADDING_SLOT),
            ("tree_bits", bits, num_tokens, 0),
        ):
            start, count = offsets[name], values.shape[0]
            packed[start : start + count] = values
            packed[start + count : start + size] = fill
            end = max(end, start + size)
        buffers.staging_device[:end].copy_(buffers.staging_host[:end], non_blocking=True)
        _record_staging(buffers)
        return dict(buffers.used(padded, num_tokens))

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: ForwardMetadata,
        scale: float | None = None,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See AttentionBackend.forward; `out`, when given, receives the output in place."""
        k_cache, v_cache = self.pool.k_cache[layer], self.pool.v_cache[layer]
        num_tokens = metadata.out_slots.shape[0]
        _check_shapes(q, k, v, k_cache, num_tokens)
        if out is None:
            out = torch.empty_like(q)
        elif out.shape[0] < num_tokens or out.shape[1:] != q.shape[1:]:
            raise BufferTooSmall(
                f"out has shape {tuple(out.shape)}; this pass needs {(num_tokens, *q.shape[1:])}"
            )
        if num_tokens == 0:
            return out
        k_new, v_new = k.to(k_cache.dtype), v.to(v_cache.dtype)
        if not kv_stored:
            k_cache.index_copy_(0, metadata.out_slots, k_new)
            v_cache.index_copy_(0, metadata.out_slots, v_new)
        q_cache = q.to(k_cache.dtype)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        if metadata.mode == Mode.EXTEND:
            # padding tokens' rows: zeros (the kernel writes the requests' rows only), so
            # that their K/V in the next layer are finite: a masked key weighs 0 in the
            # kernel, and 0 x NaN is NaN. A graph's plan says 0: its count varies by replay.
            real = metadata.extra.get("new_tokens", num_tokens)
            if real < num_tokens:
                out[real:num_tokens].zero_()
            return extend_attention(
                q_cache,
                k_new,
                v_new,
                k_cache,
                v_cache,
                metadata.kv_indices,
                metadata.kv_indptr,
                metadata.qo_indptr,
                metadata.prefix_lens,
                out,
                metadata.max_new_len,
                metadata.max_seq_len,
                scale,
            )
        return decode_attention(
            q_cache,
            k_cache,
            v_cache,
            metadata.kv_indices,
            metadata.kv_indptr,
            metadata.qo_indptr,
            metadata.prefix_lens,
            metadata.tree_bits,
            out,
            metadata.extra["num_splits"],
            metadata.extra["max_q"],
            scale,
            counters=metadata.extra.get("counters"),
        )


def _wait_for_staging(buffers: GraphBuffers) -> None:
    if buffers.staged is not None:  # an event never recorded returns at once
        buffers.staged.synchronize()


def _record_staging(buffers: GraphBuffers) -> None:
    if buffers.staged is not None:
        buffers.staged.record()


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, num_tokens: int
) -> None:
    head_dim = k_cache.shape[2]
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens or v.shape[0] != num_tokens:
        raise ValueError(
            f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens; the plan has {num_tokens}"
        )
    if k.shape[1:] != k_cache.shape[1:] or v.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"k/v must be [T, {k_cache.shape[1]}, {head_dim}]; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != head_dim or q.shape[1] % k_cache.shape[1]:
        raise ValueError(
            f"q must be [T, Hq, {head_dim}] with Hq a multiple of "
            f"{k_cache.shape[1]} kv heads; got {tuple(q.shape)}"
        )
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {head_dim} is not supported; allowed 16/32/64/128/256")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k and v need a contiguous last (head_dim) dimension")
