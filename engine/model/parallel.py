"""Tensor parallelism's arithmetic: which part of each weight a rank holds (Megatron-style).

q, k, v, gate and up are split by output rows (column-parallel: by whole heads for q/k/v); o
and down by input columns (row-parallel), so a layer needs one all-reduce after attention and
one after the MLP. The embedding and the LM head are split by vocabulary rows. KV heads are
split across ranks, or replicated when there are fewer KV heads than ranks (each rank keeps
the KV head its query heads read). A shape the plan cannot split evenly is refused at load
with an error naming it.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from engine.model.config import ModelConfig


@attrs.frozen
class ShardPlan:
    """Rank `rank` of `world` for a model of these shapes."""

    rank: int
    world: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")
        if self.num_heads % self.world:
            raise ValueError(
                f"num_attention_heads={self.num_heads} does not split over "
                f"tensor_parallel_size={self.world}; it must be a multiple of it"
            )
        kv, world = self.num_kv_heads, self.world
        if (kv >= world and kv % world) or (kv < world and world % kv):
            raise ValueError(
                f"num_key_value_heads={kv} does not split over tensor_parallel_size={world}: "
                "one must be a multiple of the other"
            )
        if self.intermediate_size % self.world:
            raise ValueError(
                f"intermediate_size={self.intermediate_size} does not split over "
                f"tensor_parallel_size={self.world}; it must be a multiple of it"
            )

    # --- what this rank holds --------------------------------------------------------------
    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this rank keeps (1 when they are replicated)."""
        return max(self.num_kv_heads // self.world, 1)

    def q_heads(self) -> range:
        start = self.rank * self.heads_per_rank
        return range(start, start + self.heads_per_rank)

    def kv_heads(self) -> range:
        """The KV heads of this rank's query heads (GQA keeps q head h on kv head h // group)."""
        if self.num_kv_heads >= self.world:
            start = self.rank * self.kv_heads_per_rank
            return range(start, start + self.kv_heads_per_rank)
        group = self.num_heads // self.num_kv_heads
        first = self.q_heads()[0] // group
        return range(first, first + 1)

    def _head_rows(self, heads: range) -> torch.Tensor:
        return torch.arange(heads.start * self.head_dim, heads.stop * self.head_dim)

    def q_rows(self) -> torch.Tensor:
        """Rows of q_proj's weight (and bias) this rank holds; also o_proj's columns."""
        return self._head_rows(self.q_heads())

    def kv_rows(self) -> torch.Tensor:
        """Rows of k_proj's and v_proj's weights (and biases) this rank holds."""
        return self._head_rows(self.kv_heads())

    def mlp_rows(self) -> torch.Tensor:
        """Rows of gate_proj and up_proj; also down_proj's columns."""
        size = self.intermediate_size // self.world
        return torch.arange(self.rank * size, (self.rank + 1) * size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.world)  # the last rank's part is padded

    def vocab_rows(self) -> torch.Tensor:
        start = self.rank * self.vocab_per_rank
        return torch.arange(start, min(start + self.vocab_per_rank, self.vocab_size))

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes of this rank's part of `config`'s layers (heads, KV heads, MLP width,
        vocabulary rows): what the rank's model allocates."""
        return attrs.evolve(
            config,
            num_heads=self.heads_per_rank,
            num_kv_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_size // self.world,
            vocab_size=len(self.vocab_rows()),
        )

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world: int) -> ShardPlan:
        """Rank `rank`'s plan for a model of `config`'s shapes (refused if they do not split)."""
        return cls(
            rank,
            world,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
        )

    # --- weights ---------------------------------------------------------------------------
    def shard(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of a layer weight named like HF Llama's (`q_proj`, `o_proj`,
        `embed_tokens`, ...; `.weight` or `.bias`); norms are whole on every rank."""
        short = name.removesuffix(".weight").removesuffix(".bias").rsplit(".", 1)[-1]
        rows = {
            "q_proj": self.q_rows,
            "k_proj": self.kv_rows,
            "v_proj": self.kv_rows,
            "gate_proj": self.mlp_rows,
            "up_proj": self.mlp_rows,
            "embed_tokens": self.vocab_rows,
            "lm_head": self.vocab_rows,
        }
        columns = {"o_proj": self.q_rows, "down_proj": self.mlp_rows}
        if short in rows:
            return weight.index_select(0, rows[short]().to(weight.device)).contiguous()
        if short in columns:
            if name.endswith(".bias"):  # added once: after the all-reduce, on rank 0
                return weight if self.rank == 0 else torch.zeros_like(weight)
            return weight.index_select(1, columns[short]().to(weight.device)).contiguous()
        return weight


# --- the collectives a sharded forward makes (the default process group) -------------------
def all_reduce(partial: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a row-parallel product's partial results, in place."""
    dist.all_reduce(partial)
    return partial


def embed(ids: torch.Tensor, table: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """Vocab-parallel lookup: each rank looks up the ids in its rows (zeros elsewhere) and
    the sum over ranks is the whole table's lookup."""
    start = plan.rank * plan.vocab_per_rank
    local = ids - start
    outside = (local < 0) | (local >= table.shape[0])
    rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), table)
    return all_reduce(rows.masked_fill(outside[:, None], 0))


def gather_vocab(logits: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """The whole vocabulary's logits [T, vocab] on every rank from each rank's columns (the
    last rank's part padded to `vocab_per_rank`)."""
    short = plan.vocab_per_rank - logits.shape[1]  # only the last rank's part may be short
    padded = torch.nn.functional.pad(logits, (0, short)) if short else logits
    rows = padded.shape[0]
    parts = torch.empty(
        (plan.world * rows, padded.shape[1]), dtype=padded.dtype, device=padded.device
    )
    _all_gather_single(parts, padded)
    width = plan.vocab_per_rank
    whole = parts.view(plan.world, rows, width).permute(1, 0, 2).reshape(rows, plan.world * width)
    return whole[:, : plan.vocab_size]


# torch >= 2.13 names it all_gather_single (the old name warns); older releases have the old one
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
