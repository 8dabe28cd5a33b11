"""The default model's tokenizer (read from the GGUF) and streaming detokenization."""

from __future__ import annotations

import copy

import pytest

from engine.errors import InvalidRequest
from engine.model import (
    IncrementalDetokenizer,
    ModelNotFoundError,
    Tokenizer,
    default_model_path,
    load_tokenizer,
)
from engine.model.tokenizer import ChatRendering, _from_gguf, tokenizer_cache_dir

TEXTS = [
    "Hello, world!",
    "  spaced   out 3 and 42",
    "Héllo 🚀 日本語\n\tend",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_cached_per_path(tokenizer):
    assert load_tokenizer(None) is tokenizer


def test_encode_decode_and_ids(tokenizer):
    ids = tokenizer.encode("Hello, world!")
    assert ids and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == "Hello, world!"
    assert tokenizer.eos_token_id == 2 and tokenizer.vocab_size == 49152
    assert tokenizer.decode([2]) == "" and tokenizer.decode([2], skip_special_tokens=False) == (
        "<|im_end|>"
    )


def test_chat_template_ends_with_the_assistant_prompt(tokenizer):
    text = tokenizer.chat_text([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "text",
    [
        "Plain ASCII, with punctuation... and numbers 12345.",
        "Accents: café, naïve, Žluťoučký kůň; CJK: 日本語のテキスト; emoji: 🙂🚀👩‍👩‍👧",
        "  leading spaces\nand\ttabs\n\n",
    ],
)
def test_incremental_deltas_rebuild_the_text(tokenizer, text):
    ids = tokenizer.encode(text)
    for prompt in ([], tokenizer.encode("Prompt:")):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
        deltas = [detok.add([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == text == detok.text
        assert not any("\ufffd" in d for d in deltas)


def test_a_split_multibyte_character_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🚀"


def test_missing_model_path_raises(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")


def test_disk_cache_gives_the_same_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    fresh = Tokenizer(_from_gguf(path))  # converts from the GGUF and saves
    assert (tokenizer_cache_dir(path) / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def from_cache_only(source, *args, **kwargs):  # a GGUF conversion now fails the test
        assert "gguf_file" not in kwargs, "the cached tokenizer was not used"
        return real(source, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_cache_only)
    cached = Tokenizer(_from_gguf(path))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"}]
    assert cached.apply_chat_template(chat) == fresh.apply_chat_template(chat)
    for text in TEXTS:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special_tokens=False) == fresh.decode(
            ids, skip_special_tokens=False
        )
    assert (cached.eos_token_id, cached.bos_token_id, cached.vocab_size) == (
        fresh.eos_token_id,
        fresh.bos_token_id,
        fresh.vocab_size,
    )


def test_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", "")
    assert tokenizer_cache_dir(default_model_path()) is None


THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if not loop.last or add_generation_prompt %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}{% endif %}"
)


@pytest.fixture
def thinking(tokenizer):
    """The default tokenizer with a template that reads a variable (as Qwen3's reads
    `enable_thinking`), apart from the cached one."""
    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = THINKING_TEMPLATE
    return Tokenizer(hf)


def test_a_chat_renders_as_asked(thinking):
    """`chat_template_kwargs` reach the template's variables; `continue_final_message` leaves
    the assistant's last message open for the model to go on from."""
    user = [{"role": "user", "content": "hi"}]
    assert thinking.chat_text(user) == "<|user|>hi<|end|><|assistant|>"
    no_think = ChatRendering(template_kwargs={"enable_thinking": False})
    assert thinking.chat_text(user, rendering=no_think).endswith("<|assistant|><no-think>")
    started = user + [{"role": "assistant", "content": "Well,"}]
    open_end = ChatRendering(add_generation_prompt=False, continue_final_message=True)
    assert thinking.chat_text(started, rendering=open_end) == "<|user|>hi<|end|><|assistant|>Well,"
    ids = thinking.apply_chat_template(started, rendering=open_end)
    assert thinking.decode(ids, skip_special_tokens=False).endswith("Well,")


@pytest.mark.parametrize(
    ("rendering", "field", "words"),
    [
        (
            ChatRendering(template_kwargs={"shout": True}),
            "chat_template_kwargs.shout",
            "reads: enable_thinking",
        ),
        (
            ChatRendering(template_kwargs={"tokenize": True}),
            "chat_template_kwargs.tokenize",
            "set by the server",
        ),
        (
            ChatRendering(continue_final_message=True),
            "continue_final_message",
            "add_generation_prompt=false",
        ),
        (
            ChatRendering(add_generation_prompt=False, continue_final_message=True),
            "continue_final_message",
            "must be the assistant's",
        ),
    ],
)
def test_a_rendering_the_template_cannot_make_is_refused(thinking, rendering, field, words):
    """A variable the template does not read would be taken and ignored: refused, naming the
    variables it does read."""
    with pytest.raises(InvalidRequest) as refused:
        thinking.chat_text([{"role": "user", "content": "hi"}], rendering=rendering)
    assert refused.value.field == field and words in refused.value.message


def test_a_tokenizer_without_a_chat_template_refuses_messages_naming_them(tokenizer):
    """It raised a bare ValueError, which the server answered as an internal error (500)."""
    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template") as refused:
        Tokenizer(hf).chat_text([{"role": "user", "content": "hi"}])
    assert refused.value.field == "messages"
