"""rvqstore.bit_allocation for uniform grids: the levels a step needs, and steps per slot from the
sensitivity profile (step = scale / sqrt(sens / mean sens), on a ladder, capped)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import CodecConfigError, RVQCodec
from rvqstore.bit_allocation import GRID_REACH, STEP_MAX, allocate_steps, grid_bits, ladder_step


@pytest.mark.parametrize("step", [0.03, 0.0456, 0.1, 0.2441, 0.5, 0.99, 1.5, 2.0])
def test_grid_bits_span_the_reach_with_the_fewest_levels(step):
    b1, b2 = grid_bits(step)
    levels = 1 << (b1 + b2)
    assert 1 <= b1 <= 4 and 0 <= b2 <= 4 and (b2 == 0 or b1 == 4)  # stage 1 filled first
    if levels < 256:
        assert levels * step >= 2 * GRID_REACH - 1e-9  # spans +-reach
    if levels > 4:
        assert (levels // 2) * step < 2 * GRID_REACH  # one bit fewer would not
    # the codec takes it and codes N(0, 1) at about step^2/12 (on real keys/values +-3.5 leaves it within
    # 0.5%, tools/results/quality-ecsq-study.md; a Gaussian's tails beyond +-3.8 add 20% at step 0.03)
    y = mx.array(np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32))
    codec = RVQCodec(64, (b1, b2), step=step)
    err = float(mx.mean(mx.square(y - codec.dequantize(*codec.quantize(y)))).item())
    assert codec.bits == (b1, b2)
    assert err == pytest.approx(step * step / 12, rel=0.2 if levels * step < 8 else 0.03 if step < 1.2 else 0.1)


def test_grid_bits_cap_at_4_4_and_refuse_bad_steps():
    assert grid_bits(0.001) == (4, 4)
    for bad in (0.0, -0.1, float("nan"), float("inf"), "0.1", None):
        with pytest.raises(CodecConfigError):
            grid_bits(bad)


def test_steps_follow_inverse_square_root_of_sensitivity_on_the_ladder():
    sens = {(0, "k"): 4.0, (0, "v"): 1.0, (1, "k"): 0.25, (1, "v"): 0.0}
    steps = allocate_steps(sens, 0.2)
    mean = sum(sens.values()) / 4
    for slot, s in sens.items():
        want = STEP_MAX if s == 0 else min(STEP_MAX, 0.2 / math.sqrt(s / mean))
        assert steps[slot] == ladder_step(want) or steps[slot] == STEP_MAX
        assert abs(math.log2(steps[slot] / want)) <= 1 / 8 + 1e-3  # within half a rung
        rung = math.log2(steps[slot]) * 4  # a quarter octave, to the 4 significant digits kept
        assert abs(rung - round(rung)) < 0.01 or steps[slot] == STEP_MAX
    assert steps[(0, "k")] < steps[(0, "v")] < steps[(1, "k")] <= steps[(1, "v")] == STEP_MAX
    assert steps[(0, "v")] / steps[(0, "k")] == pytest.approx(2.0, rel=0.01)  # 4x the sensitivity: half the step
    # a larger scale: coarser everywhere (fewer bits on disk)
    assert all(allocate_steps(sens, 0.4)[k] >= steps[k] for k in sens)


def test_allocate_steps_refuses_bad_input():
    for bad in ({}, {(0, "k"): 0.0}):
        with pytest.raises(CodecConfigError):
            allocate_steps(bad, 0.2)
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(CodecConfigError):
            allocate_steps({(0, "k"): 1.0}, scale)
