"""The default model (fp32, CPU): greedy output with the prefix cache equals greedy output
without it on multi-turn chats, with and without speculation, and mixed passes keep running
requests decoding while a long prompt prefills without changing a token."""

from __future__ import annotations

import pytest
from engine_checks import run, settled

from engine import SamplingParams
from engine.shell.engine import Engine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly and politely."


def converse(engine: Engine, turns: list[str], conversations: int) -> list[list[tuple]]:
    """`conversations` chats of len(turns) turns (each resends the whole history, as a chat
    client does); returns each turn's tokens per conversation, and checks the pool."""
    tok = engine.tokenizer
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(conversations)]
    outputs: list[list[tuple]] = [[] for _ in range(conversations)]
    for turn, text in enumerate(turns):
        prompts = []
        for i, history in enumerate(histories):
            history.append({"role": "user", "content": f"{text} (conversation {i})"})
            prompts.append(list(history))
        completions = engine.generate(prompts, GREEDY)
        for i, completion in enumerate(completions):
            outputs[i].append(completion.token_ids)
            histories[i].append({"role": "assistant", "content": tok.decode(completion.token_ids)})
            if engine.book.cache is not None and turn:
                assert 0 < completion.usage.cached_tokens < completion.usage.prompt_tokens
            if engine.book.cache is None:
                assert completion.usage.cached_tokens == 0
        engine.check()
    settled(engine)
    return outputs


TURNS = ["Name a fruit.", "What color is it?", "Where does it grow?"]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_greedy_with_the_cache_equals_greedy_without_on_multi_turn_chats(make_engine, speculative):
    on = make_engine(speculative=speculative, max_running_requests=8)
    off = make_engine(speculative=speculative, max_running_requests=8, prefix_cache=False)
    assert converse(on, TURNS, 3) == converse(off, TURNS, 3)
    assert on.metrics()["cached_prompt_tokens"] > 0
    assert "prefix_cache_slots" not in off.metrics()


def test_mixed_passes_keep_decoding_while_a_prompt_prefills_and_change_no_token(make_engine):
    long_prompt = "Tell me a story. " + "The sea was calm and the sky was grey. " * 12
    outputs = {}
    for mixed in (True, False):
        engine = make_engine(mixed_passes=mixed, chunk_size=16)
        first = engine._submit("Count from one to ten:", dict(max_tokens=40), None, None)
        while not first.output_ids:
            engine.step()
        second = engine._submit(long_prompt, dict(max_tokens=8, ignore_eos=True), None, None)
        engine.step()  # admits the long prompt: its chunks take several passes
        emitted = []
        while engine.running.pending_lens.max() > 1:  # the long prompt is prefilling
            before = len(first.output_ids)
            engine.step()
            engine.check()
            emitted.append(len(first.output_ids) - before)
        assert len(emitted) >= 4
        if mixed:
            assert all(n == 1 for n in emitted)  # a token every pass
        else:
            assert all(n == 0 for n in emitted[:-1])  # paused until the prompt is done
        run(engine)
        settled(engine)
        outputs[mixed] = (first.output_ids, second.output_ids)
    assert outputs[True] == outputs[False]
