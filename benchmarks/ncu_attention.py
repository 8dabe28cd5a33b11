"""Hardware counters of the attention kernels beside SDPA's flash kernel (cuDNN's on an H100)
and a kernel moving the decode pass's bytes, read by Nsight Compute (`ncu`) where the timed
benchmarks leave a gap.

    python3 benchmarks/ncu_attention.py                      # every label of LAUNCHES
    python3 benchmarks/ncu_attention.py --only decode-16x1024-ours,decode-16x1024-copy
    python3 benchmarks/ncu_attention.py --out DIR            # keep each report and CSV in DIR

Each label runs in a process of its own under `ncu --clock-control none --profile-from-start
off` (the device's clocks left as they are): it builds its problem as `attention_problems.py`
does (32 q / 8 kv heads, head_dim 128, bf16, slots in random order), runs one copy's launches
once to compile them, then profiles the next copy's (ncu flushes the caches before each
replay: L2 holds none of it, as in the timed benchmarks). The table gives, for each label, its
kernels' summed duration under the profiler and, of its longest kernel, the grid, registers,
achieved occupancy, the SM's and DRAM's throughput as fractions of their peaks, the issue
slots used, the tensor pipes' activity and the warps' four most frequent stall reasons
(cycles a warp waits per instruction issued, by reason). The durations are one launch's, not
the graph replays' of the other benchmarks: compare labels, not these with those.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SECTIONS = (
    "SpeedOfLight",
    "LaunchStats",
    "Occupancy",
    "WarpStateStats",
    "SchedulerStats",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "SourceCounters",  # stall samples by instruction: `ncu --import <report> --page source`
)
# label: (kind, batch, keys a request, whose launch)
LAUNCHES = {
    "extend-8x1024-ours": ("extend", 8, 1024, "ours"),
    "extend-8x1024-sdpa": ("extend", 8, 1024, "sdpa"),
    "extend-4x2048-ours": ("extend", 4, 2048, "ours"),
    "extend-4x2048-sdpa": ("extend", 4, 2048, "sdpa"),
    "extend-1x1024-ours": ("extend", 1, 1024, "ours"),
    "extend-1x1024-sdpa": ("extend", 1, 1024, "sdpa"),
    "decode-16x1024-ours": ("decode", 16, 1024, "ours"),
    "decode-16x1024-sdpa": ("decode", 16, 1024, "sdpa"),
    "decode-16x1024-copy": ("decode", 16, 1024, "copy"),
}
DURATION = "gpu__time_duration.sum"
NAMED = {  # table column: the ncu metric
    "grid": "launch__grid_size",
    "registers": "launch__registers_per_thread",
    "occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "DRAM %": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "issued %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
}
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
TENSOR = re.compile(r"^sm__\w*pipe_tensor\w*\.avg\.pct_of_peak_sustained_active$")
PIPE_NAME = re.compile(r"^sm__|_cycles_active|\.avg\.pct_of_peak_sustained_active$")
UNIT_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def launches(label: str) -> Callable[[int], object]:
    """`run(copy)`: the label's launches on one copy of its problem."""
    from attention_problems import (  # needs CUDA
        Problem,
        decode_like_shape,
        kv_bytes,
        ours_decode,
        ours_extend,
        sdpa,
    )

    kind, batch, keys, whose = LAUNCHES[label]
    if kind == "extend":
        prefix, new = 0, keys
    else:
        prefix, new, nbytes = decode_like_shape(kind, batch, keys)
    fns: list[Callable[[], object]]
    if whose == "copy":  # the decode pass's bytes moved, half read and half written (a
        # kernel: the timed benchmarks' copy, a memcpy, is none for ncu)
        srcs = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(2)]
        fns = [_copier(s) for s in srcs]
    else:
        p = Problem(kind, batch, prefix, new, kv_bytes(batch, prefix, new))
        if whose == "ours":
            fns = ours_extend(p) if kind == "extend" else ours_decode(p)
        else:
            fns = list(sdpa(p, kind, prefix, new)[0])
    if len(fns) < 2:
        raise RuntimeError(f"{label}: the problem has {len(fns)} copy; two are needed")
    return lambda i: fns[i]()


def _copier(src: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`src`'s bytes read and as many written by an elementwise kernel (their complement):
    `copy_` of a contiguous tensor is a memcpy, which ncu does not profile."""
    dst = torch.empty_like(src)
    return lambda: torch.bitwise_not(src, out=dst)


def profile_one(label: str) -> None:
    """The label's first copy run (compiled), then its second between profiler start and
    stop: what `ncu --profile-from-start off` records."""
    run = launches(label)
    run(0)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run(1)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return candidates[-1] if candidates else None


def read_raw(text: str) -> list[dict[str, str]]:
    """ncu's `--csv --page raw` output: a header of metric names, a row of units (unit:
    <metric>), then one row a kernel; lines before the header (the profiler's) skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    header, units, kernels = rows[0], rows[1], rows[2:]
    out = [{"unit:" + name: unit for name, unit in zip(header, units, strict=True)}]
    out += [dict(zip(header, row, strict=True)) for row in kernels if len(row) == len(header)]
    return out


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text not in ("", "n/a") else float("nan")


def summary(label: str, raw: list[dict[str, str]]) -> dict[str, str]:
    """One table row: the label's kernels' summed duration, its longest kernel's metrics."""
    if len(raw) < 2:
        return {"label": label, "kernel": "no kernel profiled"}
    units, kernels = raw[0], raw[1:]
    scale = UNIT_TO_US.get(units.get("unit:" + DURATION, "ns"), 1e-3)
    longest = max(kernels, key=lambda k: _number(k[DURATION]))
    row = {
        "label": label,
        "kernel": longest["Kernel Name"][:40],
        "kernels": str(len(kernels)),
        "us": f"{sum(_number(k[DURATION]) for k in kernels) * scale:.1f}",
    }
    for column, metric in NAMED.items():
        row[column] = f"{_number(longest[metric]):.4g}" if metric in longest else "-"
    tensor = [(PIPE_NAME.sub("", m), _number(v)) for m, v in longest.items() if TENSOR.match(m)]
    row["tensor pipe %"] = ", ".join(
        f"{name} {v:.3g}" for name, v in sorted(tensor, key=lambda nv: -nv[1])[:2] if v == v
    )
    stalls = [(hit[1], _number(v)) for m, v in longest.items() if (hit := STALL.match(m))]
    row["stalls (cycles an issue)"] = ", ".join(
        f"{name} {v:.2f}" for name, v in sorted(stalls, key=lambda nv: -nv[1])[:4] if v == v
    )
    return row


def print_table(rows: list[dict[str, str]]) -> None:
    columns = list(dict.fromkeys(c for r in rows for c in r))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(r.get(c, "") for c in columns) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"labels separated by commas, of {list(LAUNCHES)}")
    parser.add_argument("--out", help="a folder for each label's ncu report and raw CSV")
    parser.add_argument("--profile-one", help=argparse.SUPPRESS)  # the process ncu runs
    args = parser.parse_args()
    labels = args.only.split(",") if args.only else list(LAUNCHES)
    unknown = [label for label in labels if label not in LAUNCHES]
    if unknown:
        parser.error(f"--only: {unknown} are not labels; the labels are {list(LAUNCHES)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device to profile the attention kernels; torch sees none")
    if args.profile_one:
        profile_one(args.profile_one)
        return
    ncu = find_ncu()
    if ncu is None:
        parser.error("needs Nsight Compute's `ncu` on PATH or in /opt/nvidia/nsight-compute")
    out = Path(args.out or tempfile.mkdtemp(prefix="ncu-attention-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label in labels:
        report = out / label
        sections = [arg for s in SECTIONS for arg in ("--section", s)]
        record = [ncu, "--clock-control", "none", "--profile-from-start", "off", *sections]
        record += ["-f", "-o", str(report), sys.executable, __file__, "--profile-one", label]
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        done = subprocess.run(record, capture_output=True, text=True, env=env)
        (out / f"{label}.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            rows.append({"label": label, "kernel": f"ncu exit {done.returncode} ({label}.log)"})
            continue
        raw = subprocess.run(
            [ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "raw"],
            capture_output=True,
            text=True,
        ).stdout
        (out / f"{label}.csv").write_text(raw)
        rows.append(summary(label, read_raw(raw)))
    print(f"ncu reports and raw CSVs: {out}")
    print_table(rows)


if __name__ == "__main__":
    main()
