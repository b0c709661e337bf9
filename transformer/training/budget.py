"""Training budgets as steps. Every budget (train.max_steps, max_epochs, max_minutes) becomes one
end step, recorded in the training state; from then on the stop, the `linear` schedule and a resume
are functions of the step alone, so a run killed and resumed takes exactly the steps of one that
ran through.

A time budget becomes steps in two measurements, both recorded: the first steps of a run are
timed (training steps only, not validation or saving), and `max_minutes` is divided by the seconds
per step they give. Batches differ in size and shape, so that first measurement is taken per token
and scaled to the average tokens of a step over a whole epoch: the first few dozen steps are too
few to average out their mix. Steps later in a run are not as fast as those (the allocator's and
the kernels' caches still change), so once, at a step fixed by the first plan (REESTIMATE_AT of
the way to its end), the seconds per step since the first measurement re-plan the end: only the
last part of the run is then extrapolated. A resume re-plans nothing that was decided: the
plan, the step of the re-estimate and both measurements travel with the training state. An epoch
budget is counted in steps from the batches each epoch has. Raising a budget after a `linear`
run finished starts a new schedule segment with its own warm-up; changing one in the middle of a
linear schedule is refused, since it would bend the rate of steps already planned.

`wsd` (warm-up, stable, decay) needs no end until its cooldown, the last `train.cooldown_fraction`
of the budget: its rate is the peak until then, whatever the end. A time budget's cooldown begins
when that share of the training time is left (a fact of the clock, not a forecast), and only then
is the end planned, from the median pace of the latest windows of WINDOW_STEPS steps, so that a
busy minute (another program, an editor indexing) is outvoted rather than extrapolated. The end is
planned again, from the same median, halfway through what is left of the cooldown, and again
halfway through what is left after that; each re-plan bends the line from the rate it has reached.
The windows travel with the training state, so a resumed run plans as the run that went through.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from dataclasses import dataclass, field

from transformer.config import TrainConfig
from transformer.errors import ConfigError

log = logging.getLogger(__name__)

# A time budget is measured over the steps of the first session up to MEASURE_UNTIL_STEP, without
# its first UNTIMED_STEPS (thread pools and the allocator warm up over them), and at least
# MIN_TIMED_STEPS of them. The linear schedule keeps its peak until the measurement: a warm-up at
# least this long leaves the rates of all steps as they would be with the same budget in steps.
MEASURE_UNTIL_STEP = 100
UNTIMED_STEPS = 20
MIN_TIMED_STEPS = 10
# The second measurement: at this fraction of the steps between the first one and the end it
# planned, if at least MIN_TIMED_STEPS lie between them.
REESTIMATE_AT = 0.8
# wsd's pace: seconds per token of each window of this many steps (aligned on step numbers, so a
# resumed run cuts the same windows), the median of the latest RECENT_WINDOWS of them; the cooldown
# is planned again while at least MIN_REPLAN_STEPS lie between a re-plan and the end.
WINDOW_STEPS = 25
RECENT_WINDOWS = 40
MIN_REPLAN_STEPS = 50

BUDGET_KEYS = ("max_steps", "max_epochs", "max_minutes")


def budget_values(train: TrainConfig) -> dict[str, float]:
    """The budget settings an end step was computed from, to notice when a resume changes them."""
    return {key: getattr(train, key) for key in BUDGET_KEYS}


@dataclass
class Plan:
    """The end step and, for `linear`, the current schedule segment."""

    end_step: int  # the last step; 0 while a time budget is still being measured
    segment_start: int  # linear: the step before the segment's first (0, or where a raised budget restarted)
    decay_start: int  # linear: the rate falls in a straight line from here to zero after end_step
    # linear: the fraction of the peak the line starts from at decay_start (below 1 where a re-estimated
    # end bent the line at the step of the re-estimate, so that the rate goes on from where it was)
    decay_from: float = 1.0


def linear_rate(step: int, peak: float, warmup: int, plan: Plan) -> float:
    """Warm up from the segment's start to `peak` over `warmup` steps, then fall in a straight line
    to zero at the end of the budget (Li, Yumer & Ramanan, "Budgeted Training", ICLR 2020). The last
    step still gets a small non-zero rate. While the end is unknown, the rate stays at its warm-up
    value or at the peak."""
    rate = min((step - plan.segment_start) / warmup, 1.0)
    if plan.end_step:
        rate = min(rate, plan.decay_from * (plan.end_step - step + 1) / (plan.end_step - plan.decay_start + 1))
    return peak * max(rate, 0.0)


def decay_start(segment_start: int, warmup: int, end_step: int, measured_at: int = 0) -> int:
    """Where the decay begins: after the warm-up (or, for a budget shorter than its warm-up, at the
    segment's start, so that the two lines cross), and never before a time budget was measured,
    because the steps before that were taken without knowing the end."""
    start = segment_start + warmup if end_step > segment_start + warmup else segment_start
    return max(start, measured_at)


def wsd_decay_start(segment_start: int, warmup: int, end_step: int, cooldown_fraction: float) -> int:
    """Where a `wsd` schedule whose end is known in steps begins its cooldown: the last
    `cooldown_fraction` of the segment's steps, never inside the warm-up (a fraction of 1 is then
    the `linear` schedule). For a budget shorter than its warm-up, at the segment's start, so that
    the two lines cross, as `linear`'s do."""
    if end_step <= segment_start + warmup:
        return segment_start
    return max(segment_start + warmup, end_step - math.ceil(cooldown_fraction * (end_step - segment_start)))


def steps_for_epochs(max_epochs: int, epoch: int, batch_in_epoch: int, step: int, batches_per_epoch: int,
                     accumulate: int) -> int:
    """The step at which epoch `max_epochs` ends, counted from the current position: each step takes
    `accumulate` batches of the epoch (the epoch's last step takes what is left). Every epoch has
    the same number of batches (`token_batches` forms them from the lengths alone), so no epoch
    but the one at hand needs planning, however many there are."""
    if epoch >= max_epochs:
        return step
    return (step + math.ceil((batches_per_epoch - batch_in_epoch) / accumulate)
            + (max_epochs - epoch - 1) * math.ceil(batches_per_epoch / accumulate))


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
        return dataclasses.replace(plan, end_step=new_end)
    if finished:  # a warm restart: the rate had reached zero, so it climbs again over a new warm-up
        return Plan(new_end, step, decay_start(step, train.warmup_steps, new_end, measured_at=step))
    raise ConfigError(
        f"{budget_changed}: the budget changed in the middle of this run's linear schedule, which ends at step "
        f"{plan.end_step} (now at step {step}); a new end would change the learning rate of the steps left. "
        "Restore the old value to continue; once the run has finished, raising the budget starts a new "
        "schedule segment with its own warm-up")


@dataclass
class BudgetState:
    """Everything a run's budget knows, as one value of the training state (saved in checkpoints):
    the plan, the budget settings it was computed from, and the time budget's one measurement."""

    plan: Plan = field(default_factory=lambda: Plan(0, 0, 0))
    settings: dict = field(default_factory=dict)  # budget_values() the plan was computed from
    seconds_per_step: float = 0.0  # 0 while a time budget is still being measured
    measured_at_step: int = 0  # the latest measurement: its step and the training seconds up to it
    measured_train_seconds: float = 0.0
    reestimate_at_step: int = 0  # the step of the next measurement (linear) or re-plan (wsd); 0 when none is to come
    # wsd: seconds per source + target token of the latest whole windows of WINDOW_STEPS steps (oldest
    # first), the window under way as [seconds, tokens], and the training seconds when the schedule's
    # segment began (a raised budget starts a new one)
    windows: list[float] = field(default_factory=list)
    window: list[float] = field(default_factory=lambda: [0.0, 0.0])
    segment_seconds: float = 0.0

    @classmethod
    def from_dict(cls, data: dict) -> "BudgetState":
        return cls(**dict(data, plan=Plan(**data["plan"])))


@dataclass
class Position:
    """Where training is, as the budget needs it."""

    step: int
    epoch: int
    batch_in_epoch: int
    train_seconds: float


class Budget:
    """A run's budget as steps: plans the end step at the start of a session (or reconciles a changed
    budget with the recorded plan), measures a time budget once in the first steps, and says when
    training is finished. Everything it decides is in `self.state`, which travels with checkpoints."""

    def __init__(self, train: TrainConfig, state: BudgetState, position: Position, batches_per_epoch: int,
                 tokens_per_step: float) -> None:
        """`batches_per_epoch`: the global batches of every epoch (a property of the data);
        `tokens_per_step`: the source + target tokens of an average step over an epoch (what a
        step's time scales with)."""
        self.train, self.state = train, state
        self.batches_per_epoch, self.tokens_per_step = batches_per_epoch, tokens_per_step
        self._timed: list[tuple[float, int]] = []  # this session's (step seconds, step tokens)
        # While a time budget is unmeasured, a step or epoch budget may still end training first.
        self._end_before_measuring = self._end_without_time(position) \
            if train.max_minutes and not state.seconds_per_step else 0
        self._steps_end = self._end_without_time(position)  # wsd: the step and epoch budgets' end (0: none)
        self._projected_end = 0  # wsd: the end a time budget's pace so far points to, before it is planned
        if train.schedule == "wsd":
            self._plan_wsd(position)
        else:
            self._plan(position)

    @property
    def end_step(self) -> int:
        return self.state.plan.end_step

    @property
    def expected_end(self) -> int:
        """The planned end step or, while a `wsd` time budget has not planned it yet, where its pace
        so far points (for a progress bar: nothing is decided by it)."""
        return self.state.plan.end_step or self._projected_end

    def finished(self, step: int) -> bool:
        return bool(self.end_step) and step >= self.end_step

    def _end_without_time(self, position: Position) -> int:
        """The end step of the step and epoch budgets, from `position` (0 = neither is set)."""
        train = self.train
        ends = [train.max_steps] if train.max_steps else []
        if train.max_epochs:
            ends.append(steps_for_epochs(train.max_epochs, position.epoch, position.batch_in_epoch, position.step,
                                         self.batches_per_epoch, train.accumulate_batches))
        return min(ends, default=0)

    def _plan(self, position: Position) -> None:
        """Turn the budget settings into the end step: at a run's start, or when a resume changed them."""
        train, state = self.train, self.state
        values = budget_values(train)
        if state.settings == values:
            return
        end = self._end_without_time(position)
        if train.max_minutes and state.seconds_per_step:
            end = min(e for e in (end, steps_for_minutes(train.max_minutes, state.measured_at_step,
                                                         state.measured_train_seconds, state.seconds_per_step)) if e)
        elif train.max_minutes:
            end = 0  # measured in this session's first steps (`measure`)
        plan = state.plan
        if not state.settings or not plan.end_step:  # a new run, or one whose time budget is still unmeasured
            state.plan = Plan(end, plan.segment_start, decay_start(plan.segment_start, train.warmup_steps, end,
                                                                   state.measured_at_step or position.step))
        else:
            changed = ", ".join(f"train.{key}: {state.settings.get(key)} -> {value}"
                                for key, value in values.items() if state.settings.get(key) != value)
            new = reconcile(train, position.step, plan, end, changed)
            if new is not None and new != plan:
                if new.segment_start != plan.segment_start:
                    log.info("%s: the finished linear schedule starts a new segment at step %d: warm-up over %d "
                             "steps to peak_lr %g, then down to zero at step %d", changed, new.segment_start,
                             train.warmup_steps, train.peak_lr, new.end_step)
                else:
                    log.info("%s: training now ends at step %d", changed, new.end_step)
                state.plan = new
        state.settings = values

    def measure(self, position: Position, step_seconds: float, step_tokens: int) -> None:
        """After each step (its time and source + target tokens): once, early in the first session,
        max_minutes of training at the measured seconds per step becomes the end step (`wsd`: see
        `_measure_wsd`). Under torchrun every rank passes rank 0's step times and the global tokens,
        so all compute the same end."""
        train, state = self.train, self.state
        if train.schedule == "wsd":
            if train.max_minutes:
                self._measure_wsd(position, step_seconds, step_tokens)
            return
        if train.max_minutes and state.seconds_per_step and position.step == state.reestimate_at_step:
            self._reestimate(position)
        if not train.max_minutes or state.seconds_per_step:
            return
        self._timed.append((step_seconds, step_tokens))
        timed = self._timed[UNTIMED_STEPS:]
        must_end = position.train_seconds >= train.max_minutes * 60 or position.step == self._end_before_measuring
        if not must_end and (position.step < MEASURE_UNTIL_STEP or len(timed) < MIN_TIMED_STEPS):
            return
        timed = timed or self._timed
        seconds_per_token = sum(seconds for seconds, _ in timed) / max(sum(tokens for _, tokens in timed), 1)
        state.seconds_per_step = seconds_per_token * self.tokens_per_step
        state.measured_at_step, state.measured_train_seconds = position.step, position.train_seconds
        by_time = steps_for_minutes(train.max_minutes, position.step, position.train_seconds, state.seconds_per_step)
        end = min(e for e in (by_time, self._end_without_time(position)) if e)
        state.plan = Plan(end, state.plan.segment_start,
                          decay_start(state.plan.segment_start, train.warmup_steps, end, measured_at=position.step))
        reestimate_at = position.step + math.floor(REESTIMATE_AT * (by_time - position.step))
        state.reestimate_at_step = reestimate_at if end == by_time and \
            reestimate_at - position.step >= MIN_TIMED_STEPS and reestimate_at < end else 0
        log.info("time budget: %g minute%s of training at %.3f s a step (measured over %d steps): it ends at step %d%s",
                 train.max_minutes, "" if train.max_minutes == 1 else "s", state.seconds_per_step, len(timed), by_time,
                 "" if end == by_time else f"; another budget ends training first, at step {end}")

    def _reestimate(self, position: Position) -> None:
        """The second measurement: the seconds per step since the first one re-plan the end. The
        linear schedule's line bends here, from the rate it has reached to zero at the new end."""
        train, state = self.train, self.state
        plan, step = state.plan, position.step
        seconds_per_step = (position.train_seconds - state.measured_train_seconds) / (step - state.measured_at_step)
        by_time = steps_for_minutes(train.max_minutes, step, position.train_seconds, seconds_per_step)
        end = min(e for e in (by_time, self._end_without_time(position)) if e)
        start = decay_start(plan.segment_start, train.warmup_steps, end, measured_at=state.measured_at_step)
        if start > step and step < plan.decay_start:  # no decay yet: it begins where it would with this end
            state.plan = dataclasses.replace(plan, end_step=end, decay_start=start)
        else:
            reached = 1.0 if step < plan.decay_start else \
                plan.decay_from * (plan.end_step - step + 1) / (plan.end_step - plan.decay_start + 1)
            state.plan = Plan(end, plan.segment_start, step, reached)
        log.info("time budget: %.3f s a step over steps %d-%d: training now ends at step %d (planned: %d)",
                 seconds_per_step, state.measured_at_step + 1, step, end, plan.end_step)
        state.seconds_per_step, state.measured_at_step, state.measured_train_seconds = \
            seconds_per_step, step, position.train_seconds
        state.reestimate_at_step = 0

    # ------------------------------------------------------------------ wsd

    def _wsd_plan(self, segment_start: int) -> Plan:
        """A segment's plan before training it: with a time budget the end is open until the cooldown."""
        if self.train.max_minutes:
            return Plan(0, segment_start, 0)
        end = self._steps_end
        return Plan(end, segment_start, wsd_decay_start(segment_start, self.train.warmup_steps, end,
                                                        self.train.cooldown_fraction))

    def _more_to_train(self, position: Position) -> bool:
        """Whether the budget settings leave steps to train after `position`."""
        train = self.train
        return (not self._steps_end or self._steps_end > position.step) and \
            (not train.max_minutes or position.train_seconds < train.max_minutes * 60)

    def _plan_wsd(self, position: Position) -> None:
        """Turn the budget settings into a plan at a run's start, or when a resume changed them. Until
        the cooldown begins no rate depends on the end, so any budget may change; a finished run
        given more starts a new segment with its own warm-up; inside the cooldown a change is refused."""
        train, state = self.train, self.state
        values = budget_values(train)
        if state.settings == values:
            return
        plan, step = state.plan, position.step
        changed = ", ".join(f"train.{key}: {state.settings.get(key)} -> {value}"
                            for key, value in values.items() if state.settings.get(key) != value)
        if not state.settings:
            state.plan, state.segment_seconds = self._wsd_plan(plan.segment_start), position.train_seconds
        elif plan.end_step and step >= plan.end_step:  # finished
            if self._more_to_train(position):
                state.plan, state.segment_seconds = self._wsd_plan(step), position.train_seconds
                state.windows, state.window, state.reestimate_at_step = [], [0.0, 0.0], 0
                log.info("%s: the finished schedule starts a new segment at step %d: warm-up over %d steps to "
                         "peak_lr %g, the peak, then the cooldown over the last %g of the budget", changed, step,
                         train.warmup_steps, train.peak_lr, train.cooldown_fraction)
        elif plan.end_step and step > plan.decay_start:  # the rates taken since decay_start depend on the end
            raise ConfigError(
                f"{changed}: the budget changed during this run's cooldown, which began at step {plan.decay_start} "
                f"and ends at step {plan.end_step} (now at step {step}); a new end would change the learning rate "
                "of the steps left. Restore the old value to continue; once the run has finished, raising the "
                "budget starts a new schedule segment with its own warm-up")
        else:  # the cooldown has not begun: every rate so far is the same whatever the end
            state.plan, state.reestimate_at_step = self._wsd_plan(plan.segment_start), 0
            log.info("%s: the cooldown has not begun, so the new budget applies as it is%s", changed,
                     f": training ends at step {state.plan.end_step}" if state.plan.end_step else "")
        state.settings = values

    def _measure_wsd(self, position: Position, step_seconds: float, step_tokens: int) -> None:
        """A time budget's step: into the pace windows; then the cooldown begins when its share of the
        time is left (planning the end), or the planned end is checked at the step recorded for it."""
        state = self.state
        state.window = [state.window[0] + step_seconds, state.window[1] + step_tokens]
        if position.step % WINDOW_STEPS == 0:
            state.windows = (state.windows + [state.window[0] / max(state.window[1], 1.0)])[-RECENT_WINDOWS:]
            state.window = [0.0, 0.0]
            if not state.plan.end_step:
                self._project(position)
        if not state.plan.end_step:
            if self._cooldown_due(position):
                self._plan_cooldown(position, first=True)
        elif position.step == state.reestimate_at_step:
            self._plan_cooldown(position, first=False)

    def _pace(self, position: Position) -> tuple[float, str]:
        """Seconds per step from here on, and how they were found: the median pace of the latest
        windows (per token, times an average step's tokens), or before the first window closes, the
        mean of the segment's steps."""
        state = self.state
        if state.windows:
            return (statistics.median(state.windows) * self.tokens_per_step,
                    f"the median of the last {len(state.windows)} windows of {WINDOW_STEPS} steps")
        steps = max(position.step - state.plan.segment_start, 1)
        return (position.train_seconds - state.segment_seconds) / steps, f"the mean of {steps} steps"

    def _project(self, position: Position) -> None:
        """Before the cooldown: where the pace so far points, for the progress bar; logged once, when
        the first measurement of the `linear` schedule would be taken."""
        train, state = self.train, self.state
        seconds_per_step, _ = self._pace(position)
        self._projected_end = steps_for_minutes(train.max_minutes, position.step, position.train_seconds,
                                                seconds_per_step)
        if self._steps_end:
            self._projected_end = min(self._projected_end, self._steps_end)
        if position.step == state.plan.segment_start + MEASURE_UNTIL_STEP:
            minutes = train.max_minutes * (1 - train.cooldown_fraction) + state.segment_seconds / 60 * \
                train.cooldown_fraction
            log.info("time budget: %g minute%s of training, about %d steps at %.3f s a step so far; the rate stays "
                     "at its peak until the cooldown begins after %.1f minutes of training, which plans the end",
                     train.max_minutes, "" if train.max_minutes == 1 else "s", self._projected_end, seconds_per_step,
                     minutes)

    def _cooldown_due(self, position: Position) -> bool:
        """Whether the cooldown begins after this step: its share of the time budget is all that is left
        (or nothing is), or a step or epoch budget's own cooldown begins here."""
        train, state = self.train, self.state
        budget_seconds = train.max_minutes * 60
        spent = position.train_seconds - state.segment_seconds
        if position.train_seconds >= budget_seconds or \
                spent >= (1 - train.cooldown_fraction) * (budget_seconds - state.segment_seconds):
            return True
        return bool(self._steps_end) and position.step >= wsd_decay_start(
            state.plan.segment_start, train.warmup_steps, self._steps_end, train.cooldown_fraction)

    def _plan_cooldown(self, position: Position, first: bool) -> None:
        """Plan (`first`) or re-plan the end from the pace; a re-plan bends the line at this step, from
        the rate it has reached to zero at the new end. Schedules the next re-plan."""
        train, state = self.train, self.state
        plan, step = state.plan, position.step
        seconds_per_step, how = self._pace(position)
        by_time = steps_for_minutes(train.max_minutes, step, position.train_seconds, seconds_per_step)
        end = min(e for e in (by_time, self._steps_end) if e)
        if first:
            state.plan = Plan(end, plan.segment_start, step, 1.0)
            log.info("time budget: the cooldown begins at step %d, after %.1f of %g minutes of training: at %.3f s a "
                     "step (%s), the rate falls to zero at step %d", step, position.train_seconds / 60,
                     train.max_minutes, seconds_per_step, how, end)
        elif end != plan.end_step:
            reached = plan.decay_from * (plan.end_step - step + 1) / (plan.end_step - plan.decay_start + 1)
            state.plan = Plan(end, plan.segment_start, step, reached)
            log.info("time budget: %.3f s a step (%s): training now ends at step %d (planned: %d)",
                     seconds_per_step, how, end, plan.end_step)
        state.seconds_per_step = seconds_per_step
        state.measured_at_step, state.measured_train_seconds = step, position.train_seconds
        gap = (end - step) // 2
        state.reestimate_at_step = step + gap if end == by_time and gap >= MIN_REPLAN_STEPS else 0


__all__ = ["Budget", "BudgetState", "Position", "MEASURE_UNTIL_STEP", "UNTIMED_STEPS", "MIN_TIMED_STEPS",
           "REESTIMATE_AT", "WINDOW_STEPS", "RECENT_WINDOWS", "MIN_REPLAN_STEPS", "wsd_decay_start",
           "BUDGET_KEYS", "budget_values", "Plan", "linear_rate", "decay_start", "steps_for_epochs",
           "steps_for_minutes", "reconcile"]
