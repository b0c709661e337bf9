"""Training budgets as steps. Every budget (train.max_steps, max_epochs, max_minutes) becomes one
end step, recorded in the training state; from then on the stop, the `linear` schedule and a resume
are functions of the step alone, so a run killed and resumed takes exactly the steps of one that
ran through.

A time budget becomes steps once: the first steps of a run are timed (training steps only, not
validation or saving), and `max_minutes` is divided by the measured seconds per step. An epoch
budget is counted in steps from the batches each epoch has. Raising a budget after a `linear`
run finished starts a new schedule segment with its own warm-up; changing one in the middle of a
linear schedule is refused, since it would bend the rate of steps already planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .config import TrainConfig
from .errors import ConfigError

# A time budget is measured over the steps of the first session up to MEASURE_UNTIL_STEP, without
# its first UNTIMED_STEPS (thread pools and the allocator warm up there), and at least
# MIN_TIMED_STEPS of them.
MEASURE_UNTIL_STEP = 30
UNTIMED_STEPS = 2
MIN_TIMED_STEPS = 10

BUDGET_KEYS = ("max_steps", "max_epochs", "max_minutes")


def budget_values(train: TrainConfig) -> dict[str, float]:
    """The budget settings an end step was computed from, to notice when a resume changes them."""
    return {key: getattr(train, key) for key in BUDGET_KEYS}


@dataclass
class Plan:
    """The end step and, for `linear`, the current schedule segment. Lives in TrainState."""

    end_step: int  # the last step; 0 while a time budget is still being measured
    segment_start: int  # linear: the step before the segment's first (0, or where a raised budget restarted)
    decay_start: int  # linear: the rate falls in a straight line from here to zero after end_step


def linear_rate(step: int, peak: float, warmup: int, plan: Plan) -> float:
    """Warm up from the segment's start to `peak` over `warmup` steps, then fall in a straight line
    to zero at the end of the budget (Li, Yumer & Ramanan, "Budgeted Training", ICLR 2020). The last
    step still gets a small non-zero rate. While the end is unknown, the rate stays at its warm-up
    value or at the peak."""
    rate = min((step - plan.segment_start) / warmup, 1.0)
    if plan.end_step:
        rate = min(rate, (plan.end_step - step + 1) / (plan.end_step - plan.decay_start + 1))
    return peak * max(rate, 0.0)


def decay_start(segment_start: int, warmup: int, end_step: int, measured_at: int = 0) -> int:
    """Where the decay begins: after the warm-up (or, for a budget shorter than its warm-up, at the
    segment's start, so that the two lines cross), and never before a time budget was measured,
    because the steps before that were taken without knowing the end."""
    start = segment_start + warmup if end_step > segment_start + warmup else segment_start
    return max(start, measured_at)


def steps_for_epochs(max_epochs: int, epoch: int, batch_in_epoch: int, step: int,
                     batches_in_epoch: Callable[[int], int], accumulate: int) -> int:
    """The step at which epoch `max_epochs` ends, counted from the current position: each step takes
    `accumulate` batches of the epoch (the epoch's last step takes what is left)."""
    for current in range(epoch, max_epochs):
        step += math.ceil((batches_in_epoch(current) - batch_in_epoch) / accumulate)
        batch_in_epoch = 0
    return step


def steps_for_minutes(max_minutes: float, measured_at: int, measured_seconds: float,
                      seconds_per_step: float) -> int:
    """The step at which `max_minutes` of training time run out, from the measurement taken at step
    `measured_at` (training seconds spent up to then, and seconds per step since)."""
    left = max_minutes * 60 - measured_seconds
    return measured_at + max(0, math.floor(left / seconds_per_step))


def reconcile(train: TrainConfig, step: int, plan: Plan, new_end: int, budget_changed: str) -> Plan | None:
    """The plan a resumed run follows when its budget settings changed (described in `budget_changed`),
    given the end step they now give (0: a time budget this session measures). None: the run is
    finished and stays so."""
    finished = bool(plan.end_step) and step >= plan.end_step
    if new_end == plan.end_step:
        return plan
    if finished and new_end and new_end <= step:
        return None
    if train.schedule != "linear":  # the rate does not depend on the end: only the stop moves
        return Plan(new_end, plan.segment_start, plan.decay_start)
    if finished:  # a warm restart: the rate had reached zero, so it climbs again over a new warm-up
        return Plan(new_end, step, decay_start(step, train.warmup_steps, new_end, measured_at=step))
    raise ConfigError(
        f"{budget_changed}: the budget changed in the middle of this run's linear schedule, which ends at step "
        f"{plan.end_step} (now at step {step}); a new end would change the learning rate of the steps left. "
        "Restore the old value to continue; once the run has finished, raising the budget starts a new "
        "schedule segment with its own warm-up")


__all__ = ["MEASURE_UNTIL_STEP", "UNTIMED_STEPS", "MIN_TIMED_STEPS", "BUDGET_KEYS", "budget_values", "Plan",
           "linear_rate", "decay_start", "steps_for_epochs", "steps_for_minutes", "reconcile"]
