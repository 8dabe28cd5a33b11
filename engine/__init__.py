"""engine: the scheduling core of an LLM inference server, built as a state machine."""

from engine.config import EngineConfig
from engine.state import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):  # lazy: importing engine.state must not load torch models
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)
