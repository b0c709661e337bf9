"""The run state (transformer/checkpoints/manager.py): `best` names the checkpoint of the best validation and moves
only when a validation beats it; a run that ends off the validation cycle validates and records its
last step; a rerun of a finished command changes nothing; pruning never removes the best; a save killed
before the run state recorded it is undone; runs of earlier versions are refused for training only.

Validation scores are scripted (the tiny model's BLEU is noise), so each test knows which step is best.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout
from transformer.checkpoints.format import read_meta

from transformer.training import trainer
from transformer.checkpoints.manager import CheckpointManager
from transformer.errors import CheckpointError
from transformer.checkpoints.layout import STATE_FILE, read_run_state
from transformer.checkpoints.lookup import find_checkpoint
from transformer.checkpoints.rundir import RunDirectory
from transformer.training.validation import EvaluationResult
from transformer.translation.metrics import Scores

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI script at the repository root)


def write_config(path: Path, csv_path: Path, **train: object) -> Path:
    config = {
        "data": {"path": str(csv_path), "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
        "train": {"max_steps": 45, "batch_tokens": 256, "warmup_steps": 10, "log_every": 15, "valid_every": 30,
                  "checkpoint_every": 30, "keep_checkpoints": 1, "device": "cpu", "threads": 1, "attention_images": False, **train},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def scripted_loss(score: float) -> float:
    """The validation loss ScriptedValidation gives a step scripted `score`: the higher the score, the lower
    the loss, so that the best checkpoint (the lowest loss) is the one with the highest score."""
    return (100.0 - score) / 10


class ScriptedValidation:
    """Validation that returns, for the step being validated, the BLEU of `scores` and a loss that falls
    as it rises (`scripted_loss`), and notes the step."""

    def __init__(self) -> None:
        self.scores: dict[int, float] = {}
        self.losses: dict[int, float] = {}  # a step's loss where it is not scripted_loss(its score)
        self.validated: list[int] = []
        self.trainer: trainer.Trainer | None = None

    def evaluate(self, model, valid, tokenizers, config, device) -> EvaluationResult:
        step = self.trainer.state.step
        self.validated.append(step)
        loss = self.losses.get(step, scripted_loss(self.scores[step]))
        return EvaluationResult(loss, math.exp(loss), Scores(self.scores[step], self.scores[step] / 2, ""), [], [])


@pytest.fixture
def scripted(monkeypatch) -> ScriptedValidation:
    script = ScriptedValidation()
    real_init = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        script.trainer = self

    monkeypatch.setattr(trainer, "evaluate", script.evaluate)
    monkeypatch.setattr(trainer.Trainer, "__init__", init)
    return script


def train_run(config: Path, run_dir: Path, *overrides: str) -> int:
    words = [word for override in overrides for word in ("--set", override)]
    return train_cli.main(["--config", str(config), "--run-dir", str(run_dir), "--no-progress", *words])


def best_files(run_dir: Path) -> dict[str, bytes]:
    """What a reader of checkpoints/best sees: the link's target and every file's bytes."""
    best = run_dir / layout.CHECKPOINTS / layout.BEST
    return {"->": os.readlink(best).encode(), **{p.name: p.read_bytes() for p in sorted(best.iterdir())}}


@pytest.mark.slow
def test_a_run_ending_off_the_validation_cycle_validates_and_records_its_last_step(
        tmp_path: Path, tiny_csv: Path, scripted, capsys):
    """The budget (45) ends between validations (every 30). The last step is validated, then saved
    with its own metrics; it is the best, so best names it."""
    scripted.scores.update({30: 10.0, 45: 20.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    assert scripted.validated == [30, 45]
    state = read_run_state(run_dir)
    assert (state.best.checkpoint, state.best.step, state.best.score) == ("step_00000045", 45, 8.0)
    last = checkpoint.read_meta(run_dir / "checkpoints" / "step_00000045")
    assert last["metrics"] == state.best.metrics == {"valid_nll": 8.0, "valid_perplexity": math.exp(8.0),
                                                     "valid_bleu": 20.0, "valid_chrf": 10.0}
    assert checkpoint.read_meta(run_dir / "checkpoints" / layout.BEST)["step"] == 45
    assert "best: step 45, valid nll 8.000" in capsys.readouterr().err


def test_best_is_the_lowest_validation_loss_never_an_equal_one_and_any_beats_an_unscored_best():
    best = layout.Best("step_00000010", 10, {"valid_nll": 2.0, "valid_bleu": 30.0})
    assert layout.beats({"valid_nll": 1.9, "valid_bleu": 10.0}, best)  # a lower loss wins, whatever its BLEU
    assert not layout.beats({"valid_nll": 2.1, "valid_bleu": 50.0}, best)  # a higher BLEU alone does not
    assert not layout.beats({"valid_nll": 2.0, "valid_bleu": 31.0}, best)  # equal: the first stays
    assert layout.beats({"valid_nll": 9.0}, None)
    assert not layout.beats({}, None)  # a save between validations is never best
    imported = layout.Best("step_00000000", 0, {})  # an imported run's only checkpoint: no validation
    assert layout.beats({"valid_nll": 9.0}, imported)


def test_a_validation_with_a_higher_bleu_but_a_higher_loss_leaves_best_where_it_is(
        tmp_path: Path, tiny_csv: Path, scripted, capsys):
    """What the rule changed: at 45 the sample BLEU rises, the whole split's loss rises too; best stays at
    30. Rebuilding the run state from the checkpoints chooses the same."""
    scripted.scores.update({30: 20.0, 45: 25.0})
    scripted.losses.update({30: 3.0, 45: 3.5})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv, keep_checkpoints=2), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    assert read_run_state(run_dir).best.step == 30
    assert os.readlink(run_dir / "checkpoints" / layout.BEST) == "step_00000030"
    assert "best: step 30, valid nll 3.000" in capsys.readouterr().err
    assert CheckpointManager.rebuild(RunDirectory(run_dir), keep=2).best.step == 30


@pytest.mark.slow
def test_rerunning_a_finished_run_changes_nothing_and_raising_its_budget_keeps_best_right(
        tmp_path: Path, tiny_csv: Path, scripted, capsys):
    """The run of the issue: best at step 30, then a worse last step (45). A rerun leaves best and
    the run state byte-identical. Raising the budget validates at 60 (worse: best stays at 30, which
    pruning keeps although keep_checkpoints is 1) and 75 (better: best moves)."""
    scripted.scores.update({30: 33.1, 45: 32.3, 60: 30.0, 75: 40.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    assert read_run_state(run_dir).best.step == 30
    before, state_bytes = best_files(run_dir), (run_dir / STATE_FILE).read_bytes()
    mtimes = {p: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    capsys.readouterr()

    assert train_run(config, run_dir) == 0  # the same command again
    assert "already reached its budget at step 45; nothing to do" in capsys.readouterr().err
    assert best_files(run_dir) == before and (run_dir / STATE_FILE).read_bytes() == state_bytes
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == mtimes
    assert scripted.validated == [30, 45]  # no validation either

    assert train_run(config, run_dir, "train.max_steps=60") == 0
    state = read_run_state(run_dir)
    assert state.best.step == 30 and best_files(run_dir) == before
    assert state.kept == ["step_00000030", "step_00000060"]  # the best, and the newest one
    assert not (run_dir / "checkpoints" / "step_00000045").exists()

    assert train_run(config, run_dir, "train.max_steps=75") == 0
    state = read_run_state(run_dir)
    assert (state.best.step, state.best.metrics["valid_bleu"]) == (75, 40.0) and state.kept == ["step_00000075"]
    assert os.readlink(run_dir / "checkpoints" / layout.BEST) == "step_00000075"
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step_00000075"
    assert scripted.validated == [30, 45, 60, 75]


def test_a_save_killed_before_the_run_state_recorded_it_is_undone(tmp_path: Path, tiny_csv: Path, scripted,
                                                                  caplog):
    scripted.scores.update({30: 5.0, 45: 6.0, 60: 7.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    state_bytes = (run_dir / STATE_FILE).read_bytes()
    # What a kill between the checkpoint's rename and the run state's leaves behind: a complete
    # step directory that state.json does not name.
    orphan = run_dir / "checkpoints" / "step_00000050"
    shutil.copytree(run_dir / "checkpoints" / "step_00000045", orphan)
    assert CheckpointManager(RunDirectory(run_dir), keep=1).resume_point() == run_dir / "checkpoints" / "step_00000045"
    assert not orphan.exists() and (run_dir / STATE_FILE).read_bytes() == state_bytes
    assert "its save was interrupted before the run state recorded it" in caplog.text


@pytest.mark.slow
def test_a_damaged_best_checkpoint_is_dropped_and_the_next_validation_sets_a_new_one(
        tmp_path: Path, tiny_csv: Path, scripted, caplog):
    scripted.scores.update({30: 5.0, 45: 9.0, 60: 1.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv, keep_checkpoints=2), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    newest = run_dir / "checkpoints" / "step_00000045"  # the best and the newest
    (newest / checkpoint.MODEL_FILE).write_bytes(b"torn")
    assert train_run(config, run_dir, "train.max_steps=60") == 0
    assert "the best checkpoint step_00000045 is damaged or gone" in caplog.text
    state = read_run_state(run_dir)
    assert state.best.step == 60 and state.best.metrics["valid_bleu"] == 1.0  # redone from step 30: 45 was not validated again
    assert list((run_dir / "checkpoints").glob("corrupt-step_00000045-*"))  # moved aside, not deleted


@pytest.mark.slow
def test_a_best_checkpoint_whose_training_state_is_torn_stays_best_for_its_weights(
        tmp_path: Path, tiny_csv: Path, scripted, caplog):
    scripted.scores.update({30: 5.0, 45: 9.0, 60: 1.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv, keep_checkpoints=2), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    newest = run_dir / "checkpoints" / "step_00000045"  # the best and the newest
    weights = (newest / checkpoint.MODEL_FILE).read_bytes()
    (newest / checkpoint.TRAINING_FILE).write_bytes(b"torn")
    assert train_run(config, run_dir, "train.max_steps=60") == 0
    assert "keeping step_00000045 for its weights" in caplog.text
    state = read_run_state(run_dir)
    assert (state.best.step, state.latest) == (45, "step_00000060")  # resumed from 30; 45 is still the best
    assert (newest / checkpoint.MODEL_FILE).read_bytes() == weights and find_checkpoint(run_dir) == newest


@pytest.mark.slow
def test_a_run_of_an_earlier_version_is_refused_with_one_line(tmp_path: Path, tiny_csv: Path, scripted, capsys):
    scripted.scores.update({30: 5.0, 45: 6.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir) == 0
    # What the previous version wrote: run state format 1, checkpoints without a format.
    state = json.loads((run_dir / STATE_FILE).read_text())
    (run_dir / STATE_FILE).write_text(json.dumps(dict(state, format=1)))
    assert train_run(config, run_dir, "train.max_steps=60") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {run_dir / STATE_FILE}: run state format 1, but this version reads format 2: the run was trained "
        "by another version of this project")
    (run_dir / STATE_FILE).write_text(json.dumps(state))
    meta_path = run_dir / "checkpoints" / "step_00000045" / "meta.json"
    meta_path.write_text(json.dumps({k: v for k, v in json.loads(meta_path.read_text()).items() if k != "format"}))
    with pytest.raises(CheckpointError, match=f"^{meta_path}: checkpoint format None, but this version reads format 2"):
        read_meta(meta_path.parent)


@pytest.mark.slow
def test_the_run_state_is_replaced_in_one_rename(tmp_path: Path, tiny_csv: Path, scripted, monkeypatch):
    """A failed write of state.json leaves the previous one whole and stops training with one message."""
    scripted.scores.update({30: 5.0, 45: 6.0})
    config, run_dir = write_config(tmp_path / "c.yaml", tiny_csv), tmp_path / "run"
    assert train_run(config, run_dir, "train.max_steps=30") == 0
    state_bytes = (run_dir / STATE_FILE).read_bytes()
    real_replace = os.replace

    def refuse_state(src, dst, *args, **kwargs):
        if str(dst).endswith(STATE_FILE):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse_state)
    assert train_run(config, run_dir) == 2
    assert (run_dir / STATE_FILE).read_bytes() == state_bytes
    assert not list(run_dir.glob(f".{STATE_FILE}.tmp-*"))


def test_the_checkpoint_bench_refuses_a_directory_without_a_run_in_one_line(tmp_path: Path, monkeypatch, capsys):
    """bench/checkpoint_choice.py, which measured the rule above, stopped with a traceback (StopIteration) on
    a directory train.py did not write, and with a CheckpointError's on checkpoints copied aside alone."""
    import runpy

    def bench(*extra: str) -> str:
        monkeypatch.setattr(sys, "argv", ["checkpoint_choice.py", "--run", str(tmp_path), *extra])
        with pytest.raises(SystemExit) as stopped:
            runpy.run_path(str(ROOT / "bench" / "checkpoint_choice.py"), run_name="__main__")
        assert stopped.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert f"{tmp_path / 'heldout'}: no valid split with references here" in bench()
    assert f"{tmp_path / 'heldout'}: no test split" in bench("--test", "step_00000010")
    (tmp_path / "heldout").mkdir()
    (tmp_path / "heldout" / "test.en").write_text("Hi.\n", encoding="utf-8")
    (tmp_path / "heldout" / "test.fr.1").write_text("Salut.\n", encoding="utf-8")
    assert bench("--test", "step_00000010").endswith(
        f"--test step_00000010: no such checkpoint in {tmp_path / 'checkpoints'}")
    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)  # copied aside without its files
    assert str(tmp_path / "checkpoints" / "step_00000010") in bench("--test", "step_00000010")
