"""Host cost of a pass's grammar masks: rows of the `copy` workload's JSON schema (each request
at its own point of the document) filled by llguidance's pool and one row after another, on a
byte vocabulary (what random weights constrain) of each size given; microseconds per row, and
the round trip of `Grammars.start` + `PendingMasks.host` (the fill off the loop's thread).

    .venv/bin/python benchmarks/bench_grammar_masks.py [--vocab 49152,128256] [--rows 1,8,32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_workload import DOCUMENT_SCHEMA, compact, copy_document  # noqa: E402

from engine.shell.grammar import Grammars  # noqa: E402
from engine.state import StructuredOutputs  # noqa: E402

EOS = 2
SCHEMA = DOCUMENT_SCHEMA
DOCUMENT = compact(copy_document(1, answer=True)).encode()  # request 1's answer


def per_row(fill, rows: int, repeats: int) -> float:
    fill()  # warm
    started = time.perf_counter()
    for _ in range(repeats):
        fill()
    return 1e6 * (time.perf_counter() - started) / repeats / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="49152,128256", help="byte vocabulary sizes")
    parser.add_argument("--rows", default="1,8,32", help="constrained rows per pass")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cpus, llguidance {llguidance.__version__}; us per row")
    print("| vocab | rows | pool | one by one | start + host (parallel) |")
    print("|---|---|---|---|---|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        book = Grammars(None, vocab, EOS, parallel=True)
        book.wait_ready()
        executor = llguidance.LLExecutor()
        for rows in (int(r) for r in args.rows.split(",")):
            for uid in range(rows):
                book.add(uid, StructuredOutputs(json=SCHEMA))
                book.advance(uid, list(DOCUMENT[: (uid * 7) % (len(DOCUMENT) - 1)]))
            pairs = [(book.matchers[u], u) for u in range(rows)]
            bitmask = np.full((rows, book.words), -1, dtype=np.int32)

            def pool() -> None:
                llg_numpy.fill_next_token_bitmask_par(executor, pairs, bitmask)

            def serial() -> None:
                for matcher, row in pairs:
                    llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)

            def started() -> None:
                pending = book.start(list(range(rows)))
                assert pending is not None  # every row is constrained
                pending.host()

            cells = [per_row(f, rows, args.repeats) for f in (pool, serial, started)]
            print(f"| {vocab} | {rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
            for uid in range(rows):
                book.remove(uid)


if __name__ == "__main__":
    main()
