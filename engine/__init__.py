"""engine: the scheduling core of an LLM inference server, built as a state machine."""

from typing import TYPE_CHECKING

from engine.errors import InvalidRequest
from engine.shell.config import EngineConfig
from engine.state import SamplingParams

if TYPE_CHECKING:  # the lazy names below, as the type checker should see them
    from engine.api import AsyncEngine
    from engine.model.tokenizer import ChatRendering
    from engine.shell.engine import Engine
    from engine.shell.request import Completion, Delta
    from engine.shell.textio import ChatPrompt

__all__ = [
    "AsyncEngine",
    "ChatPrompt",
    "ChatRendering",
    "Completion",
    "Delta",
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "SamplingParams",
]


def __getattr__(name: str):  # lazy: importing engine.state must not load torch models
    if name == "Engine":
        from engine.shell.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from engine.api import AsyncEngine

        return AsyncEngine
    if name == "ChatPrompt":
        from engine.shell.textio import ChatPrompt

        return ChatPrompt
    if name == "ChatRendering":
        from engine.model.tokenizer import ChatRendering

        return ChatRendering
    if name in ("Completion", "Delta"):
        from engine.shell import request

        return getattr(request, name)
    raise AttributeError(name)
