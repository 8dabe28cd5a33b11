"""The one-launch draw (`engine.ops.draw`) against the unfused draw of `engine.model.sampling`
(in the interpreter on CPU; on the GPU where there is one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.sampling import _filtered_logits, draw_unfused
from engine.ops import draw as draw_module
from engine.ops.draw import draw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Rows of several blocks on CPU: the interpreter costs a loop step per block."""
    if DEVICE == "cpu":
        monkeypatch.setattr(draw_module, "DRAW_BLOCK", 64)


def unfused(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor):
    """The unfused draw's tokens for unfiltered rows, and each row's float64 CDF."""
    scaled = _filtered_logits(logits, temperature, None, None, filtered=False)
    cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
    return draw_unfused(logits, temperature, uniform), cdf


def test_draw_is_the_unfused_draw_but_at_rounding_boundaries():
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 24, 300  # 300: a last block partly past the row
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(DEVICE)
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0] * 6, device=DEVICE)
    uniform = torch.rand(rows, generator=generator, dtype=torch.float64).to(DEVICE)
    got = draw(logits, temperature, uniform)
    want, cdf = unfused(logits, temperature, uniform)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    for row in np.flatnonzero((got != want).cpu().numpy()):
        # a different token only where the target sits within rounding of the boundary
        boundary = cdf[row, min(int(got[row]), int(want[row]))]
        target = uniform[row] * cdf[row, -1]
        assert abs(float(boundary - target)) < 1e-6, (row, got[row], want[row])
    assert torch.equal(got[temperature == 0], logits[temperature == 0].argmax(dim=-1))


def test_evenly_spread_uniforms_draw_each_token_in_proportion_to_its_probability():
    """Inverse CDF at uniforms (i + 1/2) / n: token k is drawn n * p_k times, within one."""
    logits = torch.tensor([[2.0, -1.0, 0.5, float("-inf"), 1.0, 0.0, -3.0]], device=DEVICE)
    n = 400
    for temperature in (0.7, 1.0, 1.6):
        rows = logits.expand(n, -1).contiguous()
        uniform = (torch.arange(n, dtype=torch.float64, device=DEVICE) + 0.5) / n
        got = draw(rows, torch.full((n,), temperature, device=DEVICE), uniform)
        counts = torch.bincount(got, minlength=logits.shape[1]).cpu()
        p = torch.softmax(logits[0].double().cpu() / temperature, dim=-1)
        assert counts[3] == 0  # a token of zero probability is never drawn
        assert (counts - n * p).abs().max() <= 1.0 + 1e-9, (counts, n * p)


def test_greedy_rows_take_the_first_of_tied_maxima_and_half_precision_rows_draw():
    logits = torch.zeros(3, 130, device=DEVICE)
    logits[:, 70] = logits[:, 129] = logits[:, 5] = 4.0  # ties across blocks and lanes
    got = draw(logits, torch.zeros(3, device=DEVICE), torch.full((3,), 0.5, device=DEVICE))
    assert got.tolist() == [5, 5, 5]
    half = logits.half()
    got = draw(half, torch.ones(3, device=DEVICE), torch.tensor([0.01, 0.5, 0.99], device=DEVICE))
    want, _ = unfused(half.float(), torch.ones(3, device=DEVICE), torch.tensor([0.01, 0.5, 0.99]))
    assert got.tolist() == want.cpu().tolist()


def test_draw_refuses_shapes_it_cannot_take():
    logits = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match=r"temperature \(3,\) and uniform \(2,\)"):
        draw(logits, torch.ones(3, device=DEVICE), torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        draw(logits.t(), torch.ones(10, device=DEVICE), torch.ones(10, device=DEVICE))
    assert draw(logits[:0], logits[:0, 0], logits[:0, 0]).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sample_on_a_gpu_draws_unfiltered_batches_in_one_launch_without_waiting():
    from engine.model.sampling import SamplingTensors, sample
    from engine.state import SamplingParams

    params = [SamplingParams(temperature=t, seed=s) for t, s in [(0.0, 1), (0.8, 2), (1.3, 3)]]
    logits = torch.randn(3, 5000, device="cuda")
    sampling = SamplingTensors.build(params, [4, 0, 9], 5000, "cuda")
    assert not sampling.filtered
    fused = draw(logits, sampling.temperature, sampling.uniform)  # compiled before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sample(logits, sampling)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, fused)
    want, _ = unfused(logits, sampling.temperature, sampling.uniform)
    assert got.tolist() == want.tolist()  # well away from any boundary at these uniforms
