"""How requests come in: `submit` and `abort` from any thread (validated at once, queued on
the inbox for the loop), and `generate` and `stream`, which drive the loop themselves (the
offline API of vLLM's `LLM`). `Frontend` is `Engine`'s base class, in a file of its own as
`Admission` is; it uses the engine's state (listed in the class)."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from engine.errors import InvalidRequest
from engine.shell.ahead import PlanAhead
from engine.shell.grammar import Grammars
from engine.shell.inbox import Inbox, validate_params, validate_prompt, with_bad_word_ids
from engine.shell.kv import KVBook
from engine.shell.request import Completion, Delta, DeltaSink, Request
from engine.shell.runtime import Runtime
from engine.shell.textio import PromptInput, as_prompt_list, prompt_to_ids, to_params
from engine.state import Running, SamplingParams

Prompt = PromptInput


class Frontend:
    """Submission, abort and the convenience API, `Engine`'s."""

    # the engine's state these use (`Engine.__init__` and `Engine._build` set them)
    tokenizer: Any
    runtime: Runtime
    max_context: int
    inbox: Inbox
    book: KVBook
    grammars: Grammars
    ahead: PlanAhead
    running: Running
    step: Any
    _drain_inbox: Any

    # --- submission (any thread) ------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        sink: DeltaSink | None = None,
    ) -> str:
        """Validate and queue one request; raises InvalidRequest, allocating nothing."""
        return self._submit(prompt, params, request_id, sink).request_id

    def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams | dict | None,
        request_id: str | None,
        sink: DeltaSink | None,
    ) -> Request:
        params = to_params(params)
        if params.n != 1:
            raise InvalidRequest(
                "n", f"n={params.n}: submit and stream take one sample; generate() takes n"
            )
        ids = self._prompt_ids(prompt, params)
        return self.inbox.add(ids, self._validate(ids, params), request_id, sink)

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, its last `truncate_prompt_tokens` where the params ask."""
        ids = prompt_to_ids(self.tokenizer, prompt)
        keep = params.truncate_prompt_tokens
        return ids if keep is None else ids[-keep:]

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its slots are freed at the next step."""
        self.inbox.abort(request_id)

    def _validate(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """The request's parameters as it runs (see `validate_params`); InvalidRequest if the
        prompt or they do not fit."""
        validate_prompt(ids, self.runtime.vocab_size, self.max_context, self.book.slots.capacity)
        params = with_bad_word_ids(params, self.tokenizer)
        params = validate_params(params, len(ids), self.runtime.vocab_size, self.max_context)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # kept for the request's matcher
        return params

    # --- convenience API (drives the loop itself) ---------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict | list | None = None,
    ) -> list[Completion]:
        """Results in input order; one params value or one per prompt. A prompt whose params
        have n > 1 gives n completions in a row (sample 0 to n - 1)."""
        batch_prompts = as_prompt_list(prompts)
        params = (
            list(sampling_params)
            if isinstance(sampling_params, list)
            else [sampling_params] * len(batch_prompts)
        )
        if len(params) != len(batch_prompts):
            raise InvalidRequest(
                "sampling_params",
                f"{len(params)} values for "
                f"{len(batch_prompts)} prompts; give one, or one per prompt",
            )
        # Validate everything first, so a bad prompt rejects the call before anything runs.
        given = [to_params(sp) for sp in params]
        checked = [
            (ids, self._validate(ids, sp))
            for prompt, sp in zip(batch_prompts, given, strict=True)
            for ids in [self._prompt_ids(prompt, sp)]
        ]
        requests: list[Request] = []
        first_of: list[int] = []  # each request's prompt's first sample
        for ids, sp in checked:
            first = len(requests)
            for i in range(sp.n):
                one = sp.sample(i)
                if i:  # a prompt's later samples take its first's prompt scores
                    one = attrs.evolve(one, prompt_logprobs=None)
                requests.append(self.inbox.add(ids, one, None, None))
                first_of.append(first)
        while not all(r.done for r in requests):
            self.step()
        completions = [r.completion() for r in requests]
        return [
            c if f == i else attrs.evolve(c, prompt_logprobs=completions[f].prompt_logprobs)
            for i, (c, f) in enumerate(zip(completions, first_of, strict=True))
        ]

    def stream(
        self, prompt: Prompt, params: SamplingParams | dict | None = None
    ) -> Iterator[Delta]:
        """Deltas of one request, stepping the engine while it waits. Closing the iterator
        early (or dropping it) aborts the request and frees its slots at once."""
        sink: queue.SimpleQueue = queue.SimpleQueue()
        request_id = self.submit(prompt, params, sink=sink)
        finished = False
        try:
            while True:
                while sink.empty():
                    self.step()
                delta = sink.get()
                # set before yielding: a consumer that stops after the final delta closes
                # the generator at the yield, and a finished request needs no abort
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
                self._drain_inbox()
                self.ahead.fit(self.running)
