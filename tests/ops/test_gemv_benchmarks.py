"""The matrix-vector kernels' benchmark scripts (`bench_gemv.py`, `bench_gemv_sweeps.py`):
their options, the studies each flag runs, and their tables, without a GPU (the studies
stubbed or their launches listed, nothing timed)."""

from __future__ import annotations

import pytest
import torch
from op_cases import random_tensor

from engine.ops import gemv_policy


def test_bench_gemv_names_silu_after_gate_up_as_such(bench_script):
    """`bench_gemv.py --fused` labels the gate_up product with SiLU*mul after it by that op,
    not by the norm that comes before gate_up in the table's other rows."""
    bench_gemv = bench_script("bench_gemv")

    table = bench_gemv.fused_table(
        [
            bench_gemv.Fused("norm", "gate_up", 13, 10e-6, None, None, "apart (all rows)"),
            bench_gemv.Fused(bench_gemv.SILU_AFTER, "gate_up", 13, 10e-6, 5e-6, 20e-6, "one"),
        ]
    )
    labels = [line.split(" | ")[0] for line in table.splitlines()[3:]]
    assert labels == ["| norm + gate_up", "| gate_up + silu after"]
    assert "| gate_up + silu after | 13 | 10.0 | 5.0 | 2.00x | 20.0 | one |" in table


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--only", "lm_head", "--fused"], "--only picks the shapes"),
        (["--only", "lm_hed"], "no shapes"),
        (["--load-3d", "--dtype", "bfloat16"], "--load-3d times the all-rows kernel"),
        (["--sweep-verify"], "unrecognized arguments: --sweep-verify"),  # bench_gemv_sweeps'
    ],
)
def test_bench_gemv_refuses_options_it_would_ignore(
    bench_script, monkeypatch, capsys, argv, message
):
    """`--only` with a mode that times its own shapes is refused before anything runs (it
    would be accepted and ignored), as is an unknown shape; the sweeps are another
    script's."""
    bench_gemv = bench_script("bench_gemv")
    monkeypatch.setattr("sys.argv", ["bench_gemv.py", *argv])
    with pytest.raises(SystemExit):
        bench_gemv.main()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,cuda,message",
    [
        ([], True, "one of the arguments --sweep --loop-stages --sweep-verify is required"),
        (["--sweep", "--loop-stages"], True, "not allowed with argument --sweep"),
        (["--loop-stages", "--wide"], True, "--wide widens --sweep"),
        (["--sweep", "--only", "lm_hed"], True, "no shapes"),
        (["--only", "qkv", "--sweep-verify", "--dtype", "float32"], True, "--only picks"),
        (["--sweep-verify"], True, "--sweep-verify times the all-rows kernel, which takes"),
        (["--sweep"], False, "needs a CUDA device"),
    ],
)
def test_bench_gemv_sweeps_refuses_options_it_would_ignore(bench_refusal, argv, cuda, message):
    """`bench_gemv_sweeps.py` runs one study a call; `--wide` without `--sweep`, `--only`
    with a study that times its own shapes, an unknown shape, bf16 rows for the all-rows
    kernel and a machine without a CUDA device are refused before anything runs."""
    assert message in bench_refusal("bench_gemv_sweeps", argv, cuda)


@pytest.mark.parametrize(
    "argv,study,rest",
    [
        (
            ["--sweep", "--wide", "--only", "lm_head", "--rows", "8,13"],
            "sweep",
            (["lm_head"], "float32", [8, 13], True),
        ),
        (
            ["--sweep", "--rows", "1"],
            "sweep",
            (["qkv", "o_proj", "gate_up", "down", "lm_head"], "float32", [1], False),
        ),
        (["--loop-stages", "--rows", "1,13"], "compare_loop_stages", (torch.float32, [1, 13])),
        (["--sweep-verify", "--rows", "8,13"], "sweep_verify", ([8, 13],)),
    ],
)
def test_bench_gemv_sweeps_runs_the_study_its_flag_names(
    bench_script, monkeypatch, argv, study, rest
):
    """Each of `bench_gemv_sweeps.py`'s flags runs its study alone, on the shapes, rows and
    dtype given (the studies stubbed and a CUDA device pretended: the parse and the
    dispatch, nothing timed)."""
    sweeps = bench_script("bench_gemv_sweeps")
    problems = bench_script("gemv_problems")
    ran = []
    for name in ("sweep", "compare_loop_stages", "sweep_verify"):
        monkeypatch.setattr(sweeps, name, lambda *a, name=name: ran.append((name, a)))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda: "no device")
    monkeypatch.setattr(gemv_policy, "MAX_WEIGHT_ELEMENTS", gemv_policy.MAX_WEIGHT_ELEMENTS)
    smollm2 = ["--shapes", "smollm2_135m", "--dtype", "float32"]
    monkeypatch.setattr("sys.argv", ["bench_gemv_sweeps.py", *argv, *smollm2])
    sweeps.main()
    assert ran == [(study, (problems.SHAPES["smollm2_135m"], *rest))]


def test_the_gemv_table_shows_the_swept_best_only_beside_a_sweep(bench_script):
    """The main table (`gemv_problems.compared_table`): bench_gemv.py's without a column for
    a sweep, bench_gemv_sweeps.py's `--sweep` with the fastest swept launch's time."""
    problems = bench_script("gemv_problems")
    row = problems.Compared("qkv", 13, 10e-6, 5e-6, 4e-6, 4e-6, 2_000_000, 1e-7)
    plain = problems.compared_table([row]).splitlines()
    swept = problems.compared_table([row], [3e-6]).splitlines()
    assert "best swept" not in plain[1] and "best swept us" in swept[1]
    for lines in (plain, swept):  # as many columns in the head, the rule and the row
        assert len({line.count("|") for line in lines[1:]}) == 1
    assert plain[3] == "| qkv | 13 | 10.0 | 200 | 5.0 | 400 | 2.00x | 4.0 | 4.0 | 1.0e-07 |"
    assert swept[3] == "| qkv | 13 | 10.0 | 200 | 5.0 | 400 | 2.00x | 4.0 | 4.0 | 3.0 | 1.0e-07 |"


def test_bench_gemv_sweeps_sweeps_the_verify_launches_around_the_models(bench_script):
    """`--sweep-verify`'s space: every tile, warp count and key steps in flight once, each
    keeping the model's launch's other settings (its loads, num_stages, all rows), the
    model's own launch among them."""
    sweeps = bench_script("bench_gemv_sweeps")
    model = gemv_policy.rows_config(960, 132)
    space = sweeps.verify_space(model)
    names = ("BLOCK_N", "BLOCK_K", "num_warps", "LOOP_STAGES")
    knobs = [tuple(config[name] for name in names) for config in space]
    assert len(set(knobs)) == len(knobs) == len(sweeps.VERIFY_TILES) * 2 * 3
    assert model in space

    def rest(config: dict) -> dict:
        return {key: value for key, value in config.items() if key not in names}

    for config in space:
        assert 128 <= config["BLOCK_N"] * config["BLOCK_K"] <= 1024
        assert rest(config) == rest(model)


@pytest.mark.parametrize("name", ["qkv", "o_proj", "gate_up", "down"])
def test_bench_gemv_times_each_verify_launch_flat_and_in_3d_blocks(bench_script, name):
    """`bench_gemv.py --load-3d`'s launches: each product as a verify pass makes it gives
    its float64 value in each variant: the loads flat, in 3-d blocks, the key steps as dots
    (small widths here)."""
    problems = bench_script("gemv_problems")  # bench_gemv.py's launches and variants
    n, k, rows = (12, 40, 13) if name != "gate_up" else (24, 40, 13)
    x = random_tensor(rows, k, dtype=torch.float32, seed=51)
    weight = random_tensor(n, k, dtype=torch.float32, seed=52) * 0.2
    norm_w = random_tensor(k, dtype=torch.float32, seed=53).abs() + 0.5
    model, call, exact = problems.verify_launch(name, n, 2, norm_w)
    want = exact(x, weight).float()
    assert model["all_rows"]
    for overrides in problems.ROWS_VARIANTS.values():
        torch.testing.assert_close(
            call(x, weight, dict(model, **overrides)), want, rtol=1e-5, atol=1e-5
        )
