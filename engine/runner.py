"""The runner: one snapshot in, one forward pass, logits for the rows that sample out."""

from __future__ import annotations

import numpy as np
import torch

from engine.backends import AttentionBackend
from engine.state import Batch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 device: torch.device, cuda_graph_max_batch: int = 0) -> None:
        self.model = model
        self.cuda_graph_max_batch = cuda_graph_max_batch
        self.backend = backend
        self.device = device

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """fp32 logits [len(batch.logit_rows), vocab] for the rows `batch.logit_rows` names."""
        metadata = self.backend.plan(batch)
        hidden = self.model(self._tensor(batch.input_ids), self._tensor(batch.positions),
                            metadata, self.backend)
        return self.model.logits(hidden[self._tensor(batch.logit_rows)])
