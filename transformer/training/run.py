"""Build a training run from a config and hand it to the Trainer: the run directory, the data (one
call to data/prepare.py, told which tokenizer files the run reuses or writes), model, optimizer,
and the checkpoint to resume from. It loads and saves nothing itself: the run directory's files go
through checkpoints/rundir.py, checkpoints through the checkpoint manager. Process-wide settings
(threads, the allocator, logging) are train.py's.

Under torchrun, rank 0 alone writes the run directory; the other ranks read what it wrote (so the
run directory must be on a filesystem every node sees at the same path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from transformer.checkpoints.manager import CheckpointManager, load_checkpoint
from transformer.checkpoints.parent import Parent, load_parent_weights, open_parent
from transformer.checkpoints.format import read_meta
from transformer.checkpoints.layout import Best
from transformer.checkpoints.lookup import load_run_config
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import Config, config_to_dict, config_to_yaml
from transformer.data.prepare import TokenizerSource, prepare
from transformer.errors import CheckpointError, ConfigError
from transformer.model import Transformer, count_parameters
from transformer.runtime import check_precision, seed_everything, select_device
from transformer.training import distributed
from transformer.training.logs import TensorBoard
from transformer.training.optim import build_optimizer
from transformer.training.precision_choice import decide_precision, log_precision, write_precision
from transformer.training.row_padding import pad_linear_rows
from transformer.training.trainer import Trainer, TrainingData, TrainState
from transformer.training.validation import EvaluationSet, sample_over_lengths
from transformer.translation.metrics import group_references

log = logging.getLogger(__name__)

VALID_SAMPLE = "valid_sample"  # heldout/valid_sample.*: the sentences every validation scores

# Keys that may change between sessions of one run: they steer the loop, not what is learned or how
# it is scored (train.valid_max_pairs sets the validation sample, so it stays). Budgets may change
# as budget.py allows, and so may train.patience (raising it lets an early-stopped run go on). Every
# other key is fixed for the life of a run; train.init_from among them: a run has one parent.
RESUMABLE_KEYS = {
    "name",
    "train.max_steps", "train.max_epochs", "train.max_minutes", "train.patience", "train.log_every",
    "train.valid_every",
    "train.checkpoint_every", "train.keep_checkpoints", "train.n_valid_samples", "train.attention_images",
    "train.device", "train.threads",
}


@dataclass
class TrainOutcome:
    run_dir: Path
    state: TrainState
    best: Best | None  # the best checkpoint of the run so far (rank 0; None elsewhere)
    resumed_from: Path | None
    already_finished: bool  # the budget was used up (or training stopped early) before this session started
    stopped_early: bool  # train.patience validations in a row brought no lower valid loss


def _flatten(mapping: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(old: Config, new: Config) -> list[str]:
    """Keys whose values differ, as 'key: old -> new', excluding those a resume may change."""
    before, after = _flatten(config_to_dict(old)), _flatten(config_to_dict(new))
    return [f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
            for key in sorted(set(before) | set(after))
            if key not in RESUMABLE_KEYS and before.get(key) != after.get(key)]


@contextlib.contextmanager
def _writing(run_dir: Path) -> Iterator[None]:
    """Turn a failed write in the run directory (disk full, read-only, permissions) into a message
    naming the file and the reason, instead of a traceback."""
    try:
        yield
    except OSError as error:
        raise CheckpointError(
            f"cannot write {error.filename or run_dir}: {error.strerror or error}. Training needs a writable "
            "run directory with free space; fix that and rerun (or choose another run directory)"
        ) from error


def train(config: Config, run_dir: Path, should_stop: Callable[[], bool] = lambda: False,
          show_progress: bool = True, rebuild_state: bool = False,
          before_training: Callable[[], None] = lambda: None) -> TrainOutcome:
    """Train (or resume) the run in `run_dir` until a budget is reached or `should_stop()` says so.
    `rebuild_state`: first write the run state anew from the checkpoints on disk (it was lost).
    `before_training` is called once the data is ready, before the model is built: where train.py
    sets process-wide policy meant for the training steps only (the allocator's).

    Started by torchrun (WORLD_SIZE > 1), each process joins the process group and trains its
    share of every batch; see trainer.py."""
    run = RunDirectory(run_dir)
    # Device and precision first: a setting this machine cannot run fails before anything is written.
    device = distributed.training_device(select_device(config.train.device))
    check_precision(config.train.precision, device)
    with distributed.process_group(device), contextlib.ExitStack() as held:
        checkpoints, resume_from = None, None
        # Rank 0 alone checks and locks the run directory, for all ranks, and picks the checkpoint to
        # resume from (moving damaged ones aside); a refusal there stops the other ranks too.
        with distributed.fail_together():
            if distributed.is_main():
                RunDirectory.check_trainable(run.path, rebuilding=rebuild_state)
                held.enter_context(_writing(run.path))
                with _writing(run.path):
                    held.enter_context(run.lock())
                    checkpoints = _open_run(config, run, rebuild_state)
                    resume_from = checkpoints.resume_point()
        resume_from = distributed.broadcast_object(resume_from)
        return _train(config, run, checkpoints, resume_from, device, should_stop, show_progress, before_training)


def _open_run(config: Config, run: RunDirectory, rebuild_state: bool) -> CheckpointManager:
    """Make `run` a run, or check that this config may resume it; its checkpoint manager."""
    if rebuild_state:
        if not run.step_checkpoints():
            raise CheckpointError(f"{run.path}: has no checkpoints to rebuild {run.state_file.name} from")
        checkpoints = CheckpointManager.rebuild(run, config.train.keep_checkpoints)
    else:
        run.create()
        checkpoints = CheckpointManager(run, config.train.keep_checkpoints)
    if checkpoints.state.kept and run.config_file.is_file():
        changes = config_changes(load_run_config(run.path), config)
        if changes:
            raise ConfigError(
                f"{run.path} holds a run started with a different config, so it cannot be resumed with this one:\n  "
                + "\n  ".join(changes)
                + f"\nTrain in another run directory to start a new run, or restore those values (see "
                f"{run.config_file}).")
    return checkpoints


def _train(config: Config, run: RunDirectory, checkpoints: CheckpointManager | None, resume_from: Path | None,
           device: torch.device, should_stop: Callable[[], bool], show_progress: bool,
           before_training: Callable[[], None]) -> TrainOutcome:
    main = distributed.is_main()
    saved_config = config  # keeps `auto`: the precision it chose is recorded in the training state

    # Data and tokenizers: rank 0 first, which fills the datasets cache and writes a new run's
    # tokenizer files; the other ranks then read them instead of racing it to write them.
    with distributed.main_first():
        # A fine-tuned run reads its parent once, at its start; a resume continues from its own checkpoints.
        parent = open_parent(saved_config) if config.train.init_from and resume_from is None else None
        data, heldout = _prepare_data(config, run, write=main, resuming=resume_from is not None, parent=parent)
    before_training()

    seed_everything(config.train.seed)  # the same config gives the same initial weights
    # Stages where one rank may fail alone end in an agreement (fail_together); none holds a collective.
    with distributed.fail_together():
        model = Transformer(config.model, data.tokenizers.source_vocab_size,
                            data.tokenizers.target_vocab_size).to(device)
        pad_linear_rows(model)  # in bf16 on a CPU only: few matrix shapes for oneDNN to compile
        if parent is not None:
            load_parent_weights(parent, model)
        optimizer = build_optimizer(model, config.train)
        with _writing(run.path):
            tensorboard = TensorBoard(run.tensorboard_dir, enabled=main)
    # After the model is built, before the Trainer: `auto` times steps on a copy of the model and
    # restores the random state, so the run goes on exactly as if told the precision it chose.
    choice = decide_precision(config.train, device, model, data, resuming=resume_from is not None,
                              recorded=lambda: _recorded_precision(resume_from) if resume_from else None)
    precision = choice.precision
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision))
    log_precision(choice)
    rank, world_size = distributed.rank(), distributed.world_size()
    if rank:  # each rank draws its own dropout masks; rank 0 keeps the stream of a single-process run
        torch.manual_seed(distributed.seed_for_rank(config.train.seed, rank))
    log.info("model: %s parameters, %d+%d layers, d_model %d; device %s, %s, %d threads%s",
             f"{count_parameters(model):,}", config.model.n_encoder_layers, config.model.n_decoder_layers,
             config.model.d_model, device, precision, torch.get_num_threads(),
             f", {world_size} processes" if world_size > 1 else "")
    trainer = Trainer(config, model, optimizer, data, device, checkpoints, tensorboard, show_progress)
    with distributed.fail_together():
        if parent is not None:  # a resume reads this back from the checkpoint
            trainer.state.parent = parent.record()
        if resume_from is not None:
            load_checkpoint(resume_from, trainer)
            log.info("resuming from %s (step %d, epoch %d, batch %d of it)", resume_from, trainer.state.step,
                     trainer.state.epoch + 1, trainer.state.batch_in_epoch)
        if main:  # every check has passed: the run's files may be written
            with _writing(run.path):
                run.write_config(config_to_yaml(saved_config))
                if resume_from is None:
                    heldout()
                    tensorboard.text(0, "config", "```\n" + config_to_yaml(config) + "\n```")
                    write_precision(choice, tensorboard)
    already_finished = trainer.finished()
    # Checkpoint saves raise their own CheckpointError; this catches the other writers (TensorBoard
    # re-raises its writer thread's OSError on a later call). The last checkpoint stays the resume point.
    with _writing(run.path):
        try:
            state = trainer.run(should_stop)
        finally:
            with contextlib.suppress(OSError):  # the first error is the one to report
                tensorboard.close()
    return TrainOutcome(run.path, state, checkpoints.best if checkpoints else None, resume_from, already_finished,
                        trainer.stopped_early())


def _recorded_precision(checkpoint: Path) -> str | None:
    """The precision the run resumed from `checkpoint` trained at (None: a checkpoint from before the
    precision was recorded)."""
    return read_meta(checkpoint, verify=False)["state"].get("precision")


def _prepare_data(config: Config, run: RunDirectory, write: bool, resuming: bool,
                  parent: Parent | None = None) -> tuple[TrainingData, Callable[[], None]]:
    """The data stage (data/prepare.py) with this run's tokenizers: a new run's trained and written into
    its tokenizer/ (with `write`), a resumed run's read back, a fine-tuned run's copied from its
    `parent`. The held-out files are written by the function returned, once every check has passed."""
    prepared = prepare(config, _tokenizer_source(run, write, resuming, parent))
    valid_sources, valid_references = group_references(prepared.valid.sources, prepared.valid.targets)
    sample = (run.read_heldout(VALID_SAMPLE) if resuming or not write else None) or \
        sample_over_lengths(valid_sources, valid_references, config.train.valid_max_pairs, config.data.split_seed)
    valid = EvaluationSet(prepared.valid_corpus, *sample)
    data = TrainingData(prepared.corpus, valid, prepared.tokenizers, prepared.fingerprints, prepared.dropout,
                        config.model.decoder_start_id)

    def write_heldout() -> None:
        run.write_heldout("valid", valid_sources, valid_references)
        if len(prepared.test):
            run.write_heldout("test", *group_references(prepared.test.sources, prepared.test.targets))
        run.write_heldout(VALID_SAMPLE, *sample)
        log.info("validation: BLEU and chrF on %d of the %d valid sentences, spread over their lengths (%s)",
                 len(sample[0]), len(valid_sources), run.heldout_dir / f"{VALID_SAMPLE}.en")

    return data, write_heldout


def _tokenizer_source(run: RunDirectory, write: bool, resuming: bool, parent: Parent | None) -> TokenizerSource:
    """Which tokenizer files the data stage reads, or whether it trains new ones for this run to write."""
    if not write:  # a rank > 0, after rank 0 saved them: they must be visible here too
        if not run.tokenizer_dir.is_dir():
            raise CheckpointError(f"rank {distributed.rank()} cannot see {run.tokenizer_dir}, which rank 0 has "
                                  "written: every node must see the run directory at the same path (a shared "
                                  "filesystem)")
        return TokenizerSource.read(run.tokenizer_dir)
    if resuming:  # the checkpoint's fingerprint check makes sure they are the ones it used
        return TokenizerSource.read(run.tokenizer_dir)
    if parent is not None:  # fine-tuning: the parent's vocabulary, byte for byte
        with _writing(run.path):
            run.copy_tokenizer(parent.run.tokenizer_dir)
        log.info("tokenizers: copied from the parent run's %s", parent.run.tokenizer_dir)
        return TokenizerSource.read(run.tokenizer_dir)

    # Trained afresh whenever there is no checkpoint to resume, even if a killed earlier session
    # left tokenizer files: their settings or data may since have changed.
    def store(save: Callable[[Path], None]) -> None:
        with _writing(run.path):
            run.replace_tokenizer(save)

    return TokenizerSource.train(run.tokenizer_dir, store)
