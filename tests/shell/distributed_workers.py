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


# --- a decoder layer's projections, split by ShardPlan, against the whole layer --------------
LAYER_SHAPES = dict(hidden=32, heads=4, head_dim=8, intermediate=48, vocab=50)


def layer_weights(num_kv_heads: int) -> dict[str, torch.Tensor]:
    """A random Llama-shaped layer (q/k/v with biases, as Qwen2's) with `num_kv_heads`."""
    g = torch.Generator().manual_seed(0)
    s = LAYER_SHAPES
    q, kv = s["heads"] * s["head_dim"], num_kv_heads * s["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    return {
        "q_proj.weight": rand(q, s["hidden"]),
        "q_proj.bias": rand(q),
        "k_proj.weight": rand(kv, s["hidden"]),
        "k_proj.bias": rand(kv),
        "v_proj.weight": rand(kv, s["hidden"]),
        "v_proj.bias": rand(kv),
        "o_proj.weight": rand(s["hidden"], q),
        "gate_proj.weight": rand(s["intermediate"], s["hidden"]),
        "up_proj.weight": rand(s["intermediate"], s["hidden"]),
        "down_proj.weight": rand(s["hidden"], s["intermediate"]),
        "lm_head.weight": rand(s["vocab"], s["hidden"]),
    }


def layer_forward(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, kv_heads: int):
    """Attention (causal, GQA) + o_proj, then the MLP on the result, then the LM head:
    (attention out, MLP out, logits), each before any cross-rank sum."""
    d = LAYER_SHAPES["head_dim"]
    t = x.shape[0]
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).view(t, heads, d).transpose(0, 1)
    k = (x @ w["k_proj.weight"].T + w["k_proj.bias"]).view(t, kv_heads, d).transpose(0, 1)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).view(t, kv_heads, d).transpose(0, 1)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = att.transpose(0, 1).reshape(t, heads * d) @ w["o_proj.weight"].T
    gate, up = x @ w["gate_proj.weight"].T, x @ w["up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ w["down_proj.weight"].T
    logits = x @ w["lm_head.weight"].T
    return attn, mlp, logits


def sharded_layer(rank: int) -> Any:
    """Each message (num_kv_heads, world, x): this rank's part of `layer_forward`, summed
    (attention, MLP) or gathered (logits) across ranks."""
    from engine.model.parallel import ShardPlan

    def handle(rank: int, message: Any) -> None:
        num_kv_heads, world, x = message
        run_shard(rank, world, num_kv_heads, x, ShardPlan)

    return handle


def run_shard(rank: int, world: int, num_kv_heads: int, x: torch.Tensor, plan_cls: Any):
    s = LAYER_SHAPES
    plan = plan_cls(
        rank, world, s["heads"], num_kv_heads, s["head_dim"], s["intermediate"], s["vocab"]
    )
    weights = {name: plan.shard(name, w) for name, w in layer_weights(num_kv_heads).items()}
    attn, mlp, logits = layer_forward(x, weights, plan.heads_per_rank, plan.kv_heads_per_rank)
    dist.all_reduce(attn)
    dist.all_reduce(mlp)
    parts = [torch.zeros(x.shape[0], plan.vocab_per_rank) for _ in range(world)]
    padded = torch.zeros(x.shape[0], plan.vocab_per_rank)
    padded[:, : logits.shape[1]] = logits
    dist.all_gather(parts, padded)
    return attn, mlp, torch.cat(parts, dim=1)[:, : s["vocab"]]
