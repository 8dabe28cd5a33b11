"""The prompts and JSON documents of the serving benchmarks' workloads: 'stories' (free
writing; as JSON, a short story record) and 'copy' (a passage, or a JSON document, to be
repeated: the case n-gram speculation is for). `bench_server.py --structured`,
`bench_structured_host.py` and `bench_grammar_masks.py` share them."""

from __future__ import annotations

import json

TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "the moon", "trains", "gardens"]
PASSAGE = (
    "The river rises in the hills, runs past the old mill and the stone bridge, and "
    "reaches the sea at the harbour town, where boats wait for the tide. "
)

STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "mood": {"enum": ["calm", "stormy", "bright", "dark"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
    },
    "required": ["title", "mood", "lines"],
    "additionalProperties": False,
}
DOCUMENT_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "place": {"type": "string"},
        "text": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "place", "text", "tags"],
    "additionalProperties": False,
}


def json_task(workload: str, index: int) -> tuple[dict, str]:
    """(schema, user message): 'stories', a short story record; 'copy', a given JSON
    document back with its id changed."""
    topic = TOPICS[index % len(TOPICS)]
    if workload == "stories":
        return STORY_SCHEMA, f"Describe {topic} as JSON: a title, a mood and up to three lines."
    text = compact(copy_document(index))
    return DOCUMENT_SCHEMA, f"Repeat this JSON exactly, with id set to {index + 1000}:\n{text}"


def copy_document(index: int, answer: bool = False) -> dict:
    """The 'copy' workload's document of request `index` (`answer`: with its id changed, as
    the request asks it back)."""
    topic = TOPICS[index % len(TOPICS)]
    return {
        "id": index + 1000 if answer else index,
        "place": topic,
        "text": PASSAGE.replace("river", topic),
        "tags": [topic, "passage"],
    }


def compact(document: dict) -> str:
    return json.dumps(document, separators=(",", ":"))
