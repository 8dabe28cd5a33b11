"""The decoder every family runs on (Llama's layout, with the options of Qwen2 and Qwen3) in
torch; attention goes only through an `AttentionBackend`.

Tokens are flat ([T] ids, [T] positions): the batch layout lives in the backend's metadata.
The forward has no host sync and no branch on tensor values, so CUDA graphs can capture it.
Norms, RoPE, SiLU*mul and the matrix products run as an op set from `engine.ops` (the
reference, the CPU kernels or Triton), chosen by name: the model imports no op set itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops as op_sets
from engine.backends.base import AttentionBackend, ForwardMetadata
from engine.model import parallel
from engine.model.config import ModelConfig
from engine.model.parallel import ShardPlan
from engine.model.rope import rope_attention_factor, rope_inv_freq
from engine.ops.blockq import BlockWeight, linear
from engine.ops.reference import QkvExtras, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised weight: the loader or `init_random` fills every one. On CPU it is
    stored column-major (a transposed view of a [cols, rows] tensor): F.linear then runs
    MKL's no-transpose GEMM, ~2x faster for the few-row passes of verify and short chunks."""
    if torch.device(device).type == "cpu":
        return nn.Parameter(
            torch.empty(cols, rows, dtype=dtype, device=device).t(), requires_grad=False
        )
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


def _norm_linear(
    ops: Any, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, weight: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the product of RMSNorm(hidden + residual) with weight, the residual stream): the op
    set's one call where it has one that applies, else the norm and then the product
    (residual None: the stream starts from hidden)."""
    fused = getattr(ops, "norm_linear", None)
    result = fused(hidden, residual, norm.weight, norm.eps, weight) if fused is not None else None
    if result is not None:
        return result
    normed, residual = _norm(ops, hidden, residual, norm)
    return ops.linear(normed, weight), residual


def _norm(
    ops: Any, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(hidden + residual), the residual stream; residual None: hidden)."""
    if residual is None:
        return ops.rms_norm(hidden, norm.weight, norm.eps), hidden
    return ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)


def _mlp(
    ops: Any, hidden: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the SwiGLU MLP of RMSNorm(hidden + residual), the residual stream), in the op set's
    fewest calls: the norm and SiLU*mul inside the gate_up product (`norm_linear_silu_mul`:
    a few float32 rows), the norm inside the gate_up product and SiLU*mul inside the down
    product (`norm_linear`, `silu_mul_linear`: one row), or SiLU*mul inside the gate_up
    product (`linear_silu_mul`), else one call an op."""
    norm, gate_up_proj = layer.post_attention_layernorm, layer.gate_up_proj
    fused_all = getattr(ops, "norm_linear_silu_mul", None)
    both = (
        fused_all(hidden, residual, norm.weight, norm.eps, gate_up_proj)
        if fused_all is not None
        else None
    )
    if both is not None:
        act, residual = both
        return ops.linear(act, layer.down_proj), residual
    fused_norm = getattr(ops, "norm_linear", None)
    result = (
        fused_norm(hidden, residual, norm.weight, norm.eps, gate_up_proj)
        if fused_norm is not None
        else None
    )
    if result is None:
        normed, residual = _norm(ops, hidden, residual, norm)
        fused_silu = getattr(ops, "linear_silu_mul", None)
        act = fused_silu(normed, gate_up_proj) if fused_silu is not None else None
        if act is None:
            act = ops.silu_mul(ops.linear(normed, gate_up_proj))
        return ops.linear(act, layer.down_proj), residual
    gate_up, residual = result
    fused = getattr(ops, "silu_mul_linear", None)
    out = fused(gate_up, layer.down_proj) if fused is not None else None
    if out is None:
        out = ops.linear(ops.silu_mul(gate_up), layer.down_proj)
    return out, residual


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, with fused qkv and gate/up projections; `qkv_bias`
    (Qwen2) and the per-head `q_norm` / `k_norm` (Qwen3) are None where the config has none."""

    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        dtype: torch.dtype,
        device: torch.device,
        sharded: bool = False,
    ) -> None:
        super().__init__()
        self.index = index
        # `config` holds this rank's shapes; `sharded`: o_proj and down_proj give partial sums
        self.sharded = sharded
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        hidden, inter = config.hidden_size, config.intermediate_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, hidden, dtype, device)
        self.qkv_bias = (
            nn.Parameter(
                torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype, device=device),
                requires_grad=False,
            )
            if config.qkv_bias
            else None
        )
        self.q_norm, self.k_norm = (
            (
                RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device),
                RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device),
            )
            if config.qk_norm
            else (None, None)
        )
        self.o_proj = _weight(hidden, self.q_size, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.gate_up_proj = _weight(2 * inter, hidden, dtype, device)
        self.down_proj = _weight(hidden, inter, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: ForwardMetadata,
        backend: AttentionBackend,
        ops: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added); the first layer
        gets residual None and starts the stream from `hidden`."""
        whole_layer = getattr(ops, "decoder_layer", None)  # one kernel call (CPU), if it applies
        if whole_layer is not None and not self.sharded:
            result = whole_layer(self, hidden, residual, cos, sin, metadata, backend)
            if result is not None:
                return result
        num_tokens = hidden.shape[0]
        qkv, residual = _norm_linear(ops, hidden, residual, self.input_layernorm, self.qkv_proj)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = backend.pool.k_cache[self.index], backend.pool.v_cache[self.index]
        stored = ops.stores_kv  # the kernel casts K/V to the cache dtype, as the backends do
        extras = self.qkv_extras()  # bias, head norms: applied by the op set with RoPE
        if stored:  # rotation and the K/V cache write in one launch
            q, k, v = ops.rope_qkv_store(
                qkv, cos, sin, *heads, k_cache, v_cache, metadata.out_slots, extras
            )
        else:
            q, k, v = ops.rope_qkv(qkv, cos, sin, *heads, extras)
        attn = backend.forward(
            self.index, q, k, v, metadata, scale=self.head_dim**-0.5, kv_stored=stored
        )
        hidden = ops.linear(attn.reshape(num_tokens, self.q_size), self.o_proj)
        if self.sharded:
            hidden = parallel.all_reduce(hidden)
        out, residual = _mlp(ops, hidden, residual, self)
        return (parallel.all_reduce(out) if self.sharded else out), residual

    def qkv_extras(self) -> QkvExtras | None:
        """The layer's q/k/v bias and q/k head norms for the op set (None: it has neither)."""
        if self.qkv_bias is None and self.q_norm is None:
            return None
        q_norm, k_norm = self.q_norm, self.k_norm
        return QkvExtras(
            bias=self.qkv_bias,
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if k_norm is None else k_norm.weight,
            eps=1e-6 if q_norm is None else q_norm.eps,
        )


class LlamaModel(nn.Module):
    """`model(input_ids, positions, metadata, backend)` -> final-normed hidden [T, hidden];
    `model.logits(hidden[rows])` -> fp32 logits [rows, vocab].

    With `shard`, this is one rank's part of the model (`ShardPlan`): its heads, MLP columns
    and vocabulary rows, with the collectives that make each layer's output whole on every
    rank (an all-reduce after o_proj and after down_proj, the embedding's, and an all-gather
    of the logits). `config` stays the whole model's; `local` is this rank's shapes."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        op_set: str | None = None,
        shard: ShardPlan | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = config, dtype, device
        self.shard = shard
        self.local = config if shard is None else shard.local_config(config)
        local = self.local
        # Which `engine.ops` set runs the layers' elementwise work and products (None: the
        # device's default). A plain attribute: tests switch it on one set of weights.
        self.op_set = op_sets.default_for(device, dtype) if op_set is None else op_set
        op_sets.load(self.op_set)  # an unknown name fails here, not at the first pass
        self.embed_tokens = _weight(local.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(local, i, dtype, device, shard is not None)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(local.vocab_size, config.hidden_size, dtype, device)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        self.rope_scale = rope_attention_factor(config)  # yarn scales cos and sin
        self.block_weights: dict[str, BlockWeight] = {}  # see use_block_weights

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] in the model dtype, computed in fp32 as HF does."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos.to(self.dtype), sin.to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: ForwardMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        ops = op_sets.load(self.op_set)
        if self.shard is None:
            hidden = F.embedding(input_ids, self.embed_tokens)
        else:
            hidden = parallel.embed(input_ids, self.embed_tokens, self.shard)
        cos, sin = self.rope(positions)
        residual = None  # the config has at least one layer, so the loop sets it
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, metadata, backend, ops)
        return ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of `hidden` [rows, hidden]: the output layer through the
        op set's product (the Triton set's kernels where they take it, e.g. a small fp32
        model's at every row count), or the block kernel for block weights."""
        weight = self.lm_head
        product = linear if isinstance(weight, BlockWeight) else op_sets.load(self.op_set).linear
        if self.shard is None:
            return product(hidden, weight).float()
        # gathered in the model's dtype (half the bytes of fp32; the cast after is exact)
        return parallel.gather_vocab(product(hidden, weight), self.shard).float()

    def layer_products(self) -> list[torch.Tensor]:
        """The weights of the layers' matrix products (qkv, o_proj, gate_up, down of each
        layer, in order); the output layer's is `lm_head`."""
        layers = cast("list[DecoderLayer]", list(self.layers))  # nn.ModuleList yields Modules
        return [
            weight
            for layer in layers
            for weight in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]

    @torch.inference_mode()
    def warm_products(self, token_counts: Iterable[int], logit_rows: Iterable[int]) -> int:
        """Run each distinct product of the layers on zeros of each of `token_counts` rows,
        and the output layer on each of `logit_rows` rows, through the op set's calls as a
        pass makes them. What it is for: cuBLAS chooses a kernel for each new shape and
        loads that kernel the first time it is chosen (about 3 ms on an H200, the device
        idle meanwhile), so a server does this once before it serves. Returns how many
        products ran. Not for one rank's part of a model (its output layer gathers across
        the ranks)."""
        if self.shard is not None:
            raise ValueError("warm_products runs a whole model's products; this is one rank's")
        ops = op_sets.load(self.op_set)
        weights: dict[tuple[int, ...], torch.Tensor] = {}
        for weight in self.layer_products():
            weights.setdefault(tuple(weight.shape), weight)
        counts, rows = sorted(set(token_counts)), sorted(set(logit_rows))
        if counts and min(counts) < 1 or rows and min(rows) < 1:
            raise ValueError(f"warm_products: row counts must be at least 1; got {counts}, {rows}")
        ran = 0
        for (_, k), weight in weights.items():
            x = torch.zeros(max(counts, default=0), k, dtype=self.dtype, device=self.device)
            for count in counts:
                ops.linear(x[:count], weight)
                ran += 1
        x = torch.zeros(
            max(rows, default=0), self.config.hidden_size, dtype=self.dtype, device=self.device
        )
        for count in rows:
            self.logits(x[:count])
            ran += 1
        return ran

    def use_block_weights(self, weights: dict[str, BlockWeight]) -> None:
        """Replace matrix weights (by parameter name: 'layers.0.qkv_proj', 'lm_head') with
        block-quantized ones of the same shape, freeing the dense ones. A tied lm_head keeps
        the dense embedding table for lookups."""
        for name, weight in weights.items():
            owner_name, _, attr = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            dense = getattr(owner, attr)
            if tuple(dense.shape) != weight.shape:
                raise ValueError(
                    f"block weight for {name} has shape {weight.shape}; the model "
                    f"needs {tuple(dense.shape)}"
                )
            del owner._parameters[attr]
            object.__setattr__(owner, attr, weight)
            self.block_weights[name] = weight

    def dense_weight(self, name: str) -> torch.Tensor:
        """A matrix weight by parameter name, dequantized if it is held in blocks."""
        if name in self.block_weights:
            return self.block_weights[name].dequantize()
        return self.get_parameter(name).data

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> LlamaModel:
        """Random weights of a trained model's scale: N(0, std) matrices, unit norms.
        Drawn on the model's device (fast for an 8B model on GPU)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):  # every RMSNorm: layers', q/k heads', final
                param.fill_(1.0)
            else:  # drawn in row-major order whatever the layout (see `_weight`)
                drawn = (
                    param
                    if param.is_contiguous()
                    else torch.empty_like(param, memory_format=torch.contiguous_format)
                )
                param.copy_(drawn.normal_(0.0, std, generator=generator))
        return self

    def num_bytes(self) -> int:
        """Bytes of weights (tied embeddings counted once), blocks as stored."""
        return sum(p.numel() * p.element_size() for p in self.parameters()) + sum(
            w.num_bytes() for w in self.block_weights.values()
        )
