"""benchmarks/ncu_attention.py without a GPU: its reading of ncu's raw CSV page into a table
row, and what it refuses before anything runs."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

HEADER = [
    "ID",
    "Kernel Name",
    "gpu__time_duration.sum",
    "launch__grid_size",
    "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
]
UNITS = ["", "", "usecond", "", "register/thread", "%", "ratio", "ratio", "ratio", "%"]


def _csv(rows: list[list[str]]) -> str:
    quoted = [",".join(f'"{cell}"' for cell in row) for row in [HEADER, UNITS, *rows]]
    return "\n".join(["==PROF== Disconnected from process 1", *quoted]) + "\n"


def test_raw_page_reads_into_the_longest_kernels_row(bench_script) -> None:
    """The profiler's own lines before the header are skipped, units read from the second
    row, durations summed over the label's kernels (microseconds kept, nanoseconds scaled),
    the other columns the longest kernel's, stall reasons and tensor pipes by their values."""
    ncu = bench_script("ncu_attention")
    text = _csv(
        [
            ["0", "merge_kernel", "2.5", "64", "40", "50", "1.0", "0.1", "0.2", "0"],
            [
                "1",
                "_extend_kernel(int)",
                "180.25",
                "4096",
                "174",
                "22.4",
                "3.5",
                "0.25",
                "1.5",
                "61.2",
            ],
        ]
    )
    raw = ncu.read_raw(text)
    row = ncu.summary("extend-8x1024-ours", raw)
    assert row["kernel"] == "_extend_kernel(int)"
    assert row["kernels"] == "2"
    assert row["us"] == "182.8"  # 2.5 + 180.25
    assert (row["grid"], row["registers"], row["occupancy %"]) == ("4096", "174", "22.4")
    assert row["SM %"] == "-"  # not in the page: shown as absent, not as zero
    assert row["stalls (cycles an issue)"] == "long_scoreboard 3.50, wait 1.50, barrier 0.25"
    assert row["tensor pipe %"] == "pipe_tensor_op_gmma 61.2"
    nanoseconds = ncu.read_raw(text.replace('"usecond"', '"nsecond"', 1))
    assert ncu.summary("x", nanoseconds)["us"] == "0.2"
    assert ncu.summary("x", ncu.read_raw("==PROF== no kernels\n"))["kernel"] == "no kernel profiled"
    assert math.isnan(ncu._number("n/a"))


@pytest.mark.parametrize(
    "argv, cuda, message",
    [
        (
            ["--only", "decode-16x1024-ours,extend-3x3-ours"],
            True,
            "['extend-3x3-ours'] are not labels",
        ),
        ([], False, "needs a CUDA device"),
    ],
)
def test_ncu_attention_refuses_what_it_cannot_run(bench_refusal, argv, cuda, message) -> None:
    """An unknown label, and a machine without a CUDA device, are refused before anything
    runs, naming what was wrong."""
    assert message in bench_refusal("ncu_attention", argv, cuda)


def test_ncu_attention_profiles_each_label_in_its_own_ncu_run(
    bench_script, monkeypatch, capsys, tmp_path
) -> None:
    """Each label is recorded by one ncu run of this script's `--profile-one` process with
    the device's clocks left alone and profiling off until the script starts it, then read
    back as a raw CSV page into its table row; a label whose run fails gets a row naming its
    log, and the others still run. ncu here is a stand-in for its command line."""
    ncu_main = bench_script("ncu_attention")
    page = _csv([["0", "_extend_kernel", "184.0", "4096", "174", "22", "3", "0.2", "1", "60"]])
    calls: list[list[str]] = []

    def fake_ncu(args: list[str], **kwargs) -> subprocess.CompletedProcess:
        calls.append(args)
        if "--import" in args:
            return subprocess.CompletedProcess(args, 0, page, "")
        if args[-1] == "decode-16x1024-copy":
            return subprocess.CompletedProcess(args, 3, "", "profiling failed")
        Path(args[args.index("-o") + 1] + ".ncu-rep").touch()
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(ncu_main, "find_ncu", lambda: "ncu")
    monkeypatch.setattr(ncu_main.subprocess, "run", fake_ncu)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    out = tmp_path / "out"
    labels = "extend-8x1024-ours,decode-16x1024-copy"
    monkeypatch.setattr("sys.argv", ["ncu_attention.py", "--only", labels, "--out", str(out)])
    ncu_main.main()
    table = capsys.readouterr().out
    assert "| extend-8x1024-ours | _extend_kernel | 1 | 184.0 | 4096 | 174 | 22 |" in table
    assert "| decode-16x1024-copy | ncu exit 3 (decode-16x1024-copy.log) |" in table
    assert "profiling failed" in (out / "decode-16x1024-copy.log").read_text()
    assert len(calls) == 3  # two recordings, one import (the failed one has no report)
    record, imported = " ".join(calls[0]), calls[1]
    assert record.startswith("ncu --clock-control none --profile-from-start off --section ")
    assert record.endswith("--profile-one extend-8x1024-ours")
    assert f" -o {out / 'extend-8x1024-ours'} " in record
    report = f"{out / 'extend-8x1024-ours'}.ncu-rep"
    assert imported == ["ncu", "--import", report, "--csv", "--page", "raw"]


# Metric names of the raw page ncu printed for the decode kernel on an H100 (Nsight Compute
# in the GPU image, sections as ncu_attention asks), of those the table reads.
SEEN_ON_H100 = {
    "gpu__time_duration.sum",
    "launch__grid_size",
    "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
}


def test_table_columns_read_metrics_ncu_prints(bench_script) -> None:
    """Every named column reads a metric the profiler's raw page has (a name it does not
    print leaves the column empty on every row)."""
    ncu = bench_script("ncu_attention")
    assert set(ncu.NAMED.values()) <= SEEN_ON_H100 | {ncu.DURATION}


def test_copy_label_moves_its_bytes_in_a_kernel(bench_script, monkeypatch) -> None:
    """The copy label's launch is an elementwise kernel that reads and writes its bytes:
    `copy_` of a contiguous tensor is a memcpy, which ncu does not profile."""
    import torch

    ncu = bench_script("ncu_attention")

    def memcpy(*args, **kwargs):
        raise AssertionError("a memcpy: ncu profiles no kernel")

    monkeypatch.setattr(torch.Tensor, "copy_", memcpy)
    src = torch.arange(256, dtype=torch.uint8)
    dst = ncu._copier(src)()
    assert torch.equal(dst, ~src)  # every byte read and one written for it
