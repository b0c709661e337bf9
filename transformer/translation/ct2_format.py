"""What a CTranslate2 export of this project is: its file names, the description file that says how
text becomes the model's tokens (and marks the directory as ours) and records the size and SHA-256 of
every file as written, and where a run caches the export of a checkpoint. Reading only, and no torch:
ct2_engine.py loads exports, export/ writes them.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from transformer.checkpoints.format import MODEL_FILE, file_sha256, read_meta
from transformer.checkpoints.layout import EXPORTS_DIR
from transformer.checkpoints.lookup import run_dir_of
from transformer.errors import CheckpointError, UserError


EXPORT_INFO = "transformer-enfr.json"
EXPORT_TOKENIZER_DIR = "tokenizer"
EXPORT_MODEL_FILE = "model.bin"  # CTranslate2's weights: without it a directory holds no complete export
EXPORT_FORMAT = "transformer-enfr/ctranslate2"
EXPORT_VERSION = 1
_HASH_CHARS = 16  # of the weights' SHA-256 in the cache directory's name
INSTALL_HINT = "pip install ctranslate2"  # a regular dependency, missing only where it has no wheel or --no-deps


def import_ctranslate2() -> Any:
    """The ctranslate2 module, or a UserError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise UserError(f"the ctranslate2 package is not installed; install it with {INSTALL_HINT}") from None
    return ctranslate2


def read_export_info(directory: Path) -> dict[str, Any] | None:
    """The export description of `directory`, or None if it holds no complete export of this format."""
    path = Path(directory) / EXPORT_INFO
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(info, dict) or (info.get("format"), info.get("version")) != (EXPORT_FORMAT, EXPORT_VERSION):
        return None
    if not (Path(directory) / EXPORT_MODEL_FILE).is_file():
        return None
    return info


def cached_export_dir(checkpoint: Path) -> tuple[Path, str]:
    """Where translate.py keeps the export of `checkpoint`: RUN/ctranslate2/<weights hash>, and that hash
    (the SHA-256 that meta.json records for the weights, so the export follows the weights)."""
    meta = read_meta(checkpoint, verify=False)
    digest = meta["files"].get(MODEL_FILE, {}).get("sha256")
    if not isinstance(digest, str):
        raise CheckpointError(f"{checkpoint}: meta.json records no SHA-256 for {MODEL_FILE}")
    return run_dir_of(checkpoint) / EXPORTS_DIR / digest[:_HASH_CHARS], digest


def file_records(directory: Path) -> dict[str, dict[str, Any]]:
    """The size and SHA-256 of every file in `directory` but the description, by its path relative to
    `directory`: what the description records when an export is written, for `damaged_file`."""
    directory = Path(directory)
    return {path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            for path in sorted(directory.rglob("*")) if path.is_file() and path != directory / EXPORT_INFO}


def damaged_file(directory: Path, info: dict[str, Any]) -> str | None:
    """Which file of the export in `directory` (whose description is `info`) is not as it was written, and
    how; None when every recorded file has its recorded size and SHA-256, or when nothing was recorded
    (an export of an earlier version of this project)."""
    records = info.get("files")
    if not isinstance(records, dict):
        return None
    for name, record in sorted(records.items()):
        path = Path(directory) / name
        if not isinstance(record, dict) or PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            return f"its description records {name!r}, which is no file of an export"
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record.get("bytes"):
            return f"{name} holds {size} bytes where {record.get('bytes')} were written"
        if file_sha256(path) != record.get("sha256"):
            return f"{name} is not the file written (its SHA-256 differs from the one recorded)"
    return None


def cached_export_damage(directory: Path, digest: str) -> str | None:
    """Why `directory` does not hold an intact export of the weights whose SHA-256 is `digest`; None when
    it does. A run's cached export must carry the record of its files: one without (an earlier version's)
    cannot be verified, and is a cache to write again."""
    info = read_export_info(directory)
    if info is None:
        return "no complete export there"
    checkpoint = info.get("checkpoint")
    if not isinstance(checkpoint, dict) or checkpoint.get("model_sha256") != digest:
        return "the export of other weights"
    if not isinstance(info.get("files"), dict):
        return "its description records no size or SHA-256 of its files (an earlier version wrote it)"
    return damaged_file(directory, info)


__all__ = ["EXPORTS_DIR", "EXPORT_INFO", "EXPORT_TOKENIZER_DIR", "EXPORT_MODEL_FILE", "EXPORT_FORMAT",
           "EXPORT_VERSION", "INSTALL_HINT", "import_ctranslate2", "read_export_info", "cached_export_dir",
           "file_records", "damaged_file", "cached_export_damage"]
