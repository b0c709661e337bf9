"""Early stopping (train.patience): training ends after N validations in a row without a new best (a
lower valid loss), says so, keeps the count across a stop and resume, composes with the budgets, and a rerun of
an early-stopped run changes nothing. Validation scores are scripted (test_checkpoint_manager.py's
`scripted`), so each test knows where the plateau starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_checkpoint_manager import best_files, scripted, train_run, write_config  # noqa: F401 (a fixture)
from transformer.checkpoints import layout
from transformer.checkpoints.format import META_FILE
from transformer.checkpoints.layout import STATE_FILE, read_run_state
from transformer.config import load_config
from transformer.training import run

# Validated every 5 steps: the best is at 10, then 15, 20 and 25 do not beat it (20 equals it).
PLATEAU = {5: 10.0, 10: 20.0, 15: 15.0, 20: 20.0, 25: 19.0, 30: 30.0, 35: 1.0, 40: 2.0}


def meta_state(run_dir: Path, step: int) -> dict:
    path = run_dir / layout.CHECKPOINTS / layout.step_dir_name(step) / META_FILE
    return json.loads(path.read_text(encoding="utf-8"))["state"]


def plateau_config(tmp_path: Path, tiny_csv: Path, **train: object) -> Path:
    settings = dict(max_steps=40, valid_every=5, checkpoint_every=5, keep_checkpoints=10, patience=3)
    return write_config(tmp_path / "c.yaml", tiny_csv, **dict(settings, **train))


def test_training_stops_after_patience_validations_without_a_new_best(tmp_path: Path, tiny_csv: Path,
                                                                         scripted, capsys, caplog):
    scripted.scores.update(PLATEAU)
    config, run_dir = plateau_config(tmp_path, tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    assert scripted.validated == [5, 10, 15, 20, 25]  # 3 validations after the best at 10, not to step 40
    assert [meta_state(run_dir, s)["validations_without_improvement"] for s in (5, 10, 15, 20, 25)] == [0, 0, 1, 2, 3]
    assert read_run_state(run_dir).latest == "step_00000025" and read_run_state(run_dir).best.step == 10
    assert "step 25: no lower valid loss in 3 validations (train.patience): stopping early" in caplog.text
    assert "stopped early at step 25: no lower valid loss in 3 validations; best: step 10, valid nll 8.000" \
        in capsys.readouterr().err


def test_a_stop_in_the_middle_of_a_plateau_and_a_resume_keep_the_count(tmp_path: Path, tiny_csv: Path, scripted):
    """Stopped at step 17 (after one validation without improvement, checkpointed by the stop), the
    resumed run counts on: it stops at 25, as the run left alone does."""
    scripted.scores.update(PLATEAU)
    config_path, run_dir = plateau_config(tmp_path, tiny_csv, checkpoint_every=100), tmp_path / "run"
    config = load_config(config_path)
    first = run.train(config, run_dir, should_stop=lambda: scripted.trainer.state.step >= 17, show_progress=False)
    assert first.state.step == 17 and not first.stopped_early
    assert meta_state(run_dir, 17)["validations_without_improvement"] == 1
    second = run.train(config, run_dir, show_progress=False)
    assert second.resumed_from.name == "step_00000017"
    assert second.stopped_early and second.state.step == 25 and second.state.validations_without_improvement == 3
    assert scripted.validated == [5, 10, 15, 20, 25]


def test_the_budget_ends_a_run_first_when_it_comes_first(tmp_path: Path, tiny_csv: Path, scripted, capsys):
    scripted.scores.update(PLATEAU)
    config, run_dir = plateau_config(tmp_path, tiny_csv, max_steps=20), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    assert scripted.validated == [5, 10, 15, 20] and "done: 20 steps" in capsys.readouterr().err
    assert meta_state(run_dir, 20)["validations_without_improvement"] == 2


@pytest.mark.slow
def test_patience_0_never_stops_and_an_improvement_resets_the_count(tmp_path: Path, tiny_csv: Path, scripted):
    scripted.scores.update(PLATEAU)
    config, run_dir = plateau_config(tmp_path, tiny_csv, patience=0), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    assert scripted.validated == [5, 10, 15, 20, 25, 30, 35, 40]
    assert meta_state(run_dir, 30)["validations_without_improvement"] == 0  # 30 was a new best
    assert meta_state(run_dir, 35)["validations_without_improvement"] == 1


@pytest.mark.slow
def test_rerunning_an_early_stopped_run_changes_nothing_and_more_patience_trains_on(
        tmp_path: Path, tiny_csv: Path, scripted, capsys):
    scripted.scores.update(PLATEAU)
    config, run_dir = plateau_config(tmp_path, tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    before, state_bytes = best_files(run_dir), (run_dir / STATE_FILE).read_bytes()
    mtimes = {p: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    capsys.readouterr()

    assert train_run(config, run_dir) == 0
    assert "already stopped early at step 25 (no lower valid loss in 3 validations); nothing to do" \
        in capsys.readouterr().err
    assert best_files(run_dir) == before and (run_dir / STATE_FILE).read_bytes() == state_bytes
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == mtimes
    assert scripted.validated == [5, 10, 15, 20, 25]

    assert train_run(config, run_dir, "train.patience=4") == 0  # 30 is a new best; 35 and 40 are not
    assert scripted.validated == [5, 10, 15, 20, 25, 30, 35, 40]
    assert read_run_state(run_dir).best.step == 30 and "done: 40 steps" in capsys.readouterr().err
