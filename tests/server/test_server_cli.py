"""`engine serve` flags: without the server extra it prints the install hint whatever the
arguments; the server options parse into ServerOptions; a real `engine serve` on a tiny model
checks the API key from ENGINE_API_KEY and logs one line per request, without the prompt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_server_cli_smoke import EXIT_WAIT_S, Output

from engine import cli
from engine.server.options import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["serve", "--port", "0", "--api-key", "k", "--max-waiting-requests", "4"],
        ["serve", "--no-such-flag"],
        ["serve", "--help"],
    ],
)
def test_serve_without_the_server_extra_prints_the_install_hint(monkeypatch, capsys, argv):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails
    monkeypatch.delitem(sys.modules, "engine.server.app", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "pip install 'engine[server]'" in err and "uvicorn" in err
    assert "unrecognized arguments" not in err


def test_server_flags_parse_into_server_options(monkeypatch):
    monkeypatch.delenv("ENGINE_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve"])
    defaults = cli.server_options_from(args)
    assert defaults.max_waiting_requests == DEFAULT_MAX_WAITING_REQUESTS
    assert defaults.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert defaults.api_key is None and defaults.allowed_origins == ()
    assert defaults.request_timeout_s is None and not defaults.logs_requests
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--max-waiting-requests",
            "0",
            "--request-timeout",
            "2.5",
            "--max-body-bytes",
            "1000",
            "--allowed-origins",
            "https://a.example, https://b.example",
            "--log-prompts",
        ]
    )
    monkeypatch.setenv("ENGINE_API_KEY", "from-env")
    options = cli.server_options_from(args)
    assert options.max_waiting_requests is None  # 0: no bound
    assert options.request_timeout_s == 2.5 and options.max_body_bytes == 1000
    assert options.allowed_origins == ("https://a.example", "https://b.example")
    assert options.api_key == "from-env" and options.logs_requests and options.log_prompts
    args = cli.build_parser().parse_args(["serve", "--api-key", "flag"])
    assert cli.server_options_from(args).api_key == "flag"  # the flag over the environment


@pytest.mark.parametrize(
    "flags",
    [["--max-waiting-requests", "-1"], ["--request-timeout", "0"], ["--max-body-bytes", "x"]],
)
def test_bad_server_flags_are_refused(capsys, flags):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", *flags])
    assert flags[0] in capsys.readouterr().err


def test_engine_serve_with_a_key_and_request_logs():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ENGINE_API_KEY": "secret-key"}
    command = [sys.executable, "-m", "engine", "serve", "--port", "0", "--device", "cpu"]
    command += ["--random-weights", "tiny", "--dtype", "float32", "--max-context", "128"]
    command += ["--log-requests", "--log-level", "warning"]
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = Output(process)
    try:
        url = output.wait_listening()
        body = {"model": "random-tiny", "prompt": [71, 72, 73], "max_tokens": 3}
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        auth = {"Authorization": "Bearer secret-key"}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert answer.status_code == 200
        request_id = answer.json()["id"]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=EXIT_WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = output.text()
    assert process.returncode == 0, text
    (line,) = [line for line in text.splitlines() if f"request {request_id} " in line]
    assert line.startswith("INFO:") and "prompt_tokens=3" in line and "finish=" in line
    assert "71, 72" not in text
