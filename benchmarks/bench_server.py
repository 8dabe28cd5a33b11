"""HTTP serving benchmark: time to first token, inter-token latency (p50, p99) and requests/s at
several client concurrencies, against `engine serve` started here (or an existing --url).

    .venv/bin/python benchmarks/bench_server.py --device cpu [--speculative]
    .venv/bin/python benchmarks/bench_server.py --device cpu --sampling-modes

`--sampling-modes` runs each concurrency three times in one server, sampled at temperature
0.8: plain, with logprobs (5 alternatives per token), and with frequency, presence and
repetition penalties, and prints their throughput side by side (ratios to plain).

`--structured` runs each concurrency twice in one server, greedy: requests whose answer a JSON
schema constrains (response_format json_schema) and the same requests unconstrained, and prints
their throughput side by side, with the host time the server spent on token masks. With
`--workload copy` each request asks for a given JSON document back with one field changed
(the case speculation gains on: compare runs with and without --speculative).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_workload import PASSAGE, TOPICS, json_task  # noqa: E402


def user_message(workload: str, index: int) -> str:
    """'stories': free writing (few n-gram matches); 'copy': the answer repeats the prompt
    (the case n-gram speculation is for)."""
    topic = TOPICS[index % len(TOPICS)]
    if workload == "stories":
        return f"Write a short story about {topic}."
    return f"Repeat this text exactly, twice:\n{PASSAGE.replace('river', topic)}"


@attrs.frozen
class RequestTiming:
    ttft_s: float
    gaps_s: tuple[float, ...]  # between successive chunks that carry text
    num_tokens: int


@attrs.frozen
class LevelResult:
    concurrency: int
    num_requests: int
    wall_s: float
    timings: tuple[RequestTiming, ...]

    def row(self) -> dict[str, float]:
        ttft = np.array([t.ttft_s for t in self.timings])
        gaps = np.array([g for t in self.timings for g in t.gaps_s] or [np.nan])
        tokens = sum(t.num_tokens for t in self.timings)
        return {
            "clients": self.concurrency,
            "requests": self.num_requests,
            "req_per_s": self.num_requests / self.wall_s,
            "tok_per_s": tokens / self.wall_s,
            "ttft_p50_ms": 1e3 * np.percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * np.percentile(ttft, 99),
            "itl_p50_ms": 1e3 * np.nanpercentile(gaps, 50),
            "itl_p99_ms": 1e3 * np.nanpercentile(gaps, 99),
        }


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    sent_s = time.perf_counter()
    arrivals_s: list[float] = []
    num_tokens = 0
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:  # random weights: one response, its tokens counted
        response = await client.post(f"{url}{path}", json=body)
        response.raise_for_status()
        return RequestTiming(float("nan"), (), response.json()["usage"]["completion_tokens"])
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("delta", {}).get("content") or choice.get("text"):
                arrivals_s.append(time.perf_counter())
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if not arrivals_s:
        raise RuntimeError(f"request produced no text: {body}")
    gaps = tuple(np.diff(arrivals_s).tolist())
    return RequestTiming(arrivals_s[0] - sent_s, gaps, num_tokens)


SAMPLING_MODES = {  # the fields each --sampling-modes run adds to a request
    "plain": {"temperature": 0.8},
    "logprobs": {"temperature": 0.8, "logprobs": True, "top_logprobs": 5},
    "penalties": {
        "temperature": 0.8,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
}


RANDOM_PROMPT_TOKENS = 64  # random weights have no tokenizer: prompts are token ids


def request_body(
    model: str, workload: str, index: int, max_tokens: int, fields: dict | None = None
) -> dict:
    if model.startswith("random-"):
        rng = np.random.default_rng(index)
        fields = {k: v for k, v in (fields or {}).items() if k != "top_logprobs"} | (
            {"logprobs": 5} if (fields or {}).get("logprobs") else {}
        )
        return {  # not streamed: without text, a stream would carry logprobs' chunks only
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": False,
            "ignore_eos": True,
            "prompt": rng.integers(3, 250, RANDOM_PROMPT_TOKENS).tolist(),  # any preset's vocab
            "seed": index,
            **fields,
        }
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": user_message(workload, index)}],
        "seed": index,
        **(fields or {}),
    }


async def run_level(
    url: str,
    model: str,
    workload: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    fields: dict | None = None,
    body_of: Callable[[int], dict] | None = None,
) -> LevelResult:
    """`concurrency` clients share a queue of `num_requests` requests, one at a time each
    (request i's body: `body_of(i)`, or `request_body`'s)."""
    pending = list(range(num_requests))
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            index = pending.pop()
            body = (
                request_body(model, workload, index, max_tokens, fields)
                if body_of is None
                else body_of(index)
            )
            timings.append(await one_request(client, url, body))

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started_s = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall_s = time.perf_counter() - started_s
    return LevelResult(concurrency, num_requests, wall_s, tuple(timings))


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--device",
        args.device,
        "--speculative" if args.speculative else "--no-speculative",
    ]
    if args.model:
        command += ["--model", args.model]
    if args.random_weights:
        command += ["--random-weights", args.random_weights]
    command += shlex.split(args.server_args)
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline_s and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"engine serve did not start within {args.start_timeout_s} s")


def spec_acceptance(url: str) -> str:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict(
        line.split(" ", 1)
        for line in text.splitlines()
        if line.startswith(
            (
                "engine_spec_acceptance_rate ",
                "engine_spec_accepted_tokens_total ",
                "engine_spec_draft_tokens_total ",
            )
        )
    )
    return ", ".join(f"{k}={float(v):g}" for k, v in values.items())


def print_table(rows: list[dict[str, float]], title: str) -> None:
    print(f"\n{title}")
    header = (
        "clients",
        "requests",
        "req_per_s",
        "tok_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print(
            "| "
            + " | ".join(
                f"{row[h]:.0f}"
                if h in ("clients", "requests")
                else f"{row[h]:.2f}"
                if h.endswith("per_s")
                else f"{row[h]:.0f}"
                for h in header
            )
            + " |"
        )


def best_of_two(
    levels: list[int], modes: list[str], run_one: Callable[[str, int], float]
) -> dict[tuple[str, int], float]:
    """Each concurrency in each mode, in turns, two rounds: the best output tok/s of each
    (mode, concurrency); `run_one(mode, concurrency)` runs one and returns its tok/s. A
    round of warm-up goes first, not counted: the first run at a concurrency captures the
    CUDA graphs of its batch sizes, which would count against whichever mode runs first."""
    best: dict[tuple[str, int], float] = {}
    for counted in (False, True, True):
        for concurrency in levels:
            for mode in modes:
                tok_s = run_one(mode, concurrency)
                if counted:
                    best[mode, concurrency] = max(best.get((mode, concurrency), 0.0), tok_s)
    return best


def compare_sampling(url: str, model: str, args: argparse.Namespace) -> None:
    """Each concurrency in each sampling mode, in turns (plain, logprobs, penalties, plain,
    ...), best of two rounds per mode; throughput and the ratio to plain."""
    levels = [int(c) for c in args.concurrency.split(",")]

    def run_one(mode: str, concurrency: int) -> float:
        result = asyncio.run(
            run_level(
                url,
                model,
                args.workload,
                concurrency,
                concurrency * args.requests_per_client,
                args.max_tokens,
                SAMPLING_MODES[mode],
            )
        )
        return result.row()["tok_per_s"]

    best = best_of_two(levels, list(SAMPLING_MODES), run_one)
    print(
        f"\n{model} on {args.device} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus), workload {args.workload}, max_tokens={args.max_tokens}, "
        "temperature 0.8, ignore_eos; output tok/s, best of two rounds after a warm-up round"
    )
    print("| clients | " + " | ".join(SAMPLING_MODES) + " | logprobs / plain | penalties / plain |")
    print("|---|" + "---|" * (len(SAMPLING_MODES) + 2))
    for c in levels:
        plain = best["plain", c]
        cells = [f"{best[m, c]:.1f}" for m in SAMPLING_MODES]
        ratios = [f"{best[m, c] / plain:.2f}x" for m in ("logprobs", "penalties")]
        print(f"| {c} | " + " | ".join(cells + ratios) + " |")


def structured_body(
    model: str, workload: str, index: int, max_tokens: int, constrained: bool
) -> dict:
    """The request of `json_task`, constrained by its schema or not (random weights: their
    token-id prompt, constrained on the byte vocabulary)."""
    schema, message = json_task(workload, index)
    body = request_body(model, workload, index, max_tokens)
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": message}]
    if constrained:
        format_ = {"name": "answer", "schema": schema, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": format_}
    return body


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The server's metrics of these names, each summed over its labels (a name given with
    labels, `name{label="value"}`, sums the series that carry them)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        for wanted in names:
            wanted_name, _, wanted_labels = wanted.partition("{")
            if wanted_name == name and all(
                label in labels.rstrip("}").split(",")
                for label in wanted_labels.rstrip("}").split(",")
                if label
            ):
                totals[wanted] += float(value)
    return totals


def speculation_profile(masks: dict[str, float]) -> str:
    """Where a constrained speculative run's steps go: drafts per request and verify step,
    the share of the proposed drafts the grammars cut, the share of the verified drafts
    accepted, and the mean time and count of verify, decode and extend (prefill) steps."""
    steps = masks["engine_spec_verify_steps_total"]
    drafted = masks["engine_spec_draft_tokens_total"]
    cut = masks["engine_grammar_drafts_cut_total"]
    if not steps or not drafted:
        return "no verify steps"

    def step(mode: str) -> str:
        count = masks[f'engine_step_seconds_count{{mode="{mode}"}}']
        seconds = masks[f'engine_step_seconds_sum{{mode="{mode}"}}']
        return f"{mode} {1e3 * seconds / count if count else 0:.1f} ms ({count:.0f})"

    accepted = masks["engine_spec_accepted_tokens_total"]
    return (
        f"{drafted / steps:.1f} drafts per request and step, {100 * cut / (drafted + cut):.0f}% of "
        f"the proposed cut by the grammars, {100 * accepted / drafted:.0f}% of the verified "
        f"accepted; steps: {step('verify')}, {step('decode')}, {step('extend')}"
    )


MASK_SERIES = (
    "engine_grammar_masks_total",
    "engine_grammar_mask_seconds_total",
    "engine_grammar_mask_wait_seconds_total",
    "engine_grammar_drafts_cut_total",
    "engine_grammar_tokens_checked_total",
    "engine_grammar_tokens_redrawn_total",
    "engine_spec_verify_steps_total",
    "engine_spec_draft_tokens_total",
    "engine_spec_accepted_tokens_total",
    "engine_step_seconds_sum",
    'engine_step_seconds_sum{mode="verify"}',
    'engine_step_seconds_count{mode="verify"}',
    'engine_step_seconds_sum{mode="decode"}',
    'engine_step_seconds_count{mode="decode"}',
    'engine_step_seconds_sum{mode="extend"}',
    'engine_step_seconds_count{mode="extend"}',
)


def server_note(args: argparse.Namespace) -> str:
    return f", server {args.server_args!r}" if args.server_args else ""


def compare_structured(url: str, model: str, args: argparse.Namespace) -> None:
    """Each concurrency constrained by a JSON schema, then unconstrained, best of two rounds
    each; output tok/s, their ratio, and the host time spent on masks (constrained runs).
    A grammar ends its request when the document is complete (before `max_tokens`, whatever
    `ignore_eos` says): the unconstrained requests then ask for as many tokens as the last
    constrained run produced per request, so that both do the same work."""
    levels = [int(c) for c in args.concurrency.split(",")]
    masks = {c: dict.fromkeys(MASK_SERIES, 0.0) for c in levels}  # constrained runs
    lengths = dict.fromkeys(levels, args.max_tokens)  # tokens per constrained request

    def run_one(mode: str, concurrency: int) -> float:
        constrained = mode == "json"
        before = scrape(url, MASK_SERIES) if constrained else {}
        max_tokens = args.max_tokens if constrained else lengths[concurrency]
        result = asyncio.run(
            run_level(
                url,
                model,
                args.workload,
                concurrency,
                concurrency * args.requests_per_client,
                max_tokens,
                body_of=lambda i: structured_body(model, args.workload, i, max_tokens, constrained),
            )
        )
        if constrained:
            after = scrape(url, MASK_SERIES)
            for name in MASK_SERIES:
                masks[concurrency][name] += after[name] - before[name]
            produced = sum(t.num_tokens for t in result.timings)
            lengths[concurrency] = max(1, round(produced / result.num_requests))
        return result.row()["tok_per_s"]

    best = best_of_two(levels, ["json", "free"], run_one)
    speculation = "on" if args.speculative else "off"
    print(
        f"\n{model} on {args.device} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus), workload {args.workload}, speculation {speculation}, "
        f"max_tokens={args.max_tokens}, greedy{server_note(args)}; output tok/s, best of "
        "two rounds after a warm-up round"
    )
    print("| clients | tokens per request | unconstrained | JSON schema | JSON / unconstrained |")
    print("|---|---|---|---|---|")
    for c in levels:
        free, constrained = best["free", c], best["json", c]
        print(
            f"| {c} | {lengths[c]} | {free:.1f} | {constrained:.1f} | {constrained / free:.2f}x |"
        )
    total = {name: sum(masks[c][name] for c in levels) for name in MASK_SERIES}
    count = total["engine_grammar_masks_total"]
    seconds = total["engine_grammar_mask_seconds_total"]
    waited = total["engine_grammar_mask_wait_seconds_total"]
    steps = total["engine_step_seconds_sum"]
    if count:
        print(
            f"token masks: {count:.0f}, {1e6 * seconds / count:.1f} us each on the host, "
            f"{100 * seconds / steps:.1f}% of the constrained runs' step time; the loop "
            f"waited for them {100 * waited / steps:.1f}% of it (the rest ran while it went on)"
        )
    checked = total["engine_grammar_tokens_checked_total"]
    if checked:
        redrawn = total["engine_grammar_tokens_redrawn_total"]
        print(
            f"greedy tokens checked against their grammar without a mask: {checked:.0f}, "
            f"{100 * redrawn / checked:.1f}% refused and drawn again under their mask"
        )
    if args.speculative:
        print(f"speculation: {spec_acceptance(url)}")
        for c in levels:
            print(f"constrained, {c} clients: {speculation_profile(masks[c])}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="benchmark a running server instead of starting one")
    parser.add_argument("--model", help="model for the server started here; default model if unset")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--speculative", action="store_true", help="serve with n-gram speculation")
    parser.add_argument(
        "--random-weights",
        help="serve random weights of this preset (e.g. llama3_8b): token-id prompts through "
        "/v1/completions, not streamed (no text; time to first token is not measured)",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="more options for the server started here, e.g. '--no-launch-ahead'",
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workload", choices=["stories", "copy"], default="stories")
    parser.add_argument("--start-timeout-s", type=float, default=600)
    parser.add_argument(
        "--sampling-modes",
        action="store_true",
        help="plain sampling against logprobs and penalties, side by side",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="JSON-schema requests against the same requests unconstrained, side by side",
    )
    args = parser.parse_args()

    process, url = (None, args.url) if args.url else start_server(args)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(run_level(url, model, args.workload, 1, 1, 4))  # warm-up
        if args.sampling_modes:
            compare_sampling(url, model, args)
            return 0
        if args.structured:
            compare_structured(url, model, args)
            return 0
        rows = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            result = asyncio.run(
                run_level(
                    url,
                    model,
                    args.workload,
                    concurrency,
                    concurrency * args.requests_per_client,
                    args.max_tokens,
                )
            )
            rows.append(result.row())
        mode = "on" if args.speculative else "off"
        print_table(
            rows,
            f"{model} on {args.device} ({platform.processor() or platform.machine()}"
            f", {os.cpu_count()} cpus), speculation {mode}, "
            f"workload {args.workload}, max_tokens={args.max_tokens}, greedy, "
            "ignore_eos",
        )
        print(f"speculation: {spec_acceptance(url)}")
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
