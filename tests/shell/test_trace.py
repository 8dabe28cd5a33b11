"""Scheduler traces: a real CPU run (tiny random model) with speculation, aborts, retractions,
evictions, prefix reuse and failed passes is recorded and replays clean; a trace edited at
one step fails at that step, naming it; `engine replay` prints either."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from engine_checks import tiny

from engine.cli import main
from engine.shell.config import EngineConfig
from engine.shell.failures import Faults
from engine.shell.replay import Mismatch, TraceError, replay_file
from engine.shell.trace import decode_effects, encode_effects


def family(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=length).tolist()


def record(path: Path, scored: tuple[int, ...] = (), **overrides) -> float:
    """A busy run written to `path`: two prompt families sharing prefixes, copy-heavy
    prompts (drafts match), the prompts `scored` asks their logprobs, a pool small enough to
    evict and retract, an abort, a stop token, and (by default) a failed forward and a failed
    commit. Returns its seconds."""
    settings = dict(
        trace_path=str(path),
        speculative=True,
        kv_cache_slots=240,
        chunk_size=24,
        max_running_requests=6,
    )
    engine = tiny(**(settings | overrides))
    engine.faults = Faults.at(forward=[50], commit=[35])
    system = family(1, 40)
    prompts = [system + family(10 + i, 4 + i) for i in range(4)]
    prompts += [family(20 + i, 6) * 4 for i in range(4)]  # repeats: drafts are accepted
    started = time.perf_counter()
    ids = [
        engine.submit(
            p,
            dict(
                max_tokens=40 + 8 * (i % 3),
                ignore_eos=i % 2 == 0,
                prompt_logprobs=1 if i in scored else None,  # passes with score rows
            ),
        )
        for i, p in enumerate(prompts)
    ]
    for step in range(2000):
        if not engine.has_work:
            break
        if step == 10:
            engine.abort(ids[0])
        if step == 12:  # a follow-up that matches a finished request's prompt and output
            engine.submit(prompts[0] + family(99, 3), dict(max_tokens=8))
        engine.step()
        engine.check()
    assert not engine.has_work
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> tuple[Path, float]:
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    return path, record(path, scored=(1, 5))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def write(path: Path, header: str, edited: list[dict]) -> None:
    path.write_text(header + "".join(json.dumps(r) + "\n" for r in edited))


def test_a_recorded_run_replays_clean_and_faster(trace):
    path, seconds = trace
    ops = [r["op"] for r in records(path)]
    # the run went through every kind of step
    for op in (
        "admit",
        "share",
        "schedule_extend",
        "extend",
        "schedule_decode",
        "decode",
        "decode_writes",
        "assume_decoded",
        "schedule_verify",
        "verify",
        "retract",
        "finish",
        "abandon",
    ):
        assert op in ops, op
    all_records = records(path)
    assert any(sum(r["prefix_lens"]) for r in all_records if r["op"] == "admit")
    assert any(r.get("evicted") for r in all_records)
    assert any(r["reason"] == "ABORT" for r in all_records if r["op"] == "finish")
    assert any(r.get("applied") is False for r in all_records)  # the failed commit
    assert any(sum(r["accepted_lens"]) for r in all_records if r["op"] == "verify")
    assert any(r.get("score_rows") for r in all_records if r["op"] == "schedule_extend")
    report = replay_file(str(path))
    assert report.steps == len(all_records)
    print(
        f"\nrecorded in {seconds:.3f} s, replayed {report.steps} steps in "
        f"{report.seconds:.3f} s: {seconds / report.seconds:.1f}x"
    )


@pytest.mark.parametrize(
    "variant",
    [
        dict(prefix_cache=False),
        dict(mixed_passes=False, plan_ahead=False),
        dict(speculative=False, kv_cache_slots=120),
        dict(speculative=False, launch_ahead=True),
        dict(launch_ahead=True),
        dict(launch_ahead=True, verify_ahead=True),
    ],
    ids=[
        "no-prefix-cache",
        "extend-only-no-plan",
        "plain-decode",
        "launch-ahead",
        "spec-launch-ahead",
        "spec-verify-ahead",
    ],
)
def test_other_settings_replay_clean(tmp_path, variant):
    path = tmp_path / "run.jsonl"
    record(path, **variant)
    ops = [r["op"] for r in records(path)]
    assert replay_file(str(path)).steps == len(ops)
    if variant.get("launch_ahead"):  # requests that left were cut from a launched pass
        assert "narrow" in ops
    if variant.get("verify_ahead"):  # verify passes planned ahead, their slots handed on
        verifies = [r for r in records(path) if r["op"] == "schedule_verify"]
        assert any("assumed" in r for r in verifies)
        assert any("slots_of" in r for r in verifies)


@pytest.mark.parametrize("outcome", ["fails", "is dropped"])
def test_a_decode_pass_launched_at_a_commit_replays_clean(tmp_path, outcome):
    """The decode pass launched as a speculative step commits (`Engine._launch_next`) is
    scheduled again from the committed tokens, taking the plan's slots. Where its launch
    fails, or where requests leave before the next step takes it, the pass given up must be
    that one, which holds the slots now, not the plan it took them from: the trace named the
    plan, and its replay found the launched pass's slots both free and held."""
    path = tmp_path / "run.jsonl"
    engine = tiny(trace_path=str(path), speculative=True, launch_ahead=True)
    launch_next, ahead, seen, hit = engine._launch_next, engine.ahead, [], []

    def launching(verify):  # the decode pass launched at a commit: fail it, or drop it
        seen.append(True)
        launched = ahead.launched
        launch_next(verify)
        prepared = ahead.prepared
        if outcome == "is dropped" and not launched and ahead.launched:
            assert prepared is not None
            if prepared.batch.trees is None:
                hit.append(True)
                ahead.drop()

    forward = engine.passes.forward

    def failing(batch, *args, **kwargs):
        if outcome == "fails" and seen and batch.trees is None:
            seen.clear()
            hit.append(True)
            raise RuntimeError("injected at a commit's launch")
        return forward(batch, *args, **kwargs)

    engine._launch_next, engine.passes.forward = launching, failing
    prompts = [family(20 + i, 6) * 4 for i in range(3)]  # repeats: drafts, verify steps
    for prompt in prompts:
        engine.submit(prompt, dict(max_tokens=30, ignore_eos=True))
    while engine.has_work:
        engine.step()
        engine.check()
        seen.clear()
    engine.close()
    assert hit, f"no decode pass launched at a commit {outcome}"
    ops = [r["op"] for r in records(path)]
    assert replay_file(str(path)).steps == len(ops)


def test_prompts_sent_again_decode_their_first_token_and_replay_clean(tmp_path):
    """Prompts cached but for their last token join the decode pass (no extend pass for
    them): the trace's decode records carry requests that have not sampled yet."""
    path = tmp_path / "run.jsonl"
    engine = tiny(trace_path=str(path), speculative=False, max_running_requests=6)
    prompts = [family(20 + i, 12) for i in range(4)]
    params = dict(max_tokens=6, ignore_eos=True)
    engine.generate(prompts, params)
    extends = [r["op"] for r in records(path)].count("extend")
    assert extends > 0
    engine.generate(prompts, params)
    engine.close()
    ops = [r["op"] for r in records(path)]
    assert ops.count("extend") == extends  # the second round added none
    assert replay_file(str(path)).steps == len(ops)


def edited_at(path: Path, tmp_path: Path, op: str, edit) -> tuple[int, Path]:
    """The trace with the first `op` record that `edit` changes (edit returns True) edited."""
    lines = path.read_text().splitlines(keepends=True)
    out = list(records(path))
    for record_ in out:
        if record_["op"] == op and edit(record_):
            target = tmp_path / "edited.jsonl"
            write(target, lines[0], out)
            return record_["step"], target
    raise AssertionError(f"no {op} record to edit")


def test_one_accepted_length_edited_fails_at_that_step(trace, tmp_path):
    def shorten(record_) -> bool:
        lens = record_["accepted_lens"]
        if not any(lens):
            return False
        i = next(i for i, n in enumerate(lens) if n)
        lens[i] -= 1  # one accepted draft fewer for request i (its node list cut to match)
        del record_["accepted_nodes"][sum(lens[: i + 1])]
        return True

    step, edited = edited_at(trace[0], tmp_path, "verify", shorten)
    with pytest.raises(Mismatch) as caught:
        replay_file(str(edited))
    assert caught.value.step == step and caught.value.op == "verify"
    assert f"step {step} (verify)" in str(caught.value)
    assert "recorded:" in str(caught.value) and "replayed:" in str(caught.value)


def test_an_inconsistent_accepted_length_fails_at_that_step(trace, tmp_path):
    def grow(record_) -> bool:
        record_["accepted_lens"][0] += 1  # more accepted than nodes given
        return True

    step, edited = edited_at(trace[0], tmp_path, "verify", grow)
    with pytest.raises(Mismatch, match=rf"step {step} \(verify\): the replayed transition raised"):
        replay_file(str(edited))


def test_one_slot_edited_fails_at_that_step(trace, tmp_path):
    def move(record_) -> bool:
        if "slots" not in record_ or not record_["slots"]:
            return False
        record_["slots"][-1] += 1000
        return True

    step, edited = edited_at(trace[0], tmp_path, "schedule_decode", move)
    with pytest.raises(Mismatch) as caught:
        replay_file(str(edited))
    assert (caught.value.step, caught.value.what) == (step, "slots handed out differ")


def test_one_effect_slot_edited_fails_at_that_step(trace, tmp_path):
    def move(record_) -> bool:
        slots = record_["out"]["effects"].get("table_slots")
        if not slots:
            return False
        slots[0] += 1
        return True

    step, edited = edited_at(trace[0], tmp_path, "decode", move)
    with pytest.raises(Mismatch) as caught:
        replay_file(str(edited))
    assert (caught.value.step, caught.value.what) == (step, "effects.table_slots differs")


def test_token_ids_are_pseudonyms_unless_asked(tmp_path):
    prompt = family(5, 12)
    for asked in (False, True):
        path = tmp_path / f"tokens-{asked}.jsonl"
        engine = tiny(trace_path=str(path), trace_tokens=asked)
        engine.generate([prompt], dict(max_tokens=4))
        admitted = next(r for r in records(path) if r["op"] == "admit")
        assert (admitted["tokens"][0] == prompt) is asked
        assert replay_file(str(path)).steps == len(records(path))


def test_engine_replay_prints_the_verdict(trace, tmp_path, capsys):
    path, _ = trace
    assert main(["replay", str(path)]) == 0
    assert f"replayed {len(records(path))} steps, all effects equal" in capsys.readouterr().out
    step, edited = edited_at(path, tmp_path, "decode", lambda r: r["sampled"].append(7) or True)
    assert main(["replay", str(edited)]) == 1
    assert capsys.readouterr().out.startswith(f"step {step} (decode): ")
    (tmp_path / "not.jsonl").write_text("{}\n")
    with pytest.raises(TraceError):
        replay_file(str(tmp_path / "not.jsonl"))
    assert main(["replay", str(tmp_path / "not.jsonl")]) == 2


def test_the_trace_flag_has_a_short_form():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    args = parser.parse_args(["--trace", "run.jsonl", "--trace-tokens"])
    assert EngineConfig.overrides_from(args) == dict(trace_path="run.jsonl", trace_tokens=True)


def test_effects_written_and_read_back_are_equal(trace):
    for record_ in records(trace[0]):
        effects = record_.get("out", {}).get("effects")
        if effects is not None:
            assert encode_effects(decode_effects(effects)) == effects
