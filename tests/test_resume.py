"""Exact resume: a run killed (SIGKILL) or stopped (SIGINT/SIGTERM) at an arbitrary step and resumed
ends with the same weights and optimizer state, bit for bit, as the same run left alone; a damaged
newest checkpoint is skipped; non-finite steps are skipped, counted, and end training after 5 in a row;
a kill in the middle of an early-stopping count stops where the run left alone stops.

The runs use the tiny CSV, dropout 0.3 (so the RNG state matters), 5 batches per epoch with 2 batches
per step (so an epoch ends on a one-batch step and resuming must land mid-epoch) and 40 steps (13
epochs). Threads are fixed to 1 so that both processes reduce in the same order; with that, the CPU
kernels used here are deterministic and the test asks for bitwise equality, not a tolerance.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout

from transformer.training import trainer
from transformer.training.budget import MEASURE_UNTIL_STEP
from transformer.training import loss as loss_module
from transformer.checkpoints.layout import read_run_state
from transformer.errors import CheckpointError
from transformer.training.trainer import MAX_NONFINITE_IN_A_ROW

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI script at the repository root)

MAX_STEPS = 40
CHECKPOINT_EVERY = 7  # step 14 is the 2nd step of epoch 5 (3 steps an epoch): mid-epoch

# Runs train.py with each step slowed down, so that a signal lands at an arbitrary point of the run,
# and held before step `hold` until the test creates the `release` file, so that the run cannot
# outrun the signal however slow or busy the machine (the deadline only keeps an abandoned process
# from waiting forever). The waits come before the step and touch no RNG: they change nothing learned.
SLOW_TRAIN = """
import os, sys, time
import transformer.training.trainer as trainer
{prelude}
train_step = trainer.Trainer.train_step
def slow_train_step(self, batches):
    if self.state.step + 1 >= {hold}:
        deadline = time.monotonic() + 600
        while not os.path.exists({release!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep({seconds})
    return train_step(self, batches)
trainer.Trainer.train_step = slow_train_step
sys.path.insert(0, {root!r})
import train
sys.exit(train.main(sys.argv[1:]))
"""


def write_config(path: Path, csv_path: Path, **train: object) -> Path:
    config = {
        "data": {"path": str(csv_path), "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64,
                  "dropout": 0.3},
        "train": {"max_steps": MAX_STEPS, "batch_tokens": 104, "accumulate_batches": 2, "warmup_steps": 10,
                  "log_every": 10, "valid_every": 10, "checkpoint_every": CHECKPOINT_EVERY, "device": "cpu",
                  "threads": 1, "attention_images": False,
                  # A run killed in a child process is compared with one trained here: auto could time
                  # the two precisions differently in each (conftest's _auto_precision_times_nothing).
                  "precision": "fp32", **train},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def cli_args(config: Path, run_dir: Path) -> list[str]:
    return ["--config", str(config), "--run-dir", str(run_dir), "--no-progress"]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory, tiny_csv: Path) -> Path:
    return write_config(tmp_path_factory.mktemp("config") / "resume.yaml", tiny_csv)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, config_file: Path) -> Path:
    """The final checkpoint of the run left alone for MAX_STEPS steps."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    assert train_cli.main(cli_args(config_file, run_dir)) == 0
    return run_dir / layout.CHECKPOINTS / layout.step_dir_name(MAX_STEPS)


def _flat_tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    flat = {}
    for key, item in items:
        flat.update(_flat_tensors(item, f"{prefix}/{key}"))
    return flat


def assert_same_training(expected: Path, actual: Path) -> None:
    """Weights, Adam moments, RNG state and data position of two checkpoints are bitwise equal."""
    weights_a, weights_b = load_file(expected / checkpoint.MODEL_FILE), load_file(actual / checkpoint.MODEL_FILE)
    assert weights_a.keys() == weights_b.keys()
    differ = [name for name in weights_a if not torch.equal(weights_a[name], weights_b[name])]
    assert not differ, f"weights differ: {differ[:3]}, max |diff| " \
                       f"{max(float((weights_a[n] - weights_b[n]).abs().max()) for n in differ)}"
    state_a = _flat_tensors(checkpoint.load_training_state(expected))
    state_b = _flat_tensors(checkpoint.load_training_state(actual))
    assert state_a.keys() == state_b.keys()
    assert [k for k in state_a if not torch.equal(state_a[k], state_b[k])] == []
    meta_a, meta_b = checkpoint.read_meta(expected), checkpoint.read_meta(actual)
    for key in ("step", "epoch", "batch_in_epoch", "target_tokens", "nonfinite_steps"):
        assert meta_a["state"][key] == meta_b["state"][key], key
    assert meta_a["state"]["budget"]["plan"] == meta_b["state"]["budget"]["plan"]


def release_file(log: Path) -> Path:
    """The file that lets a run started by start_slow_run take its held steps."""
    return log.with_suffix(".release")


# The trainer's clock in a child process, as TickingClock is in this one: every reading moves TICK
# seconds, so every step takes TICK seconds of training time on any machine. A power of two, so that
# sums of it are exact and a resumed session's clock, started afresh, adds up to the same bits.
TICK = 1 / 16
TICKING_CLOCK = f"""
class TickingClock:
    now = 0.0
    @classmethod
    def monotonic(cls):
        cls.now += {TICK}
        return cls.now
trainer.time = TickingClock
"""


class TickingClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += TICK
        return self.now


def start_slow_run(config: Path, run_dir: Path, log: Path, seconds_per_step: float = 0.1,
                   hold: int = sys.maxsize, prelude: str = "", extra_args: Sequence[str] = ()) -> subprocess.Popen:
    """train.py on `config` (and `extra_args`, e.g. --init-from RUN) in a process of its own, writing
    stderr to `log`; the run takes no step from `hold` on until release_file(log) exists. `prelude`:
    code run in it before training."""
    code = SLOW_TRAIN.format(seconds=seconds_per_step, root=str(ROOT), hold=hold, release=str(release_file(log)),
                             prelude=prelude)
    with open(log, "w", encoding="utf-8") as stderr:
        return subprocess.Popen([sys.executable, "-c", code, *cli_args(config, run_dir), *extra_args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr)


def recorded_step(run_dir: Path) -> int:
    """The step of the newest checkpoint the run state records (0 if none yet)."""
    try:
        state = read_run_state(run_dir)
    except CheckpointError:  # read between two writes cannot happen (rename), but a partial copy could
        return 0
    return int(state.latest.split("_")[1]) if state and state.latest else 0


def wait_for_checkpoint(process: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 120) -> None:
    """Until the run state records a checkpoint at `step` or later."""
    deadline = time.monotonic() + timeout
    while recorded_step(run_dir) < step:
        if process.poll() is not None:
            pytest.fail(f"training exited ({process.returncode}) before step {step}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no checkpoint at step {step} after {timeout} s:\n{log.read_text()}")
        time.sleep(0.02)


def wait_for_log(process: subprocess.Popen, log: Path, text: str, timeout: float = 120) -> None:
    """Until the run's stderr holds `text`."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text(encoding="utf-8"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"training never logged {text!r}:\n{log.read_text()}")
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_step_then_resume_gives_identical_weights(
        tmp_path: Path, config_file: Path, uninterrupted: Path, capsys):
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    process = start_slow_run(config_file, run_dir, log, hold=MAX_STEPS)  # cannot end before the kill
    wait_for_checkpoint(process, run_dir, 2 * CHECKPOINT_EVERY, log)
    os.kill(process.pid, signal.SIGKILL)  # no chance to save anything: mid-step, maybe mid-write
    assert process.wait(timeout=30) == -signal.SIGKILL
    latest = run_dir / layout.CHECKPOINTS / read_run_state(run_dir).latest
    assert recorded_step(run_dir) >= 2 * CHECKPOINT_EVERY
    resumed_state = checkpoint.read_meta(latest)["state"]
    assert resumed_state["epoch"] >= 1 and resumed_state["batch_in_epoch"] % 5 != 0  # mid-epoch, not at a boundary

    assert train_cli.main(cli_args(config_file, run_dir)) == 0
    err = capsys.readouterr().err
    assert f"resuming from {latest}" in err
    assert f"done: {MAX_STEPS} steps" in err
    assert_same_training(uninterrupted, run_dir / layout.CHECKPOINTS / layout.step_dir_name(MAX_STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_the_step_saves_and_exits_0_then_resume_gives_identical_weights(
        tmp_path: Path, config_file: Path, uninterrupted: Path, capsys, signum: signal.Signals):
    run_dir, log = tmp_path / "stopped", tmp_path / "stopped.log"
    process = start_slow_run(config_file, run_dir, log, hold=MAX_STEPS - 1)
    wait_for_checkpoint(process, run_dir, CHECKPOINT_EVERY, log)
    os.kill(process.pid, signum)
    # Released once the signal is in: a run already held takes its held step, and stops there.
    wait_for_log(process, log, f"{signum.name} received")
    release_file(log).touch()
    assert process.wait(timeout=60) == 0, log.read_text()
    err = log.read_text()
    assert "Traceback" not in err
    assert f"{signum.name} received: finishing this step and saving a checkpoint" in err
    newest = layout.list_checkpoints(run_dir)[-1]
    stop_step = checkpoint.read_meta(newest)["step"]
    assert CHECKPOINT_EVERY < stop_step < MAX_STEPS  # saved at the stop, not only at the regular steps
    resume_hint = [line for line in err.splitlines() if line.startswith(f"stopped at step {stop_step};")]
    assert resume_hint == [f"stopped at step {stop_step}; saved {newest}. Resume with: python train.py "
                           f"--config {config_file} --run-dir {run_dir} --no-progress"]
    checkpoint.read_meta(newest, verify=True, need_training_state=True)  # complete and intact

    assert train_cli.main(cli_args(config_file, run_dir)) == 0
    assert f"resuming from {newest} (step {stop_step}," in capsys.readouterr().err
    assert_same_training(uninterrupted, run_dir / layout.CHECKPOINTS / layout.step_dir_name(MAX_STEPS))


@pytest.mark.slow
@pytest.mark.alone  # a real clock's budget: another test beside it would move the steps it measures
def test_a_time_budgeted_run_killed_between_its_measurements_re_estimates_at_the_recorded_step(
        tmp_path: Path, tiny_csv: Path, capsys):
    """max_minutes becomes steps at the first measurement, which also fixes the step of the second one;
    the kill comes between the two. The resumed session takes the second measurement at exactly that
    step (its time is the training state's, not the new session's) and ends where it then recorded."""
    linear = {"schedule": "linear", "peak_lr": 1e-3, "warmup_steps": MEASURE_UNTIL_STEP}
    timed = write_config(tmp_path / "timed.yaml", tiny_csv, max_steps=0, max_minutes=0.2, **linear)
    run_dir, log = tmp_path / "timed", tmp_path / "timed.log"
    # The budget comes to about 200 steps; the run is held after the first checkpoint past the first
    # measurement, so the kill certainly comes before the second, however slow the machine.
    checkpoint_after = (MEASURE_UNTIL_STEP // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
    process = start_slow_run(timed, run_dir, log, seconds_per_step=0.02, hold=checkpoint_after + 1)
    wait_for_checkpoint(process, run_dir, checkpoint_after, log)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    latest = run_dir / layout.CHECKPOINTS / read_run_state(run_dir).latest
    recorded = checkpoint.read_meta(latest)["state"]
    reestimate_at = recorded["budget"]["reestimate_at_step"]
    assert recorded["budget"]["measured_at_step"] == MEASURE_UNTIL_STEP and reestimate_at > recorded["step"]

    assert train_cli.main(cli_args(timed, run_dir)) == 0
    final = checkpoint.read_meta(run_dir / layout.CHECKPOINTS / read_run_state(run_dir).latest)["state"]
    assert final["budget"]["measured_at_step"] == reestimate_at and final["budget"]["reestimate_at_step"] == 0
    assert final["step"] == final["budget"]["plan"]["end_step"]
    assert f"done: {final['step']} steps" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before the cooldown", "inside the cooldown"])
def test_a_wsd_run_with_averaged_weights_killed_before_or_inside_its_cooldown_resumes_bitwise(
        tmp_path: Path, tiny_csv: Path, capsys, monkeypatch, where: str):
    """A time budget on a clock every step moves by the same TICK, so the run left alone is a fixed
    target: the kill lands before the cooldown planned the end, or inside it before the first re-plan;
    the resumed run ends with the same weights, average, Adam moments and plan, bit for bit."""
    wsd = write_config(tmp_path / "wsd.yaml", tiny_csv, max_steps=0, max_minutes=0.25, schedule="wsd",
                       cooldown_fraction=0.5, peak_lr=1e-3, warmup_steps=20, ema_decay=0.9)
    monkeypatch.setattr(trainer, "time", TickingClock())
    alone = tmp_path / "alone"
    assert train_cli.main(cli_args(wsd, alone)) == 0
    final = checkpoint.read_meta(alone / layout.CHECKPOINTS / read_run_state(alone).latest)["state"]
    plan = final["budget"]["plan"]
    assert plan["decay_start"] > 0 and final["step"] == plan["end_step"]
    assert "time budget: the cooldown begins at step" in capsys.readouterr().err
    kill_after = 105 if where == "before the cooldown" else 154
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    process = start_slow_run(wsd, run_dir, log, seconds_per_step=0.0, hold=kill_after + 1, prelude=TICKING_CLOCK)
    wait_for_checkpoint(process, run_dir, kill_after, log)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    recorded = checkpoint.read_meta(run_dir / layout.CHECKPOINTS / read_run_state(run_dir).latest)["state"]
    if where == "before the cooldown":
        assert recorded["budget"]["plan"]["end_step"] == 0
    else:
        assert 0 < recorded["budget"]["plan"]["decay_start"] < recorded["step"] < recorded["budget"]["reestimate_at_step"]
    monkeypatch.setattr(trainer, "time", TickingClock())  # a new session's clock starts afresh
    assert train_cli.main(cli_args(wsd, run_dir)) == 0
    assert_same_training(alone / layout.CHECKPOINTS / layout.step_dir_name(final["step"]),
                         run_dir / layout.CHECKPOINTS / layout.step_dir_name(final["step"]))
    # and a rerun of the finished run changes nothing
    before = (run_dir / layout.STATE_FILE).read_bytes()
    assert train_cli.main(cli_args(wsd, run_dir)) == 0
    assert (run_dir / layout.STATE_FILE).read_bytes() == before
    assert "already reached its budget" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_skips_a_truncated_newest_checkpoint_and_still_matches(
        tmp_path: Path, config_file: Path, uninterrupted: Path, capsys):
    run_dir = tmp_path / "truncated"
    assert train_cli.main(cli_args(config_file, run_dir) + ["--set", "train.max_steps=21"]) == 0
    *_, previous, newest = layout.list_checkpoints(run_dir)
    assert newest.name == layout.step_dir_name(21)
    previous_step = checkpoint.read_meta(previous)["step"]
    weights = newest / checkpoint.MODEL_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a torn write

    assert train_cli.main(cli_args(config_file, run_dir)) == 0
    err = capsys.readouterr().err
    assert f"skipping checkpoint: {weights}: truncated or corrupt" in err
    assert f"resuming from {previous} (step {previous_step}," in err
    assert f"moving the damaged {newest} aside" in err
    assert_same_training(uninterrupted, run_dir / layout.CHECKPOINTS / layout.step_dir_name(MAX_STEPS))


def test_a_run_with_only_damaged_checkpoints_is_not_silently_restarted(tmp_path: Path, config_file: Path, capsys):
    run_dir = tmp_path / "damaged"
    assert train_cli.main(cli_args(config_file, run_dir) + ["--set", "train.max_steps=7"]) == 0
    only = layout.list_checkpoints(run_dir)[0]
    (only / checkpoint.TRAINING_FILE).write_bytes(b"garbage")
    assert train_cli.main(cli_args(config_file, run_dir)) == 2
    err = capsys.readouterr().err
    assert f"{run_dir}: none of its 1 checkpoints holds an intact training state" in err and "Traceback" not in err
    assert f"the weights of {only.name} are intact: translate with them" in err
    assert layout.list_checkpoints(run_dir) == [only]  # nothing overwritten


def test_nonfinite_steps_are_skipped_counted_and_stop_training_after_5_in_a_row(
        tmp_path: Path, config_file: Path, monkeypatch, capsys, caplog):
    nan_gradient_steps = {3}  # a lone bad step: skipped, then training goes on
    nan_loss_steps = set(range(12, 12 + MAX_NONFINITE_IN_A_ROW))  # 12..16, across the save at step 14
    params_after: dict[int, list[torch.Tensor]] = {}
    real_train_step, real_batch_loss = trainer.Trainer.train_step, loss_module.batch_loss
    poisoned = {"loss": False}

    def batch_loss(model, batch, label_smoothing=0.0):
        loss, nll = real_batch_loss(model, batch, label_smoothing)
        return (loss * math.nan, nll) if poisoned["loss"] else (loss, nll)

    def train_step(self, batches):
        step = self.state.step + 1
        poisoned["loss"] = step in nan_loss_steps
        first_parameter = next(self.model.parameters())
        hooks = [first_parameter.register_hook(lambda grad: grad * math.inf)] if step in nan_gradient_steps else []
        metrics = real_train_step(self, batches)
        for hook in hooks:
            hook.remove()
        assert metrics["finite"] == (step not in nan_loss_steps | nan_gradient_steps)
        params_after[step] = [p.detach().clone() for p in self.model.parameters()]
        return metrics

    monkeypatch.setattr(loss_module, "batch_loss", batch_loss)
    monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
    run_dir = tmp_path / "nan"
    assert train_cli.main(cli_args(config_file, run_dir)) == 2
    last_bad = max(nan_loss_steps)
    saved = run_dir / layout.CHECKPOINTS / layout.step_dir_name(14)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: step {last_bad}: the loss or gradient was not finite for {MAX_NONFINITE_IN_A_ROW} steps in a row "
        f"({MAX_NONFINITE_IN_A_ROW + 1} skipped in all), so training stopped; the last checkpoint, {saved}, is "
        "intact. Start a new run in another run directory with a lower learning rate (train.lr_factor / train.peak_lr), "
        "a longer train.warmup_steps, or train.precision: fp32.")
    assert "step 3: non-finite loss or gradient (loss " in caplog.text and "update skipped" in caplog.text

    def same(a: int, b: int) -> bool:
        return all(torch.equal(x, y) for x, y in zip(params_after[a], params_after[b]))

    assert same(2, 3) and not same(3, 4)  # skipped, then training went on
    assert all(same(11, step) for step in nan_loss_steps)  # no skipped step moved a weight
    assert max(params_after) == last_bad  # stopped right there
    assert layout.list_checkpoints(run_dir)[-1] == saved
    meta = checkpoint.read_meta(saved, verify=True, need_training_state=True)
    assert meta["state"]["nonfinite_steps"] == 4 and meta["state"]["nonfinite_in_a_row"] == 3  # 3; 12, 13, 14
    model, _ = checkpoint.load_model(saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_after[11]))


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_patience_count_then_resume_stops_where_the_run_left_alone_stops(
        tmp_path: Path, tiny_csv: Path, capsys):
    """train.patience counts validations without a better BLEU; the count travels in the checkpoints,
    so a run killed while it counts stops at the same step, with the same weights, as one left alone."""
    config = write_config(tmp_path / "patience.yaml", tiny_csv, patience=3, valid_every=2, checkpoint_every=2,
                          keep_checkpoints=100)
    alone = tmp_path / "alone"
    assert train_cli.main(cli_args(config, alone)) == 0
    assert "stopped early at step" in capsys.readouterr().err
    stop = read_run_state(alone).latest
    counts = {path.name: checkpoint.read_meta(path)["state"]["validations_without_improvement"]
              for path in layout.list_checkpoints(alone)}
    assert counts[stop] == 3 and stop != layout.step_dir_name(MAX_STEPS)
    # The first checkpoint whose count is under way: the kill lands after it, well before the stop.
    counting = min(name for name, count in counts.items() if 0 < count < 3)
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    process = start_slow_run(config, run_dir, log, hold=int(stop.split("_")[1]))  # killed before it can stop
    wait_for_checkpoint(process, run_dir, int(counting.split("_")[1]), log)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    assert recorded_step(run_dir) < int(stop.split("_")[1])
    assert train_cli.main(cli_args(config, run_dir)) == 0
    assert f"stopped early at step {int(stop.split('_')[1])}" in capsys.readouterr().err
    assert read_run_state(run_dir).latest == stop
    assert_same_training(alone / layout.CHECKPOINTS / stop, run_dir / layout.CHECKPOINTS / stop)
