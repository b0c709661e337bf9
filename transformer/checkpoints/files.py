"""Writes checkpoints and loads their weights and training state. The run directory's layout and
reading a checkpoint's meta.json are rundir.py's (no torch there); which checkpoints a run keeps, and
which is best, checkpoint_manager.py's.

A checkpoint is a directory `checkpoints/step_00001234/` holding
  model.safetensors   weights (no pickle),
  training.pt         optimizer moments, RNG states (every rank's in a data-parallel run) and
                      the fp16 gradient scaler's state: tensors and numbers only, read with
                      torch.load(weights_only=True), which refuses any pickled code,
  meta.json           step, data position, model config, vocabulary sizes, tokenizer fingerprint,
                      metrics, and the size and SHA-256 of the two files above.
It is written into a temporary directory, fsynced, then renamed: a reader sees all of it or none.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as load_safetensors_file
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_file as save_safetensors_file

from transformer.config import ModelConfig
from transformer.errors import CheckpointError, ConfigError
from transformer.model import Transformer
# The run directory's layout and meta.json reading live in rundir.py (no torch there); re-exported
# here, where callers have always found them.
from transformer.checkpoints.rundir import (AVERAGED, BEST, CHECKPOINTS, META_FILE, MODEL_FILE, RUN_CONFIG,  # noqa: F401
                     TOKENIZER_DIR, TRAINING_FILE, _sha256, list_checkpoints, load_run_config, read_meta,
                     step_dir_name)

log = logging.getLogger(__name__)



def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) cannot open directories; rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _publish(tmp: Path, final: Path) -> None:
    """Atomically make directory `tmp` appear as `final`, replacing an older one if present."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _os_reason(error: BaseException) -> str | None:
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


def save_checkpoint(run_dir: Path, model: Transformer, optimizer: torch.optim.Optimizer,
                    meta: dict[str, Any], rng_state: dict[str, Any], *,
                    grad_scaler_state: dict[str, Any] | None = None,
                    rank_rng_states: list[dict[str, Any]] | None = None) -> Path:
    """Write checkpoint `checkpoints/step_<meta['step']>` atomically and return its path.

    `meta` must be JSON-serialisable; model config and vocabulary sizes are added here so that
    any checkpoint can rebuild its own model. `rng_state` is this (rank 0) process's; a
    data-parallel run also passes every rank's, in rank order, and an fp16 run its gradient
    scaler's state. Raises CheckpointError if the disk refuses.
    """
    final = Path(run_dir) / CHECKPOINTS / step_dir_name(int(meta["step"]))
    training: dict[str, Any] = {"optimizer": optimizer.state_dict(), "rng": rng_state}
    if rank_rng_states is not None:
        training["rank_rng"] = rank_rng_states
    if grad_scaler_state is not None:
        training["grad_scaler"] = grad_scaler_state
    _write_checkpoint(final, model, meta, training)
    return final


def save_weights(run_dir: Path, name: str, model: Transformer, meta: dict[str, Any]) -> Path:
    """Write a weights-only checkpoint `checkpoints/<name>` (e.g. averaged weights) atomically:
    translation can load it, training cannot resume from it."""
    final = Path(run_dir) / CHECKPOINTS / name
    _write_checkpoint(final, model, meta, training_state=None)
    return final


def _write_checkpoint(final: Path, model: Transformer, meta: dict[str, Any],
                      training_state: dict[str, Any] | None) -> None:
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    names = [MODEL_FILE] + ([TRAINING_FILE] if training_state is not None else [])
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _save_weights_file(model, tmp / MODEL_FILE)
        if training_state is not None:
            with open(tmp / TRAINING_FILE, "wb") as handle:  # a file object: torch then keeps the OSError as context
                torch.save(training_state, handle)
        files = {}
        for name in names:
            _fsync_file(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        full_meta = dict(meta, model_config=asdict(model.config), src_vocab_size=model.src_vocab_size,
                         tgt_vocab_size=model.tgt_vocab_size, files=files)
        _write_json(tmp / META_FILE, full_meta)
        if _same_content(full_meta, final / META_FILE):
            shutil.rmtree(tmp, ignore_errors=True)  # the one on disk stays untouched (same bytes, same times)
            return
        _fsync_file(tmp / META_FILE)
        _fsync_dir(tmp)  # the files' names too, not only their bytes, must survive a power cut
        _publish(tmp, final)
    except (OSError, SafetensorError, RuntimeError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = _os_reason(error)
        if reason is None:
            raise
        raise CheckpointError(
            f"cannot write checkpoint {final}: {reason}. "
            "Training stopped so that no work goes unsaved; free space or fix permissions, then rerun to resume."
        ) from error


def load_model(checkpoint: Path, device: torch.device | str = "cpu") -> tuple[Transformer, dict[str, Any]]:
    """Rebuild the model from the config stored in the checkpoint, then load its weights."""
    checkpoint = Path(checkpoint)
    meta = read_meta(checkpoint)
    try:
        model_config = ModelConfig(**meta["model_config"])
    except (TypeError, ConfigError) as error:
        raise CheckpointError(f"{checkpoint / META_FILE}: invalid model_config ({error})") from None
    model = Transformer(model_config, meta["src_vocab_size"], meta["tgt_vocab_size"])
    load_weights(model, checkpoint / MODEL_FILE)
    return model.to(device), meta


def check_model_fits(checkpoint: Path, meta: dict[str, Any], model: Transformer) -> None:
    """Refuse a checkpoint whose stored model config or vocabulary sizes differ from `model`'s, naming them."""
    stored = meta["model_config"]
    differences = [f"model.{key} is {stored.get(key)!r} in the checkpoint but {value!r} here"
                   for key, value in asdict(model.config).items() if stored.get(key) != value]
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


def _split_fused_cross_attention(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints written before cross-attention had its own query and key/value projections held
    them as one fused `in_proj` (rows: query, key, value); give those rows their current names."""
    converted = {}
    for name, tensor in tensors.items():
        prefix, _, kind = name.rpartition(".in_proj.")
        if prefix.endswith("cross_attention") and kind in ("weight", "bias"):
            d_model = tensor.shape[0] // 3
            converted[f"{prefix}.q_proj.{kind}"] = tensor[:d_model]
            converted[f"{prefix}.kv_proj.{kind}"] = tensor[d_model:]
        else:
            converted[name] = tensor
    return converted


def load_weights(model: Transformer, path: Path) -> None:
    """Load safetensors weights into `model`, naming any shape or key mismatch."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
        if any(".cross_attention.in_proj." in name for name in names):
            _load_state(model, _split_fused_cross_attention(load_safetensors_file(str(path))), path)
            return
        missing, unexpected = load_safetensors_model(model, str(path), strict=False)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: not a valid safetensors file ({error})") from None
    except RuntimeError:  # torch's own message lists every tensor on its own line: too long to read
        raise CheckpointError(f"{path}: weights do not fit this model: {_shape_differences(model, path)}") from None
    _check_keys(path, missing, unexpected)


def _load_state(model: Transformer, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Load a converted state dict; a tied matrix is stored once under one of its names."""
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError:
        raise CheckpointError(f"{path}: weights do not fit this model (tensor shapes differ)") from None
    state = model.state_dict(keep_vars=True)
    loaded = {id(state[name]) for name in tensors if name in state}
    missing = [name for name in result.missing_keys if id(state[name]) not in loaded]
    _check_keys(path, missing, result.unexpected_keys)


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


def remove_temporaries(run_dir: Path) -> None:
    """Clean up after a save that was killed midway. Call only while holding the run's lock.

    A `.tmp-*` directory is an unfinished checkpoint: deleted. An `.old-<name>-*` directory is the
    previous `<name>` that `_publish` had moved aside: put back if `<name>` never appeared, else deleted.
    """
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name.startswith(".tmp-"):
            log.info("removing %s, left by an interrupted save", path)
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".old-"):
            final = directory / path.name[len(".old-"):].rsplit("-", 1)[0]
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                log.warning("restoring %s from %s, left by an interrupted save", final, path)
                os.replace(path, final)


