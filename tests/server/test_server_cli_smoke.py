"""`python -m engine serve --speculative` as a real subprocess: answers the openai client with the
same greedy text as the non-speculative engine, and on SIGTERM stops accepting, aborts the
request in flight and exits with status 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from serverkit import CHAT_MESSAGES, MAX_CONTEXT, MAX_TOKENS, Served

REPO = Path(__file__).resolve().parents[2]
READY_POLLS = 600
EXIT_WAIT_S = 60


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(process: subprocess.Popen, url: str) -> None:
    for _ in range(READY_POLLS):
        if process.poll() is not None:
            raise AssertionError(f"engine serve exited with {process.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError("engine serve did not answer /health")


def _stream_until_end(
    client: openai.OpenAI, model: str, reasons: list[str | None], started: threading.Event
) -> None:
    stream = client.completions.create(
        model=model,
        prompt="Count slowly:",
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        started.set()
        reasons.append(chunk.choices[0].finish_reason)


def test_engine_serve_subprocess_answers_and_exits_cleanly_on_sigterm(served: Served) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "serve",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-context",
            str(MAX_CONTEXT),
            "--speculative",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_ready(process, url)
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
        output, _ = process.communicate(timeout=EXIT_WAIT_S)
        streamer.join(EXIT_WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert reasons[-1] == "abort", reasons[-5:]
    assert "Traceback" not in output, output
    try:
        httpx.get(f"{url}/health", timeout=2)
        raise AssertionError("the port still answers after shutdown")
    except httpx.TransportError:
        pass
