"""The launch policies: split counts, the verify config and the extend config, as pure
functions of the shape."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import pdl
from engine.backends import decode_policy
from engine.backends.decode_policy import (
    DECODE_CONFIG,
    LONG_BLOCK_MAX_ROWS,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    ONE_WAVE_WARPS,
    PROGRAMS_PER_SM,
    VERIFY_CONFIGS,
    choose_decode_warps,
    choose_num_splits,
    choose_verify_config,
    decode_launch,
)
from engine.backends.extend_policy import (
    EXTEND_CONFIG,
    SHORT_PROMPTS_CONFIG,
    choose_extend_config,
    extend_launch,
    grid_order,
)
from engine.pdl import AUTO_MAX_ROWS

H200_SMS = 132
BLOCK = DECODE_CONFIG["BLOCK_N"]


@pytest.mark.parametrize(
    "batch,length,expected",
    [
        (1, 8192, 64),  # batch 1, long context: 8 x 64 programs, about four on every SM
        (1, 4096, 32),  # 64 would cut 64-key splits though 256 programs cover every SM
        (1, 1024, 16),  # 8 x 8 programs at 128 keys leave SMs idle: 64-key splits
        (4, 1024, 8),  # 32 x 8 programs cover the SMs: 128-key splits
        (16, 4096, 4),  # 128 programs per split: one wave of ~4 per SM (H200: 79 us at 4,
        # 88 at 2, 85 at 8; bench_decode_launches.py --split-grid)
        (64, 2048, 1),  # 512 programs already: no split, no merge
        (256, 1024, 1),
        (1, 100, 1),  # a short context: the merge would cost more than the split gains
    ],
)
def test_split_counts_for_the_benchmark_shapes(batch: int, length: int, expected: int) -> None:
    assert choose_num_splits(batch, 8, length, H200_SMS) == expected


@pytest.mark.parametrize(
    "batch,length,warps",
    [
        (1, 8192, ONE_WAVE_WARPS),  # 512 programs: one wave
        (16, 4096, ONE_WAVE_WARPS),  # 4 splits of 128 programs: one wave
        (64, 2048, ONE_WAVE_WARPS),  # 512 programs, no split
        (256, 1024, DECODE_CONFIG["num_warps"]),  # 2048 programs: four waves
    ],
)
def test_decode_warps_for_the_benchmark_shapes(batch: int, length: int, warps: int) -> None:
    programs = batch * 8 * choose_num_splits(batch, 8, length, H200_SMS)
    assert choose_decode_warps(programs, H200_SMS) == warps


@settings(max_examples=100, deadline=None)
@given(**dict(batch=st.integers(0, 600), heads=st.sampled_from([1, 2, 8, 32])))
def test_decode_warps_only_drop_when_the_grid_is_one_wave(batch: int, heads: int) -> None:
    """Never fewer warps for a larger grid (more requests, kv heads or splits)."""
    programs = max(batch, 1) * heads
    assert choose_decode_warps(programs, H200_SMS) <= choose_decode_warps(programs + 1, H200_SMS)
    expected = ONE_WAVE_WARPS if programs <= PROGRAMS_PER_SM * H200_SMS else 4
    assert choose_decode_warps(programs, H200_SMS) == expected


SHAPES = dict(
    batch=st.integers(0, 600),
    heads=st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64]),
    length=st.integers(0, 300_000),
    sms=st.sampled_from([1, 8, 78, 108, 114, 132, 170]),
)


@settings(max_examples=300, deadline=None)
@given(**SHAPES)
def test_split_count_is_valid_for_any_shape(batch: int, heads: int, length: int, sms: int) -> None:
    splits = choose_num_splits(batch, heads, length, sms)
    assert 1 <= splits <= MAX_SPLITS
    assert splits & (splits - 1) == 0  # a power of two
    programs = max(batch, 1) * heads
    if splits > 1:  # no split shorter than a key block; two unless SMs would idle
        assert length // splits >= BLOCK
        assert length // splits >= MIN_KEYS_PER_SPLIT or programs * splits // 2 < sms
        # never more programs than useful: half as many splits left the wave less than
        # ~71% (2 ** -0.5) full
        assert programs * splits / 2 < PROGRAMS_PER_SM * sms * 2**-0.5


@settings(max_examples=300, deadline=None)
@given(**SHAPES, more=st.integers(1, 300))
def test_split_count_is_monotone(batch: int, heads: int, length: int, sms: int, more: int) -> None:
    """More requests or kv heads: never more splits; a longer context: never fewer."""
    splits = choose_num_splits(batch, heads, length, sms)
    assert choose_num_splits(batch + more, heads, length, sms) <= splits
    assert choose_num_splits(batch, heads * 2, length, sms) <= splits
    assert choose_num_splits(batch, heads, length + more * 64, sms) >= splits


def test_split_count_fills_a_small_batch_and_leaves_a_full_chip_alone() -> None:
    for length in (8192, 16384):
        for batch in (1, 2, 4, 8, 16):
            programs = batch * 8 * choose_num_splits(batch, 8, length, H200_SMS)
            # one wave of PROGRAMS_PER_SM per SM, within a factor sqrt(2) (powers of two)
            wave = programs / (PROGRAMS_PER_SM * H200_SMS)
            assert 2**-0.5 <= wave <= 2**0.5
        full = -(-PROGRAMS_PER_SM * H200_SMS // 8)  # requests that fill the chip
        assert choose_num_splits(full, 8, length, H200_SMS) == 1


@pytest.mark.parametrize(
    "args", [(-1, 8, 100, 132), (1, 0, 100, 132), (1, 8, -5, 132), (1, 8, 100, 0)]
)
def test_split_count_rejects_impossible_shapes(args: tuple) -> None:
    with pytest.raises(ValueError, match="choose_num_splits"):
        choose_num_splits(*args)


@pytest.mark.parametrize(
    "programs,expected_block_n",
    [
        (384, 32),  # 48 requests x 8 kv heads: one wave of 3 programs per SM
        (512, 64),  # 64 requests: two full waves of 2 per SM beat 1.3 waves of 3
        (400, 64),  # past one wave of either: 2 waves of 2 per SM (0.76 full) beat 1.01 of 3
        (264, 32),  # one wave of either (8 kv heads x 33 splits): none waits, the first
        (192, 32),  # the default model's batch-1 verify: 3 kv heads x 64 splits
        (8, 32),  # a handful: the same
        (792, 32),  # both fill their waves exactly: ties go to the first
    ],
)
def test_verify_config_fills_its_waves(programs: int, expected_block_n: int) -> None:
    config = choose_verify_config(programs, H200_SMS, rows=13)
    assert config["BLOCK_N"] == expected_block_n
    assert config in [entry[0] for entry in VERIFY_CONFIGS]


@pytest.mark.parametrize(
    "programs,wide,narrow",
    [
        (192, 32, 64),  # the default model's batch-1 verify: one wave of either
        (264, 32, 64),  # one wave of either: the rows decide
        (8, 32, 64),
        (384, 32, 32),  # past one wave of the 64-key launch: the fuller waves decide
        (512, 64, 64),
        (792, 32, 32),
    ],
)
def test_verify_config_by_the_pass_rows(programs: int, wide: int, narrow: int) -> None:
    """Where the grid is one wave of every config, a pass of up to LONG_BLOCK_MAX_ROWS rows
    (the products `auto` starts beside the attention) takes the longest key block, a wider
    one the first; past one wave the waves' fill decides whatever the rows."""
    assert LONG_BLOCK_MAX_ROWS == AUTO_MAX_ROWS
    assert choose_verify_config(programs, H200_SMS, LONG_BLOCK_MAX_ROWS + 1)["BLOCK_N"] == wide
    assert choose_verify_config(programs, H200_SMS, LONG_BLOCK_MAX_ROWS)["BLOCK_N"] == narrow


def test_bench_steps_lays_verify_settings_over_the_policys_choice(bench_script):
    """`bench_steps.py --verify-attention`: inside the block a verify launch's settings
    (`decode_launch`, which `decode_attention` asks) are the policy's with the given
    settings laid over them; 'policy' and the block's end leave the policy's own."""

    def launch() -> dict:
        return decode_launch(False, True, 192, H200_SMS, 13, 64, None)

    bench_steps = bench_script("bench_steps")
    chosen = launch()
    # the other entry's settings, unlike the policy's own at this grid: laying them shows
    other = next(c for c, _ in VERIFY_CONFIGS if c["BLOCK_N"] != chosen["BLOCK_N"])
    with bench_steps.verify_attention(json.dumps(other)):
        assert launch() == {**chosen, **other}
    assert launch() == chosen
    with bench_steps.verify_attention("policy"):
        assert launch() == chosen


@pytest.mark.parametrize("setting", ["top", "late", "exit"])
def test_decode_and_verify_launches_are_the_same_with_and_without_pdl(monkeypatch, setting):
    """PDL changes when a kernel starts, never what it computes: a launch's settings (the
    verify key block sets where the splits fall, so the rounding) come from the shape alone.
    Chosen by whether the products ran with PDL (d50ba25), a 13-row verify pass took 64-key
    blocks with PDL and 32-key ones without, and tests/test_pdl.py's logits differed."""
    monkeypatch.setattr(pdl, "_capable", lambda device: True)  # as on a Hopper GPU

    def launches() -> list[dict]:
        return [
            decode_launch(False, tree, programs, H200_SMS, rows, splits, None)
            for tree in (False, True)
            for programs, rows, splits in [(192, 1, 64), (192, 8, 64), (192, 13, 64), (512, 16, 4)]
        ]

    with pdl.using("off"):
        plain = launches()
    with pdl.using(setting):
        assert launches() == plain


def test_decode_launch_takes_the_policys_choices() -> None:
    """The interpreter's config on a CPU; on a GPU decode's warps by the wave and the merge
    fused up to FUSED_MERGE_MAX_SPLITS splits, verify's config by `choose_verify_config` and
    never fused; a given config laid over either."""
    assert decode_launch(True, False, 512, H200_SMS, 16, 4, None) == {
        "FUSED_MERGE": True,
        **decode_policy.INTERPRETER_CONFIG,
    }
    one_wave = decode_launch(False, False, 512, H200_SMS, 16, 4, None)
    assert one_wave["num_warps"] == ONE_WAVE_WARPS and one_wave["FUSED_MERGE"]
    many = decode_launch(False, False, 64 * 132, H200_SMS, 16, 64, None)
    assert many["num_warps"] == DECODE_CONFIG["num_warps"] and not many["FUSED_MERGE"]
    verify = decode_launch(False, True, 192, H200_SMS, 13, 4, None)
    assert verify == {"FUSED_MERGE": False, **choose_verify_config(192, H200_SMS, 13)}
    laid = decode_launch(False, True, 192, H200_SMS, 13, 4, {"FUSED_MERGE": True, "BLOCK_N": 16})
    assert laid["FUSED_MERGE"] and laid["BLOCK_N"] == 16


@pytest.mark.parametrize(
    "entry,message",
    [
        ('{"BLOCK_M": 32}', "unknown key(s) ['BLOCK_M']"),
        ("[32]", "is not 'policy' or a JSON dict"),
        ("fast", "is not 'policy' or a JSON dict"),
        ('{"num_warps": 0}', "must be positive integers"),
        ('{"num_warps": 2.5}', "must be positive integers"),
        ('{"num_warps": true}', "must be positive integers"),
        ('{"FUSED_MERGE": 1}', "must be true or false"),
    ],
)
def test_bench_steps_refuses_verify_settings_it_cannot_lay_over(
    bench_script, monkeypatch, capsys, entry, message
):
    """A `--verify-attention` entry that is not 'policy' or a dict of a verify launch's
    settings is refused before any engine is built (on a CPU, before any CUDA call)."""
    bench_steps = bench_script("bench_steps")
    monkeypatch.setattr("sys.argv", ["bench_steps.py", "--verify-attention", f"policy;{entry}"])
    with pytest.raises(SystemExit):
        bench_steps.main()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "requests,keys,group,short",
    [
        (16, 512, 4, True),  # H100: 0.89x the default's time (bench_extend --turns)
        (8, 1024, 4, True),  # 0.96x
        (4, 2048, 4, False),  # 1.08x: longer prompts keep 64 x 64 tiles of one head
        (1, 1024, 4, False),  # 1.09x: one request
        (8, 2560, 4, False),  # 512 new tokens after 2048 cached: 1.08x
        (16, 512, 3, False),  # the default model: 3 q heads a kv head, no pair shares one
        (16, 512, 8, True),
    ],
)
def test_extend_config_for_the_benchmark_shapes(
    requests: int, keys: int, group: int, short: bool
) -> None:
    assert (choose_extend_config(requests, keys, group) == SHORT_PROMPTS_CONFIG) == short


@pytest.mark.parametrize(
    "flag,study", [("--grid", "extend_grid"), ("--turns", "extend_turns_table")]
)
def test_bench_extend_runs_the_study_its_flag_names(bench_script, monkeypatch, flag, study):
    """`bench_extend.py --grid` and `--turns` each run their study alone (the studies stubbed
    and a CUDA device pretended: the parse and the dispatch, nothing timed)."""
    bench_extend = bench_script("bench_extend")
    ran = []
    for name in ("extend_grid", "extend_turns_table"):
        monkeypatch.setattr(bench_extend, name, lambda name=name: ran.append(name))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("sys.argv", ["bench_extend.py", flag])
    bench_extend.main()
    assert ran == [study]


@pytest.mark.parametrize(
    "argv,cuda,message",
    [
        ([], True, "one of the arguments --grid --turns is required"),
        (["--grid", "--turns"], True, "not allowed with argument --grid"),
        (["--turns"], False, "needs a CUDA device"),
    ],
)
def test_bench_extend_refuses_no_study_both_studies_and_no_device(
    bench_refusal, argv, cuda, message
):
    """`bench_extend.py` runs one study a call, and without a CUDA device says so before
    anything runs."""
    assert message in bench_refusal("bench_extend", argv, cuda)


@given(st.integers(1, 512), st.integers(1, 1 << 17), st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
def test_extend_config_is_one_the_kernel_accepts(requests: int, keys: int, group: int) -> None:
    """The launch a GPU pass gets is the policy's over EXTEND_CONFIG, passes the launch's
    checks (they raise) and comes with its grid order; its HEADS divides the group and its
    tiles divide as the kernel requires."""
    config = extend_launch(False, requests, keys, group, None)
    assert config == {
        **EXTEND_CONFIG,
        **choose_extend_config(requests, keys, group),
        "GRID_ORDER": grid_order(requests),
    }
    assert group % config["HEADS"] == 0
    assert config["BLOCK_M"] % config["BLOCK_N"] == 0


@pytest.mark.parametrize(
    "config,named",
    [
        (
            {"BLOCK_M": 32, "BLOCK_N": 64, "DIAGONAL_IN_LOOP": False},
            "BLOCK_M=32 must be a multiple of BLOCK_N=64",
        ),
        ({"BLOCK_M": 48, "BLOCK_N": 64}, "or divide it with DIAGONAL_IN_LOOP"),
        ({"HEADS": 3}, "HEADS=3 must be a power of two dividing"),
        ({"HEADS": 8}, "HEADS=8 must be a power of two dividing the q heads a kv head serves (4)"),
        ({"GRID_ORDER": "qqh"}, "GRID_ORDER='qqh' must order the letters of 'qrh'"),
    ],
)
@pytest.mark.parametrize("on_cpu", [False, True])
def test_extend_launch_refuses_settings_the_kernel_cannot_run(
    config: dict, named: str, on_cpu: bool
) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        extend_launch(on_cpu, 2, 512, 4, config)


@pytest.mark.parametrize(
    "flag,study",
    [
        ("--split-grid", "split_grid"),
        ("--verify-configs", "verify_configs_table"),
        ("--short", "shape_table"),
    ],
)
def test_bench_decode_launches_runs_the_study_its_flag_names(
    bench_script, monkeypatch, flag, study
):
    """`bench_decode_launches.py` runs the one study its flag names (the studies and the
    ceiling stubbed, a CUDA device pretended); `--short` runs its table at each `--shapes`
    pair in order."""
    script = bench_script("bench_decode_launches")
    ran = []
    for name in ("split_grid", "verify_configs_table"):
        monkeypatch.setattr(script, name, lambda ceiling, name=name: ran.append((name,)))
    monkeypatch.setattr(
        script, "shape_table", lambda b, n, ceiling, top: ran.append(("shape_table", b, n, top))
    )
    monkeypatch.setattr(script, "copy_ceiling_gbs", lambda: 1000.0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda: "pretended")
    monkeypatch.setattr("sys.argv", ["x", flag, "--shapes", "16x1024,32x2048", "--top", "3"])
    script.main()
    if study == "shape_table":
        assert ran == [("shape_table", 16, 1024, 3), ("shape_table", 32, 2048, 3)]
    else:
        assert ran == [(study,)]


@pytest.mark.parametrize(
    "argv,cuda,message",
    [
        ([], True, "one of the arguments --split-grid --verify-configs --short is required"),
        (["--short", "--split-grid"], True, "not allowed with argument"),
        (["--short", "--shapes", "16"], True, "--shapes takes BxL pairs"),
        (["--short", "--shapes", "16x1024x2"], True, "--shapes takes BxL pairs"),
        (["--short", "--shapes", "16xL"], True, "--shapes takes BxL pairs"),
        (["--short", "--shapes", "0x1024"], True, "--shapes takes BxL pairs"),
        (["--split-grid"], False, "needs a CUDA device"),
    ],
)
def test_bench_decode_launches_refuses_what_it_cannot_run(bench_refusal, argv, cuda, message):
    """No study, two studies, shapes that are not positive BxL pairs and a machine without a
    CUDA device are each refused before anything is timed, naming what was wrong."""
    assert message in bench_refusal("bench_decode_launches", argv, cuda)
