"""`train.precision: auto` decided by measurement (training/precision_choice.py): a new run on
hardware with bf16 units times both precisions on its own batches and trains at the faster, logs
both figures, and records the choice in its checkpoints; a resume keeps it without timing again and
ends bitwise as the run left alone; an explicit precision, or hardware without bf16 units, times
nothing. The timing touches neither the run's weights, nor its optimizer, nor its random state.

Which precision wins is the test's to say (the timing is replaced, or its figures overridden), so
these tests pass alike on CPUs with and without bf16 units.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from test_distributed import MAX_STEPS as TORCHRUN_STEPS
from test_distributed import ROOT, torchrun
from test_distributed import write_config as torchrun_config
from test_resume import assert_same_training
from transformer.checkpoints import layout
from transformer.checkpoints.format import read_meta
from transformer.checkpoints.layout import TENSORBOARD_DIR
from transformer.config import Config, config_from_dict, config_to_dict
from transformer.data.batching import Batch
from transformer.data.encode import EncodedSplits, corpus_of
from transformer.data.tokenizer import Tokenizers
from transformer.model import Transformer
from transformer.runtime import rng_state
from transformer.training import precision_choice, run
from transformer.training.optim import build_optimizer
from transformer.training.precision_choice import (
    SAMPLE_BATCHES, PrecisionChoice, choose_precision, sample_batches, time_precisions)
from transformer.training.state import TrainingData

CPU = torch.device("cpu")
STEPS = 4


def auto_config(config: Config, precision: str = "auto") -> Config:
    raw = config_to_dict(config)
    raw["train"].update(max_steps=STEPS, checkpoint_every=2, valid_every=STEPS, threads=1, precision=precision)
    return config_from_dict(raw)


class Timing:
    """Stands in for the hardware and the timing: `bf16_units` is what fast_bf16 says, `speeds` what
    the timing measures (target tokens/s by precision); `calls` counts the timings."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bf16_units, self.speeds, self.calls, self.batches = True, {"fp32": 1000.0, "bf16": 2000.0}, 0, []
        monkeypatch.setattr(precision_choice, "fast_bf16", lambda device: self.bf16_units)
        monkeypatch.setattr(precision_choice, "time_precisions", self.time)

    def time(self, model, train, batches, device) -> dict[str, float]:
        self.calls += 1
        self.batches = batches
        return dict(self.speeds)


@pytest.fixture
def timing(monkeypatch: pytest.MonkeyPatch) -> Timing:
    return Timing(monkeypatch)


def precision_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision")]


def recorded(run_dir: Path, step: int = STEPS) -> str:
    return read_meta(run_dir / layout.CHECKPOINTS / layout.step_dir_name(step))["state"]["precision"]


def last_checkpoint(run_dir: Path) -> Path:
    return run_dir / layout.CHECKPOINTS / layout.step_dir_name(STEPS)


# --------------------------------------------------------------------------- the choice in a run


@pytest.mark.parametrize("speeds, winner", [({"fp32": 1000.0, "bf16": 2500.0}, "bf16"),
                                            ({"fp32": 3000.0, "bf16": 2000.0}, "fp32")], ids=["bf16", "fp32"])
def test_auto_times_both_precisions_trains_at_the_faster_and_records_and_logs_it(
        timing: Timing, tiny_config: Config, tmp_path: Path, caplog, speeds: dict, winner: str):
    timing.speeds = speeds
    with caplog.at_level(logging.INFO):
        outcome = run.train(auto_config(tiny_config), tmp_path / "run", show_progress=False)
    assert timing.calls == 1
    assert timing.batches and all(isinstance(b, Batch) for b in timing.batches)  # the run's own batches
    assert outcome.state.precision == winner and recorded(tmp_path / "run") == winner
    assert "precision: auto" in (tmp_path / "run" / "config.yaml").read_text(encoding="utf-8")  # the request stays
    [line] = precision_lines(caplog)
    assert line.startswith(f"precision auto: {winner}, the faster here")
    assert f"fp32 {speeds['fp32']:,.0f}" in line and f"bf16 {speeds['bf16']:,.0f}" in line and "measuring took" in line
    assert any(f"device cpu, {winner}," in r.getMessage() for r in caplog.records)  # what the model line says
    events = EventAccumulator(str(tmp_path / "run" / TENSORBOARD_DIR))
    events.Reload()
    assert [e.value for e in events.Scalars("precision/bf16_target_tokens_per_second")] == [speeds["bf16"]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_explicit_precision_is_never_overridden_and_nothing_is_timed(
        timing: Timing, tiny_config: Config, tmp_path: Path, caplog, precision: str):
    timing.speeds = {"fp32": 1000.0, "bf16": 1000.0, precision: 1.0}  # the other would win a timing
    with caplog.at_level(logging.INFO):
        outcome = run.train(auto_config(tiny_config, precision), tmp_path / "run", show_progress=False)
    assert timing.calls == 0 and precision_lines(caplog) == []
    assert outcome.state.precision == precision and recorded(tmp_path / "run") == precision


def test_without_bf16_units_auto_is_fp32_and_nothing_is_timed(timing: Timing, tiny_config: Config, tmp_path: Path,
                                                              caplog):
    timing.bf16_units = False
    with caplog.at_level(logging.INFO):
        outcome = run.train(auto_config(tiny_config), tmp_path / "run", show_progress=False)
    assert timing.calls == 0 and outcome.state.precision == "fp32" and recorded(tmp_path / "run") == "fp32"
    assert precision_lines(caplog) == ["precision auto: fp32, as this hardware has no bf16 units (nothing timed)"]


@pytest.mark.slow
def test_a_stopped_auto_run_resumes_at_its_recorded_choice_without_timing_and_ends_bitwise_as_one_left_alone(
        timing: Timing, tiny_config: Config, tmp_path: Path, caplog):
    config = auto_config(tiny_config)
    # fp32 measured faster: the bitwise comparison below then holds on any CPU, whatever its bf16 kernels do
    # beside other work; which precision is recorded does not matter to what is tested, that it is kept.
    timing.speeds = {"fp32": 2000.0, "bf16": 1000.0}
    run.train(config, tmp_path / "alone", show_progress=False)
    steps = iter(range(1, 100))
    first = run.train(config, tmp_path / "stopped", should_stop=lambda: next(steps) >= 2, show_progress=False)
    assert first.state.step == 2 and timing.calls == 2
    timing.speeds = {"fp32": 1000.0, "bf16": 2000.0}  # a timing now would choose otherwise
    caplog.clear()  # the lines of the runs above, where an earlier test left the log level at INFO
    with caplog.at_level(logging.INFO):
        second = run.train(config, tmp_path / "stopped", show_progress=False)
    assert second.resumed_from.name == layout.step_dir_name(2) and timing.calls == 2  # not timed again
    assert second.state.precision == "fp32" and recorded(tmp_path / "stopped") == "fp32"
    assert precision_lines(caplog) == ["precision auto: fp32, as measured when this run started (recorded in its "
                                       "checkpoints)"]
    assert_same_training(last_checkpoint(tmp_path / "alone"), last_checkpoint(tmp_path / "stopped"))


@pytest.mark.slow
def test_the_timing_leaves_the_run_as_it_was_an_auto_run_that_chose_fp32_is_the_run_told_fp32(
        monkeypatch: pytest.MonkeyPatch, tiny_config: Config, tmp_path: Path):
    """The real timing (steps in both precisions, dropout drawn) runs; only its verdict is the test's."""
    measured = []

    def fp32_wins(model, train, batches, device):
        speeds = time_precisions(model, train, batches, device)
        measured.append(speeds)
        return {"fp32": 2.0, "bf16": 1.0}

    monkeypatch.setattr(precision_choice, "fast_bf16", lambda device: True)
    monkeypatch.setattr(precision_choice, "time_precisions", fp32_wins)
    auto = run.train(auto_config(tiny_config), tmp_path / "auto", show_progress=False)
    told = run.train(auto_config(tiny_config, "fp32"), tmp_path / "told", show_progress=False)
    assert len(measured) == 1 and all(speed > 0 for speed in measured[0].values())
    assert auto.state.precision == told.state.precision == "fp32"
    assert_same_training(last_checkpoint(tmp_path / "told"), last_checkpoint(tmp_path / "auto"))


# --------------------------------------------------------------------------- the pieces


def tiny_data(tiny_encoded: EncodedSplits) -> TrainingData:
    return TrainingData(corpus_of(tiny_encoded.train), None, None, {})  # valid, tokenizers, fingerprints: unused


def test_the_timing_reads_the_model_and_restores_the_random_state(tiny_config: Config, tiny_encoded: EncodedSplits,
                                                                  tiny_tokenizers: Tokenizers):
    torch.manual_seed(0)
    model = Transformer(tiny_config.model, tiny_tokenizers.source_vocab_size, tiny_tokenizers.target_vocab_size)
    optimizer = build_optimizer(model, tiny_config.train)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    random_state = rng_state()["torch"]
    batches = sample_batches(tiny_data(tiny_encoded), tiny_config.train)
    speeds = time_precisions(model, tiny_config.train, batches, CPU)
    assert set(speeds) == {"fp32", "bf16"} and all(speed > 0 for speed in speeds.values())
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and optimizer.state_dict()["state"] == {}
    assert torch.equal(rng_state()["torch"], random_state)


def test_the_timed_batches_are_the_run_s_first_spread_from_short_to_long(tiny_config: Config,
                                                                         tiny_encoded: EncodedSplits):
    data = tiny_data(tiny_encoded)
    corpus, train = data.corpus, tiny_config.train
    batches = sample_batches(data, train)
    first = [corpus.batch(indices) for indices in corpus.batches(train.batch_tokens, train.seed, 0)]

    def size(batch: Batch) -> int:
        return batch.src.shape[1] + batch.tgt_in.shape[1]

    assert 1 < len(batches) <= SAMPLE_BATCHES
    assert [size(b) for b in batches] == sorted(size(b) for b in batches)
    assert size(batches[0]) == min(map(size, first)) and size(batches[-1]) == max(map(size, first))
    assert all(any(torch.equal(b.src, f.src) and torch.equal(b.tgt_out, f.tgt_out) for f in first) for b in batches)


def never() -> dict[str, float]:
    raise AssertionError("timed")


@pytest.mark.parametrize("requested, bf16_units, resuming, record, expected", [
    ("fp16", True, False, None, PrecisionChoice("fp16", "explicit")),
    ("auto", False, False, None, PrecisionChoice("fp32", "no fast bf16")),
    ("auto", True, True, "fp32", PrecisionChoice("fp32", "recorded")),
    ("auto", False, True, "bf16", PrecisionChoice("bf16", "recorded")),  # resumed elsewhere: the run's precision stays
    ("auto", True, True, None, PrecisionChoice("bf16", "rule")),  # a run from before the record: what auto meant
    ("auto", False, True, None, PrecisionChoice("fp32", "rule")),
])
def test_what_is_chosen_without_timing(monkeypatch, requested, bf16_units, resuming, record, expected):
    monkeypatch.setattr(precision_choice, "fast_bf16", lambda device: bf16_units)
    assert choose_precision(requested, CPU, resuming, record, never) == expected


def test_a_tie_keeps_fp32(monkeypatch):
    monkeypatch.setattr(precision_choice, "fast_bf16", lambda device: True)
    choice = choose_precision("auto", CPU, False, None, lambda: {"fp32": 5.0, "bf16": 5.0})
    assert (choice.precision, choice.how, choice.speeds) == ("fp32", "measured", {"fp32": 5.0, "bf16": 5.0})


# --------------------------------------------------------------------------- under torchrun

# train.py in each rank with bf16 units assumed and the timing replaced: on rank 0 bf16 wins, on
# rank 1 fp32 would. Each rank writes which precision its trainer got, and whether it timed.
RANKS_DISAGREE = """
import os, sys
sys.path.insert(0, {root!r})
import transformer.training.precision_choice as precision_choice
import transformer.training.trainer as trainer
rank = os.environ["RANK"]
def note(name, text):
    with open(os.path.join({notes!r}, f"{{name}}.{{rank}}"), "a") as handle:
        handle.write(text)
def timed(model, train, batches, device):
    note("timed", "yes")
    return {{"fp32": 1.0, "bf16": 2.0}} if rank == "0" else {{"fp32": 2.0, "bf16": 1.0}}
precision_choice.fast_bf16 = lambda device: True
precision_choice.time_precisions = timed
init = trainer.Trainer.__init__
def noting_init(self, config, *args, **kwargs):
    note("precision", config.train.precision)
    init(self, config, *args, **kwargs)
trainer.Trainer.__init__ = noting_init
import train
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_under_torchrun_rank_0_times_and_every_rank_trains_at_its_choice(tmp_path: Path, tiny_csv: Path):
    notes = tmp_path / "notes"
    notes.mkdir()
    script = tmp_path / "ranks_disagree.py"
    script.write_text(RANKS_DISAGREE.format(root=str(ROOT), notes=str(notes)), encoding="utf-8")
    config = torchrun_config(tmp_path / "two.yaml", tiny_csv, 128, precision="auto")
    done = subprocess.run(torchrun([str(script)], config, tmp_path / "run"), cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in notes.iterdir()) == ["precision.0", "precision.1", "timed.0"]
    assert [(notes / f"precision.{rank}").read_text() for rank in (0, 1)] == ["bf16", "bf16"]
    assert "precision auto: bf16, the faster here" in done.stderr
    assert recorded(tmp_path / "run", TORCHRUN_STEPS) == "bf16"
