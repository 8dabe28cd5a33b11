"""`tool_choice` "auto" and tool-result history through a model whose chat template renders tools
and asks for Hermes-style `<tool_call>` blocks (a tiny Qwen2 checkpoint), with the real `openai`
client. A scripted sampling step makes the model's output depend on what its prompt holds: a
call where the template rendered the tools, an answer where it rendered a tool's result, plain
text otherwise; so each test sees what the server rendered and how it read the output."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
import torch
import transformers
from serverkit import Served

from engine import Engine
from engine.server import BackgroundServer, create_app
from engine.server.app import model_name_of

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's tool template, cut down to its shape: the tools as JSON in <tools>, calls asked
# for as <tool_call> blocks, an assistant's calls and a tool's result rendered back.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CALL_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
ANSWER_TEXT = "It is 21 degrees in Paris."
PLAIN_TEXT = "I cannot look that up."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of 256 bytes and ChatML's special tokens, with the Hermes template."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def _checkpoint(directory) -> None:
    tokenizer = _tokenizer()
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(5)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))


class Script:
    """Replaces the engine's logits step: each request draws, token by token, the text its
    prompt calls for (then EOS), and the prompts are kept for the tests to read."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prompts: list[str] = []
        tokenizer = engine.tokenizer
        self.eos = tokenizer.eos_token_id
        self.texts = {
            key: tokenizer.encode(text, add_special_tokens=False)
            for key, text in (("call", CALL_TEXT), ("answer", ANSWER_TEXT), ("plain", PLAIN_TEXT))
        }
        self._constrain = engine.logits.constrain
        engine.logits.constrain = self.constrain

    def text_for(self, prompt: str) -> list[int]:
        if "<tool_response>" in prompt:
            return self.texts["answer"]
        return self.texts["call"] if "<tools>" in prompt else self.texts["plain"]

    def constrain(self, logits: torch.Tensor, uids: list[int], masks=None) -> torch.Tensor:
        logits = self._constrain(logits, uids, masks).clone()
        for row, uid in enumerate(uids):
            request = self.engine.requests[uid]
            prompt = self.engine.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
            if not request.output_ids:
                self.prompts.append(prompt)
            if request.params.structured_outputs is not None:
                continue  # a constrained request draws from the model, under its grammar
            script = self.text_for(prompt)
            done = len(request.output_ids)
            token = script[done] if done < len(script) else self.eos
            logits[row] = float("-inf")
            logits[row, token] = 0.0
        return logits


@pytest.fixture(scope="module")
def hermes(tmp_path_factory) -> Iterator[tuple[Served, Script]]:
    directory = tmp_path_factory.mktemp("qwen2-hermes")
    _checkpoint(directory)
    engine = Engine(str(directory), device="cpu", dtype="float32", max_context=1024)
    script = Script(engine)
    server = BackgroundServer(create_app(engine)).start()
    try:
        yield Served(server.url, engine, model_name_of(engine.config), {}), script
    finally:
        server.stop()


def _client(served: Served) -> openai.OpenAI:
    return served.client()


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_renders_the_tools_and_returns_the_models_call(hermes, tool_choice) -> None:
    served, script = hermes
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    response = _client(served).chat.completions.create(
        model=served.model, messages=ASK, tools=TOOLS, max_tokens=200, **extra
    )
    prompt = script.prompts[-1]
    assert "<tools>" in prompt and json.dumps(TOOLS[0]) in prompt
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_auto_streams_content_then_the_calls_deltas(hermes) -> None:
    served, _ = hermes
    content, calls, reasons = "", [], []
    stream = _client(served).chat.completions.create(
        model=served.model, messages=ASK, tools=TOOLS, max_tokens=200, stream=True
    )
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        if choice.delta.content:
            assert not calls, "content after a call's delta"
            content += choice.delta.content
        for piece in choice.delta.tool_calls or ():
            assert piece.index == len(calls) and piece.id.startswith("call_")
            calls.append((piece.function.name, json.loads(piece.function.arguments)))
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_a_streamed_auto_answer_keeps_every_tokens_logprobs(hermes) -> None:
    served, _ = hermes
    stream = _client(served).chat.completions.create(
        model=served.model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=200,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    entries, usage = 0, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            entries += len(choice.logprobs.content) if choice.logprobs else 0
    assert usage is not None and entries == usage.completion_tokens > 0


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_constrained_tool_choices_render_the_tools_too(hermes, tool_choice) -> None:
    served, script = hermes
    bounded = {**WEATHER, "properties": {**WEATHER["properties"], "city": {"maxLength": 8}}}
    bounded["properties"]["city"]["type"] = "string"  # random weights: a string must end
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": bounded}}]
    response = _client(served).chat.completions.create(
        model=served.model,
        messages=ASK,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # one call: random weights would add calls without end
        max_tokens=300,
        temperature=0.0,
    )
    assert "<tools>" in script.prompts[-1]
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments.get("city"), str)
    assert set(arguments) <= {"city", "unit"}


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(hermes) -> None:
    served, script = hermes
    response = _client(served).chat.completions.create(
        model=served.model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert "<tools>" not in script.prompts[-1]
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == PLAIN_TEXT


def test_output_without_a_call_is_content(hermes, monkeypatch) -> None:
    served, script = hermes
    monkeypatch.setitem(script.texts, "call", script.texts["plain"])
    response = _client(served).chat.completions.create(
        model=served.model, messages=ASK, tools=TOOLS, max_tokens=200
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == PLAIN_TEXT


def test_tool_results_in_the_history_reach_the_template(hermes) -> None:
    served, script = hermes
    first = _client(served).chat.completions.create(
        model=served.model, messages=ASK, tools=TOOLS, max_tokens=200
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    second = _client(served).chat.completions.create(
        model=served.model, messages=history, tools=TOOLS, max_tokens=200
    )
    prompt = script.prompts[-1]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt
    assert "Let me check." in prompt
    assert second.choices[0].message.content == ANSWER_TEXT
    assert second.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        ({"role": "tool", "content": "21"}, "messages.1.tool_call_id", "required"),
        (
            {"role": "user", "content": "x", "tool_call_id": "call_1"},
            "messages.1.tool_call_id",
            "tool message only",
        ),
        ({"role": "assistant", "content": None}, "messages.1.content", "tool_calls"),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "messages.1.tool_calls",
            "assistant message only",
        ),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}
                ],
            },
            "messages.1.tool_calls.0.function.arguments",
            "JSON object",
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
            "messages.1.tool_calls.0.function",
            "required",
        ),
    ],
)
def test_malformed_tool_history_is_a_400_naming_the_field(
    hermes, message: dict, param: str, says: str
) -> None:
    served, _ = hermes
    with pytest.raises(openai.BadRequestError) as caught:
        _client(served).chat.completions.create(
            model=served.model, messages=[*ASK, message], tools=TOOLS, max_tokens=4
        )
    error = caught.value.body
    assert error["param"] == param, error
    assert says in error["message"], error
