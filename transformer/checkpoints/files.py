"""Writing and loading a checkpoint's files (format.py names them and verifies them), written into a
directory the run directory's writer hands over (checkpoints/rundir.py publishes it):
  model.safetensors   weights (no pickle),
  training.pt         the trainer's state apart from weights: optimizer moments, RNG states (every
                      rank's in a data-parallel run), the gradient scaler; tensors and numbers
                      only, read with torch.load(weights_only=True), which refuses pickled code,
  meta.json           step, training state, model config, vocabulary sizes, fingerprints of the
                      tokenizer files and data, metrics, and the size and SHA-256 of the files above.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_file as save_safetensors_file

from transformer.checkpoints.format import (CHECKPOINT_FORMAT, META_FILE, MODEL_FILE, TRAINING_FILE, file_sha256,
                                            read_meta)
from transformer.config import ModelConfig, model_config_from_dict
from transformer.errors import CheckpointError, ConfigError
from transformer.model import Transformer

log = logging.getLogger(__name__)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def _same_content(meta: dict[str, Any], existing_meta: Path) -> bool:
    """Whether the checkpoint described by `meta` is already on disk: saving is idempotent by content.

    The metas compare the step, the training state and the weights' SHA-256 (safetensors writes the
    same bytes for the same tensors). Not training.pt's: torch.save writes a new serialization id
    into every file, and with the same weights at the same step of the same run, its optimizer and
    RNG states are the same too.
    """
    def comparable(data: dict[str, Any]) -> dict[str, Any]:
        files = {name: entry for name, entry in data.get("files", {}).items() if name != TRAINING_FILE}
        return dict(data, files=files)

    try:
        existing = json.loads(existing_meta.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return comparable(existing) == comparable(json.loads(json.dumps(meta)))


def _intact(checkpoint: Path, need_training_state: bool) -> bool:
    """Whether `checkpoint`'s files are those its meta.json records: one kept for its weights alone
    (its training state torn) is replaced, not taken for the same checkpoint."""
    try:
        read_meta(checkpoint, verify=True, need_training_state=need_training_state)
    except CheckpointError:
        return False
    return True


def write_failure_reason(error: BaseException) -> str | None:
    """The operating system's reason for a failed write, or None if `error` is not an I/O failure.

    torch.save reports a full disk as a RuntimeError whose context is the OSError, safetensors as a
    SafetensorError with the reason in its text; anything else is a bug and must keep its traceback.
    """
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError):
            return cause.strerror or str(cause)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, SafetensorError) and (match := re.search(r"I/O error: (.*?)(?: \(os error \d+\)|$)",
                                                                  str(error))):
        return match.group(1)
    return None


def _save_weights_file(model: Transformer, path: Path) -> None:
    """The weights as safetensors, a tied matrix once (under its first name), and no metadata:
    safetensors' save_model records the tied names in a metadata map it writes in a different order
    from call to call, so equal weights would not give equal bytes. Loading (load_weights) finds
    tied tensors from the model itself."""
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.contiguous()
    save_safetensors_file(tensors, str(path))


def write_checkpoint(directory: Path, model: Transformer, training_state: dict[str, Any] | None,
                     meta: dict[str, Any], replaces: Path | None = None) -> bool:
    """Write a checkpoint's files into the empty `directory`: the weights, `training_state` (tensors
    and numbers) and `meta` (JSON), to which this adds the model config, vocabulary sizes and the
    files' sizes and SHA-256, so that any checkpoint rebuilds its own model. Returns False, having
    written nothing that matters, where `replaces` already holds the same checkpoint: saving is
    idempotent by content. A full disk or a refused write is a CheckpointError naming the checkpoint.
    """
    names = [MODEL_FILE] + ([TRAINING_FILE] if training_state is not None else [])
    try:
        _save_weights_file(model, directory / MODEL_FILE)
        if training_state is not None:
            with open(directory / TRAINING_FILE, "wb") as handle:  # a file object: torch then keeps the OSError
                torch.save(training_state, handle)
        files = {}
        for name in names:
            _fsync_file(directory / name)
            files[name] = {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
        full_meta = dict(meta, format=CHECKPOINT_FORMAT, model_config=asdict(model.config),
                         src_vocab_size=model.src_vocab_size, tgt_vocab_size=model.tgt_vocab_size, files=files)
        if replaces is not None and _same_content(full_meta, replaces / META_FILE) and \
                _intact(replaces, need_training_state=training_state is not None):
            return False
        _write_json(directory / META_FILE, full_meta)
        _fsync_file(directory / META_FILE)
    except (OSError, SafetensorError, RuntimeError) as error:
        reason = write_failure_reason(error)
        if reason is None:
            raise
        target = replaces or directory
        raise CheckpointError(f"cannot write checkpoint {target}: {reason}. Training stopped so that no work goes "
                              "unsaved; free space or fix permissions, then rerun to resume.") from error
    return True


def stored_model_config(checkpoint: Path, meta: dict[str, Any]) -> ModelConfig:
    """The model config checkpoint `checkpoint`'s meta.json records (`meta`): a key it lacks, saved before
    that key existed, means that key's default, the model it was trained as."""
    try:
        return model_config_from_dict(meta["model_config"])
    except ConfigError as error:
        raise CheckpointError(f"{Path(checkpoint) / META_FILE}: invalid model_config ({error})") from None


def load_model(checkpoint: Path, device: torch.device | str = "cpu") -> tuple[Transformer, dict[str, Any]]:
    """Rebuild the model from the config stored in the checkpoint, then load its weights."""
    checkpoint = Path(checkpoint)
    meta = read_meta(checkpoint)
    model_config = stored_model_config(checkpoint, meta)
    try:
        model = Transformer(model_config, meta["src_vocab_size"], meta["tgt_vocab_size"])
    except ConfigError as error:  # a start or never-generated id beyond its target vocabulary
        raise CheckpointError(f"{checkpoint / META_FILE}: invalid model_config ({error})") from None
    load_weights(model, checkpoint / MODEL_FILE)
    return model.to(device), meta


def check_model_fits(checkpoint: Path, meta: dict[str, Any], model: Transformer) -> None:
    """Refuse a checkpoint whose stored model config or vocabulary sizes differ from `model`'s, naming them."""
    stored = asdict(stored_model_config(checkpoint, meta))
    differences = [f"model.{key} is {stored[key]!r} in the checkpoint but {value!r} here"
                   for key, value in asdict(model.config).items() if stored[key] != value]
    sizes = (meta.get("src_vocab_size"), meta.get("tgt_vocab_size"))
    if sizes != (model.src_vocab_size, model.tgt_vocab_size):
        differences.append(f"the vocabulary sizes (source, target) are {sizes} in the checkpoint but "
                           f"{(model.src_vocab_size, model.tgt_vocab_size)} in the tokenizers here")
    if differences:
        raise CheckpointError(f"{checkpoint}: does not fit this model: " + "; ".join(differences))


def _shape_differences(model: Transformer, path: Path) -> str:
    """'N tensors differ in shape: name is [..] in the file but [..] in the model, ...' (for messages)."""
    model_shapes = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    with safe_open(str(path), framework="pt") as handle:
        file_shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    differ = [f"{name} is {shape} in the file but {model_shapes[name]} in the model"
              for name, shape in file_shapes.items() if name in model_shapes and shape != model_shapes[name]]
    return f"{len(differ)} tensor(s) differ in shape: " + "; ".join(differ[:3]) + ("; ..." if len(differ) > 3 else "")


def load_weights(model: Transformer, path: Path) -> None:
    """Load safetensors weights into `model`, naming any shape or key mismatch. A tied matrix is
    stored once, under its first name; loading into the model fills every name that shares it."""
    try:
        missing, unexpected = load_safetensors_model(model, str(path), strict=False)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: not a valid safetensors file ({error})") from None
    except RuntimeError:  # torch's own message lists every tensor on its own line: too long to read
        raise CheckpointError(f"{path}: weights do not fit this model: {_shape_differences(model, path)}") from None
    _check_keys(path, missing, unexpected)


def _check_keys(path: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not fit this model (missing: {sorted(missing)[:5]}, "
            f"unexpected: {sorted(unexpected)[:5]})"
        )


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    """Optimizer, RNG and gradient-scaler states, loaded without unpickling code (weights_only=True)."""
    path = Path(checkpoint) / TRAINING_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's own text goes on to suggest weights_only=False: exactly what must not be done here.
        first_line = str(error).split(".")[0]
        raise CheckpointError(f"{path}: refused to load (UnpicklingError: {first_line}): it holds pickled objects "
                              "other than tensors and numbers, possibly code; do not load it with pickle. "
                              "Delete this checkpoint or get it again from a trusted source") from None
    except Exception as error:  # noqa: BLE001 - any failure here means "do not trust this file"
        raise CheckpointError(f"{path}: refused to load ({type(error).__name__}: {error})") from None


