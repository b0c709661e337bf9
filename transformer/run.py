"""Build a training run from a config: run directory, data, tokenizers, model, optimizer, and the
state of an earlier session to resume. Then hand over to the Trainer. train.py calls `train`.

Run directory (one self-contained artifact: translate.py needs nothing else):
    config.yaml  tokenizer/  checkpoints/step_*/  checkpoints/best/  heldout/  tensorboard/  train.log
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import checkpoint
from .batching import PairCorpus
from .config import Config, config_to_dict, config_to_yaml
from .data import SOURCE, TARGET, encode_splits, iter_texts, load_pairs, split_pairs
from .errors import CheckpointError, ConfigError
from .evaluate import EvaluationSet
from .logs import TensorBoard
from .metrics import group_references
from .model import Transformer, count_parameters
from .optim import build_optimizer
from .runtime import seed_everything, select_device, set_rng_state, set_threads
from .tokenizer import load_tokenizers, save_tokenizers, tokenizer_fingerprint, train_tokenizers
from .trainer import Trainer, TrainState

log = logging.getLogger(__name__)

HELDOUT_DIR = "heldout"

# Keys that may change between sessions of one run: they steer the loop, not what is learned.
RESUMABLE_KEYS = {
    "name",
    "train.max_steps", "train.max_epochs", "train.max_minutes", "train.log_every", "train.valid_every",
    "train.valid_max_pairs", "train.checkpoint_every", "train.keep_checkpoints", "train.n_valid_samples",
    "train.device", "train.threads",
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
    """Train (or resume) the run in `run_dir` until a budget is reached or `should_stop()` says so."""
    run_dir = Path(run_dir)
    prepare_run_dir(config, run_dir)
    train_config = config.train
    set_threads(train_config.threads)
    device = select_device(train_config.device)
    if config.model.max_len < config.data.max_length + 1:
        raise ConfigError(f"model.max_len ({config.model.max_len}) must be at least data.max_length + 1 "
                          f"({config.data.max_length + 1}): every training sequence needs a position")

    # ---- data and tokenizers
    pairs, _ = load_pairs(config.data, cache_dir=data_cache_dir)
    splits = split_pairs(pairs, config.data)
    tokenizer_dir = run_dir / checkpoint.TOKENIZER_DIR
    if tokenizer_dir.is_dir() and any(tokenizer_dir.iterdir()):
        tokenizers = load_tokenizers(tokenizer_dir)
        log.info("tokenizers: reusing %s", tokenizer_dir)
    else:
        log.info("training BPE tokenizers (vocabulary %d, %s) on %d training pairs", config.tokenizer.vocab_size,
                 "joint" if config.tokenizer.joint else "separate", len(splits.train))
        tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE), iter_texts(splits.train, TARGET),
                                      config.tokenizer)
        save_tokenizers(tokenizers, tokenizer_dir)
    fingerprint = tokenizer_fingerprint(tokenizer_dir)
    encoded = encode_splits(splits, tokenizers, config.data.max_length)
    corpus = PairCorpus.from_dataset(encoded.train)
    valid_sources, valid_targets = list(iter_texts(splits.valid, SOURCE)), list(iter_texts(splits.valid, TARGET))
    valid = EvaluationSet.from_pairs(PairCorpus.from_dataset(encoded.valid), valid_sources, valid_targets,
                                     max_sentences=train_config.valid_max_pairs)
    _write_heldout(run_dir, "valid", valid_sources, valid_targets)
    if len(splits.test):
        _write_heldout(run_dir, "test", list(iter_texts(splits.test, SOURCE)), list(iter_texts(splits.test, TARGET)))

    # ---- model and optimizer (seeded: the same config gives the same initial weights)
    seed_everything(train_config.seed)
    model = Transformer(config.model, tokenizers.source_vocab_size, tokenizers.target_vocab_size).to(device)
    optimizer = build_optimizer(model, train_config)
    log.info("model: %s parameters, %d+%d layers, d_model %d; device %s, %s, %d threads",
             f"{count_parameters(model):,}", config.model.n_encoder_layers, config.model.n_decoder_layers,
             config.model.d_model, device, train_config.precision, torch.get_num_threads())

    # ---- resume
    state, resumed_from = TrainState(), checkpoint.latest_good_checkpoint(run_dir)
    if resumed_from is not None:
        meta = checkpoint.read_meta(resumed_from, verify=False)
        if meta.get("tokenizer_fingerprint") != fingerprint:
            raise CheckpointError(f"{resumed_from}: was trained with other tokenizer files than {tokenizer_dir}")
        checkpoint.load_weights(model, resumed_from / checkpoint.MODEL_FILE)
        training = checkpoint.load_training_state(resumed_from)
        optimizer.load_state_dict(training["optimizer"])
        set_rng_state(training["rng"])
        state = TrainState(**{k: v for k, v in meta["state"].items()
                              if k in {f.name for f in dataclasses.fields(TrainState)}})
        state.finished = False
        log.info("resuming from %s (step %d, epoch %d)", resumed_from, state.step, state.epoch + 1)

    tensorboard = TensorBoard(run_dir)
    if resumed_from is None:
        tensorboard.text(0, "config", "```\n" + config_to_yaml(config) + "\n```")
    trainer = Trainer(config, model, optimizer, corpus, valid, tokenizers, run_dir, tensorboard, device, state,
                      fingerprint, show_progress=show_progress)
    already_finished = trainer.budget_reached() is not None
    try:
        state = trainer.run(should_stop)
    finally:
        tensorboard.close()
    return TrainOutcome(run_dir, state, resumed_from, already_finished)
