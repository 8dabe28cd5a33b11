"""Builds what an Engine runs on from its config: device, model, tokenizer, KV pool, backend."""

from __future__ import annotations

import functools
import operator
import os

import attrs
import numpy as np
import torch

from engine import cpu_kernels
from engine.backends import KVPool, get_backend
from engine.errors import ConfigError
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.loader import load_model, shard_of, shard_plan
from engine.model.sampling import SamplingTensors, greedy_tokens, sample
from engine.model.tokenizer import Tokenizer, load_tokenizer
from engine.shell.config import EngineConfig
from engine.shell.runner import ModelRunner
from engine.shell.scheduler import most_extend_tokens
from engine.shell.table import RequestTable
from engine.state import SamplingParams

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_CONTEXT = 8192


@attrs.define
class Runtime:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model: LlamaModel
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_context: int
    num_slots: int
    backend_name: str
    # the last pass's params (one per row) and sampling inputs (`sampling_inputs`)
    _last_sampling: tuple[tuple[SamplingParams, ...], SamplingTensors | None] = attrs.field(
        init=False, default=((), None), repr=False
    )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_id(self) -> int:
        if self.tokenizer is None:
            return self.model_config.eos_token_id or -1
        eos = self.tokenizer.eos_token_id
        return -1 if eos is None else int(eos)

    @property
    def more_eos_ids(self) -> tuple[int, ...]:
        """The model's other EOS ids (config.json with generation_config.json, or a GGUF's
        eos / eot / eom): each ends generation as `eos_id` does."""
        return tuple(t for t in self.model_config.eos_token_ids if t != self.eos_id)

    def make_runner(self, table: RequestTable) -> ModelRunner:
        """The runner over a KV pool of this rank's KV heads, reading `table`."""
        local = self.model.local  # the whole model's shapes, or this rank's part of them
        pool = KVPool.allocate(
            local.num_layers,
            self.num_slots + 1,
            local.num_kv_heads,
            local.head_dim,
            self.dtype,
            table.device,
        )
        cfg = self.config
        graph_max_batch = min(cfg.cuda_graph_max_batch, cfg.max_running_requests)
        if self.device.type != "cuda":
            graph_max_batch = 0
        tree_nodes = cfg.draft_budget + 1 if cfg.speculative else 0
        return ModelRunner(
            self.model,
            get_backend(self.backend_name, pool),
            self.device,
            graph_max_batch,
            tree_nodes,
            table=table,
            # no extend pass is longer than the scheduler's largest: no graph beyond it
            graph_max_tokens=min(
                cfg.cuda_graph_max_tokens,
                most_extend_tokens(cfg.chunk_size, cfg.max_running_requests),
            ),
        )

    def sampling_inputs(
        self, params: list[SamplingParams], uids: np.ndarray, steps: list[int]
    ) -> SamplingTensors | None:
        """The rows' sampling tensors on the device (None: all greedy). Built before the pass
        is launched: their host-to-device copies then do not wait for the pass."""
        if all(p.greedy for p in params):
            return None
        seeds = [
            p.seed if p.seed is not None else self._seed(u)
            for p, u in zip(params, uids.tolist(), strict=True)
        ]
        # the same requests as the last pass (most steps): only the uniforms change
        key, last = self._last_sampling
        if last is not None and len(key) == len(params) and all(map(operator.is_, key, params)):
            return last.at_steps(seeds, steps)
        inputs = SamplingTensors.build(params, steps, self.vocab_size, self.device, seeds)
        self._last_sampling = (tuple(params), inputs)
        return inputs

    @staticmethod
    def sample(logits: torch.Tensor, inputs: SamplingTensors | None) -> torch.Tensor:
        """One token per row, on the logits' device (the caller reads them when it needs
        them, so the host can work meanwhile)."""
        return greedy_tokens(logits) if inputs is None else sample(logits, inputs)

    def _seed(self, uid: int) -> int:
        # Requests without a seed draw from the engine seed and their own id: reproducible
        # for one engine, different across requests.
        return (self.config.random_seed * 1_000_003 + uid) % (2**63)


def rank_device(name: str, rank: int = 0, world: int = 1) -> torch.device:
    """The device of `rank` (of `world` tensor-parallel ranks: rank r on cuda:r of its
    machine, `LOCAL_RANK` under torchrun)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA device is available; use 'cpu'")
    if device.type == "cuda" and world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"tensor_parallel_size={world} needs a GPU for each rank on this machine; "
                f"it has {torch.cuda.device_count()}"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def build_runtime(config: EngineConfig, rank: int = 0) -> Runtime:
    """What rank `rank` runs on: the whole model, or with `tensor_parallel_size` > 1 the
    rank's part of it (rank 0 also loads the tokenizer)."""
    world = config.tensor_parallel_size
    shard = None if world == 1 else (rank, world)
    device = rank_device(config.device, rank, world)
    dtype = (
        _DTYPES[config.dtype]
        if config.dtype != "auto"
        else torch.bfloat16
        if device.type == "cuda"
        else torch.float32
    )
    backend = (
        config.attention_backend
        if config.attention_backend != "auto"
        else "triton"
        if device.type == "cuda"
        else "torch"
    )
    # Random weights come without a tokenizer: prompts are token ids, outputs have no text.
    tokenizer = None if config.random_weights or rank else load_tokenizer(config.model)
    if config.random_weights and config.hf_config_path is not None:
        raise ConfigError(
            f"hf_config_path={config.hf_config_path!r} applies to a GGUF model; "
            f"random_weights={config.random_weights!r} takes its shape from the preset"
        )
    if config.random_weights:
        presets = {
            "llama3_8b": ModelConfig.llama3_8b,
            "qwen2_7b": ModelConfig.qwen2_7b,
            "qwen3_8b": ModelConfig.qwen3_8b,
            "smollm2_135m": ModelConfig.smollm2_135m,
            "tiny": ModelConfig.tiny,
        }
        if config.random_weights not in presets:
            raise ConfigError(
                f"random_weights={config.random_weights!r}; choose one of {sorted(presets)}"
            )
        model_config = presets[config.random_weights]()
        if shard is not None:
            shard_plan(model_config, *shard)  # refused before any drawing
        model = LlamaModel(model_config, dtype, device).init_random(config.random_seed)
        if shard is not None:  # the weights of one rank equal the same part of the whole
            model = shard_of(model, *shard)
            if device.type == "cuda":  # the whole model's memory back, before the KV budget
                torch.cuda.empty_cache()
    else:
        # the flag only matters where the loader can keep blocks: the cache key says so
        blocks = config.block_weights and cpu_kernels.usable(device, dtype) and shard is None
        model, model_config = _load_shared(
            config.model, dtype, str(device), blocks, config.hf_config_path, shard
        )
    max_context = config.max_context or min(
        model_config.max_position_embeddings, DEFAULT_MAX_CONTEXT
    )
    model_config.check_context(max_context)  # a sliding window shorter than it is refused
    # a rank's KV pool holds its own KV heads (`model.local`: the whole model's with one rank)
    slots = config.kv_cache_slots or _slots_from_budget(config, model.local, dtype, device)
    return Runtime(
        config, device, dtype, model, model_config, tokenizer, max_context, slots, backend
    )


@functools.lru_cache(maxsize=2)
def _load_shared(
    path: str | None,
    dtype: torch.dtype,
    device: str,
    block_weights: bool,
    hf_config_path: str | None,
    shard: tuple[int, int] | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """Weights are never written after loading, so engines in one process share them."""
    return load_model(
        path,
        dtype,
        device,
        block_weights=block_weights,
        hf_config_path=hf_config_path,
        shard=shard,
    )


def _slots_from_budget(
    config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    per_slot = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.kv_cache_fraction)
    else:
        budget = config.kv_cache_bytes
    slots = budget // per_slot
    if slots < 16:
        raise ConfigError(
            f"the KV budget of {budget} bytes holds {slots} tokens "
            f"({per_slot} bytes each); raise kv_cache_bytes or kv_cache_fraction"
        )
    return int(slots)
