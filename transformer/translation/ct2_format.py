"""What a CTranslate2 export of this project is: its file names, the description file that says how
text becomes the model's tokens (and marks the directory as ours), and where a run caches the export
of a checkpoint. Reading only, and no torch: ct2_engine.py loads exports, export/ writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformer.checkpoints.format import MODEL_FILE, read_meta
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


def is_current_export(directory: Path, digest: str) -> bool:
    """Whether `directory` holds a complete export of the weights whose SHA-256 is `digest`."""
    info = read_export_info(directory)
    return info is not None and info["checkpoint"]["model_sha256"] == digest


__all__ = ["EXPORTS_DIR", "EXPORT_INFO", "EXPORT_TOKENIZER_DIR", "EXPORT_MODEL_FILE", "EXPORT_FORMAT",
           "EXPORT_VERSION", "INSTALL_HINT", "import_ctranslate2", "read_export_info", "cached_export_dir",
           "is_current_export"]
