"""Eager passes padded to a multiple of the runner's token alignment (on CUDA with the Triton
backend: `runner.TOKEN_ALIGN`) give the logits of the same passes unpadded: padding tokens
belong to no request, write their K/V to the padding slot, and no row of the batch reads
them. On CPU the Triton backend runs in the interpreter with the alignment set by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_cases import DEVICE, tiny_engine

from engine.backends.base import host_metadata
from engine.shell.engine import Engine
from engine.shell.runner import TOKEN_ALIGN
from engine.state import PADDING_SLOT, Mode, SamplingParams


def _engine(align: int, speculative: bool) -> tuple[Engine, list, list]:
    engine = tiny_engine(  # no graphs: decode and verify passes run eagerly too
        chunk_size=24,  # a long prompt prefills in chunks, with decodes riding along
        speculative=speculative,
        draft_budget=4,
        launch_ahead=True,  # a decode's input ids come from the pass before, on the device
    )
    runner = engine.runner
    runner.token_align = align
    passes, device_ids = [], []
    launch = runner.launch

    def recorded(prepared, batch, input_ids=None, shift=None):
        logits = launch(prepared, batch, input_ids, shift)
        passes.append((batch.mode, batch.new_lens.total, runner.num_tokens(batch), logits.cpu()))
        device_ids.append(input_ids is not None)
        return logits

    runner.launch = recorded
    return engine, passes, device_ids


@pytest.mark.parametrize("speculative", [False, True])
def test_padded_passes_give_the_logits_of_unpadded_ones(speculative):
    prompts = [[(5 * i + j % (2 + i)) % 250 + 3 for j in range(7 + 11 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    plain, plain_passes, _ = _engine(1, speculative)
    padded, padded_passes, device_ids = _engine(TOKEN_ALIGN, speculative)
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in padded.generate(prompts, params)] == expected
    assert len(padded_passes) == len(plain_passes)
    modes = set()
    for (mode, count, num_tokens, logits), (_, _, plain_tokens, plain_logits) in zip(
        padded_passes, plain_passes, strict=True
    ):
        assert plain_tokens == count and num_tokens % TOKEN_ALIGN == 0
        assert count <= num_tokens < count + TOKEN_ALIGN
        if num_tokens > count:
            modes.add(mode)
        torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)
    wanted = {Mode.EXTEND, Mode.DECODE} | ({Mode.VERIFY} if speculative else set())
    assert wanted <= modes  # each kind of pass ran padded
    assert any(device_ids)  # and a decode launched ahead: its input ids padded on the device
    for engine in (plain, padded):  # both ran every request to its end
        assert not engine.has_work


def test_the_runner_pads_on_cuda_with_the_triton_backend_only():
    for device in {"cpu", DEVICE}:
        engine = Engine(random_weights="tiny", device=device, attention_backend="triton")
        assert engine.runner.token_align == (TOKEN_ALIGN if device == "cuda" else 1)
        torch_backend = Engine(random_weights="tiny", device=device, attention_backend="torch")
        assert torch_backend.runner.token_align == 1


def test_host_metadata_pads_the_slots_and_tree_bits():
    engine, _, _ = _engine(1, speculative=False)
    engine.submit([3, 4, 5, 6, 7], SamplingParams(max_tokens=1))
    captured = []
    plan = engine.runner.backend.plan
    engine.runner.backend.plan = lambda b, **kw: captured.append(b) or plan(b, **kw)
    engine.step()
    (batch,) = captured
    meta, _ = host_metadata(batch, "cpu", None, batch.new_lens.total + 3)
    slots = meta["out_slots"].numpy()
    assert list(slots[: batch.new_lens.total]) == list(batch.out_slots)
    assert list(slots[batch.new_lens.total :]) == [PADDING_SLOT] * 3
    with pytest.raises(ValueError, match="num_tokens=4: the batch has 5 new tokens"):
        host_metadata(batch, "cpu", None, 4)
    assert np.array_equal(meta["qo_indptr"].numpy(), batch.new_lens.indptr())
