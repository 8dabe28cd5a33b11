"""The host's cost of constrained requests per step, without a model: the default model's
tokenizer and engine with a forward that costs nothing and "copies" a JSON document (each row's
logits peak at its request's next token of the document, then EOS), so that constrained and
unconstrained requests emit the same tokens and only the host work differs.

    python benchmarks/bench_structured_host.py [--clients 1,4,16] [--requests 4] [--profile]
        [--speculative] [--forward model --device cuda]
    python benchmarks/bench_structured_host.py --server [--clients 1,4,16] [--requests 4]

Prints, for each number of clients, unconstrained then JSON-schema constrained (the
unconstrained requests ask for as many tokens as the constrained ones made): output tok/s, ms
per decode step, passes by mode, plans ahead used/dropped; with --profile, the top of a
cProfile of each kind's steps. `--forward model` keeps the model's own forward (on
`--device`): the engine loop without the server. With --server the same engine serves HTTP
in a process of its own and `bench_server.py`'s JSON-schema comparison drives it (streamed
chat requests, as on a GPU): the server's and the engine loop's host work together.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import compare_structured  # noqa: E402
from json_workload import compact, copy_document, json_task  # noqa: E402

from engine.server.app import create_app, make_server  # noqa: E402
from engine.shell.engine import Engine  # noqa: E402
from engine.shell.runner import Prepared  # noqa: E402
from engine.state import SamplingParams  # noqa: E402


class CopyRunner:
    """A runner whose logits pick each request's next token of its target (then EOS): no
    model work, so the step is the host's work alone."""

    def __init__(self, engine: Engine, targets: dict[int, list[int]]) -> None:
        self.engine, self.targets = engine, targets
        self.vocab = engine.runtime.vocab_size
        self.eos = engine.runtime.eos_id
        self.passes: collections.Counter = collections.Counter()

    def prepare(self, batch) -> Prepared:
        return Prepared(batch, None, None, None)  # type: ignore[arg-type]  # no backend plan

    def _pick(self, uid: int, ahead: int = 0) -> int:
        target = self.targets[uid]
        done = len(self.engine.requests[uid].output_ids) + ahead
        return target[done] if done < len(target) else self.eos

    def launch(self, prepared: Prepared, batch, input_ids=None, shift=None) -> torch.Tensor:
        """The pass's logits (`input_ids`, a pass launched ahead, and `shift`, a graph's:
        unused: `launch_ahead` is off on the CPU and no pass replays a graph, so the engine
        never sends them)."""
        if input_ids is not None or shift is not None:
            raise ValueError("CopyRunner does not run passes launched ahead")
        self.passes[batch.mode.name.lower()] += 1
        trees = batch.trees
        if trees is None:  # one row per sampling request
            picks = [self._pick(uid) for uid in batch.running.rids[batch.samples].tolist()]
        else:  # verify: one row per tree node, the token after the node's path
            picks = []
            starts = trees.sizes.starts().tolist()
            for i, uid in enumerate(batch.running.rids.tolist()):
                parents = trees.parents[starts[i] : starts[i] + int(trees.sizes.lens[i])]
                depths: list[int] = []
                for parent in parents.tolist():
                    depths.append(0 if parent < 0 else depths[parent] + 1)
                picks.extend(self._pick(uid, depth) for depth in depths)
        logits = torch.zeros((len(picks), self.vocab), dtype=torch.float32)
        logits[torch.arange(len(picks)), torch.tensor(picks)] = 10.0
        return logits

    def forward(self, batch) -> torch.Tensor:
        return self.launch(self.prepare(batch), batch)


class PromptCopyRunner(CopyRunner):
    """A `CopyRunner` whose targets come from the prompts: each request's own "copy" task
    (`json_task`) as `bench_server.py` sends it, the document with its id changed."""

    ASK = re.compile(r"with id set to (\d+):\n(\{.*\})", re.DOTALL)

    def _pick(self, uid: int, ahead: int = 0) -> int:
        if uid not in self.targets:
            tokenizer = self.engine.tokenizer
            assert tokenizer is not None  # the default model's
            prompt = tokenizer.decode(list(self.engine.requests[uid].prompt_ids))
            found = self.ASK.search(prompt)
            if found is None:
                raise ValueError(f"not a copy request: {prompt[-200:]!r}")
            document = json.loads(found.group(2)) | {"id": int(found.group(1))}
            self.targets[uid] = tokenizer.encode(compact(document))
        return super()._pick(uid, ahead)


def serve_copy(port: int) -> None:
    """Serve the default model's tokenizer and engine, its forward a `PromptCopyRunner`."""
    engine = Engine(device="cpu", dtype="float32", max_running_requests=32)
    engine.runner = PromptCopyRunner(engine, {})  # the plan-ahead's runner too
    make_server(create_app(engine), "127.0.0.1", port, "warning").run()


def server_main(args: argparse.Namespace) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, __file__, "--serve-copy", str(port)]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline_s = time.monotonic() + 300
        while time.monotonic() < deadline_s and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        options = argparse.Namespace(
            concurrency=args.clients,
            requests_per_client=args.requests,
            max_tokens=args.max_tokens,
            workload="copy",
            speculative=False,
            device="cpu, a forward that costs nothing",
            server_args="",
        )
        compare_structured(url, model, options)
    finally:
        process.terminate()
        process.wait(30)


def run(
    engine: Engine,
    clients: int,
    requests: int,
    constrained: bool,
    max_tokens: int,
    runner: CopyRunner | None,
) -> dict[str, Any]:
    """`clients` requests in flight until `requests` per client are done (greedy); `runner`:
    a `CopyRunner` in place of the engine's own (None: the model's forward)."""
    if runner is not None:
        runner.passes.clear()
    engine.stats.clear()
    engine.step_times.clear()
    total, submitted, done = clients * requests, 0, 0
    live: list[str] = []
    tokens = 0
    tokenizer = engine.tokenizer
    assert tokenizer is not None  # the default model's
    started = time.perf_counter()

    def submit() -> None:
        nonlocal submitted
        schema, message = json_task("copy", submitted)
        target = tokenizer.encode(compact(copy_document(submitted, answer=True)))
        ids = tokenizer.encode(message)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            structured_outputs={"json": schema} if constrained else None,
        )
        request = engine._submit(ids, params, None, None)
        if runner is not None:
            runner.targets[request.uid] = target
        live.append(request.request_id)
        submitted += 1

    while done < total:
        while len(live) < clients and submitted < total:
            submit()
        engine.step()
        for rid in list(live):
            request = engine.by_request_id.get(rid)
            if request is None:
                live.remove(rid)
                done += 1
        tokens = engine.stats["generated_tokens"]
    seconds = time.perf_counter() - started
    decode = [s for mode, s in engine.step_times if mode == "decode"]
    return dict(
        tok_s=tokens / seconds,
        tokens=tokens,
        decode_ms=1e3 * float(np.mean(decode)) if decode else 0.0,
        passes=dict(
            runner.passes
            if runner is not None
            else collections.Counter(mode for mode, _ in engine.step_times)
        ),
        used=engine.stats["plans_ahead_used"],
        dropped=engine.stats["plans_ahead_dropped"],
        masks=engine.stats["grammar_masks"],
    )


def per_request(result: dict, clients: int, requests: int) -> int:
    """The tokens a request of `run`'s made on average (at least 1)."""
    return max(1, round(result["tokens"] / (clients * requests)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="best of, after a warm-up round")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--server", action="store_true", help="through the HTTP server")
    parser.add_argument(
        "--forward",
        choices=("copy", "model"),
        default="copy",
        help="copy: a forward that costs nothing; model: the default model's own",
    )
    parser.add_argument("--device", default="cpu", help="with --forward model")
    parser.add_argument("--serve-copy", type=int, help=argparse.SUPPRESS)  # its process
    args = parser.parse_args()
    if args.serve_copy:
        serve_copy(args.serve_copy)
        return
    if args.server:
        server_main(args)
        return
    if args.forward == "copy" and args.device != "cpu":
        parser.error("--device needs --forward model (the copy forward runs on the CPU)")
    engine = Engine(
        device=args.device,
        dtype="float32" if args.device == "cpu" else "auto",
        max_running_requests=32,
        speculative=args.speculative,
    )
    engine.grammars.wait_ready()
    runner = CopyRunner(engine, {}) if args.forward == "copy" else None
    if runner is not None:
        engine.runner = runner  # the plan-ahead's runner too
    print(f"forward: {args.forward}, device {args.device}, launch_ahead {engine.launch_ahead}")
    print("| clients | kind | tok/s | ms/decode step | passes | plans used/dropped | masks |")
    print("|---|---|---|---|---|---|---|")
    for clients in [int(c) for c in args.clients.split(",")]:
        best: dict[str, dict[str, Any]] = {}
        length = args.max_tokens  # the unconstrained requests': as many as the JSON ones made
        for counted in [False] + [True] * args.rounds:  # a warm-up round first
            for constrained in (True, False):
                max_tokens = args.max_tokens if constrained else length
                result = run(engine, clients, args.requests, constrained, max_tokens, runner)
                if constrained:
                    length = per_request(result, clients, args.requests)
                kind = "json" if constrained else "free"
                if counted and (kind not in best or result["tok_s"] > best[kind]["tok_s"]):
                    best[kind] = result
        for kind in ("free", "json"):
            r = best[kind]
            print(
                f"| {clients} | {kind} | {r['tok_s']:.0f} | {r['decode_ms']:.3f} | "
                f"{r['passes']} | {r['used']}/{r['dropped']} | {r['masks']} |"
            )
        print(f"| {clients} | ratio | {best['json']['tok_s'] / best['free']['tok_s']:.2f}x |")
    if args.profile:
        for clients in [int(c) for c in args.clients.split(",")]:
            length = args.max_tokens
            for constrained in (True, False):
                profile = cProfile.Profile()
                profile.enable()
                max_tokens = args.max_tokens if constrained else length
                result = run(engine, clients, args.requests, constrained, max_tokens, runner)
                profile.disable()
                if constrained:
                    length = per_request(result, clients, args.requests)
                kind = "constrained" if constrained else "unconstrained"
                print(f"\n== {kind}, {clients} clients")
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile_rows)


if __name__ == "__main__":
    main()
