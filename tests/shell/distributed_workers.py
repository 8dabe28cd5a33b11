"""Worker setups for the distributed tests: module-level, so spawned processes import them."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist


def summing(rank: int) -> Any:
    """Each message (a Batch): all-reduce its total sequence length times (rank + 1)."""

    def handle(rank: int, message: Any) -> None:
        if isinstance(message, tuple):  # ("die" or "hang", the rank that does)
            what, who = message
            if rank == who and what == "die":
                os._exit(3)
            if rank == who and what == "hang":
                time.sleep(3600)
            return
        value = torch.tensor([float(message.seq_lens.total * (rank + 1))])
        dist.all_reduce(value)

    return handle
