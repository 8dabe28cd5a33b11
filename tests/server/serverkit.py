"""What the server tests share: prompts, the Engine.generate references, the served handle."""

from __future__ import annotations

from typing import Any

import attrs
import openai

from engine import Engine, SamplingParams

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12
MAX_CONTEXT = 1024
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}


@attrs.frozen
class Served:
    url: str
    engine: Engine
    model: str
    references: dict[str, Any]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120
        )


def references_of(engine: Engine) -> dict[str, Any]:
    """Engine.generate results, one request at a time (the server tests send them one at a time)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, **SAMPLED)
    return {
        "completion/greedy": engine.generate(COMPLETION_PROMPT, greedy)[0],
        "completion/sampled": engine.generate(COMPLETION_PROMPT, sampled)[0],
        "chat/greedy": engine.generate([CHAT_MESSAGES], greedy)[0],
        "chat/sampled": engine.generate([CHAT_MESSAGES], sampled)[0],
    }
