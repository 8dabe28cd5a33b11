"""Command line: `engine generate`, `engine bench`, `engine serve` (help from EngineConfig),
`engine replay`."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.shell.config import EngineConfig

if TYPE_CHECKING:
    from engine.server.options import ServerOptions

# what the `server` extra installs (and what it pulls in), by top-level module name
SERVER_EXTRA_MODULES = frozenset(
    {"fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client"}
)


# the prompts' length in token ids where the model has no tokenizer (`engine bench` with
# random weights), about that of the chat prompts it sends otherwise
BENCH_PROMPT_TOKENS = 32


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument(
        "--seed", dest="sample_seed", type=int, default=None, help="sampling seed of the request"
    )


def _params(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.shell.engine import Engine
    from engine.shell.textio import to_params

    params = to_params(_params(args))  # refused before the model loads
    engine = Engine(**EngineConfig.overrides_from(args))
    prompt: Any = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    started, count = time.perf_counter(), 0
    try:
        if engine.tokenizer is None:  # random weights: token ids in, token ids out
            prompt = _token_ids(args.prompt)
        for delta in engine.stream(prompt, params):
            count += len(delta.token_ids)
            text = delta.text if engine.tokenizer is not None else _ids_text(delta.token_ids)
            sys.stdout.write(text)
            sys.stdout.flush()
    finally:
        engine.close()  # the tensor-parallel workers stop with the command
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    print(
        f"[{count} tokens in {elapsed:.2f} s, {count / elapsed:.1f} tokens/s, "
        f"finish: {delta.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _token_ids(prompt: str) -> list[int]:
    """A prompt given as token ids separated by spaces (a model without a tokenizer)."""
    from engine.errors import InvalidRequest

    try:
        return [int(token) for token in prompt.split()]
    except ValueError:
        raise InvalidRequest(
            "prompt",
            f"{prompt!r} is not token ids: this model has no tokenizer (random weights); "
            "give the prompt as token ids separated by spaces, e.g. '1 2 3'",
        ) from None


def _ids_text(ids: Sequence[int]) -> str:
    return "".join(f" {token}" for token in ids)


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.shell.engine import Engine

    engine = Engine(**EngineConfig.overrides_from(args))
    topics = [
        "the sea",
        "a mountain",
        "bread",
        "rain",
        "a library",
        "the moon",
        "trains",
        "gardens",
    ]
    prompts: list[Any] = [
        [{"role": "user", "content": f"Write a short story about {topics[i % 8]}."}]
        for i in range(args.num_prompts)
    ]
    if engine.tokenizer is None:  # random weights: prompts of token ids, as long as those
        generator = random.Random(0)
        vocab = engine.runtime.vocab_size
        prompts = [
            [generator.randrange(vocab) for _ in range(BENCH_PROMPT_TOKENS)]
            for _ in range(args.num_prompts)
        ]
    params = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], dict(params, max_tokens=4))  # warm-up
    requests = [engine.submit(p, params) for p in prompts]
    started, before = time.perf_counter(), engine.stats["generated_tokens"]
    with tqdm(total=len(requests) * args.max_tokens, unit="tok", disable=args.quiet) as bar:
        while engine.has_work:  # only these requests are in flight after the warm-up
            counted = engine.stats["generated_tokens"]
            engine.step()
            bar.update(engine.stats["generated_tokens"] - counted)
    elapsed = time.perf_counter() - started
    total = engine.stats["generated_tokens"] - before
    print(
        f"{len(requests)} prompts, {total} tokens in {elapsed:.2f} s: "
        f"{total / elapsed:.1f} tokens/s"
    )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from engine.shell.replay import Mismatch, TraceError, replay_file

    try:
        report = replay_file(args.trace)
    except (OSError, TraceError) as error:
        print(f"engine replay: {error}", file=sys.stderr)
        return 2
    except Mismatch as mismatch:
        print(mismatch)
        return 1
    print(f"replayed {report.steps} steps, all effects equal ({report.seconds:.3f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    _sampling_options(gen)
    EngineConfig.add_arguments(gen)
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", help="throughput of a batch of prompts")
    bench.add_argument("--num-prompts", type=int, default=8)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--quiet", action="store_true")
    EngineConfig.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    EngineConfig.add_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument(
        "--port",
        type=int,
        default=8000,
        help="TCP port to listen on; 0: a free one, printed once it listens",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send and /v1/models lists; default: the model file's name",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    _server_options(serve)
    serve.set_defaults(func=cmd_serve)
    replay = sub.add_parser(
        "replay",
        help="run a trace's transitions again (no model, no device), checking every "
        "invariant and effect; prints the first step that differs",
    )
    replay.add_argument("trace", help="a file written with --trace")
    replay.set_defaults(func=cmd_replay)
    return parser


def _at_least(minimum: float, kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}")
        return value

    return parse


def _server_options(serve: argparse.ArgumentParser) -> None:
    """The flags of ServerOptions (importable without the server extra)."""
    from engine.server.options import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS

    serve.add_argument(
        "--max-waiting-requests",
        type=_at_least(0, int),
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests submitted and not yet admitted; past it a request gets HTTP 429 with "
        f"Retry-After; 0: no bound (default: {DEFAULT_MAX_WAITING_REQUESTS})",
    )
    serve.add_argument(
        "--request-timeout",
        type=_at_least(1e-3, float),
        default=None,
        metavar="SECONDS",
        help="a request still running this long after it arrived is aborted: HTTP 408, or an "
        "error event in a stream that has begun (default: none)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_at_least(1, int),
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get HTTP 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="every endpoint but /health then needs 'Authorization: Bearer KEY', else HTTP "
        "401 (default: the environment variable ENGINE_API_KEY, else none)",
    )
    serve.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated origins CORS allows, '*' for any (default: none, no CORS)",
    )
    serve.add_argument(
        "--log-requests",
        action="store_true",
        help="one log line per request: id, prompt and completion tokens, TTFT, finish reason",
    )
    serve.add_argument(
        "--log-prompts",
        action="store_true",
        help="the request log lines also carry the prompt (implies --log-requests)",
    )
    serve.add_argument(
        "--skip-warm-up",
        action="store_true",
        help="listen without first running requests and (GPU) the products at every pass size "
        "through the engine (the first client and passes then pay the kernels' first use)",
    )


def server_options_from(args: argparse.Namespace) -> ServerOptions:
    """The ServerOptions the flags of `_server_options` give (the API key from the
    environment variable ENGINE_API_KEY where --api-key is not given)."""
    from engine.server.options import ServerOptions

    return ServerOptions(
        max_waiting_requests=args.max_waiting_requests or None,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or os.environ.get("ENGINE_API_KEY") or None,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        log_requests=args.log_requests,
        log_prompts=args.log_prompts,
        warm_up=not args.skip_warm_up,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM, then exit 0."""
    from engine.server import serve

    overrides = EngineConfig.overrides_from(args)
    model = overrides.pop("model", None)
    speculative = bool(overrides.pop("speculative", False))
    serve(
        model,
        args.host,
        args.port,
        speculative,
        args.log_level,
        args.served_model_name,
        _report_listening,
        server_options_from(args),
        **overrides,
    )
    return 0


def _report_listening(url: str) -> None:
    """One line on stdout once the server accepts connections, with the port it got (the one
    to connect to where --port 0 asked for a free one): `engine serve: listening on URL`."""
    print(f"engine serve: listening on {url}", flush=True)


def _server_extra_missing() -> ImportError | None:
    """The ImportError of a module of the server extra, if one is not installed."""
    try:
        import engine.server.app  # noqa: F401
    except ImportError as error:
        if (error.name or "").split(".")[0] in SERVER_EXTRA_MODULES:
            return error
        raise
    return None


def _missing_server(error: ImportError) -> int:
    print(
        f"engine serve needs the server extra (pip install 'engine[server]'): {error}",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # before parsing: the hint, whatever the arguments
        missing = _server_extra_missing()
        if missing is not None:
            return _missing_server(missing)
    args = build_parser().parse_args(argv)
    if os.environ.get("RANK", "0") != "0" and hasattr(args, "tensor_parallel_size"):
        # torchrun started this command on every rank: rank 0 runs it, the others serve it
        from engine.shell.sharded import serve_as_worker

        serve_as_worker(EngineConfig().replace(**EngineConfig.overrides_from(args)))
        return 0
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The command; an option, a model or a request it cannot take ends it with its one-line
    message (what was wrong, what is allowed) and status 2, as argparse does, not a traceback."""
    from engine.errors import ConfigError, InvalidRequest
    from engine.model.loader import ModelLoadError, ModelNotFoundError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, InvalidRequest, ModelNotFoundError, ModelLoadError) as error:
        print(f"engine {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
