"""Tensor parallelism on CPUs (gloo): the engine split over ranks gives exactly the tokens of
one rank (greedy, fp32), keeps every rank's request-table mirror and pool in step through
aborts and retractions, fails naming a rank that died or hangs, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_checks import settled

from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.loader import save_hf_checkpoint
from engine.model.tokenizer import load_tokenizer
from engine.shell.distributed import WorkerFailed
from engine.shell.engine import Engine

TIMEOUT_S = 10.0
GREEDY = {"max_tokens": 12, "temperature": 0}
# different lengths, chunked by a small chunk_size: prefill chunks share passes with decodes
MIXED_PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(50, 71)), [11, 12, 11, 12, 11, 12]]


def _tokens(engine: Engine, prompts: list, params: dict = GREEDY) -> list[tuple[int, ...]]:
    return [c.token_ids for c in engine.generate(prompts, params)]


def _alive(engine: Engine) -> list[int]:
    assert engine.workers is not None
    return [p.pid for p in engine.workers.processes if p.is_alive()]


# --- the default model (9 heads, 3 KV heads: it splits over 3 ranks, not 2) ---------------
def test_the_default_model_over_three_ranks_gives_the_tokens_of_one(make_engine):
    """Batch 1 and a mixed batch, with speculation (passes that drafted verify; the others
    decode), against one rank without it."""
    one = make_engine(max_context=512, kv_cache_slots=2048, chunk_size=16)
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6,"]
    three = Engine(
        device="cpu",
        dtype="float32",
        max_context=512,
        kv_cache_slots=2048,
        chunk_size=16,
        speculative=True,
        draft_cost=0.1,
        tensor_parallel_size=3,
        tensor_parallel_timeout=60.0,
    )
    try:
        assert _tokens(three, prompts[:1]) == _tokens(one, prompts[:1])  # batch 1
        assert _tokens(three, prompts + MIXED_PROMPTS) == _tokens(one, prompts + MIXED_PROMPTS)
        modes = {mode for mode, _ in three.step_times}
        assert {"extend", "decode", "verify"} <= modes
        settled(three)
    finally:
        three.close()
    assert not _alive(three)


def test_a_model_that_does_not_split_is_refused_naming_the_option():
    with pytest.raises(
        ValueError, match="num_attention_heads=9 does not split over tensor_parallel_size=2"
    ):
        Engine(device="cpu", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="device='cuda:1' with tensor_parallel_size=2"):
        Engine(device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        Engine(device="cpu", tensor_parallel_size=0)


# --- tiny random checkpoints ----------------------------------------------------------------
CHECKPOINTS = {
    # heads and KV heads split evenly; a vocabulary that does not (the last rank's part padded)
    "even": dict(num_heads=4, num_kv_heads=2, vocab_size=251, tie_word_embeddings=True),
    # one KV head for two ranks: replicated, each rank keeps it; Qwen2's q/k/v biases
    # (and the tokenizer's whole vocabulary: text prompts for the torchrun test)
    "kv-replicated": dict(
        num_heads=4, num_kv_heads=1, architecture="qwen2", qkv_bias=True, vocab_size=49152
    ),
    # Qwen3's per-head q/k norms
    "qk-norms": dict(num_heads=4, num_kv_heads=2, architecture="qwen3", qk_norm=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tokenizer = load_tokenizer(None).hf  # ids below the tiny vocabularies decode to something
    made = {}
    for name, shape in CHECKPOINTS.items():
        config = ModelConfig.tiny(**shape)
        model = LlamaModel(config).init_random(seed=3, std=0.2)  # peaked enough to not tie
        directory = tmp_path_factory.mktemp(name)
        save_hf_checkpoint(model, directory)
        tokenizer.save_pretrained(str(directory))
        made[name] = directory
    return made


def _tiny(path: Path, **overrides) -> Engine:
    settings = dict(
        device="cpu",
        dtype="float32",
        max_context=128,
        kv_cache_slots=512,
        max_running_requests=8,
        chunk_size=16,
        draft_cost=0.1,
        tensor_parallel_timeout=TIMEOUT_S,
    )
    return Engine(str(path), **(settings | overrides))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tiny_checkpoints_over_two_ranks_give_the_tokens_of_one(checkpoints, name):
    one = _tiny(checkpoints[name])
    want = [_tokens(one, MIXED_PROMPTS[:1]), _tokens(one, MIXED_PROMPTS)]
    scored = GREEDY | {"max_tokens": 2, "prompt_logprobs": 2}  # rows past the sampled ones
    want_scores = [c.prompt_logprobs for c in one.generate(MIXED_PROMPTS, scored)]
    two = _tiny(checkpoints[name], tensor_parallel_size=2)
    try:
        assert two.runner.backend.pool.k_cache[0].shape[1] == 1  # this rank's KV heads
        assert [_tokens(two, MIXED_PROMPTS[:1]), _tokens(two, MIXED_PROMPTS)] == want
        scores = [c.prompt_logprobs for c in two.generate(MIXED_PROMPTS, scored)]
        for got, expected in zip(scores, want_scores, strict=True):
            assert [e and e.token_id for e in got] == [e and e.token_id for e in expected]
            assert [e and [t for t, _ in e.top] for e in got] == [
                e and [t for t, _ in e.top] for e in expected
            ]
            pairs = zip(got[1:], expected[1:], strict=True)
            assert max(abs(a.logprob - b.logprob) for a, b in pairs) < 1e-4
        settled(two)
    finally:
        two.close()
    assert not _alive(two)


def test_aborts_and_retractions_leave_every_rank_consistent(checkpoints):
    """A pool too small for the batch (retractions), the prefix cache, speculation, and a
    request aborted halfway: every rank's mirror and pool are checked after every step."""
    settings = dict(kv_cache_slots=96, max_running_requests=4, speculative=True)
    system = [5, 6, 7, 8, 5, 6, 7, 8] * 3  # a shared prefix: the prefix cache is used
    prompts = [system + [i, i + 1, i, i + 1] for i in range(20, 26)]
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}  # 4 x 52 > 96 slots
    one = _tiny(checkpoints["even"], **settings)
    want = _tokens(one, prompts[1:], params)
    two = _tiny(checkpoints["even"], tensor_parallel_size=2, **settings)
    try:
        aborted = two.submit(prompts[0], params)
        requests = [two._submit(p, params, None, None) for p in prompts[1:]]
        for step in range(10_000):
            if not two.has_work:
                break
            two.step()
            two.check()  # rank 0's book, and each worker's mirror and pool against it
            if step == 3:
                two.abort(aborted)
        assert two.stats["retractions"] > 0
        assert all(r.done for r in requests)
        # the requests that ran to the end got the tokens of one rank (retracted and resumed)
        assert [tuple(r.output_ids) for r in requests] == want
        settled(two)
        two.book.table.host[0, 0] = 7  # behind the journal's back: the mirrors now differ
        with pytest.raises(AssertionError, match="rank 1's request-table mirror"):
            two.check()
        two.book.table.host[0, 0] = 0
        two.check()
    finally:
        two.close()
    assert not _alive(two)


# --- faults ------------------------------------------------------------------------------------
def test_a_killed_worker_fails_the_engine_naming_it(checkpoints):
    engine = _tiny(checkpoints["even"], tensor_parallel_size=2)
    try:
        _tokens(engine, MIXED_PROMPTS[:1])
        os.kill(engine.workers.processes[0].pid, signal.SIGKILL)  # rank 1
        engine.workers.processes[0].join(TIMEOUT_S)
        with pytest.raises(WorkerFailed, match="rank 1 failed: its process exited"):
            _tokens(engine, MIXED_PROMPTS[:2])
        with pytest.raises(WorkerFailed, match="rank 1"):  # and every later pass
            _tokens(engine, MIXED_PROMPTS[:1])
    finally:
        engine.close()
    assert not _alive(engine)


def test_a_worker_that_hangs_fails_the_engine_within_the_timeout(checkpoints):
    engine = _tiny(checkpoints["even"], tensor_parallel_size=2, tensor_parallel_timeout=3.0)
    try:
        _tokens(engine, MIXED_PROMPTS[:1])
        os.kill(engine.workers.processes[0].pid, signal.SIGSTOP)  # alive, answering nothing
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match="rank 1 failed: it did not answer"):
            _tokens(engine, MIXED_PROMPTS[:1])
        assert time.monotonic() - started < 60  # bounded by the timeout, not a hang
    finally:
        engine.close()
    assert not _alive(engine)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_serve_with_two_ranks_leaves_no_process_after_ctrl_c():
    pytest.importorskip("uvicorn")
    command = [sys.executable, "-m", "engine", "serve", "--random-weights", "tiny"]
    command += ["--device", "cpu", "--tensor-parallel-size", "2", "--port", "0"]
    server = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        assert server.poll() is None, "".join(lines)
        children = _children(server.pid)
        assert children  # the worker (and multiprocessing's helper processes)
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{c}").exists() for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [c for c in children if Path(f"/proc/{c}").exists()]
    assert not left, f"processes left after Ctrl-C: {left}"


def test_torchrun_starts_every_rank_and_rank_0_runs_the_command(checkpoints):
    """Several machines are reached through a launcher: torchrun starts the same command on
    every rank (here two on this machine); rank 0 runs it, the others serve its passes."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    command = ["-m", "engine", "generate", "a b c d", "--raw", "--max-tokens", "10"]
    command += ["--model", str(checkpoints["kv-replicated"]), "--device", "cpu"]
    command += ["--dtype", "float32", "--max-context", "128", "--kv-cache-slots", "256"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    one = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=300, env=env
    )
    assert one.returncode == 0, one.stderr
    launcher = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run(
        [*launcher, *command, "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.strip() and two.stdout == one.stdout  # rank 0's text only, the same


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_one_rank_shard_with_its_collectives_gives_the_tokens_of_the_whole_model(device):
    """The sharded forward (its all-reduces and all-gather, in a group of one rank) on the
    engine's runner: on CUDA over NCCL, with the decode and verify graphs captured, as each
    rank captures its own."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.model.loader import shard_of
    from engine.shell.distributed import GroupConfig, Workers

    settings = dict(random_weights="tiny", device=device, dtype="float32", max_context=128)
    settings |= dict(kv_cache_slots=512, speculative=True, draft_cost=0.1, cuda_graph_max_batch=4)
    whole = Engine(**settings)
    want = _tokens(whole, MIXED_PROMPTS)
    engine = Engine(**settings)
    group = Workers(GroupConfig.local(1, device), setup=None)
    group.start()  # this process alone: rank 0 of 1
    try:
        engine.runtime.model = shard_of(engine.runtime.model, 0, 1)
        engine.runner = engine.runtime.make_runner(engine.book.table)  # captures on CUDA
        engine.ahead.runner = engine.runner
        assert engine.runner.model.shard is not None
        assert bool(engine.runner.graphs) == (device == "cuda")
        assert _tokens(engine, MIXED_PROMPTS) == want
        settled(engine)
    finally:
        group.stop()


def test_launch_ahead_with_several_ranks_is_refused_naming_both_options():
    """A pass launched ahead takes its input ids from rank 0's device; the other ranks would
    run it on ids they do not have."""
    from engine.shell.config import EngineConfig

    with pytest.raises(ValueError, match="launch_ahead=True with tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, launch_ahead=True)
    assert EngineConfig(tensor_parallel_size=1, launch_ahead=True).launch_ahead


def test_rank_0s_runner_refuses_a_pass_launched_ahead_before_sending_it():
    """Input ids or a shift on rank 0's device (a pass launched ahead, or moved on by a walk
    on the device) are refused before the pass reaches the workers."""
    from types import SimpleNamespace

    from engine.shell.sharded import ParallelRunner

    sent = []
    inner = SimpleNamespace(model=None, backend=None, graphs=[])
    runner = ParallelRunner(inner, SimpleNamespace(send=sent.append), None)
    for launched_ahead in (dict(input_ids=torch.zeros(1)), dict(shift=torch.zeros(1))):
        with pytest.raises(ValueError, match="cannot run on several ranks"):
            runner.launch(None, None, **launched_ahead)
    assert sent == []
