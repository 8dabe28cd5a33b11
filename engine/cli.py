"""Command line: `engine generate`, `engine bench`, `engine serve` (help from EngineConfig)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import attrs

from engine.config import EngineConfig


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    for field in attrs.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{field.metadata['help']} (default: {field.default})"
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            kinds = {"int": int, "float": float, "int | None": int, "float | None": float}
            kind = kinds.get(str(field.type), str)
            parser.add_argument(flag, type=kind, default=None, help=help_text)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in attrs.fields(EngineConfig)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", dest="sample_seed", type=int, default=None,
                        help="sampling seed of the request")


def _params(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.sample_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine

    engine = Engine(**engine_overrides(args))
    prompt: Any = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    started, count = time.perf_counter(), 0
    for delta in engine.stream(prompt, _params(args)):
        count += len(delta.token_ids)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    print(f"[{count} tokens in {elapsed:.2f} s, {count / elapsed:.1f} tokens/s, "
          f"finish: {delta.finish_reason}]", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.engine import Engine

    engine = Engine(**engine_overrides(args))
    topics = ["the sea", "a mountain", "bread", "rain", "a library", "the moon", "trains",
              "gardens"]
    prompts = [[{"role": "user", "content": f"Write a short story about {topics[i % 8]}."}]
               for i in range(args.num_prompts)]
    params = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], dict(params, max_tokens=4))  # warm-up
    requests = [engine._submit(p, params, None, None) for p in prompts]
    started, before = time.perf_counter(), engine.stats["generated_tokens"]
    with tqdm(total=len(requests) * args.max_tokens, unit="tok", disable=args.quiet) as bar:
        while engine.has_work:  # only these requests are in flight after the warm-up
            counted = engine.stats["generated_tokens"]
            engine.step()
            bar.update(engine.stats["generated_tokens"] - counted)
    elapsed = time.perf_counter() - started
    total = engine.stats["generated_tokens"] - before
    print(f"{len(requests)} prompts, {total} tokens in {elapsed:.2f} s: "
          f"{total / elapsed:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    _sampling_options(gen)
    _add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", help="throughput of a batch of prompts")
    bench.add_argument("--num-prompts", type=int, default=8)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--quiet", action="store_true")
    _add_engine_options(bench)
    bench.set_defaults(func=cmd_bench)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    try:
        from engine.server.app import add_serve_arguments, run_serve_command
    except ImportError as error:
        serve.set_defaults(func=lambda _: _missing_server(error))
    else:
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve_command)
    return parser


def _missing_server(error: ImportError) -> int:
    print(f"engine serve needs the server extra (pip install 'engine[server]'): {error}",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
