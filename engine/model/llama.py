"""The Llama family in torch; attention goes only through an `AttentionBackend`.

Tokens are flat ([T] ids, [T] positions): the batch layout lives in the backend's metadata.
The forward has no host sync and no branch on tensor values, so CUDA graphs can capture it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import AttentionBackend, ForwardMetadata
from engine.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, with linear or llama3 scaling applied
    (the same arithmetic as HF transformers, so fp32 results agree)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D] (rotate-half layout, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised weight: the loader or `init_random` fills every one."""
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, with fused qkv and gate/up projections."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        hidden, inter = config.hidden_size, config.intermediate_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, hidden, dtype, device)
        self.o_proj = _weight(hidden, self.q_size, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.gate_up_proj = _weight(2 * inter, hidden, dtype, device)
        self.down_proj = _weight(hidden, inter, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: ForwardMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = F.linear(self.input_layernorm(hidden), self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        attn = backend.forward(self.index, q, k, v, metadata, scale=self.head_dim ** -0.5)
        hidden = hidden + F.linear(attn.reshape(num_tokens, self.q_size), self.o_proj)
        gate, up = F.linear(self.post_attention_layernorm(hidden), self.gate_up_proj).chunk(2, -1)
        return hidden + F.linear(F.silu(gate) * up, self.down_proj)


class LlamaModel(nn.Module):
    """`model(input_ids, positions, metadata, backend)` -> final-normed hidden [T, hidden];
    `model.logits(hidden[rows])` -> fp32 logits [rows, vocab]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = config, dtype, device
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _weight(config.vocab_size, config.hidden_size, dtype, device))
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] in the model dtype, computed in fp32 as HF does."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: ForwardMetadata, backend: AttentionBackend) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, metadata, backend)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> LlamaModel:
        """Random weights of a trained model's scale: N(0, std) matrices, unit norms.
        Drawn on the model's device (fast for an 8B model on GPU)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
        return self

    def num_bytes(self) -> int:
        """Bytes of weights (tied embeddings counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())
