"""The checkpoint format: the files a checkpoint directory holds, and their verification against
the sizes and SHA-256 that meta.json records. No torch: the CTranslate2 engine and the lookup of a
checkpoint read it without loading a model. Writing and loading those files is files.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformer.errors import CheckpointError
from transformer.files import file_sha256

MODEL_FILE, TRAINING_FILE, META_FILE = "model.safetensors", "training.pt", "meta.json"
CHECKPOINT_FILES = {MODEL_FILE, TRAINING_FILE, META_FILE}
CHECKPOINT_FORMAT = 2  # in meta.json: what this version writes and reads


def read_meta(checkpoint: Path, verify: bool = True, need_training_state: bool = False) -> dict[str, Any]:
    """Read meta.json of `checkpoint` and (with `verify`) check the size and SHA-256 of its weights,
    and of its training state too where a resume `need`s it."""
    checkpoint = Path(checkpoint)
    meta_path = checkpoint / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{checkpoint}: not a checkpoint ({META_FILE} is missing)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or "model_config" not in meta:
        raise CheckpointError(f"{meta_path}: not a checkpoint description of this project")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{meta_path}: checkpoint format {meta.get('format')}, but this version reads format "
                              f"{CHECKPOINT_FORMAT}: it was written by another version of this project")
    if verify:
        for name in [MODEL_FILE] + ([TRAINING_FILE] if need_training_state else []):
            verify_file(checkpoint, meta, name)
    return meta


def verify_file(checkpoint: Path, meta: dict[str, Any], name: str) -> None:
    """Refuse file `name` of `checkpoint` unless its size and SHA-256 are those `meta` recorded."""
    expected, path = meta["files"].get(name), Path(checkpoint) / name
    if not isinstance(expected, dict) or not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    size = path.stat().st_size
    if size != expected.get("bytes"):
        raise CheckpointError(f"{path}: truncated or corrupt ({size} bytes, expected {expected.get('bytes')})")
    if file_sha256(path) != expected.get("sha256"):
        raise CheckpointError(f"{path}: corrupt (SHA-256 differs from the one recorded at save time)")


__all__ = ["MODEL_FILE", "TRAINING_FILE", "META_FILE", "CHECKPOINT_FILES", "CHECKPOINT_FORMAT", "file_sha256",
           "read_meta", "verify_file"]
