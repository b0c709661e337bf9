"""A fine-tuned run's parent (train.init_from): the settings a new run takes from it where its config
leaves them out, which of its checkpoints gives the new run its weights, the checks that the new
run's config fits it, and loading those weights. It only reads the parent; the tokenizer files are
copied into the new run by rundir.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformer.checkpoints import files
from transformer.checkpoints.format import META_FILE, MODEL_FILE, read_meta
from transformer.checkpoints.layout import RUN_CONFIG, STATE_FILE, checkpoint_location, list_checkpoints
from transformer.checkpoints.lookup import find_checkpoint, load_run_config
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import Config, DataConfig, ModelConfig, config_to_dict
from transformer.data.tokenizer import tokenizer_fingerprint
from transformer.errors import CheckpointError, ConfigError
from transformer.model import Transformer

log = logging.getLogger(__name__)

KEY = "train.init_from"
# The sections whose keys a child's config may leave out: they are then its parent's.
INHERITED_SECTIONS = ("model", "tokenizer")
# Tokenizer settings that describe the tokenizer files a child copies (tokenizer.dropout only
# changes how training text is encoded), and model settings that may differ from the parent's:
# dropout shapes no weight.
TOKENIZER_KEYS = ("vocab_size", "joint", "min_frequency")
FREE_MODEL_KEYS = {"dropout"}


def _as_json(values: dict[str, Any]) -> dict[str, Any]:
    """`values` as JSON holds them (a tuple as a list), as meta.json does: how model settings compare."""
    return json.loads(json.dumps(values))


def _parent_model_settings(checkpoint: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Every ModelConfig key as `checkpoint` (its `meta`) was trained with it, as JSON holds it. A key
    its meta.json lacks was written before that key existed: the model it built had that key's default."""
    stored = meta["model_config"]
    if not isinstance(stored, dict):
        raise CheckpointError(f"{KEY}: {checkpoint / META_FILE}: model_config is not a mapping")
    return {key: stored.get(key, default) for key, default in _as_json(asdict(ModelConfig())).items()}


def _read_parent(path: Path, verify: bool) -> tuple[Path, dict[str, Any], Config]:
    """The checkpoint of the parent run at `path` that a child starts from (its best, else its newest),
    that checkpoint's meta (its weights verified with `verify`) and the run's config."""
    if not (path / STATE_FILE).is_file():
        if (path / META_FILE).is_file():  # runs/<name>/checkpoints/<step or best>: the run is two folders up
            raise ConfigError(f"{KEY}: {path} is a checkpoint, not a run: give its run directory, "
                              f"{checkpoint_location(path).parent.parent}, whose best checkpoint is fine-tuned from")
        raise ConfigError(f"{KEY}: {path} is not a run directory of this project (no {STATE_FILE})")
    try:
        checkpoint = find_checkpoint(run=path)
        meta = read_meta(checkpoint, verify=verify)
        return checkpoint, meta, load_run_config(path)
    except CheckpointError as error:
        raise CheckpointError(f"{KEY}: {error}") from None


def inherited_settings(init_from: str, run_dir: Path) -> dict[str, dict[str, Any]]:
    """The model and tokenizer keys a fine-tuned run's config may leave out, as its parent `init_from`
    has them (config.Inherit): the model's as its checkpoint was trained with them (meta.json), the
    tokenizer's as its config.yaml has them. A run at `run_dir` that already started from this parent
    and has checkpoints to resume from takes them from its own config.yaml, which holds them as they
    were when it started: a resume does not read its parent, which may since be gone. Also
    data.max_length where the model's positions cannot hold its default (`_fitting_data`)."""
    settings = _own_settings(init_from, Path(run_dir))
    if settings is None:
        checkpoint, meta, parent_config = _read_parent(Path(init_from), verify=False)  # open_parent verifies
        settings = {"model": _parent_model_settings(checkpoint, meta),
                    "tokenizer": config_to_dict(parent_config)["tokenizer"]}
    return settings | _fitting_data(settings["model"])


def _fitting_data(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """data.max_length for a config that leaves it out, where the inherited model's position table
    (model.max_len) is shorter than its default needs: the longest it holds. An imported model may
    have fewer positions than ours; a child's config names its data, not the model's limits."""
    longest = model.get("max_len")
    if isinstance(longest, int) and 2 < longest <= DataConfig().max_length:
        return {"data": {"max_length": longest - 1}}
    return {}


def _own_settings(init_from: str, run_dir: Path) -> dict[str, dict[str, Any]] | None:
    """The inherited sections as the run at `run_dir` stored them, where it is a run fine-tuned from
    `init_from` with checkpoints; else None."""
    if not (run_dir / RUN_CONFIG).is_file() or not list_checkpoints(run_dir):
        return None
    try:
        own = load_run_config(run_dir)
    except (CheckpointError, ConfigError):
        return None  # the resume's own check of the stored config names what is wrong with it
    if own.train.init_from != init_from:  # the resume's check refuses another parent
        return None
    stored = config_to_dict(own)
    return {section: stored[section] for section in INHERITED_SECTIONS}


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
    checkpoint was trained with, and whose tokenizer and model settings `config` has (those it left
    out are the parent's: `inherited_settings`)."""
    path = Path(config.train.init_from)
    checkpoint, meta, parent_config = _read_parent(path, verify=True)
    run = RunDirectory(path)
    try:
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
                          "and model: leave these keys out of its config, or set them as the parent has them")
    return Parent(run, checkpoint, meta["files"][MODEL_FILE]["sha256"])


def load_parent_weights(parent: Parent, model: Transformer) -> None:
    """Put the parent checkpoint's weights into `model` (built from the child's config, which
    `open_parent` found to fit)."""
    files.load_weights(model, parent.checkpoint / MODEL_FILE)
    log.info("fine-tuning from %s (weights SHA-256 %s): the optimiser and learning-rate schedule start afresh",
             parent.checkpoint, parent.weights_sha256[:16])


__all__ = ["Parent", "inherited_settings", "open_parent", "load_parent_weights"]
