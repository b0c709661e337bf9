"""Tests for transformer/training/optim.py: the noam schedule of Section 5.3, inverse_sqrt (linear
warm-up, then step^-0.5 decay, peaks where and as high as documented), linear (warm-up, then a
straight line to zero at the end of the budget), and the optimiser."""

from __future__ import annotations

import math

import pytest
import torch

from transformer.training.budget import Plan, decay_start
from transformer.config import ModelConfig, TrainConfig
from transformer.model import Transformer
from transformer.training.optim import build_optimizer, learning_rate, set_learning_rate


def schedule(name: str, warmup: int, **extra) -> TrainConfig:
    return TrainConfig(max_steps=1, schedule=name, warmup_steps=warmup, **extra)


@pytest.mark.parametrize("d_model, warmup, lr_factor", [(512, 4000, 1.0), (64, 20, 2.0), (256, 1, 0.5)])
def test_noam_peak_is_lr_factor_over_sqrt_d_model_and_warmup(d_model, warmup, lr_factor):
    train, model = schedule("noam", warmup, lr_factor=lr_factor), ModelConfig(d_model=d_model, n_heads=1)
    peak = lr_factor * d_model ** -0.5 * warmup ** -0.5
    assert learning_rate(warmup, train, model) == pytest.approx(peak, rel=1e-12)
    steps = range(1, 3 * warmup + 2)
    assert max(steps, key=lambda step: learning_rate(step, train, model)) == warmup


def test_noam_matches_the_paper_formula():
    """Section 5.3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), base model."""
    train, model = schedule("noam", 4000), ModelConfig()
    for step in (1, 10, 100, 3999, 4000, 4001, 10_000, 100_000):
        expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        assert learning_rate(step, train, model) == pytest.approx(expected, rel=1e-12)
    assert learning_rate(4000, train, model) == pytest.approx(6.988e-4, rel=1e-3)


@pytest.mark.parametrize("name", ["noam", "inverse_sqrt"])
def test_linear_warmup_then_inverse_square_root_decay(name):
    warmup = 50
    train, model = schedule(name, warmup, peak_lr=2e-3), ModelConfig(d_model=64, n_heads=4)
    peak = learning_rate(warmup, train, model)
    for step in range(1, warmup + 1):  # a straight line through zero
        assert learning_rate(step, train, model) == pytest.approx(peak * step / warmup, rel=1e-12)
    for step in (warmup + 1, 2 * warmup, 4 * warmup, 100 * warmup):
        assert learning_rate(step, train, model) == pytest.approx(peak * math.sqrt(warmup / step), rel=1e-12)
    rates = [learning_rate(step, train, model) for step in range(1, 10 * warmup)]
    assert all(a < b for a, b in zip(rates[: warmup - 1], rates[1:warmup]))  # strictly rising...
    assert all(a > b for a, b in zip(rates[warmup - 1:], rates[warmup:]))  # ...then strictly falling


@pytest.mark.parametrize("warmup", [1, 20, 4000])
def test_inverse_sqrt_peaks_at_exactly_peak_lr(warmup):
    train = schedule("inverse_sqrt", warmup, peak_lr=3e-3)
    for d_model in (64, 512):  # peak_lr does not depend on the model width
        model = ModelConfig(d_model=d_model, n_heads=4)
        assert learning_rate(warmup, train, model) == pytest.approx(3e-3, rel=1e-12)
        assert learning_rate(1, train, model) == pytest.approx(3e-3 / warmup, rel=1e-12)
        assert learning_rate(4 * warmup, train, model) == pytest.approx(1.5e-3, rel=1e-12)


def test_linear_warms_up_then_falls_to_zero_at_the_end_of_the_budget():
    warmup, end = 10, 100
    train, model = schedule("linear", warmup, peak_lr=2e-3), ModelConfig(d_model=64, n_heads=4)
    plan = Plan(end, 0, decay_start(0, warmup, end))
    assert plan.decay_start == warmup
    for step in range(1, warmup + 1):  # the warm-up line, up to the peak
        assert learning_rate(step, train, model, plan) == pytest.approx(2e-3 * step / warmup, rel=1e-12)
    for step in range(warmup, end + 1):  # then a straight line from the peak to (almost) zero
        assert learning_rate(step, train, model, plan) == pytest.approx(2e-3 * (end - step + 1) / (end - warmup + 1))
    assert 0 < learning_rate(end, train, model, plan) < 2e-3 / 50  # the last step still learns a little
    assert learning_rate(end + 1, train, model, plan) == 0.0
    # A budget shorter than the warm-up: the lines cross, and the rate never reaches the peak.
    short = Plan(6, 0, decay_start(0, warmup, 6))
    rates = [learning_rate(step, train, model, short) for step in range(1, 7)]
    assert max(rates) < 2e-3 and rates[-1] == pytest.approx(2e-3 / 7)
    # A segment started by a raised budget warms up again from its start.
    restart = Plan(200, 100, decay_start(100, warmup, 200))
    assert learning_rate(101, train, model, restart) == pytest.approx(2e-3 / warmup)
    assert learning_rate(110, train, model, restart) == pytest.approx(2e-3)
    # Before a time budget is measured the end is unknown (0): warm-up, then the peak.
    assert learning_rate(5, train, model, Plan(0, 0, 0)) == pytest.approx(1e-3)
    assert learning_rate(25, train, model, Plan(0, 0, 0)) == pytest.approx(2e-3)
    # noam and inverse_sqrt do not depend on the plan
    for name in ("noam", "inverse_sqrt"):
        other = schedule(name, warmup)
        assert learning_rate(30, other, model, plan) == learning_rate(30, other, model)


def test_step_zero_is_treated_as_step_one():
    """Step numbers are 1-based; a 0 must not give a zero (or infinite) rate."""
    train, model = schedule("noam", 10), ModelConfig(d_model=64, n_heads=4)
    assert learning_rate(0, train, model) == learning_rate(1, train, model) > 0


def small_model(share_embeddings: bool = True) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                         share_embeddings=share_embeddings, max_len=16)
    return Transformer(config, 20, 20)


def test_optimizer_is_adam_with_the_configured_betas_and_first_rate():
    model = small_model()
    train = schedule("noam", 10, adam_betas=(0.9, 0.98), adam_eps=1e-9)
    optimizer = build_optimizer(model, train)
    assert type(optimizer) is torch.optim.Adam
    (group,) = optimizer.param_groups
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["weight_decay"] == 0
    assert group["lr"] == learning_rate(1, train, model.config)
    # The shared embedding matrix is one parameter: Adam must not update it twice per step.
    assert len({id(p) for p in group["params"]}) == len(group["params"]) == len(list(model.parameters()))


def test_weight_decay_selects_adamw_and_set_learning_rate_reaches_every_group():
    model = small_model(share_embeddings=False)
    optimizer = build_optimizer(model, schedule("noam", 10, weight_decay=0.01))
    assert type(optimizer) is torch.optim.AdamW
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    set_learning_rate(optimizer, 0.123)
    assert [group["lr"] for group in optimizer.param_groups] == [0.123, 0.123]
