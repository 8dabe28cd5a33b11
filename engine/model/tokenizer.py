"""Tokenizer and chat template via transformers' AutoTokenizer, plus streaming detokenization.

AutoTokenizer reads the tokenizer from a GGUF file (`gguf_file=`) or an HF directory. Reading
a GGUF's vocabulary takes seconds, so `load_tokenizer` caches one per path in memory and saves
the converted tokenizer on disk (ENGINE_CACHE_DIR, default ~/.cache/engine; "" turns it off).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from engine.errors import InvalidRequest
from engine.model.loader import ModelLoadError, resolve_model_path


class Tokenizer:
    """encode / decode / chat template over one HF tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping] | None = None,
        rendering: ChatRendering | None = None,
    ) -> str:
        """The chat template rendered with `tools` (OpenAI's function tools) where given, and
        as `rendering` says (default: the assistant's generation prompt appended)."""
        template = getattr(self.hf, "chat_template", None)
        if not template:
            raise InvalidRequest(
                "messages",
                "this model's tokenizer has no chat template; send a plain prompt (a string "
                "or token ids, /v1/completions)",
            )
        rendering = rendering or ChatRendering()
        rendering.check(messages, template_variables(template))
        return self.hf.apply_chat_template(
            list(messages),
            tools=None if tools is None else list(tools),
            tokenize=False,
            add_generation_prompt=rendering.add_generation_prompt,
            continue_final_message=rendering.continue_final_message,
            **dict(rendering.template_kwargs),
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping] | None = None,
        rendering: ChatRendering | None = None,
    ) -> list[int]:
        # The template writes any BOS itself, so encoding adds no special tokens.
        return self.encode(self.chat_text(messages, tools, rendering), add_special_tokens=False)


# apply_chat_template's own parameters: a template variable of one of these names cannot be set
_TEMPLATE_CALL_PARAMETERS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _pairs(kwargs: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    items = kwargs.items() if isinstance(kwargs, Mapping) else kwargs
    return tuple(sorted((str(name), value) for name, value in items))


@attrs.frozen
class ChatRendering:
    """How a chat is rendered (vLLM's request fields of the same names): the assistant's
    generation prompt appended (the default), or the last message, the assistant's, left open
    for the model to continue (`continue_final_message`); `template_kwargs`: variables the
    template reads (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), as (name, value)
    pairs."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_pairs)

    def check(self, messages: Sequence[Mapping[str, Any]], variables: frozenset[str]) -> None:
        """InvalidRequest naming the field unless the template can render `messages` so: a
        variable the template does not read would be taken and ignored."""
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest(
                "continue_final_message",
                "continue_final_message=true leaves the last message open; it needs "
                "add_generation_prompt=false (both were true)",
            )
        if self.continue_final_message and (
            not messages or messages[-1].get("role") != "assistant"
        ):
            raise InvalidRequest(
                "continue_final_message",
                "continue_final_message=true continues the last message, which must be the "
                "assistant's",
            )
        for name, _ in self.template_kwargs:
            if name in _TEMPLATE_CALL_PARAMETERS:
                raise InvalidRequest(
                    f"chat_template_kwargs.{name}",
                    f"{name!r} is set by the server, not a template variable",
                )
            if name not in variables:
                readable = sorted(variables - _TEMPLATE_CALL_PARAMETERS)
                raise InvalidRequest(
                    f"chat_template_kwargs.{name}",
                    f"this model's chat template does not read {name!r} (it reads: "
                    f"{', '.join(readable) or 'nothing besides the messages'})",
                )


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads (those it does not set itself), parsed as
    transformers compiles it."""
    import jinja2.meta

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
    except ImportError:  # the helper is transformers' own: parse with jinja's defaults then
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))


def tokenizer_cache_dir(gguf_path: Path) -> Path | None:
    """Where the converted tokenizer of `gguf_path` is kept (keyed by path, size, mtime)."""
    root = os.environ.get("ENGINE_CACHE_DIR", str(Path.home() / ".cache" / "engine"))
    if not root:
        return None
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return Path(root) / "tokenizers" / f"{gguf_path.stem}-{key[:16]}"


def _from_gguf(path: Path) -> Any:
    from transformers import AutoTokenizer

    cached = tokenizer_cache_dir(path)
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            shutil.rmtree(cached, ignore_errors=True)  # a damaged cache entry is rebuilt
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cached is not None:
        _save_atomically(hf, cached)
    return hf


def _save_atomically(hf: Any, directory: Path) -> None:
    """Write into a temporary sibling and rename, so readers never see half an entry."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".partial-"))
    except OSError:
        return  # a read-only cache location: run without the cache
    try:
        hf.save_pretrained(str(staging))
        staging.chmod(0o755)
        os.replace(staging, directory)
    except OSError:  # another process saved it first
        shutil.rmtree(staging, ignore_errors=True)


@functools.lru_cache(maxsize=8)
def _load_cached(resolved: str) -> Tokenizer:
    from transformers import AutoTokenizer

    path = Path(resolved)
    try:
        if path.is_dir():
            return Tokenizer(AutoTokenizer.from_pretrained(str(path)))
        return Tokenizer(_from_gguf(path))
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {error}") from error


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of the model at `path` (None: the default model), cached per path."""
    return _load_cached(str(resolve_model_path(path).resolve()))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    It re-decodes a short window (from `prefix_offset`) and emits only text that is complete:
    a delta that ends in U+FFFD (a multi-byte character split across tokens) waits for the next
    token. Seeding with the prompt's last ids keeps a leading space right for SentencePiece.
    """

    CONTEXT_IDS = 6

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT_IDS :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the text they completed (possibly empty)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (e.g. a lone partial byte)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
