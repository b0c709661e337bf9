"""A fine-tuned run's parent (train.init_from): which of its checkpoints gives the new run its
weights, the checks that the new run's config fits it, and loading those weights. It only reads
the parent; the tokenizer files are copied into the new run by rundir.py.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from transformer.checkpoints import files
from transformer.checkpoints.format import META_FILE, MODEL_FILE, read_meta
from transformer.checkpoints.layout import STATE_FILE, checkpoint_location
from transformer.checkpoints.lookup import find_checkpoint, load_run_config
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import Config
from transformer.data.tokenizer import tokenizer_fingerprint
from transformer.errors import CheckpointError, ConfigError
from transformer.model import Transformer

log = logging.getLogger(__name__)

KEY = "train.init_from"
# Tokenizer settings that describe the tokenizer files a child copies (tokenizer.dropout only
# changes how training text is encoded), and model settings that may differ from the parent's:
# dropout shapes no weight.
TOKENIZER_KEYS = ("vocab_size", "joint", "min_frequency")
FREE_MODEL_KEYS = {"dropout"}


@dataclass(frozen=True)
class Parent:
    """The run a new run is fine-tuned from, and the checkpoint whose weights it starts with."""

    run: RunDirectory
    checkpoint: Path
    weights_sha256: str

    def record(self) -> dict[str, str]:
        """What the child's training state records of its parent."""
        return {"run": str(self.run.path), "checkpoint": self.checkpoint.name, "weights_sha256": self.weights_sha256}


def open_parent(config: Config) -> Parent:
    """The parent run `config.train.init_from` names, once it is checked: a run of this project with
    a checkpoint (its best, else its newest) that is intact, whose tokenizer files are the ones that
    checkpoint was trained with, and whose tokenizer and model settings `config` repeats."""
    path = Path(config.train.init_from)
    if not (path / STATE_FILE).is_file():
        if (path / META_FILE).is_file():  # runs/<name>/checkpoints/<step or best>: the run is two folders up
            raise ConfigError(f"{KEY}: {path} is a checkpoint, not a run: give its run directory, "
                              f"{checkpoint_location(path).parent.parent}, whose best checkpoint is fine-tuned from")
        raise ConfigError(f"{KEY}: {path} is not a run directory of this project (no {STATE_FILE})")
    run = RunDirectory(path)
    try:
        checkpoint = find_checkpoint(run=path)
        meta = read_meta(checkpoint, verify=True)
        parent_config = load_run_config(path)
        fingerprint = tokenizer_fingerprint(run.tokenizer_dir)
    except CheckpointError as error:
        raise CheckpointError(f"{KEY}: {error}") from None
    if meta.get("tokenizer_fingerprint") != fingerprint:
        raise CheckpointError(f"{KEY}: {run.tokenizer_dir} differs from the tokenizer files {checkpoint} was "
                              "trained with; the parent run was changed by hand")
    differences = [f"tokenizer.{key} is {getattr(parent_config.tokenizer, key)!r} in the parent run {path} but "
                   f"{getattr(config.tokenizer, key)!r} here"
                   for key in TOKENIZER_KEYS if getattr(parent_config.tokenizer, key) != getattr(config.tokenizer, key)]
    stored = asdict(files.stored_model_config(checkpoint, meta))  # a key older metas lack: its default
    differences += [f"model.{key} is {stored[key]!r} in the parent checkpoint {checkpoint} but "
                    f"{value!r} here" for key, value in asdict(config.model).items()
                    if key not in FREE_MODEL_KEYS and stored[key] != value]
    if differences:
        raise ConfigError(f"{KEY}: " + "; ".join(differences) + ". A fine-tuned run keeps its parent's tokenizer "
                          "and model: set these as the parent has them")
    return Parent(run, checkpoint, meta["files"][MODEL_FILE]["sha256"])


def load_parent_weights(parent: Parent, model: Transformer) -> None:
    """Put the parent checkpoint's weights into `model` (built from the child's config, which
    `open_parent` found to fit)."""
    files.load_weights(model, parent.checkpoint / MODEL_FILE)
    log.info("fine-tuning from %s (weights SHA-256 %s): the optimiser and learning-rate schedule start afresh",
             parent.checkpoint, parent.weights_sha256[:16])


__all__ = ["Parent", "open_parent", "load_parent_weights"]
