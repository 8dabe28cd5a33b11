"""The runner: one snapshot in, one forward pass, logits for the rows that sample out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import attrs
import numpy as np
import torch

from engine.backends import AttentionBackend, ForwardMetadata
from engine.backends.base import upload
from engine.shell.graphs import CapturedPass, GraphRunner, graph_runners
from engine.shell.logits import Launched, VerifyLaunched
from engine.shell.table import RequestTable
from engine.state import Batch, Mode

if TYPE_CHECKING:
    from engine.backends.triton_backend import TritonBackend
    from engine.model.llama import LlamaModel

# Eager passes on CUDA run a multiple of TOKEN_ALIGN tokens, padding tokens after the
# batch's (`TritonBackend.plan`'s padded_num_tokens): the products then meet no more token
# counts than `startup.warm_up` runs before serving. cuBLAS loads a kernel the first time
# it chooses it for a shape, 3-4 ms in which the device waits for the pass (H200,
# `benchmarks/bench_first_use.py`: after every count of a step of 16 was run once, 44 of 316
# first calls at other counts still took over 1 ms). A pass pays at most TOKEN_ALIGN - 1
# tokens for it.
TOKEN_ALIGN = 16


class PassRunner(Protocol):
    """What the engine's passes launch on and its plans are prepared with: a model's runner
    (`ModelRunner`), rank 0's over its workers (`ParallelRunner`), or a stand-in for the
    model (a benchmark's)."""

    def prepare(self, batch: Batch) -> Prepared: ...

    def launch(
        self,
        prepared: Prepared,
        batch: Batch,
        input_ids: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def forward(self, batch: Batch) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        device: torch.device,
        graph_max_batch: int = 0,
        max_tree_nodes: int = 0,
        capture: bool = True,
        table: RequestTable | None = None,
        graph_max_tokens: int = 0,
    ) -> None:
        """`table`: the request table the backend's pool mirrors. Its writes may wait for the
        next captured pass (`GraphRunner`); any other pass applies them before it is
        planned. `graph_max_tokens` (with `graph_max_batch`): extend passes of up to that
        many tokens replay captured graphs too."""
        self.model = model
        self.table = table
        self.backend = backend
        self.device = device
        # where eager passes are padded: CUDA, a backend whose plan pads (the Triton one)
        pads = device.type == "cuda" and getattr(backend, "pads_eager_tokens", False)
        self.token_align = TOKEN_ALIGN if pads else 1
        self.graphs: list[GraphRunner] = []
        if graph_max_batch and hasattr(backend, "graph_buffers"):
            self.graphs = graph_runners(
                model,
                cast("TritonBackend", backend),  # the backend that captures graphs
                graph_max_batch,
                max_tree_nodes,
                capture=capture,
                table=table,
                extend_tokens=graph_max_tokens,
            )

    @torch.inference_mode()
    def prepare(self, batch: Batch) -> Prepared:
        """Plan the pass (backend metadata; for a graph, its static buffers) ahead of `launch`.
        Passes small enough replay a captured graph; the rest, and those that score prompt
        tokens (`Batch.score_rows`), run eagerly."""
        for graph in self.graphs if batch.score_rows is None else ():
            if graph.accepts(batch):
                if not graph.applies_writes:
                    self._flush()
                return Prepared(batch, graph, *graph.prepare(batch))
        self._flush()  # the plan reads the table on the device
        num_tokens = self.num_tokens(batch)
        if num_tokens == batch.new_lens.total:
            return Prepared(batch, None, None, self.backend.plan(batch))
        padding = cast("TritonBackend", self.backend)  # `token_align` > 1: a padding backend
        return Prepared(batch, None, None, padding.plan(batch, padded_num_tokens=num_tokens))

    def _flush(self) -> None:
        if self.table is not None:
            self.table.flush()

    def num_tokens(self, batch: Batch) -> int:
        """The token count an eager pass of `batch` runs: its new tokens, rounded up to
        `token_align`."""
        return -(-batch.new_lens.total // self.token_align) * self.token_align

    @torch.inference_mode()
    def launch(
        self,
        prepared: Prepared,
        batch: Batch,
        input_ids: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits [len(batch.output_rows), vocab] for the rows `batch.output_rows` names
        (`logit_rows`, then any `score_rows`: an eager pass's). `batch` has the layout
        `prepared` was planned for; its input ids may be newer.
        `input_ids`: the pass's input ids on the device (the tokens the last pass sampled,
        not read back yet), which replace `batch.input_ids`. `shift`: a decode pass's
        requests are that many tokens further on (on the device: `GraphRunner.replay`); a
        graph's pass only."""
        every_row = batch.mode in (Mode.DECODE, Mode.VERIFY)  # logit_rows is all of them
        if input_ids is not None and tuple(input_ids.shape) != (batch.new_lens.total,):
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)}; this pass has "
                f"{batch.new_lens.total} new tokens"
            )
        if prepared.runner is not None:  # the graph computes the logit rows' logits only
            assert prepared.graph is not None  # a runner's plan names its graph
            return prepared.runner.replay(prepared.graph, batch, input_ids, shift)
        if shift is not None:
            raise ValueError("a shift on the device needs a graph's pass; this pass is eager")
        arrays = {} if every_row else {"logit_rows": batch.output_rows.astype(np.int64)}
        count, num_tokens = batch.new_lens.total, self.num_tokens(batch)
        arrays["positions"] = _padded(batch.positions, num_tokens)  # padding: position 0
        if input_ids is None:
            arrays["input_ids"] = _padded(batch.input_ids, num_tokens)
        elif num_tokens > count:
            input_ids = torch.nn.functional.pad(input_ids, (0, num_tokens - count))
        on_device = upload(self.device, arrays)  # one copy the host does not wait for
        hidden = self.model(
            on_device["input_ids"] if input_ids is None else input_ids,
            on_device["positions"],
            prepared.metadata,
            self.backend,
        )
        return self.model.logits(hidden[:count] if every_row else hidden[on_device["logit_rows"]])

    def forward(self, batch: Batch) -> torch.Tensor:
        """prepare + launch: fp32 logits for the rows `batch.output_rows` names."""
        return self.launch(self.prepare(batch), batch)


def _padded(values: np.ndarray, length: int) -> np.ndarray:
    """values as int64, zeros after them up to `length`."""
    out = np.zeros(length, dtype=np.int64)
    out[: len(values)] = values
    return out


@attrs.frozen(eq=False)
class Prepared:
    """A planned pass: the batch it was planned for, the graph runner and graph that will
    replay it (None: eager) and the backend's plan (a graph's pass reads the plan's buffers,
    with the host values of its capture); `launched`: what its launch returned, when it was
    launched ahead (before the tokens of the pass before it were read back)."""

    batch: Batch
    runner: GraphRunner | None
    graph: CapturedPass | None
    metadata: ForwardMetadata
    launched: Launched | VerifyLaunched | None = None

    def verify_launched(self) -> VerifyLaunched:
        """What this verify pass's launch gave: a verify pass is held launched (`PlanAhead`'s
        `plan` and `plan_committed` with trees)."""
        assert isinstance(self.launched, VerifyLaunched)
        return self.launched
