"""Budgets as steps (transformer/training/budget.py): a time budget is measured once and recorded; the end of the linear
schedule is fixed, so a budget changed in the middle of it is refused, and one raised after the end
starts a new segment with its own warm-up; schedules that do not depend on the end just move the stop."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout
from transformer.training.budget import (MEASURE_UNTIL_STEP, REESTIMATE_AT, Budget, BudgetState, Plan, Position,
                                         linear_rate, reconcile, steps_for_epochs, steps_for_minutes)
from transformer.checkpoints.layout import STATE_FILE, read_run_state
from tests.conftest import TINY_PAIRS, write_csv
from transformer.config import Config, TrainConfig, config_from_dict, config_to_dict
from transformer.data.batching import PairCorpus
from transformer.errors import ConfigError
from transformer.training import trainer
from transformer.training.run import train


class TickingClock:
    """A stand-in for the time module whose monotonic clock moves `tick` seconds at every reading."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def monotonic(self) -> float:
        self.now += self.tick
        return self.now


def lr_by_step(run_dir: Path) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars("train/lr")}


def configured(tiny_config: Config, **train_values) -> Config:
    values = dict(schedule="linear", peak_lr=2e-3, warmup_steps=4, log_every=1, valid_every=1000,
                  checkpoint_every=1000, threads=1)
    values.update(train_values)
    return dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, **values))


def test_steps_for_epochs_and_minutes():
    # 3 epochs of 5 batches, 2 batches a step, starting 1 batch into epoch 0 at step 7
    assert steps_for_epochs(3, 0, 1, 7, 5, 2) == 7 + 2 + 3 + 3
    assert steps_for_epochs(3, 3, 0, 7, 5, 2) == 7  # the budget's last epoch is over
    assert steps_for_epochs(10**12, 0, 0, 0, 5, 1) == 5 * 10**12  # counted, not planned one by one
    assert steps_for_minutes(1.0, measured_at=30, measured_seconds=12.0, seconds_per_step=0.5) == 30 + 96
    assert steps_for_minutes(0.1, measured_at=30, measured_seconds=12.0, seconds_per_step=0.5) == 30


def test_reconcile_keeps_moves_restarts_or_refuses():
    linear, sqrt = TrainConfig(max_steps=100, schedule="linear", warmup_steps=10), TrainConfig(max_steps=100)
    plan = Plan(100, 0, 10)
    assert reconcile(linear, 50, plan, 100, "x") is plan
    assert reconcile(linear, 100, plan, 80, "x") is None  # finished, and a lower budget changes nothing
    assert reconcile(linear, 100, plan, 150, "x") == Plan(150, 100, 110)  # a new segment, its own warm-up
    assert reconcile(sqrt, 50, plan, 150, "x") == Plan(150, 0, 10)  # the stop moves
    with pytest.raises(ConfigError, match=r"^train.max_steps: 100 -> 150: the budget changed in the middle"):
        reconcile(linear, 50, plan, 150, "train.max_steps: 100 -> 150")


@pytest.mark.slow
def test_a_time_budget_is_measured_once_and_recorded(tiny_config, tmp_path, datasets_cache, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    # The trainer's clock ticks 0.01 s a reading, so every step takes the same time on any machine and
    # 0.03 minutes lasts past the measurement at MEASURE_UNTIL_STEP (a fast machine once ran out first).
    monkeypatch.setattr(trainer, "time", TickingClock(0.01))
    config = configured(tiny_config, max_steps=0, max_minutes=0.03, warmup_steps=MEASURE_UNTIL_STEP)
    run_dir = tmp_path / "run"
    outcome = train(config, run_dir, show_progress=False)
    state = outcome.state
    # the latest of the two measurements (the second, if the first plan left room for it)
    assert state.budget.measured_at_step >= MEASURE_UNTIL_STEP and state.budget.seconds_per_step > 0
    assert state.step == state.end_step == steps_for_minutes(0.03, state.budget.measured_at_step, state.budget.measured_train_seconds,
                                                             state.budget.seconds_per_step)
    assert "time budget: 0.03 minutes of training at " in caplog.text
    assert state.budget.settings == {"max_steps": 0, "max_epochs": 0, "max_minutes": 0.03}
    # The measurement travels with the checkpoint: a rerun finds the run finished, whatever the clock says.
    meta = checkpoint.read_meta(run_dir / "checkpoints" / layout.step_dir_name(state.step))
    assert meta["state"]["budget"]["plan"]["end_step"] == state.end_step
    assert meta["state"]["budget"]["seconds_per_step"] == state.budget.seconds_per_step
    again = train(config, run_dir, show_progress=False)
    assert again.already_finished and again.state.step == state.step
    # The schedule was a function of the step: warm-up to the measurement, then a line to the recorded end.
    rates, warmup = lr_by_step(run_dir), MEASURE_UNTIL_STEP
    end = state.end_step
    for step in (1, warmup - 1):
        assert rates[step] == pytest.approx(2e-3 * step / warmup, rel=1e-5)
    plan = state.budget.plan
    assert rates[end] == pytest.approx(2e-3 * plan.decay_from / (end - plan.decay_start + 1), rel=1e-5)


@pytest.mark.slow
def test_raising_the_budget_of_a_finished_linear_run_starts_a_new_segment(tiny_config, tmp_path, datasets_cache,
                                                                         caplog):
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "run"
    train(configured(tiny_config, max_steps=20), run_dir, show_progress=False)
    outcome = train(configured(tiny_config, max_steps=30), run_dir, show_progress=False)
    assert outcome.state.step == 30 and (outcome.state.budget.plan.segment_start, outcome.state.budget.plan.decay_start) == (20, 24)
    assert ("train.max_steps: 20 -> 30: the finished linear schedule starts a new segment at step 20: warm-up over 4 "
            "steps to peak_lr 0.002, then down to zero at step 30") in caplog.text
    rates = lr_by_step(run_dir)
    assert rates[20] == pytest.approx(2e-3 / 17)  # the first segment's last step: near zero
    assert rates[21] == pytest.approx(2e-3 / 4)  # no jump back to the peak: a warm-up again
    assert rates[24] == pytest.approx(2e-3) and rates[30] == pytest.approx(2e-3 / 7)


def test_changing_the_budget_in_the_middle_of_a_linear_schedule_is_refused(tiny_config, tmp_path, datasets_cache):
    run_dir = tmp_path / "run"
    calls = iter(range(1000))
    stopped = train(configured(tiny_config, max_steps=20, checkpoint_every=5), run_dir,
                    should_stop=lambda: next(calls) >= 9, show_progress=False)
    assert stopped.state.step == 10 and stopped.state.end_step == 20
    state_bytes = (run_dir / STATE_FILE).read_bytes()
    with pytest.raises(ConfigError, match=r"train.max_steps: 20 -> 40: the budget changed in the middle of this "
                                          r"run's linear schedule, which ends at step 20 \(now at step 10\)"):
        train(configured(tiny_config, max_steps=40), run_dir, show_progress=False)
    assert (run_dir / STATE_FILE).read_bytes() == state_bytes  # nothing lost: the old budget resumes
    finished = train(configured(tiny_config, max_steps=20, checkpoint_every=5), run_dir, show_progress=False)
    assert finished.state.step == 20 and read_run_state(run_dir).latest == "step_00000020"


def test_a_schedule_that_ignores_the_end_just_moves_the_stop(tiny_config, tmp_path, datasets_cache):
    run_dir = tmp_path / "run"
    calls = iter(range(1000))
    config = configured(tiny_config, schedule="inverse_sqrt", max_steps=20, checkpoint_every=5)
    train(config, run_dir, should_stop=lambda: next(calls) >= 9, show_progress=False)
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=25))
    assert train(longer, run_dir, show_progress=False).state.step == 25
    meta = json.loads((run_dir / "checkpoints" / "step_00000025" / "meta.json").read_text())
    assert meta["state"]["budget"]["plan"]["end_step"] == 25


def test_an_epoch_budget_plans_no_epoch_but_the_one_at_hand(tiny_config, tmp_path, datasets_cache, monkeypatch):
    """Time to the first step does not depend on train.max_epochs: every epoch has as many batches, so
    the budget counts the steps of 10,000 epochs without planning their batches."""
    planned = {}
    plan = PairCorpus.batches

    def counted(self, batch_tokens, seed, epoch, shuffle=True):
        batches = plan(self, batch_tokens, seed, epoch, shuffle)
        if shuffle:  # the training batches (validation plans its own, unshuffled)
            planned[epoch] = len(batches)
        return batches

    monkeypatch.setattr(PairCorpus, "batches", counted)
    config = configured(tiny_config, schedule="inverse_sqrt", max_steps=3, max_epochs=10_000)
    outcome = train(config, tmp_path / "run", show_progress=False)
    # the epochs the three steps trained on (a tiny corpus has few batches an epoch), and no other
    assert outcome.state.step == 3 and set(planned) == set(range(outcome.state.epoch + 1))
    # With the epochs as the only budget, the end is counted from the epoch at hand.
    planned.clear()
    stop_requests = iter([False, True])
    config = configured(tiny_config, max_steps=0, max_epochs=10_000, valid_every=10**6, checkpoint_every=10**6)
    outcome = train(config, tmp_path / "epochs", should_stop=lambda: next(stop_requests), show_progress=False)
    assert outcome.state.step == 2 and set(planned) == set(range(outcome.state.epoch + 1))
    assert outcome.state.end_step == 10_000 * planned[0]


# --------------------------------------------------------------------------- the time budget, on a fake clock


def step_seconds(step: int) -> float:
    """A run whose steps slow down after the first measurement, as a CPU run's do (caches filling),
    with the batch mix's noise: what made 30 minutes of training 32.9."""
    return (0.10 if step <= MEASURE_UNTIL_STEP else 0.11 + 0.02 * step / 3000) * (1 + 0.2 * ((step * 7919) % 13 - 6) / 6)


def fake_run(budget_state: BudgetState, train: TrainConfig, start: Position, until: int | None = None,
             seconds_of=step_seconds):
    """Steps timed by `seconds_of` (default `step_seconds`), every step 100 tokens as the epoch's average, from `start` until the
    budget ends (or step `until`). Returns the position and the learning rate of every step."""
    budget = Budget(train, budget_state, start, batches_per_epoch=10**6, tokens_per_step=100.0)
    position, rates = start, {}
    while not budget.finished(position.step) and position.step != until:
        step = position.step + 1
        rates[step] = linear_rate(step, train.peak_lr, train.warmup_steps, budget_state.plan)
        seconds = seconds_of(step)
        position = Position(step, 0, step, position.train_seconds + seconds)
        budget.measure(position, seconds, 100)
    return position, rates


def test_the_time_budget_lands_within_3_percent_of_max_minutes():
    train = TrainConfig(max_minutes=6.0, schedule="linear", warmup_steps=150, peak_lr=1e-3)
    state = BudgetState()
    end, rates = fake_run(state, train, Position(0, 0, 0, 0.0))
    assert abs(end.train_seconds - 360) <= 0.03 * 360, end.train_seconds
    # The second measurement was taken once, at the step the first plan fixed, and is recorded.
    assert state.measured_at_step > MEASURE_UNTIL_STEP and state.reestimate_at_step == 0
    # The line bent there without a jump, and still ends near zero at the step it ends.
    bend = state.measured_at_step
    assert rates[bend + 1] == pytest.approx(rates[bend] * (end.step - bend) / (end.step - bend + 1))
    assert 0 < rates[end.step] < 1e-3 / 50 and all(a >= b for a, b in zip(list(rates.values())[150:],
                                                                          list(rates.values())[151:]))


@pytest.mark.parametrize("stop_at", [MEASURE_UNTIL_STEP + 50, 2400, 3300])
def test_a_resumed_time_budget_plans_as_the_run_that_went_through(stop_at):
    """Killed between or after the two measurements and resumed from the state a checkpoint saved: the
    same end and the same rates; a rerun of the finished run changes nothing. (A session killed before
    the first measurement leaves none: the next one measures its own first steps.)"""
    train = TrainConfig(max_minutes=6.0, schedule="linear", warmup_steps=150, peak_lr=1e-3)
    through = BudgetState()
    end, rates = fake_run(through, train, Position(0, 0, 0, 0.0))
    first = BudgetState()
    stopped, early_rates = fake_run(first, train, Position(0, 0, 0, 0.0), until=stop_at)
    saved = json.loads(json.dumps(dataclasses.asdict(first)))  # as a checkpoint's meta.json holds it
    # A new session's Budget starts with a fresh clock: only the state carries over.
    resumed = BudgetState.from_dict(saved)
    again, late_rates = fake_run(resumed, train, stopped)
    assert again.step == end.step and resumed.plan == through.plan
    assert {**early_rates, **late_rates} == rates
    finished = json.loads(json.dumps(dataclasses.asdict(resumed)))
    rerun = BudgetState.from_dict(finished)
    after, none = fake_run(rerun, train, again)
    assert none == {} and dataclasses.asdict(rerun) == finished


def test_a_time_budget_with_a_closer_step_budget_is_not_re_estimated():
    train = TrainConfig(max_minutes=6.0, max_steps=300, schedule="linear", warmup_steps=150)
    state = BudgetState()
    end, _ = fake_run(state, train, Position(0, 0, 0, 0.0))
    assert end.step == 300 and state.measured_at_step == MEASURE_UNTIL_STEP and state.reestimate_at_step == 0


# --------------------------------------------------------------------------- wsd: the cooldown plans the end


def disturbed(step: int) -> float:
    """`step_seconds`, with two busy processes halving the CPU over steps 21-150 (a busy first minute)."""
    return step_seconds(step) * (2.5 if 20 < step <= 150 else 1.0)


def wsd_run(budget_state: BudgetState, train: TrainConfig, start: Position, until: int | None = None,
            seconds=step_seconds):
    return fake_run(budget_state, train, start, until, seconds_of=seconds)


WSD = TrainConfig(max_minutes=6.0, schedule="wsd", cooldown_fraction=0.5, warmup_steps=150, peak_lr=1e-3)


def test_wsd_holds_the_peak_until_its_cooldown_which_a_busy_first_minute_does_not_move():
    idle, busy = BudgetState(), BudgetState()
    idle_end, idle_rates = wsd_run(idle, WSD, Position(0, 0, 0, 0.0))
    busy_end, busy_rates = wsd_run(busy, WSD, Position(0, 0, 0, 0.0), seconds=disturbed)
    for state, end in ((idle, idle_end), (busy, busy_end)):
        assert abs(end.train_seconds - 360) <= 0.03 * 360, end.train_seconds
        assert end.step == state.plan.end_step and state.reestimate_at_step == 0
    # The peak until the cooldown, which begins with half the minutes left: the busy run made fewer
    # steps by then (it lost them), and that is all it lost.
    for rates, state in ((idle_rates, idle), (busy_rates, busy)):
        cooldown = min(step for step in rates if step > 150 and rates[step] < 1e-3)
        assert all(rates[step] == pytest.approx(1e-3) for step in range(150, cooldown))
        assert 0 < rates[max(rates)] < 1e-3 / 50
        assert all(a >= b for a, b in zip(list(rates.values())[150:], list(rates.values())[151:]))
    lost = sum(disturbed(step) - step_seconds(step) for step in range(21, 151))
    assert idle_end.step - busy_end.step == pytest.approx(lost / 0.12, rel=0.25)
    middle = busy.plan.segment_start + busy_end.step // 3  # before the cooldown, where linear has fallen far
    assert busy_rates[middle] == pytest.approx(1e-3)
    linear = TrainConfig(max_minutes=6.0, schedule="linear", warmup_steps=150, peak_lr=1e-3)
    _, linear_busy = wsd_run(BudgetState(), linear, Position(0, 0, 0, 0.0), seconds=disturbed)
    _, linear_idle = wsd_run(BudgetState(), linear, Position(0, 0, 0, 0.0))
    assert linear_busy[middle] < 0.85 * linear_idle[middle]


def test_wsd_re_plans_inside_the_cooldown_and_logs_each_change(caplog):
    caplog.set_level(logging.INFO)
    state = BudgetState()
    # the steps slow down by half after the cooldown began: the end moves in, and the line bends
    end, rates = wsd_run(state, WSD, Position(0, 0, 0, 0.0),
                         seconds=lambda step: step_seconds(step) * (1.5 if step > 1700 else 1.0))
    assert abs(end.train_seconds - 360) <= 0.03 * 360
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time budget")]
    assert lines[0].startswith("time budget: 6 minutes of training, about ")
    assert "the cooldown begins at step" in lines[1] and "median of the last 40 windows of 25 steps" in lines[1]
    assert any("training now ends at step" in line for line in lines[2:])
    steps = list(rates)
    assert all(rates[a] >= rates[b] for a, b in zip(steps[150:], steps[151:]))  # bent, never raised


@pytest.mark.parametrize("stop_at", [120, 1200, 1700, 2300, 2800])
def test_a_resumed_wsd_budget_plans_as_the_run_that_went_through(stop_at):
    """Killed before the cooldown, at its start, between re-plans or near the end, and resumed from the
    state a checkpoint saved: the same plan and the same rates; a rerun of the finished run changes nothing."""
    through = BudgetState()
    end, rates = wsd_run(through, WSD, Position(0, 0, 0, 0.0), seconds=disturbed)
    first = BudgetState()
    stopped, early_rates = wsd_run(first, WSD, Position(0, 0, 0, 0.0), until=stop_at, seconds=disturbed)
    resumed = BudgetState.from_dict(json.loads(json.dumps(dataclasses.asdict(first))))
    again, late_rates = wsd_run(resumed, WSD, stopped, seconds=disturbed)
    assert again.step == end.step and resumed == through
    assert {**early_rates, **late_rates} == rates
    finished = json.loads(json.dumps(dataclasses.asdict(resumed)))
    rerun = BudgetState.from_dict(finished)
    _, none = wsd_run(rerun, WSD, again)
    assert none == {} and dataclasses.asdict(rerun) == finished


def test_wsd_takes_budget_changes_before_its_cooldown_refuses_them_inside_and_restarts_after():
    state = BudgetState()
    stopped, _ = wsd_run(state, WSD, Position(0, 0, 0, 0.0), until=500)
    assert state.plan.end_step == 0  # still at the peak: no end planned
    longer = dataclasses.replace(WSD, max_minutes=8.0)
    end, rates = wsd_run(state, longer, stopped)
    assert abs(end.train_seconds - 480) <= 0.03 * 480 and rates[stopped.step + 1] == pytest.approx(1e-3)
    # inside the cooldown
    state = BudgetState()
    stopped, _ = wsd_run(state, WSD, Position(0, 0, 0, 0.0), until=2500)
    assert 0 < state.plan.decay_start < 2500
    with pytest.raises(ConfigError, match=r"^train.max_minutes: 6.0 -> 8.0: the budget changed during this run's "
                                          r"cooldown, which began at step \d+"):
        Budget(longer, state, stopped, batches_per_epoch=10**6, tokens_per_step=100.0)
    # finished, then raised: a new segment with its own warm-up and its own cooldown
    state = BudgetState()
    end, _ = wsd_run(state, WSD, Position(0, 0, 0, 0.0))
    again, rates = wsd_run(state, longer, end)
    assert state.plan.segment_start == end.step and rates[end.step + 1] == pytest.approx(1e-3 / 150)
    assert abs(again.train_seconds - 480) <= 0.03 * 480


def test_wsd_with_a_step_budget_cools_down_over_its_last_steps():
    train = TrainConfig(max_steps=1000, schedule="wsd", cooldown_fraction=0.3, warmup_steps=100, peak_lr=1e-3)
    state = BudgetState()
    end, rates = fake_run(state, train, Position(0, 0, 0, 0.0))
    assert end.step == 1000 and state.plan == Plan(1000, 0, 700) and state.windows == []
    assert rates[700] == pytest.approx(1e-3) and rates[701] == pytest.approx(1e-3 * 300 / 301)
    assert TrainConfig(max_steps=10, schedule="wsd", warmup_steps=100)  # shorter than its warm-up: lines cross
    short = BudgetState()
    fake_run(short, TrainConfig(max_steps=10, schedule="wsd", warmup_steps=100), Position(0, 0, 0, 0.0))
    assert short.plan == Plan(10, 0, 0)


# --------------------------------------------------------------------------- weighted corpora: the pace is the steps'


def weighted_config(tiny_config: Config, tmp_path: Path, weight: float, **train_values) -> Config:
    """tiny_config over two corpora (the tiny pairs, halved), both weighted `weight`."""
    raw = config_to_dict(configured(tiny_config, **train_values))
    halves = TINY_PAIRS[0::2], TINY_PAIRS[1::2]
    del raw["data"]["path"]
    raw["data"]["corpora"] = [{"path": str(write_csv(tmp_path / f"corpus{n}.csv", half)), "weight": weight,
                               "held_out": n == 0} for n, half in enumerate(halves)]
    raw["train"]["batch_tokens"] = 64  # several batches an epoch, even at weight 0.25
    return config_from_dict(raw)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, weight", [("wsd", 0.25), ("wsd", 4.0), ("linear", 0.25)])
def test_a_time_budget_over_weighted_corpora_plans_from_the_pace_of_its_steps(
        schedule, weight, tiny_config, tmp_path, datasets_cache, caplog, monkeypatch):
    """Weights change how many pairs an epoch draws, not what a step costs: the pace the budget logs
    and plans from is the seconds its steps take, and the run trains its minutes (a weight of 0.05 once
    made the budget count every pair in a twentieth of the steps, and a run trained half its minutes)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(trainer, "time", TickingClock(0.01))  # every step takes the same fake time
    minutes = 0.2
    config = weighted_config(tiny_config, tmp_path, weight, schedule=schedule, max_steps=0, max_minutes=minutes,
                             warmup_steps=20, valid_every=10**6, checkpoint_every=10**6)
    state = train(config, tmp_path / "run", show_progress=False).state
    real_pace = state.train_seconds / state.step
    logged = [float(pace) for pace in re.findall(r"at ([\d.]+) s a step", caplog.text)]
    assert logged and all(pace == pytest.approx(real_pace, rel=0.15) for pace in logged), (logged, real_pace)
    assert state.train_seconds == pytest.approx(minutes * 60, rel=0.05)
