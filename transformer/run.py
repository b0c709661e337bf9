"""Build a training run from a config: run directory, data, tokenizers, model, optimizer, and the
state of an earlier session to resume. Then hand over to the Trainer. train.py calls `train`.

Run directory (one self-contained artifact: translate.py needs nothing else):
    config.yaml  tokenizer/  checkpoints/step_*/  checkpoints/best/  heldout/  tensorboard/  train.log
    .lock (held while a process trains the run)

Under torchrun, rank 0 alone writes the run directory; the other ranks read what it wrote (so the
run directory must be on a filesystem every node sees at the same path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from . import checkpoint, distributed
from .allocator import reuse_freed_memory
from .average import average_checkpoints
from .batching import PairCorpus
from .config import Config, config_to_dict, config_to_yaml
from .data import SOURCE, TARGET, encode_splits, iter_texts, load_pairs, split_pairs, token_lengths
from .errors import CheckpointError, ConfigError
from .evaluate import EvaluationSet, evaluate
from .logs import TensorBoard
from .metrics import group_references
from .model import Transformer, count_parameters
from .optim import build_optimizer
from .runtime import (build_grad_scaler, resolve_precision, seed_everything, select_device, set_rng_state,
                      set_threads)
from .tokenizer import Tokenizers, load_tokenizers, save_tokenizers, tokenizer_fingerprint, train_tokenizers
from .trainer import Trainer, TrainState

log = logging.getLogger(__name__)

HELDOUT_DIR = "heldout"
LOCK_FILE = ".lock"

# Keys that may change between sessions of one run: they steer the loop, not what is learned.
RESUMABLE_KEYS = {
    "name",
    "train.max_steps", "train.max_epochs", "train.max_minutes", "train.log_every", "train.valid_every",
    "train.valid_max_pairs", "train.checkpoint_every", "train.keep_checkpoints", "train.n_valid_samples",
    "train.device", "train.threads", "train.average_last", "train.compile",
}


@dataclass
class TrainOutcome:
    run_dir: Path
    state: TrainState
    resumed_from: Path | None
    already_finished: bool  # the budget was used up before this session started


def _flatten(mapping: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, full + "."))
        else:
            flat[full] = value
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
            "run directory with free space; fix that and rerun (or choose another with --run-dir)"
        ) from error


@contextlib.contextmanager
def _exclusive(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's lock while training: two processes training one run would interleave
    their checkpoints. The OS releases the lock when the process ends, even on SIGKILL."""
    try:
        import fcntl
    except ImportError:  # Windows has no flock; the run goes unguarded there
        yield
        return
    with _writing(run_dir):
        handle = open(run_dir / LOCK_FILE, "a")
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{run_dir} is being trained by another process; wait for it to stop, "
                                  "or train in another --run-dir") from None
        except OSError as error:  # e.g. a network filesystem without locks
            log.warning("cannot lock %s (%s); make sure no other process trains in it", run_dir, error.strerror)
        yield


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def prepare_run_dir(config: Config, run_dir: Path) -> None:
    """Create the run directory, or check that an existing one was started with a compatible config."""
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = run_dir / checkpoint.RUN_CONFIG
    if saved.is_file() and checkpoint.list_checkpoints(run_dir):
        changes = config_changes(checkpoint.load_run_config(run_dir), config)
        if changes:
            raise ConfigError(
                f"{run_dir} holds a run started with a different config, so it cannot be resumed with this one:\n  "
                + "\n  ".join(changes)
                + f"\nUse --run-dir to start a new run, or restore those values (see {saved})."
            )
    _write_text_atomic(saved, config_to_yaml(config))


def _write_heldout(run_dir: Path, name: str, sources: list[str], targets: list[str]) -> None:
    """Held-out sentences for later scoring: `<name>.en` (distinct sources) and `<name>.fr.1..K`,
    line-aligned references, blank where a sentence has fewer than K translations."""
    directory = run_dir / HELDOUT_DIR
    directory.mkdir(exist_ok=True)
    unique, references = group_references(sources, targets)
    _write_text_atomic(directory / f"{name}.en", "".join(s + "\n" for s in unique))
    width = max((len(r) for r in references), default=0)
    for k in range(width):
        lines = "".join((refs[k] if k < len(refs) else "") + "\n" for refs in references)
        _write_text_atomic(directory / f"{name}.fr.{k + 1}", lines)


def train(config: Config, run_dir: Path, should_stop: Callable[[], bool] = lambda: False,
          show_progress: bool = True, data_cache_dir: Path | None = None) -> TrainOutcome:
    """Train (or resume) the run in `run_dir` until a budget is reached or `should_stop()` says so.

    Started by torchrun (WORLD_SIZE > 1), each process joins the process group and trains its
    share of every batch; see trainer.py."""
    run_dir = Path(run_dir)
    # Device and precision first: a setting this machine cannot run fails before anything is written.
    device = distributed.training_device(select_device(config.train.device))
    precision = resolve_precision(config.train.precision, device)
    with distributed.process_group(device):
        if not distributed.is_main():  # rank 0 holds the lock for all of them
            return _train(config, run_dir, device, precision, should_stop, show_progress, data_cache_dir)
        with _writing(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(run_dir):
            return _train(config, run_dir, device, precision, should_stop, show_progress, data_cache_dir)


def _train(config: Config, run_dir: Path, device: torch.device, precision: str, should_stop: Callable[[], bool],
           show_progress: bool, data_cache_dir: Path | None) -> TrainOutcome:
    main = distributed.is_main()
    if main:
        with _writing(run_dir):
            prepare_run_dir(config, run_dir)
            checkpoint.remove_temporaries(run_dir)  # safe: we hold the lock, so no save is under way
    train_config = config.train
    set_threads(train_config.threads)
    # The saved config keeps `auto`; this session trains at what it resolves to on this machine.
    train_config = dataclasses.replace(train_config, precision=precision)
    config = dataclasses.replace(config, train=train_config)
    if config.model.max_len < config.data.max_length + 1:
        raise ConfigError(f"model.max_len ({config.model.max_len}) must be at least data.max_length + 1 "
                          f"({config.data.max_length + 1}): every training sequence needs a position")

    # ---- data and tokenizers: rank 0 first, which fills the datasets cache and writes the tokenizer
    # and held-out files; the other ranks then read them instead of racing it to write them.
    with distributed.main_first():
        corpus, valid, tokenizers, fingerprint = _prepare_data(config, run_dir, data_cache_dir, write=main)

    # Each step frees and reallocates the same large tensors: keep that memory (see allocator.py).
    if device.type == "cpu":
        reuse_freed_memory()

    # ---- model and optimizer (seeded: the same config gives the same initial weights)
    seed_everything(train_config.seed)
    model = Transformer(config.model, tokenizers.source_vocab_size, tokenizers.target_vocab_size).to(device)
    optimizer = build_optimizer(model, train_config)
    grad_scaler = build_grad_scaler(train_config.precision, device)
    rank, world_size = distributed.rank(), distributed.world_size()
    if rank:  # each rank draws its own dropout masks; rank 0 keeps the stream of a single-process run
        torch.manual_seed(distributed.seed_for_rank(train_config.seed, rank))
    log.info("model: %s parameters, %d+%d layers, d_model %d; device %s, %s, %d threads%s",
             f"{count_parameters(model):,}", config.model.n_encoder_layers, config.model.n_decoder_layers,
             config.model.d_model, device, train_config.precision, torch.get_num_threads(),
             f", {world_size} processes" if world_size > 1 else "")

    # ---- resume: rank 0 picks the checkpoint (and moves damaged ones aside); every rank loads it
    state = TrainState(world_size=world_size)
    resumed_from = distributed.broadcast_object(_resume_point(run_dir) if main else None)
    if resumed_from is not None:
        meta = checkpoint.read_meta(resumed_from, verify=False)
        checkpoint.check_model_fits(resumed_from, meta, model)
        if meta.get("tokenizer_fingerprint") != fingerprint:
            raise CheckpointError(f"{resumed_from}: was trained with other tokenizer files than "
                                  f"{run_dir / checkpoint.TOKENIZER_DIR}")
        if not isinstance(meta.get("state"), dict):
            raise CheckpointError(f"{resumed_from / checkpoint.META_FILE}: has no training state to resume from")
        checkpoint.load_weights(model, resumed_from / checkpoint.MODEL_FILE)
        training = checkpoint.load_training_state(resumed_from)
        state = TrainState(**{k: v for k, v in meta["state"].items()
                              if k in {f.name for f in dataclasses.fields(TrainState)}})
        state.finished = False
        try:
            optimizer.load_state_dict(training["optimizer"])
            _restore_rng(training, train_config.seed, state.step)
            if grad_scaler is not None and "grad_scaler" in training:
                grad_scaler.load_state_dict(training["grad_scaler"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{resumed_from / checkpoint.TRAINING_FILE}: its optimizer or RNG state does "
                                  f"not fit this run ({type(error).__name__}: {error})") from None
        if main:
            with _writing(run_dir):
                checkpoint.restore_best(run_dir, state.best_step)
        log.info("resuming from %s (step %d, epoch %d, batch %d of it)", resumed_from, state.step, state.epoch + 1,
                 state.batch_in_epoch)
    distributed.broadcast_parameters(model)

    with _writing(run_dir):
        tensorboard = TensorBoard(run_dir, enabled=main)
        if resumed_from is None:
            tensorboard.text(0, "config", "```\n" + config_to_yaml(config) + "\n```")
    trainer = Trainer(config, model, optimizer, corpus, valid, tokenizers, run_dir, tensorboard, device, state,
                      fingerprint, show_progress=show_progress, grad_scaler=grad_scaler)
    already_finished = trainer.budget_reached() is not None
    # Checkpoint saves raise their own CheckpointError; this catches the other writers (TensorBoard
    # re-raises its writer thread's OSError on a later call). The last checkpoint stays the resume point.
    with _writing(run_dir):
        try:
            state = trainer.run(should_stop)
        except BaseException:
            with contextlib.suppress(OSError):  # the first error is the one to report
                tensorboard.close()
            raise
        if state.finished and config.train.average_last and main:
            _average_newest(config, run_dir, trainer, device)
        tensorboard.close()
    return TrainOutcome(run_dir, state, resumed_from, already_finished)


def _prepare_data(config: Config, run_dir: Path, data_cache_dir: Path | None,
                  write: bool) -> tuple[PairCorpus, EvaluationSet, Tokenizers, str]:
    """Load and split the pairs, train the tokenizers (or reuse the run's), encode; with `write`,
    save the tokenizers and the held-out files. Returns the training corpus, the valid set, the
    tokenizers and their fingerprint."""
    pairs, _ = load_pairs(config.data, cache_dir=data_cache_dir)
    splits = split_pairs(pairs, config.data)
    tokenizer_dir = run_dir / checkpoint.TOKENIZER_DIR
    if tokenizer_dir.is_dir() and any(tokenizer_dir.iterdir()):
        tokenizers = load_tokenizers(tokenizer_dir)
        log.info("tokenizers: reusing %s", tokenizer_dir)
    elif not write:  # a rank > 0, after rank 0 saved them: they must be visible here too
        raise CheckpointError(f"rank {distributed.rank()} cannot see {tokenizer_dir}, which rank 0 has written: "
                              "every node must see the run directory at the same path (a shared filesystem)")
    else:
        log.info("training BPE tokenizers (vocabulary %d, %s) on %d training pairs", config.tokenizer.vocab_size,
                 "joint" if config.tokenizer.joint else "separate", len(splits.train))
        tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE), iter_texts(splits.train, TARGET),
                                      config.tokenizer)
        with _writing(run_dir):
            save_tokenizers(tokenizers, tokenizer_dir)
    fingerprint = tokenizer_fingerprint(tokenizer_dir)
    log.info("encoding %d pairs into subword ids", len(splits.train) + len(splits.valid) + len(splits.test))
    encoded = encode_splits(splits, tokenizers, config.data.max_length)
    corpus = PairCorpus.from_dataset(encoded.train)
    valid_sources, valid_targets = list(iter_texts(splits.valid, SOURCE)), list(iter_texts(splits.valid, TARGET))
    # The valid loss feeds whole pairs to the model, so each side (+ BOS/EOS) must fit its position
    # table; a longer pair still counts in BLEU, where translate() truncates its source.
    src_len, tgt_len = token_lengths(encoded.valid)
    fits = np.flatnonzero((src_len < config.model.max_len) & (tgt_len < config.model.max_len))
    if len(fits) < len(encoded.valid):
        log.warning("valid: %d of %d pairs are longer than model.max_len=%d tokens; they count in BLEU but not "
                    "in the valid loss", len(encoded.valid) - len(fits), len(encoded.valid), config.model.max_len)
    valid = EvaluationSet.from_pairs(PairCorpus.from_dataset(encoded.valid.select(fits)), valid_sources,
                                     valid_targets, max_sentences=config.train.valid_max_pairs)
    if write:
        with _writing(run_dir):
            _write_heldout(run_dir, "valid", valid_sources, valid_targets)
            if len(splits.test):
                _write_heldout(run_dir, "test", list(iter_texts(splits.test, SOURCE)),
                               list(iter_texts(splits.test, TARGET)))
    return corpus, valid, tokenizers, fingerprint


def _resume_point(run_dir: Path) -> Path | None:
    """The newest intact checkpoint to resume from, or None for a new run. Newer, damaged ones are
    moved aside; a run whose checkpoints are all damaged is refused."""
    resumed_from, saved = checkpoint.latest_good_checkpoint(run_dir), checkpoint.list_checkpoints(run_dir)
    if resumed_from is None and saved:
        # Starting over would bury the run's history under new checkpoints: the user decides.
        raise CheckpointError(f"{run_dir}: none of its {len(saved)} checkpoints is intact (see the warnings "
                              f"above), so it cannot be resumed; move {run_dir / checkpoint.CHECKPOINTS} "
                              "away to start over, or train in another --run-dir")
    if resumed_from is not None:
        # Newer checkpoints failed verification. Out of the list they go (kept for inspection), or
        # pruning, which keeps the newest by step, would delete the good ones this session saves.
        for newer in saved[saved.index(resumed_from) + 1:]:
            aside = newer.with_name(f"corrupt-{newer.name}-{os.getpid()}")
            log.warning("moving the damaged %s aside to %s", newer, aside)
            with _writing(run_dir):
                os.replace(newer, aside)
    return resumed_from


def _restore_rng(training: dict, seed: int, step: int) -> None:
    """Put this rank's RNG back where the checkpoint left it. Rank 0 restores the state saved as
    `rng` (a single-process run's); another rank its own from `rank_rng` if the run had as many
    processes, else (fewer or more processes than before) a fresh stream seeded from (seed, rank,
    step): deterministic, but not the stream it would have drawn."""
    rank, world_size = distributed.rank(), distributed.world_size()
    per_rank = training.get("rank_rng")
    if rank == 0:
        set_rng_state(training["rng"])
    elif per_rank is not None and len(per_rank) == world_size:
        set_rng_state(per_rank[rank])
    else:
        torch.manual_seed(distributed.seed_for_rank(seed, rank, step))


def _average_newest(config: Config, run_dir: Path, trainer: Trainer, device: torch.device) -> None:
    """Average the newest `train.average_last` step checkpoints into `checkpoints/averaged`, score it on
    the valid split, and make it the best checkpoint if its BLEU beats the best single one."""
    state, paths = trainer.state, checkpoint.list_checkpoints(run_dir)[-config.train.average_last:]
    if len(paths) < 2:
        log.warning("train.average_last=%d: only %d step checkpoint(s) kept; nothing to average",
                    config.train.average_last, len(paths))
        return
    steps = [checkpoint.read_meta(path, verify=False)["step"] for path in paths]
    target = run_dir / checkpoint.CHECKPOINTS / checkpoint.AVERAGED
    try:
        previous = checkpoint.read_meta(target)
    except checkpoint.CheckpointError:
        previous = {}
    if previous.get("averaged_steps") == steps:  # a rerun of a finished run: already done
        bleu = previous.get("metrics", {}).get("valid_bleu", -1.0)
    else:
        model, steps = average_checkpoints(paths, device)
        result = evaluate(model, trainer.valid, trainer.tokenizers, config, device)
        bleu = result.scores.bleu
        log.info("average of steps %s: valid loss %.3f  ppl %.2f  %s", ", ".join(map(str, steps)), result.loss,
                 result.perplexity, result.scores)
        trainer.tensorboard.scalars(state.step, {"valid_averaged/loss": result.loss,
                                                 "valid_averaged/bleu": bleu, "valid_averaged/chrf": result.scores.chrf})
        meta = {"step": state.step, "averaged_steps": steps, "tokenizer_fingerprint": trainer.tokenizer_fingerprint,
                "config_name": config.name,
                "metrics": {"valid_loss": result.loss, "valid_bleu": bleu, "valid_chrf": result.scores.chrf}}
        checkpoint.save_weights(run_dir, checkpoint.AVERAGED, model, meta)
    if bleu > state.best_bleu:
        checkpoint.save_best(run_dir, target)
        log.info("  the averaged weights are the new best (BLEU %.2f > %.2f at step %d): %s", bleu, state.best_bleu,
                 state.best_step, target)
    else:
        log.info("  the best single checkpoint stays the best (BLEU %.2f at step %d >= %.2f averaged)",
                 state.best_bleu, state.best_step, bleu)
