"""Budgets as steps (budget.py): a time budget is measured once and recorded; the end of the linear
schedule is fixed, so a budget changed in the middle of it is refused, and one raised after the end
starts a new segment with its own warm-up; schedules that do not depend on the end just move the stop."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import rundir
from transformer.training.budget import MEASURE_UNTIL_STEP, Plan, reconcile, steps_for_epochs, steps_for_minutes
from transformer.checkpoints.rundir import STATE_FILE, read_run_state
from transformer.config import Config, TrainConfig
from transformer.data.batching import PairCorpus
from transformer.errors import ConfigError
from transformer.training.run import train


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


def test_a_time_budget_is_measured_once_and_recorded(tiny_config, tmp_path, datasets_cache, caplog):
    caplog.set_level(logging.INFO)
    config = configured(tiny_config, max_steps=0, max_minutes=0.03, warmup_steps=MEASURE_UNTIL_STEP)
    run_dir = tmp_path / "run"
    outcome = train(config, run_dir, show_progress=False, data_cache_dir=datasets_cache)
    state = outcome.state
    assert state.budget.measured_at_step == MEASURE_UNTIL_STEP and state.budget.seconds_per_step > 0
    assert state.step == state.end_step == steps_for_minutes(0.03, MEASURE_UNTIL_STEP, state.budget.measured_train_seconds,
                                                             state.budget.seconds_per_step)
    assert f"time budget: 0.03 minutes of training at {state.budget.seconds_per_step:.3f} s a step" in caplog.text
    assert state.budget.settings == {"max_steps": 0, "max_epochs": 0, "max_minutes": 0.03}
    # The measurement travels with the checkpoint: a rerun finds the run finished, whatever the clock says.
    meta = checkpoint.read_meta(run_dir / "checkpoints" / rundir.step_dir_name(state.step))
    assert meta["state"]["budget"]["plan"]["end_step"] == state.end_step
    assert meta["state"]["budget"]["seconds_per_step"] == state.budget.seconds_per_step
    again = train(config, run_dir, show_progress=False, data_cache_dir=datasets_cache)
    assert again.already_finished and again.state.step == state.step
    # The schedule was a function of the step: warm-up to the measurement, then the line to the recorded end.
    rates, warmup = lr_by_step(run_dir), MEASURE_UNTIL_STEP
    end = state.end_step
    for step in (1, warmup - 1, warmup + 1, end):
        expected = 2e-3 * min(step / warmup, (end - step + 1) / (end - warmup + 1))
        assert rates[step] == pytest.approx(expected, rel=1e-5)


def test_raising_the_budget_of_a_finished_linear_run_starts_a_new_segment(tiny_config, tmp_path, datasets_cache,
                                                                         caplog):
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "run"
    train(configured(tiny_config, max_steps=20), run_dir, show_progress=False, data_cache_dir=datasets_cache)
    outcome = train(configured(tiny_config, max_steps=30), run_dir, show_progress=False,
                    data_cache_dir=datasets_cache)
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
                    should_stop=lambda: next(calls) >= 9, show_progress=False, data_cache_dir=datasets_cache)
    assert stopped.state.step == 10 and stopped.state.end_step == 20
    state_bytes = (run_dir / STATE_FILE).read_bytes()
    with pytest.raises(ConfigError, match=r"train.max_steps: 20 -> 40: the budget changed in the middle of this "
                                          r"run's linear schedule, which ends at step 20 \(now at step 10\)"):
        train(configured(tiny_config, max_steps=40), run_dir, show_progress=False, data_cache_dir=datasets_cache)
    assert (run_dir / STATE_FILE).read_bytes() == state_bytes  # nothing lost: the old budget resumes
    finished = train(configured(tiny_config, max_steps=20, checkpoint_every=5), run_dir, show_progress=False,
                     data_cache_dir=datasets_cache)
    assert finished.state.step == 20 and read_run_state(run_dir).latest == "step_00000020"


def test_a_schedule_that_ignores_the_end_just_moves_the_stop(tiny_config, tmp_path, datasets_cache):
    run_dir = tmp_path / "run"
    calls = iter(range(1000))
    config = configured(tiny_config, schedule="inverse_sqrt", max_steps=20, checkpoint_every=5)
    train(config, run_dir, should_stop=lambda: next(calls) >= 9, show_progress=False, data_cache_dir=datasets_cache)
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=25))
    assert train(longer, run_dir, show_progress=False, data_cache_dir=datasets_cache).state.step == 25
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
    outcome = train(config, tmp_path / "run", show_progress=False, data_cache_dir=datasets_cache)
    # the epochs the three steps trained on (a tiny corpus has few batches an epoch), and no other
    assert outcome.state.step == 3 and set(planned) == set(range(outcome.state.epoch + 1))
    # With the epochs as the only budget, the end is counted from the epoch at hand.
    planned.clear()
    stop_requests = iter([False, True])
    config = configured(tiny_config, max_steps=0, max_epochs=10_000, valid_every=10**6, checkpoint_every=10**6)
    outcome = train(config, tmp_path / "epochs", should_stop=lambda: next(stop_requests), show_progress=False,
                    data_cache_dir=datasets_cache)
    assert outcome.state.step == 2 and set(planned) == set(range(outcome.state.epoch + 1))
    assert outcome.state.end_step == 10_000 * planned[0]
