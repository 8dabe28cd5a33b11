"""The model (one decoder for every family), its families, weight loading, tokenizer and
sampling."""

from engine.model import families
from engine.model.config import ModelConfig, ModelConfigError
from engine.model.llama import LlamaModel
from engine.model.loader import (
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    load_model,
    save_hf_checkpoint,
)
from engine.model.sampling import SamplingTensors, probs_for_verify, sample, seeded_uniform
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

__all__ = [
    "families",
    "ModelConfig",
    "ModelConfigError",
    "LlamaModel",
    "ModelLoadError",
    "ModelNotFoundError",
    "default_model_path",
    "load_model",
    "save_hf_checkpoint",
    "SamplingTensors",
    "probs_for_verify",
    "sample",
    "seeded_uniform",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
]
