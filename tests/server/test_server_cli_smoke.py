"""`python -m engine serve --speculative` as a real subprocess: answers the openai client with the
same greedy text as the non-speculative engine, and on SIGTERM stops accepting, aborts the
request in flight and exits with status 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
from serverkit import CHAT_MESSAGES, MAX_CONTEXT, MAX_TOKENS, Served

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"^engine serve: listening on (http://127\.0\.0\.1:(\d+))$")
# Bounds on waits for the subprocess (a hang fails instead of blocking the suite)
START_WAIT_S = 600
EXIT_WAIT_S = 60


class Output:
    """Reads the subprocess's merged stdout and stderr on a thread to its end, and notes the
    URL of the `listening on` line (`engine serve --port 0` prints the port it got)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.url: str | None = None
        self.port = 0
        self.listening = threading.Event()
        self._process = process
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            self.lines.append(line)
            found = LISTENING.match(line.rstrip("\n"))
            if found and self.url is None:
                self.url, self.port = found.group(1), int(found.group(2))
                self.listening.set()
        self.listening.set()  # the output ended: wake the waiter

    def wait_listening(self) -> str:
        assert self.listening.wait(START_WAIT_S), "engine serve printed no listening line"
        assert self.url is not None, (
            f"engine serve exited with {self._process.wait()} while starting:\n" + self.text()
        )
        assert self.port > 0, self.url  # the port it got, not the 0 it was asked for
        return self.url

    def text(self, join_s: float = EXIT_WAIT_S) -> str:
        self._thread.join(join_s)
        return "".join(self.lines)


def _stream_until_end(
    client: openai.OpenAI, model: str, reasons: list[str | None], started: threading.Event
) -> None:
    stream = client.completions.create(
        model=model,
        prompt="Count slowly:",
        max_tokens=1000,  # the context (1,024) leaves room for 1,021
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        started.set()
        reasons.append(chunk.choices[0].finish_reason)


def test_engine_serve_subprocess_answers_and_exits_cleanly_on_sigterm(served: Served) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "serve",
            "--port",
            "0",  # a free port, bound by the server: it prints the one it got
            "--device",
            "cpu",
            "--max-context",
            str(MAX_CONTEXT),
            "--speculative",
            "--draft-cost",  # configured: its drafts do not follow the machine's timings
            "0.1",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Output(process)
    try:
        url = output.wait_listening()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # it accepts already
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=CHAT_MESSAGES, max_tokens=MAX_TOKENS, temperature=0
        )
        assert reply.choices[0].message.content == served.references["chat/greedy"].text
        metrics = httpx.get(f"{url}/metrics").text
        assert "engine_speculative_enabled 1.0" in metrics
        steps = re.search(r"^engine_spec_verify_steps_total ([0-9.e+]+)$", metrics, re.M)
        assert steps is not None and float(steps.group(1)) > 0

        reasons: list[str | None] = []
        started = threading.Event()
        streamer = threading.Thread(
            target=_stream_until_end, args=(client, model, reasons, started), daemon=True
        )
        streamer.start()
        assert started.wait(120), "the long stream produced no chunk"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=EXIT_WAIT_S)
        streamer.join(EXIT_WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = output.text()
    assert process.returncode == 0, text
    assert reasons[-1] == "abort", reasons[-5:]
    assert "Traceback" not in text, text
    try:
        httpx.get(f"{url}/health", timeout=2)
        raise AssertionError("the port still answers after shutdown")
    except httpx.TransportError:
        pass
