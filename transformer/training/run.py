"""Build a training run from a config: run directory, data, tokenizers, model, optimizer, and the
state of an earlier session to resume. Then hand over to the Trainer. train.py calls `train`.
Process-wide settings (threads, the allocator, logging) are train.py's, not this module's.

Run directory (one self-contained artifact: translate.py needs nothing else):
    config.yaml  state.json  tokenizer/  checkpoints/step_*/  checkpoints/best -> step_*/  heldout/
    tensorboard/  train.log  .lock (held while a process trains the run)

Under torchrun, rank 0 alone writes the run directory; the other ranks read what it wrote (so the
run directory must be on a filesystem every node sees at the same path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from transformer.checkpoints import files as checkpoint

from transformer.training import distributed
from transformer.training.average import average_checkpoints
from transformer.data.batching import PairCorpus
from transformer.checkpoints.manager import STATE_FILE, Best, CheckpointManager
from transformer.config import Config, config_to_dict, config_to_yaml
from transformer.data.pairs import SOURCE, TARGET, encode_splits, iter_texts, load_pairs, split_pairs, token_lengths
from transformer.errors import CheckpointError, ConfigError
from transformer.training.validation import EvaluationSet, evaluate, sample_over_lengths
from transformer.training.logs import TensorBoard
from transformer.translation.metrics import group_references
from transformer.model import Transformer, count_parameters
from transformer.training.optim import build_optimizer
from transformer.runtime import build_grad_scaler, resolve_precision, seed_everything, select_device, set_rng_state
from transformer.data.text import read_lines
from transformer.data.tokenizer import Tokenizers, load_tokenizers, save_tokenizers, tokenizer_fingerprint, train_tokenizers
from transformer.training.trainer import Trainer, TrainState

log = logging.getLogger(__name__)

HELDOUT_DIR = "heldout"
VALID_SAMPLE = "valid_sample"  # heldout/valid_sample.en, .fr.1..K: the sentences every validation scores
LOCK_FILE = ".lock"

# Keys that may change between sessions of one run: they steer the loop, not what is learned or how
# it is scored (train.valid_max_pairs sets the validation sample, so it stays). Budgets may change
# as budget.py allows.
RESUMABLE_KEYS = {
    "name",
    "train.max_steps", "train.max_epochs", "train.max_minutes", "train.log_every", "train.valid_every",
    "train.checkpoint_every", "train.keep_checkpoints", "train.n_valid_samples", "train.attention_images",
    "train.device", "train.threads", "train.average_last", "train.compile",
}


@dataclass
class TrainOutcome:
    run_dir: Path
    state: TrainState
    best: Best | None  # the best checkpoint of the run so far (rank 0; None elsewhere)
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
    if saved.is_file() and ((run_dir / STATE_FILE).is_file() or checkpoint.list_checkpoints(run_dir)):
        changes = config_changes(checkpoint.load_run_config(run_dir), config)
        if changes:
            raise ConfigError(
                f"{run_dir} holds a run started with a different config, so it cannot be resumed with this one:\n  "
                + "\n  ".join(changes)
                + f"\nUse --run-dir to start a new run, or restore those values (see {saved})."
            )
    _write_text_atomic(saved, config_to_yaml(config))


def _write_heldout(run_dir: Path, name: str, sources: list[str], references: list[list[str]]) -> None:
    """Held-out sentences for later scoring: `<name>.en` (distinct sources) and `<name>.fr.1..K`,
    line-aligned references, blank where a sentence has fewer than K translations. (The suffixes
    name the shipped language pair; the files hold whatever source and target the data has.)"""
    directory = run_dir / HELDOUT_DIR
    directory.mkdir(exist_ok=True)
    for stale in directory.glob(f"{name}.fr.*"):  # a rewrite with fewer references leaves none behind
        stale.unlink()
    _write_text_atomic(directory / f"{name}.en", "".join(s + "\n" for s in sources))
    width = max((len(r) for r in references), default=0)
    for k in range(width):
        lines = "".join((refs[k] if k < len(refs) else "") + "\n" for refs in references)
        _write_text_atomic(directory / f"{name}.fr.{k + 1}", lines)


def _read_heldout(run_dir: Path, name: str) -> tuple[list[str], list[list[str]]] | None:
    """What `_write_heldout` wrote, or None if it is not there."""
    directory = run_dir / HELDOUT_DIR
    if not (directory / f"{name}.en").is_file():
        return None
    sources = read_lines(directory / f"{name}.en", "held-out file")
    streams = [read_lines(directory / f"{name}.fr.{k}", "held-out file")
               for k in range(1, len(list(directory.glob(f"{name}.fr.*"))) + 1)]
    if any(len(stream) != len(sources) for stream in streams):
        raise CheckpointError(f"{directory}: the {name} files differ in length; they were edited by hand")
    return sources, [[stream[i] for stream in streams if stream[i]] for i in range(len(sources))]


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
    manager = None
    if main:
        with _writing(run_dir):
            prepare_run_dir(config, run_dir)
            manager = CheckpointManager(run_dir, config.train.keep_checkpoints)
            resume_point = manager.resume_point()  # safe: we hold the lock, so no save is under way
    # rank 0 picks the checkpoint (and moves damaged ones aside); every rank loads it
    resumed_from = distributed.broadcast_object(resume_point if main else None)
    train_config = config.train
    # The saved config keeps `auto`; this session trains at what it resolves to on this machine.
    train_config = dataclasses.replace(train_config, precision=precision)
    config = dataclasses.replace(config, train=train_config)
    if config.model.max_len < config.data.max_length + 1:
        raise ConfigError(f"model.max_len ({config.model.max_len}) must be at least data.max_length + 1 "
                          f"({config.data.max_length + 1}): every training sequence needs a position")

    # ---- data and tokenizers: rank 0 first, which fills the datasets cache and writes the tokenizer
    # and held-out files; the other ranks then read them instead of racing it to write them.
    with distributed.main_first():
        corpus, valid, tokenizers, fingerprints = _prepare_data(config, run_dir, data_cache_dir, write=main,
                                                                resuming=resumed_from is not None)

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

    state = TrainState(world_size=world_size)
    if resumed_from is not None:
        state = _resume(resumed_from, model, optimizer, grad_scaler, fingerprints, run_dir, train_config.seed)

    with _writing(run_dir):
        tensorboard = TensorBoard(run_dir, enabled=main)
        if resumed_from is None:
            tensorboard.text(0, "config", "```\n" + config_to_yaml(config) + "\n```")
    trainer = Trainer(config, model, optimizer, corpus, valid, tokenizers, run_dir, tensorboard, device, state,
                      manager, fingerprints, show_progress=show_progress, grad_scaler=grad_scaler)
    already_finished = trainer.finished()
    # Checkpoint saves raise their own CheckpointError; this catches the other writers (TensorBoard
    # re-raises its writer thread's OSError on a later call). The last checkpoint stays the resume point.
    with _writing(run_dir):
        try:
            state = trainer.run(should_stop)
        except BaseException:
            with contextlib.suppress(OSError):  # the first error is the one to report
                tensorboard.close()
            raise
        if trainer.finished() and config.train.average_last and main:
            _average_newest(config, trainer)
        tensorboard.close()
    return TrainOutcome(run_dir, state, manager.best if manager else None, resumed_from, already_finished)


def _resume(resumed_from: Path, model: Transformer, optimizer: torch.optim.Optimizer,
            grad_scaler: torch.amp.GradScaler | None, fingerprints: dict[str, str], run_dir: Path,
            seed: int) -> TrainState:
    """Load the checkpoint's weights, optimizer, RNG and training state, after checking that it was
    trained on these pairs with these tokenizer files."""
    meta = checkpoint.read_meta(resumed_from, verify=False)
    checkpoint.check_model_fits(resumed_from, meta, model)
    if meta.get("tokenizer_fingerprint") != fingerprints["tokenizer_fingerprint"]:
        raise CheckpointError(f"{resumed_from}: was trained with other tokenizer files than "
                              f"{run_dir / checkpoint.TOKENIZER_DIR}")
    if meta.get("data_fingerprint") != fingerprints["data_fingerprint"]:
        raise CheckpointError(f"{resumed_from}: was trained on other sentence pairs: the data file changed since "
                              "this run started. Train on the new data in a new --run-dir")
    if not isinstance(meta.get("state"), dict):
        raise CheckpointError(f"{resumed_from / checkpoint.META_FILE}: has no training state to resume from")
    checkpoint.load_weights(model, resumed_from / checkpoint.MODEL_FILE)
    training = checkpoint.load_training_state(resumed_from)
    state = TrainState.from_meta(meta["state"])
    try:
        optimizer.load_state_dict(training["optimizer"])
        _restore_rng(training, seed, state.step)
        if grad_scaler is not None and "grad_scaler" in training:
            grad_scaler.load_state_dict(training["grad_scaler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{resumed_from / checkpoint.TRAINING_FILE}: its optimizer or RNG state does "
                              f"not fit this run ({type(error).__name__}: {error})") from None
    log.info("resuming from %s (step %d, epoch %d, batch %d of it)", resumed_from, state.step, state.epoch + 1,
             state.batch_in_epoch)
    return state


def _prepare_data(config: Config, run_dir: Path, data_cache_dir: Path | None, write: bool,
                  resuming: bool) -> tuple[PairCorpus, EvaluationSet, Tokenizers, dict[str, str]]:
    """Load and split the pairs, train the tokenizers (or, `resuming`, reuse the run's), encode; with
    `write`, save the tokenizers and the held-out files. Returns the training corpus, the valid set,
    the tokenizers and the fingerprints of tokenizer files and data that checkpoints record."""
    pairs, _ = load_pairs(config.data, cache_dir=data_cache_dir)
    splits = split_pairs(pairs, config.data)
    tokenizer_dir = run_dir / checkpoint.TOKENIZER_DIR
    if not write:  # a rank > 0, after rank 0 saved them: they must be visible here too
        if not tokenizer_dir.is_dir():
            raise CheckpointError(f"rank {distributed.rank()} cannot see {tokenizer_dir}, which rank 0 has "
                                  "written: every node must see the run directory at the same path (a shared "
                                  "filesystem)")
        tokenizers = load_tokenizers(tokenizer_dir)
    elif resuming:  # the checkpoint's fingerprint check (_resume) makes sure they are the ones it used
        tokenizers = load_tokenizers(tokenizer_dir)
        log.info("tokenizers: reusing %s", tokenizer_dir)
    else:
        # Trained afresh whenever there is no checkpoint to resume, even if a killed earlier session
        # left tokenizer files: their settings or data may since have changed.
        log.info("training BPE tokenizers (vocabulary %d, %s) on %d training pairs", config.tokenizer.vocab_size,
                 "joint" if config.tokenizer.joint else "separate", len(splits.train))
        tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE), iter_texts(splits.train, TARGET),
                                      config.tokenizer)
        with _writing(run_dir):
            if tokenizer_dir.is_dir():
                shutil.rmtree(tokenizer_dir)
            save_tokenizers(tokenizers, tokenizer_dir)
    fingerprints = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer_dir),
                    "data_fingerprint": splits.fingerprint}
    log.info("encoding %d pairs into subword ids", len(splits.train) + len(splits.valid) + len(splits.test))
    encoded = encode_splits(splits, tokenizers, config.data.max_length)
    corpus = PairCorpus.from_dataset(encoded.train)
    # The valid loss feeds whole pairs to the model, so each side (+ BOS/EOS) must fit its position
    # table; a longer pair still counts in BLEU, where translate() truncates its source.
    src_len, tgt_len = token_lengths(encoded.valid)
    fits = np.flatnonzero((src_len < config.model.max_len) & (tgt_len < config.model.max_len))
    if len(fits) < len(encoded.valid):
        log.warning("valid: %d of %d pairs are longer than model.max_len=%d tokens; they count in BLEU but not "
                    "in the valid loss", len(encoded.valid) - len(fits), len(encoded.valid), config.model.max_len)
    valid_sources, valid_references = group_references(list(iter_texts(splits.valid, SOURCE)),
                                                       list(iter_texts(splits.valid, TARGET)))
    sample = _validation_sample(config, run_dir, valid_sources, valid_references, write, resuming)
    valid = EvaluationSet(PairCorpus.from_dataset(encoded.valid.select(fits)), *sample)
    if write:
        with _writing(run_dir):
            _write_heldout(run_dir, "valid", valid_sources, valid_references)
            if len(splits.test):
                _write_heldout(run_dir, "test", *group_references(list(iter_texts(splits.test, SOURCE)),
                                                                  list(iter_texts(splits.test, TARGET))))
    return corpus, valid, tokenizers, fingerprints


def _validation_sample(config: Config, run_dir: Path, sources: list[str], references: list[list[str]],
                       write: bool, resuming: bool) -> tuple[list[str], list[list[str]]]:
    """The valid sentences every validation of the run translates for BLEU/chrF: drawn once over the
    length range (evaluate.sample_over_lengths), written to heldout/valid_sample.*, and read back
    from there whenever the run resumes."""
    if resuming or not write:
        saved = _read_heldout(run_dir, VALID_SAMPLE)
        if saved is not None:
            return saved
    sample = sample_over_lengths(sources, references, config.train.valid_max_pairs, config.data.split_seed)
    if write:
        with _writing(run_dir):
            _write_heldout(run_dir, VALID_SAMPLE, *sample)
        log.info("validation: BLEU and chrF on %d of the %d valid sentences, spread over their lengths (%s)",
                 len(sample[0]), len(sources), run_dir / HELDOUT_DIR / f"{VALID_SAMPLE}.en")
    return sample


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


def _average_newest(config: Config, trainer: Trainer) -> None:
    """Average the newest `train.average_last` step checkpoints into `checkpoints/averaged`, score it on
    the valid sample, and make it the best checkpoint if its BLEU beats the best single one."""
    manager, state = trainer.manager, trainer.state
    paths = manager.list_kept()[-config.train.average_last:]
    if len(paths) < 2:
        log.warning("train.average_last=%d: only %d step checkpoint(s) kept; nothing to average",
                    config.train.average_last, len(paths))
        return
    steps = [checkpoint.read_meta(path, verify=False)["step"] for path in paths]
    try:
        previous = checkpoint.read_meta(manager.directory / checkpoint.AVERAGED)
    except checkpoint.CheckpointError:
        previous = {}
    if previous.get("averaged_steps") == steps:  # a rerun of a finished run: already done
        return
    model, steps = average_checkpoints(paths, trainer.device)
    result = evaluate(model, trainer.valid, trainer.tokenizers, config, trainer.device)
    log.info("average of steps %s: valid nll %.3f  ppl %.2f  %s", ", ".join(map(str, steps)), result.loss,
             result.perplexity, result.scores)
    metrics = {"valid_nll": result.loss, "valid_perplexity": result.perplexity,
               "valid_bleu": result.scores.bleu, "valid_chrf": result.scores.chrf}
    trainer.tensorboard.scalars(state.step, {"valid_averaged/nll": result.loss, "valid_averaged/bleu":
                                             result.scores.bleu, "valid_averaged/chrf": result.scores.chrf})
    before = manager.best
    meta = {"step": state.step, "averaged_steps": steps, "config_name": config.name, **trainer.fingerprints}
    manager.save_weights(checkpoint.AVERAGED, model, meta, metrics)
    if manager.best is not before:
        log.info("  the averaged weights are the new best (BLEU %.2f, best single step %s)", result.scores.bleu,
                 f"{before.score:.2f} at step {before.step}" if before else "none")
    else:
        log.info("  the best single checkpoint stays the best (BLEU %.2f at step %d >= %.2f averaged)",
                 before.score, before.step, result.scores.bleu)
