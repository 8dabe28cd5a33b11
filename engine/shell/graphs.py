"""Decode, verify and extend passes replayed from captured CUDA graphs.

Decode and verify: one graph per padded batch size P (decode: P tokens; verify: P * W tokens
for trees of up to W nodes), sharing one memory pool and one set of static backend buffers.
Verify graphs are captured at a few tree widths W (`verify_widths`: 4, 8 and the draft
budget's trees), and a verify pass replays the narrowest its largest tree fits: its products
and attention run only that many rows a request. Extend passes (prompt chunks, with a mixed
pass's decodes) of up to `cuda_graph_max_tokens` tokens replay one of a few token counts T
(`extend_sizes`), their tokens padded up to it, with up to min(T, P) requests; the graph
computes logits only for the rows that sample, which the inputs' copy names. An eager pass
of a small model is its kernels' launches from Python (on the H200 an extend step of the
default model's chat prompts took 14-29 ms in `bench_spec.py --device cuda`'s step times,
against about 0.7 ms a decode step).
Before each replay the backend
plans into those buffers (outside the graph) and the inputs are copied into static tensors;
the pass's kv indices are built inside the graph from those buffers (where the backend can:
`build_kv_indices`), so a replay launches one graph and nothing else. Before a verify pass
the request table's writes since the last pass travel in the inputs' copy and the graph
applies them first (`apply_table_writes`): the commit of the step before launches nothing
to update the device table.
Padding requests own nothing and padding tokens write K/V to the padding slot. On a machine
without CUDA the same static path runs eagerly (`capture=False`), so it is tested on CPU: with
the metadata of the pass a capture runs (a dummy batch's), as a graph keeps its host values.
Each graph's launches run under the PDL setting and kinds `pdl.for_pass` gives its pass.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import pdl
from engine.ops.gemv_policy import kernel_takes
from engine.shell.table import RequestTable
from engine.state import (
    PADDING_SLOT,
    Batch,
    FinishRules,
    Mode,
    Running,
    schedule_decode,
    schedule_extend,
    schedule_verify,
)
from engine.state.batch import DraftTrees

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from engine.backends.base import ForwardMetadata
    from engine.backends.triton_backend import TritonBackend
    from engine.model.llama import LlamaModel


def default_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 8))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


# Tree widths (nodes a request) of the verify graphs below the widest, the draft budget's
# trees. A verify pass of a narrower graph runs fewer rows through every product and its
# attention; on the H200 (`bench_steps.py --tree-nodes`, the default model's shape, fp32,
# batch 1) a pass of 2, 4, 8 and 13 rows took 0.77, 0.77, 0.84 and 1.31 ms against a decode
# pass's 0.61 (with `pdl.for_pass`'s setting each).
VERIFY_WIDTHS = (4, 8)


def verify_widths(max_tree_nodes: int) -> list[int]:
    """The tree widths of the verify graphs for trees of up to `max_tree_nodes` nodes."""
    return sorted({w for w in VERIFY_WIDTHS if w < max_tree_nodes} | {max_tree_nodes})


# Token counts of the extend graphs below the largest (`cuda_graph_max_tokens`): an extend
# pass replays the smallest its tokens fit, so padding adds at most half its tokens from 256.
EXTEND_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def extend_sizes(max_tokens: int) -> list[int]:
    """The token counts of the extend graphs for passes of up to `max_tokens` tokens."""
    if max_tokens < 1:
        return []
    return sorted({t for t in EXTEND_TOKENS if t < max_tokens} | {max_tokens})


def graph_runners(
    model: LlamaModel,
    backend: TritonBackend,
    max_batch: int,
    max_tree_nodes: int = 0,
    capture: bool = True,
    table: RequestTable | None = None,
    extend_tokens: int = 0,
) -> list[GraphRunner]:
    """The decode graphs, then (`max_tree_nodes`: speculation's widest trees) the verify
    graphs of each of `verify_widths`, narrowest first, then (`extend_tokens`) the extend
    graphs of passes of up to that many tokens: the first runner that `accepts` a batch
    replays it. The verify runners share one memory pool (captured widest first, so the
    others reuse its memory: one pass runs at a time) and take up to as many of the table's
    writes as the widest."""
    decode = GraphRunner(model, backend, Mode.DECODE, max_batch, capture=capture, table=table)
    extend = []
    if extend_tokens:
        extend = [
            GraphRunner(
                model,
                backend,
                Mode.EXTEND,
                max_batch,
                capture=capture,
                table=table,
                extend_tokens=extend_tokens,
            )
        ]
    if not max_tree_nodes:
        return [decode, *extend]
    device = backend.pool.req_to_token.device
    pool = torch.cuda.graph_pool_handle() if capture and device.type == "cuda" else None
    *narrower, widest = verify_widths(max_tree_nodes)

    def verify(width: int, write_capacity: int | None) -> GraphRunner:
        return GraphRunner(
            model, backend, Mode.VERIFY, max_batch, width, capture, table, pool, write_capacity
        )

    runners = [verify(widest, None)]  # captured first
    for width in reversed(narrower):
        runners.append(verify(width, runners[0].write_capacity or None))
    return [decode, *reversed(runners), *extend]


class CapturedPass:
    """Static inputs and outputs of one captured pass shape, `key` among its runner's:
    `batch_size` requests (padded), `num_tokens` tokens, and for an extend pass
    (`logit_rows`) the rows whose logits it computes."""

    def __init__(
        self,
        key: int,
        batch_size: int,
        num_tokens: int,
        device: torch.device,
        writes_size: int,
        logit_rows: bool = False,
    ) -> None:
        self.key, self.batch_size, self.num_tokens = key, batch_size, num_tokens
        # ids, positions, the logit rows and the table writes in one tensor: one
        # host-to-device copy
        rows = batch_size if logit_rows else 0
        self.staged = torch.zeros(
            2 * num_tokens + rows + writes_size, dtype=torch.int64, device=device
        )
        self.inputs = self.staged[: 2 * num_tokens].view(2, num_tokens)
        self.input_ids, self.positions = self.inputs[0], self.inputs[1]
        self.rows = self.staged[2 * num_tokens : 2 * num_tokens + rows] if rows else None
        self.writes = self.staged[2 * num_tokens + rows :] if writes_size else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # the metadata of the pass the graph captured (its dummy batch's): its tensors are
        # the static buffers each plan writes, its host values fixed in the graph
        self.metadata: ForwardMetadata | None = None


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's garbage collector kept out of CUDA graph captures: what is garbage now is
    collected first, and nothing until the block ends (the collector's state is restored,
    on an error too). A collection inside a capture runs dead objects' finalizers: a dead
    engine's CUDA graphs reset there ("operation not permitted when stream is capturing"),
    which invalidates the capture ("operation failed due to a previous error during
    capture"). `torch.cuda.graph` collects on entry only with
    `torch.compiler.config.force_cudagraph_gc`."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphRunner:
    """Captures (or, without CUDA, mimics) decode or verify passes for batch sizes up to
    `max_batch`, or extend passes of up to `extend_tokens` tokens and `max_batch` requests;
    `prepare(batch)` then `replay(...)` give logits for the rows `batch.logit_rows` names
    (a decode or verify pass: every new token)."""

    def __init__(
        self,
        model: LlamaModel,
        backend: TritonBackend,
        mode: Mode,
        max_batch: int,
        max_tree_nodes: int = 1,
        capture: bool = True,
        table: RequestTable | None = None,
        pool: _POOL_HANDLE | None = None,
        write_capacity: int | None = None,
        extend_tokens: int = 0,
    ) -> None:
        """`table`: the request table the backend's pool mirrors; for verify passes that
        build their kv indices, with the table's mirror separate, its writes wait for the
        next replay, which applies them on the device before it reads the table
        (`applies_writes`), up to `write_capacity` of them (None: twice the largest pass's
        tokens). `pool`: the CUDA graph memory pool to capture into (None: one of its
        own). `extend_tokens` (extend passes only): the most tokens a replayed pass has; its
        graphs are keyed by their token counts (`extend_sizes`), each with up to
        min(tokens, max_batch) requests."""
        if (mode == Mode.EXTEND) != (extend_tokens > 0):
            raise ValueError(
                f"extend_tokens={extend_tokens} for {mode.value} passes: extend graphs need "
                "a positive token count, decode and verify graphs none"
            )
        self.model, self.backend, self.mode = model, backend, mode
        self.per_request = max_tree_nodes if mode == Mode.VERIFY else 1
        # a graph's key: its batch size (decode, verify) or its token count (extend)
        if mode == Mode.EXTEND:
            self.sizes = extend_sizes(extend_tokens)
            shapes = {t: (min(t, max_batch), t) for t in self.sizes}
        else:
            self.sizes = default_batch_sizes(max_batch)
            shapes = {s: (s, s * self.per_request) for s in self.sizes}
        self.max_batch = max(requests for requests, _ in shapes.values())
        device = backend.pool.req_to_token.device
        max_tokens = max(tokens for _, tokens in shapes.values())
        max_context = backend.pool.req_to_token.shape[1]
        self.buffers = backend.graph_buffers(
            self.max_batch,
            max_tokens,
            self.max_batch * max_context,
            max_tree_nodes=self.per_request,
        )
        # a backend whose passes can build their own kv indices: each replay does, on the
        # device (a plan then launches nothing)
        self.indices_in_pass = hasattr(backend, "build_kv_indices")
        self.table = table
        # Verify passes only: the writes a verify pass's commit makes are the host's work
        # between two passes, which the device waits for. A decode pass's writes are made
        # while the pass before it runs (`PlanAhead`), so carrying them would cost the pass
        # a launch and save no time (docs/benchmarks.md, `bench_steps.py`).
        self.applies_writes = (
            mode == Mode.VERIFY
            and table is not None
            and table.mirrored
            and self.indices_in_pass
            and hasattr(backend, "apply_table_writes")
        )
        # a replay takes up to twice its pass's tokens of writes (the accepted paths of a
        # verify pass, and a decode pass's slots before it); more are applied at once
        if write_capacity is None:
            write_capacity = 2 * max_tokens
        self.write_capacity = write_capacity if self.applies_writes else 0
        writes_size = 1 + 2 * self.write_capacity if self.applies_writes else 0
        logit_rows = mode == Mode.EXTEND
        self.graphs = {
            size: CapturedPass(size, *shapes[size], device, writes_size, logit_rows)
            for size in self.sizes
        }
        rows = {size: size * self.per_request for size in self.sizes}
        largest = max(w.numel() for w in self.model.layer_products())
        self.pdl = {
            size: pdl.for_pass(rows[size], self._package_products(rows[size]), largest)
            for size in self.sizes
        }
        # Capture allocates from torch's caching allocator; without it (as under memcheck with
        # PYTORCH_NO_CUDA_MEMORY_CACHING=1) the same static path runs uncaptured.
        self.capture = (
            capture
            and device.type == "cuda"
            and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0")
        )
        # the host side of every graph's staged copy: as long as the longest
        self._staging = torch.zeros(
            max(graph.staged.numel() for graph in self.graphs.values()),
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        )
        self._staged: torch.cuda.Event | None = None
        if self.capture:
            self._capture_all(device, torch.cuda.graph_pool_handle() if pool is None else pool)
        else:  # what a capture would keep: the metadata of the pass it ran
            for graph in self.graphs.values():
                graph.metadata = self._plan(graph, self._dummy_batch(graph.batch_size))
        if self.applies_writes:
            assert table is not None
            table.defer_writes()

    def accepts(self, batch: Batch) -> bool:
        if batch.mode != self.mode or len(batch.running) > self.max_batch:
            return False
        if self.mode == Mode.EXTEND:
            return self._graph_for(batch) is not None
        return batch.new_lens.max <= self.per_request

    def _graph_for(self, batch: Batch) -> CapturedPass | None:
        """The smallest graph that holds `batch`'s requests and tokens (None: none does)."""
        if self.mode != Mode.EXTEND:  # the tokens follow the requests
            at = bisect.bisect_left(self.sizes, len(batch.running))
            return self.graphs[self.sizes[at]] if at < len(self.sizes) else None
        tokens, requests = batch.new_lens.total, len(batch.running)
        at = bisect.bisect_left(self.sizes, tokens)
        fits = (self.graphs[t] for t in self.sizes[at:])
        return next((g for g in fits if g.batch_size >= requests), None)

    def _package_products(self, rows: int) -> bool:
        """Whether the package's matrix kernels run every product of the layers in a pass of
        `rows` rows (`kernel_takes`)."""
        return all(kernel_takes(rows, w.dtype, tuple(w.shape)) for w in self.model.layer_products())

    def _forward(self, graph: CapturedPass, metadata: ForwardMetadata) -> torch.Tensor:
        with pdl.running(self.pdl[graph.key]):
            if graph.writes is not None:
                self.backend.apply_table_writes(graph.writes)
            if self.indices_in_pass:
                self.backend.build_kv_indices(metadata)
            hidden = self.model(graph.input_ids, graph.positions, metadata, self.backend)
            if graph.rows is not None:  # an extend pass: the rows that sample
                hidden = hidden.index_select(0, graph.rows)
            return self.model.logits(hidden)

    def _plan(self, graph: CapturedPass, batch: Batch) -> ForwardMetadata:
        in_pass = {"indices_in_pass": True} if self.indices_in_pass else {}
        return self.backend.plan(
            batch,
            buffers=self.buffers,
            padded_batch_size=graph.batch_size,
            padded_num_tokens=graph.num_tokens,
            **in_pass,
        )

    def _capture_all(self, device: torch.device, pool: _POOL_HANDLE | None) -> None:
        with collection_paused():
            self._capture_each(device, pool)

    def _capture_each(self, device: torch.device, pool: _POOL_HANDLE | None) -> None:
        stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):  # largest first: later graphs reuse its memory
            graph = self.graphs[size]
            metadata = graph.metadata = self._plan(graph, self._dummy_batch(graph.batch_size))
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: autotuning and lazy init outside the capture
                    self._forward(graph, metadata)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.graph, pool=pool, stream=stream):
                graph.logits = self._forward(graph, metadata)
            torch.cuda.synchronize(device)

    def _dummy_batch(self, size: int) -> Batch:
        """`size` requests writing to the padding slot (used only to capture): the first
        token of their two-token prompts (a one-token chunk of each prompt would be a decode
        pass's shape), or their decode or root-only verify pass after a one-token prompt."""
        prompt = 2 if self.mode == Mode.EXTEND else 1
        rules = FinishRules(
            np.ones(size), np.zeros(size), -np.ones(size), np.zeros((size, 0), dtype=np.int64)
        )
        running = Running.admitted(
            np.arange(size),
            np.arange(size),
            np.full(size, prompt),
            np.full(size, prompt),
            np.zeros(size),
            rules,
            self.backend.pool.req_to_token.shape[1],
        )
        slots = np.full(size, PADDING_SLOT)
        if self.mode == Mode.EXTEND:
            ones = np.ones(size, dtype=np.int64)
            batch = schedule_extend(running, ones, np.zeros(size, dtype=np.int64), slots)
        elif self.mode == Mode.DECODE:
            batch = schedule_decode(running, slots)
        else:
            batch = schedule_verify(running, DraftTrees.roots_only(np.zeros(size)), slots)
        assert batch.mode == self.mode, (batch.mode, self.mode)
        return batch

    def prepare(self, batch: Batch) -> tuple[CapturedPass, ForwardMetadata]:
        """Plan `batch` into the static buffers of the graph that will replay it. Runs on the
        stream after any pass already launched, so it may overlap that pass's execution."""
        graph = self._graph_for(batch)
        if graph is None:
            raise ValueError(
                f"no {self.mode.value} graph holds {len(batch.running)} requests and "
                f"{batch.new_lens.total} tokens (`accepts` says which do)"
            )
        return graph, self._plan(graph, batch)

    def _stage_writes(self, writes: np.ndarray) -> int:
        """The table's waiting writes into `writes` (count, places, then at 1 + capacity the
        slots), or a count of 0 where more wait than fit (applied at once instead). Returns
        how much of `writes` the copy must take."""
        assert self.table is not None
        capacity = self.write_capacity
        taken = self.table.take_writes(capacity)
        if taken is None:
            writes[0] = 0
            return 1
        at, slots = taken
        writes[0] = at.size
        writes[1 : 1 + at.size] = at
        writes[1 + capacity : 1 + capacity + at.size] = slots
        return 1 + capacity + at.size

    @torch.inference_mode()
    def replay(
        self,
        graph: CapturedPass,
        batch: Batch,
        input_ids: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(batch.logit_rows), vocab] of the rows `batch.logit_rows` names (a
        decode or verify pass: every new token), for `batch` with the layout of the batch
        `prepare` planned into the static buffers (its input ids may differ). `input_ids`
        (on the device, one per new token): copied in on the device in place of
        `batch.input_ids`, in stream order (tokens a pass before sampled, not read back).
        `shift` (a decode pass, on the device, one per request): the requests are that many
        tokens further on than `batch` says (`TritonBackend.shift_plan`; their positions
        too), counts found on the device after `batch` was planned.
        Uncaptured, the pass runs with the metadata of the capture's pass, as a graph
        would: the plan's host values do not reach it, only its buffers."""
        if shift is not None and (self.mode != Mode.DECODE or shift.shape != (len(batch.running),)):
            raise ValueError(
                f"a shift of shape {tuple(shift.shape)} for a {self.mode.value} pass of "
                f"{len(batch.running)} requests: a decode pass takes one per request"
            )
        metadata = graph.metadata
        assert metadata is not None  # planned, or captured, as the runner was built
        count, num_tokens = batch.new_lens.total, graph.num_tokens
        if self._staged is not None:
            self._staged.synchronize()  # the last copy must have read the staging buffer
        host = self._staging.numpy()
        inputs = host[: 2 * num_tokens].reshape(2, num_tokens)
        inputs[0, :count] = batch.input_ids
        inputs[1, :count] = batch.positions
        inputs[:, count:] = 0
        end = 2 * num_tokens
        out_rows = count
        if graph.rows is not None:  # an extend pass: the rows that sample, padded with row 0
            rows = batch.logit_rows
            out_rows = rows.shape[0]
            host[end : end + out_rows] = rows
            host[end + out_rows : end + graph.batch_size] = 0
            end += graph.batch_size
        if graph.writes is not None:  # the table's waiting writes: count, places, slots
            end = self._stage_writes(host[end:]) + end
        elif self.table is not None:  # writes since the plan: on the device before the pass
            self.table.flush()
        graph.staged[:end].copy_(self._staging[:end], non_blocking=True)
        if input_ids is not None:
            graph.input_ids[:count].copy_(input_ids)
        if shift is not None:
            graph.positions[:count] += shift
            self.backend.shift_plan(metadata, shift)
        if self.capture:
            assert graph.graph is not None and graph.logits is not None  # captured
            self._staged = self._staged or torch.cuda.Event()
            self._staged.record()
            graph.graph.replay()
            return graph.logits[:out_rows]
        return self._forward(graph, metadata)[:out_rows]
