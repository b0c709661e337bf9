"""Data parallelism under torchrun (CPU, gloo): 2 processes with half the per-rank token budget
train exactly what 1 process does with the whole budget (same per-step losses, same weights up to
float summation order); only rank 0 writes the run directory; a SIGTERM to torchrun stops both
ranks at one step with a checkpoint, and resuming lands on the same weights. Plus the pieces:
the helpers without a process group, and a data position carried across a change of world size.

The 2-process runs go through `python -m torch.distributed.run` (torchrun) as a user would start
them, with --standalone so that torchrun picks a free port itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout

from transformer.errors import ConfigError
from transformer.training import distributed
from transformer.data.batching import shard_batch
from transformer.data.encode import corpus_of
from transformer.checkpoints.layout import TENSORBOARD_DIR
from transformer.training.logs import LOG_FILE, setup_logging
from transformer.training.budget import BudgetState, Plan
from transformer.training.state import TrainState, adapt_data_position

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI script at the repository root)

BUDGET = 256  # one process's batch_tokens; each of 2 ranks gets half
MAX_STEPS = 6
STOP_AFTER = 2  # the stopped run gets SIGTERM once this step's checkpoint exists

# train.py with each step slowed down, so that SIGTERM lands mid-run, and held before step `hold` until
# the test creates the `release` file, so that the run cannot end before the signal however slow the
# machine (the deadline only keeps an abandoned process from waiting forever). The waits touch no RNG.
SLOW_TRAIN = """
import os, sys, time
sys.path.insert(0, {root!r})
import transformer.training.trainer as trainer
train_step = trainer.Trainer.train_step
def slow_train_step(self, batches):
    if self.state.step + 1 >= {hold}:
        deadline = time.monotonic() + 600
        while not os.path.exists({release!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep({seconds})
    return train_step(self, batches)
trainer.Trainer.train_step = slow_train_step
import train
sys.exit(train.main(sys.argv[1:]))
"""


def write_config(path: Path, csv_path: Path, batch_tokens: int, **train: object) -> Path:
    config = {
        "data": {"path": str(csv_path), "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64,
                  "dropout": 0.0},
        # adam_eps 1e-6, not 1e-9: the attention key bias cannot change a softmax over keys, so its
        # exact gradient is 0 and both runs compute float noise of ~1e-9 there, in a different
        # summation order; with eps 1e-9 Adam would normalise that noise into full +-lr steps.
        "train": {"max_steps": MAX_STEPS, "batch_tokens": batch_tokens, "accumulate_batches": 2,
                  "schedule": "inverse_sqrt", "peak_lr": 1e-3, "warmup_steps": 4, "adam_eps": 1e-6,
                  "log_every": 1, "valid_every": 100, "checkpoint_every": STOP_AFTER,
                  "keep_checkpoints": 10, "device": "cpu", "threads": 1, "attention_images": False,
                  # fp32: the equivalences below are to float rounding; `auto` may pick bf16 on CPUs
                  # with AMX or AVX-512-BF16, whose rounding differs with the summation order.
                  "precision": "fp32", **train},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def torchrun(script: list[str], config: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *script,
            "--config", str(config), "--run-dir", str(run_dir), "--no-progress", *extra]


def run_2_ranks(config: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(torchrun(["train.py"], config, run_dir, *extra), cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    return done


def step_checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / layout.CHECKPOINTS / layout.step_dir_name(step)


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def assert_same_weights(expected: Path, actual: Path, atol: float = 1e-5) -> None:
    a, b = load_file(expected / checkpoint.MODEL_FILE), load_file(actual / checkpoint.MODEL_FILE)
    assert a.keys() == b.keys()
    worst = max(float((a[name] - b[name]).abs().max()) for name in a)
    assert worst <= atol, f"weights differ by up to {worst}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, tiny_csv: Path) -> Path:
    """The run dir of 1 process with budget BUDGET, in-process."""
    directory = tmp_path_factory.mktemp("one_process")
    config = write_config(directory / "one.yaml", tiny_csv, BUDGET)
    assert train_cli.main(["--config", str(config), "--run-dir", str(directory / "run"), "--no-progress"]) == 0
    return directory / "run"


@pytest.fixture(scope="module")
def half_budget_config(tmp_path_factory: pytest.TempPathFactory, tiny_csv: Path) -> Path:
    return write_config(tmp_path_factory.mktemp("config") / "two.yaml", tiny_csv, BUDGET // 2)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, half_budget_config: Path) -> tuple[Path, str]:
    """The run dir and stderr of 2 ranks with budget BUDGET / 2 each."""
    run_dir = tmp_path_factory.mktemp("two_ranks") / "run"
    return run_dir, run_2_ranks(half_budget_config, run_dir).stderr


# --------------------------------------------------------------------------- 2 processes = 1 process


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_two_ranks_with_half_the_budget_train_what_one_process_trains(one_process: Path, two_ranks):
    run_dir, _ = two_ranks
    one_loss, two_loss = scalars(one_process, "train/smoothed_loss"), scalars(run_dir, "train/smoothed_loss")
    assert [step for step, _ in two_loss] == list(range(1, MAX_STEPS + 1))
    np.testing.assert_allclose([v for _, v in two_loss], [v for _, v in one_loss], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in scalars(run_dir, "train/grad_norm")],
                               [v for _, v in scalars(one_process, "train/grad_norm")], rtol=1e-4)
    assert_same_weights(step_checkpoint(one_process, MAX_STEPS), step_checkpoint(run_dir, MAX_STEPS))
    one_state = checkpoint.read_meta(step_checkpoint(one_process, MAX_STEPS))["state"]
    two_state = checkpoint.read_meta(step_checkpoint(run_dir, MAX_STEPS))["state"]
    for key in ("step", "epoch", "batch_in_epoch", "target_tokens"):  # the global counts, not one rank's
        assert two_state[key] == one_state[key], key
    assert (one_state["world_size"], two_state["world_size"]) == (1, 2)


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_a_rank_with_no_sentence_in_a_step_still_joins_the_gradient_reduction(tmp_path: Path, tiny_csv: Path):
    """Global batches of 2 tokens hold one sentence each (every pair is longer), so rank 1's shard of
    every batch is empty: it trains on nothing, runs its zero-weight pass, and the two ranks learn
    what one process does."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_cli.main(["--config", str(write_config(tmp_path / "one.yaml", tiny_csv, 2)),
                           "--run-dir", str(one), "--no-progress"]) == 0
    run_2_ranks(write_config(tmp_path / "two.yaml", tiny_csv, 1), two)
    np.testing.assert_allclose([v for _, v in scalars(two, "train/smoothed_loss")],
                               [v for _, v in scalars(one, "train/smoothed_loss")], rtol=1e-5)
    assert_same_weights(step_checkpoint(one, MAX_STEPS), step_checkpoint(two, MAX_STEPS))


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_only_rank_0_writes_the_run_directory_and_logs_at_info(one_process: Path, two_ranks):
    run_dir, stderr = two_ranks

    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                      if p.is_file() and TENSORBOARD_DIR not in p.parts)

    assert files(run_dir) == files(one_process)  # the same files as one process writes, no more
    assert len(list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 1  # one writer
    log = (run_dir / LOG_FILE).read_text(encoding="utf-8")
    assert log.count(f"done: {MAX_STEPS} steps") == 1 and "[rank 1]" not in log
    assert stderr.count(f"done: {MAX_STEPS} steps") == 1 and "2 processes" in stderr
    assert "Traceback" not in stderr
    training = checkpoint.load_training_state(step_checkpoint(run_dir, MAX_STEPS))
    assert len(training["rank_rng"]) == 2  # every rank's dropout stream, for an exact resume
    assert "rank_rng" not in checkpoint.load_training_state(step_checkpoint(one_process, MAX_STEPS))


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_sigterm_to_torchrun_stops_both_ranks_with_a_checkpoint_then_resume_matches(
        tmp_path: Path, half_budget_config: Path, one_process: Path):
    run_dir, log = tmp_path / "run", tmp_path / "stopped.log"
    release = tmp_path / "release"
    code = SLOW_TRAIN.format(root=str(ROOT), seconds=0.5, hold=MAX_STEPS - 1, release=str(release))
    script = tmp_path / "slow_train.py"
    script.write_text(code, encoding="utf-8")
    with open(log, "w", encoding="utf-8") as stderr:
        process = subprocess.Popen(torchrun([str(script)], half_budget_config, run_dir), cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=stderr, env=dict(os.environ, OMP_NUM_THREADS="1"))
    meta = step_checkpoint(run_dir, STOP_AFTER) / checkpoint.META_FILE
    deadline = time.monotonic() + 120
    while not meta.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no checkpoint at step {STOP_AFTER}:\n{log.read_text()}")
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    # Released once both ranks have the signal: ranks already held take their held step, and stop there.
    while log.read_text(encoding="utf-8").count("SIGTERM received") < 2:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the ranks never logged the SIGTERM:\n{log.read_text()}")
        time.sleep(0.05)
    release.touch()
    process.wait(timeout=60)
    err = log.read_text(encoding="utf-8")
    assert err.count("SIGTERM received: finishing this step and saving a checkpoint") == 2, err  # both ranks
    stopped = layout.list_checkpoints(run_dir)[-1]
    stop_step = checkpoint.read_meta(stopped, verify=True, need_training_state=True)["step"]
    assert STOP_AFTER <= stop_step < MAX_STEPS, err
    assert f"stopped at step {stop_step}; saved {stopped}. Resume with: torchrun --nproc_per_node=2 " in err

    resumed = run_2_ranks(half_budget_config, run_dir)
    assert f"resuming from {stopped} (step {stop_step}," in resumed.stderr
    assert_same_weights(step_checkpoint(one_process, MAX_STEPS), step_checkpoint(run_dir, MAX_STEPS))


# --------------------------------------------------------------------------- one rank fails, all stop

# train.py whose checkpoint writes fail as on a full disk: only rank 0 writes checkpoints, so only it
# meets the error, in the middle of the training loop.
FULL_DISK_AT_SAVE = """
import errno, sys
sys.path.insert(0, {root!r})
from transformer.checkpoints import files
def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
files.write_checkpoint = full_disk
import train
sys.exit(train.main(sys.argv[1:]))
"""


def run_2_ranks_to_failure(tmp_path: Path, script: list[str], config: Path,
                           run_dir: Path) -> tuple[dict[int, str], dict[int, int]]:
    """Each rank's stderr (torchrun writes them to files of their own) and exit code, of a torchrun
    run that must fail; a run that hangs fails the test at its timeout."""
    logs = tmp_path / "torchrun-logs"
    command = torchrun(script, config, run_dir)
    command[4:4] = ["--redirects", "3", "--log-dir", str(logs)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode != 0, done.stderr
    stderr = {int(path.parent.name): path.read_text(encoding="utf-8") for path in logs.rglob("stderr.log")}
    # torchrun's summary: a block per failed rank, "rank      : 1 (local_rank: 1)" then "exitcode  : 2 (pid: ...)"
    codes = {int(rank): int(code) for rank, code in
             re.findall(r"^\s+rank\s*:\s*(\d+).*\n\s+exitcode\s*:\s*(-?\d+)", done.stderr, re.MULTILINE)}
    return stderr, codes


def assert_every_rank_stopped_with_one_line(stderr: dict[int, str], codes: dict[int, int], rank_0_says: str) -> None:
    expected = {0: f"error: {rank_0_says}", 1: f"[rank 1] error: rank 0 failed: {rank_0_says}"}
    assert sorted(stderr) == sorted(codes) == [0, 1], (codes, stderr)
    for rank, text in stderr.items():
        assert "Traceback" not in text, text
        errors = [line for line in text.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(expected[rank]), text
    # Each rank exits 2 on its own: torchrun's SIGTERM to the ranks still ending once one has exited is
    # ignored by a rank that has its error to report.
    assert codes == {0: 2, 1: 2}, (codes, stderr)


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_a_missing_data_file_stops_both_ranks_with_one_line_each(tmp_path: Path):
    config = write_config(tmp_path / "missing.yaml", tmp_path / "missing.csv", BUDGET // 2)
    stderr, codes = run_2_ranks_to_failure(tmp_path, ["train.py"], config, tmp_path / "run")
    assert_every_rank_stopped_with_one_line(stderr, codes, f"data file not found: {tmp_path / 'missing.csv'}")


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_a_changed_config_on_resume_stops_both_ranks_with_one_line_each(tmp_path: Path, tiny_csv: Path):
    run_dir = tmp_path / "run"
    first = write_config(tmp_path / "first.yaml", tiny_csv, BUDGET, max_steps=2)
    assert train_cli.main(["--config", str(first), "--run-dir", str(run_dir), "--no-progress"]) == 0
    changed = write_config(tmp_path / "changed.yaml", tiny_csv, BUDGET // 2, max_steps=2, peak_lr=5e-4)
    stderr, codes = run_2_ranks_to_failure(tmp_path, ["train.py"], changed, run_dir)
    assert_every_rank_stopped_with_one_line(stderr, codes, f"{run_dir} holds a run started with a different config")
    assert "train.peak_lr" in stderr[0]  # rank 0's message goes on to list the changes


@pytest.mark.slow
@pytest.mark.alone  # torchrun's two ranks need both cores
def test_a_full_disk_at_a_checkpoint_stops_both_ranks_at_that_step(tmp_path: Path, half_budget_config: Path):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_AT_SAVE.format(root=str(ROOT)), encoding="utf-8")
    run_dir = tmp_path / "run"
    stderr, codes = run_2_ranks_to_failure(tmp_path, [str(script)], half_budget_config, run_dir)
    checkpoint_path = step_checkpoint(run_dir, STOP_AFTER)
    assert_every_rank_stopped_with_one_line(stderr, codes, f"cannot write checkpoint {checkpoint_path}: No space left")


# --------------------------------------------------------------------------- the pieces, in one process


def test_helpers_are_identities_without_a_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not distributed.launched() and (distributed.rank(), distributed.world_size()) == (0, 1)
    assert distributed.is_main()
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    assert distributed.gather_objects(3) == [3]
    assert distributed.all_reduce_sum([1, 2.5]) == [1.0, 2.5]
    assert distributed.all_reduce_max([0, 7]) == [0.0, 7.0]
    cpu = torch.device("cpu")
    assert distributed.training_device(cpu) == cpu
    with distributed.process_group(cpu), distributed.main_first(), distributed.fail_together():
        assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="^mine$"), distributed.fail_together():
        raise ConfigError("mine")  # no process group: the error as it is


def test_torchrun_environment_is_read_before_the_process_group_exists(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.launched() and distributed.env_rank() == 3 and distributed.local_rank() == 1
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc_per_node=1: a plain run
    assert not distributed.launched() and distributed.env_rank() == 0


@contextlib.contextmanager
def logging_restored():
    """setup_logging changes the root logger: put back the handlers and level the test session had."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def test_other_ranks_log_only_warnings_prefixed_with_their_rank_and_write_no_log_file(tmp_path: Path, capsys):
    with logging_restored():
        setup_logging(tmp_path / "run", rank=1)
        logging.getLogger("transformer.training.trainer").info("step 10  valid loss 1.0")
        logging.getLogger("transformer.training.trainer").warning("step 11: non-finite loss")
    assert capsys.readouterr().err == "[rank 1] step 11: non-finite loss\n"
    assert not (tmp_path / "run").exists()


def test_libraries_info_lines_stay_out_of_the_log_and_their_warnings_do_not(tmp_path: Path, capsys):
    with logging_restored():
        setup_logging(tmp_path / "run")
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("datasets.builder").info("Generating train split")
        logging.getLogger("transformer.training.trainer").info("step 10  valid loss 1.0")
        logging.getLogger("matplotlib.font_manager").warning("findfont: Font family not found")
    assert capsys.readouterr().err == "step 10  valid loss 1.0\nfindfont: Font family not found\n"
    logged = (tmp_path / "run" / LOG_FILE).read_text(encoding="utf-8")
    assert "step 10" in logged and "findfont" in logged and "fontManager" not in logged and "split" not in logged


def test_ranks_draw_distinct_deterministic_dropout_seeds():
    assert distributed.seed_for_rank(42, 1) == 43
    resumed = {distributed.seed_for_rank(42, rank, step) for rank in range(1, 4) for step in (10, 11)}
    assert len(resumed) == 6 and distributed.seed_for_rank(42, 2, 10) == distributed.seed_for_rank(42, 2, 10)


def test_shards_split_each_global_batch_into_contiguous_near_equal_slices():
    batch = np.array([5, 3, 9, 1, 7])
    shards = [shard_batch(batch, rank, 2) for rank in range(2)]
    assert [s.tolist() for s in shards] == [[5, 3, 9], [1, 7]]
    assert shard_batch(batch, 0, 1) is batch  # one process: the batch itself
    few = [shard_batch(np.array([4]), rank, 3) for rank in range(3)]
    assert [s.tolist() for s in few] == [[4], [], []]  # fewer sentences than ranks: empty shards


def test_resuming_with_another_world_size_keeps_the_fraction_of_the_epoch(tiny_config, tiny_encoded, tmp_path,
                                                                          caplog):
    corpus = corpus_of(tiny_encoded.train)
    config = dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, batch_tokens=64))
    train = config.train
    # Saved by 2 processes (global batches of 128 tokens); resumed by this one (64).
    saved_batches = len(corpus.batches(train.batch_tokens * 2, train.seed, 3))
    own_batches = len(corpus.batches(train.batch_tokens, train.seed, 3))
    state = TrainState(step=40, epoch=3, batch_in_epoch=saved_batches // 2, world_size=2,
                       budget=BudgetState(Plan(60, 0, 0), {"max_steps": 60, "max_epochs": 0, "max_minutes": 0.0}))
    with caplog.at_level(logging.WARNING):
        adapt_data_position(state, saved_batches, own_batches, world_size=1)
    assert state.epoch == 3 and state.world_size == 1
    assert state.batch_in_epoch == round(saved_batches // 2 * own_batches / saved_batches)
    assert "resuming a run trained by 2 process(es) with 1" in caplog.text and "approximate" in caplog.text

