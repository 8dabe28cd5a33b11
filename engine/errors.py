"""Errors a caller can act on: each names what was wrong and what is allowed."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses at submission; nothing was allocated for it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(ValueError):
    """An engine option (or the machine it runs on) that cannot work: the message names the
    option, its value and what is allowed. Raised while an engine is built, before it serves."""
