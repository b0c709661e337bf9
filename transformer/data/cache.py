"""The data cache's rules: what names a cached result, and how entries are written and checked.

A result is named by a key of our own (`content_key`): the digest of what it was made from (the
corpus file's bytes, formats/common.py), the settings and the code that made it (`code_digest`), never
datasets' private fingerprints. Entries this project writes beside datasets' Arrow files (a
split's row assignment, the token files, the batch plans of an epoch) are directories, filled under
a temporary name with a manifest of what they hold (sizes, and checksums of the small files), then
renamed into place. An entry is opened only after it matches its manifest; a damaged one (a power
cut, a partial copy, a full disk) is removed with a warning and built again, so the cache is never
a reason to stop. What the entries hold is their writers' business (split.py, token_files.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from transformer.errors import DataError, disk_full
from transformer.files import file_sha256

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"

# Files up to this size get a checksum, verified each time the entry is opened; larger ones (token
# ids, offsets, a plan's order: read a batch at a time) are checked by size alone, since hashing them
# on every open would read the whole corpus again.
CHECKSUM_BYTES = 16 << 20

# Hex digits of a key: short enough for datasets' file names (a map's key plus its worker suffix
# must stay within 64 characters), long enough that two contents never meet.
KEY_CHARS = 32


def content_key(*parts: object) -> str:
    """The key of a cached result made from `parts`: the keys of its inputs, its settings, the digest
    of the code that made it. Equal parts give the same key in every process and every run."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:KEY_CHARS]


def code_digest(*modules: str) -> str:
    """A digest of the source of `modules` (files beside this one, by name): part of the key of what
    their code computes, so that an edit to it is never answered from a stale cache."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in modules)).hexdigest()[:KEY_CHARS]


def _inventory(directory: Path) -> dict[str, dict[str, object]]:
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            size = path.stat().st_size
            files[path.relative_to(directory).as_posix()] = (
                {"size": size, "sha256": file_sha256(path)} if size <= CHECKSUM_BYTES else {"size": size})
    return files


def damage(entry: Path) -> str | None:
    """What is wrong with the entry `entry` (a directory) compared with its manifest; None if it is
    intact. A missing file, a size or a checksum that differs, or a missing or unreadable manifest."""
    try:
        recorded = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))["files"]
        items = list(recorded.items())
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{MANIFEST} unreadable ({type(error).__name__})"
    for name, facts in items:
        path = entry / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:
            return f"{name}: {error.strerror or error}"
        if not isinstance(facts, dict) or size != facts.get("size"):
            return f"{name} has {size} bytes, {facts.get('size') if isinstance(facts, dict) else '?'} were written"
        if "sha256" in facts and file_sha256(path) != facts["sha256"]:
            return f"{name} does not match its checksum"
    return None


def intact(entry: Path) -> bool:
    """Whether the entry `entry` is there and matches its manifest. A damaged entry is removed, with
    one warning, so that the caller builds it again."""
    if not entry.is_dir():
        return False
    found = damage(entry)
    if found is None:
        return True
    discard_damaged(entry, found)
    return False


def discard_damaged(entry: Path, reason: object) -> None:
    """The one note for a damaged entry, which is then removed for its caller to build again."""
    logger.warning("the data cache entry %s is damaged (%s): building it again", entry, reason)
    discard(entry)


def discard(entry: Path) -> None:
    """Remove `entry`: renamed aside first, so no reader finds it half deleted. Another process that
    removed or replaced it first is no error."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.discarded.", dir=entry.parent))
        os.rename(entry, aside / entry.name)
    except OSError:  # gone already, or no room even for a directory entry: removed in place
        shutil.rmtree(entry, ignore_errors=True)
        return
    shutil.rmtree(aside, ignore_errors=True)


def write_entry(entry: Path, fill: Callable[[Path], None]) -> None:
    """Every write of the data cache: `fill` writes the entry's files into a fresh temporary
    directory beside `entry`, the manifest is added, and the directory is renamed to `entry`.

    Another process (a torchrun rank, a second run on the same cache) that wrote an intact entry
    first wins: its files hold the same. A damaged entry in the way is replaced. A full disk is a
    DataError naming the cache directory."""
    scratch = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        fill(scratch)
        (scratch / MANIFEST).write_text(json.dumps({"files": _inventory(scratch)}), encoding="utf-8")
        for _ in range(3):  # a rival writer may put an entry in the way again after each removal
            try:
                os.rename(scratch, entry)
                return
            except OSError:
                if not entry.is_dir():
                    raise
            if damage(entry) is None:
                return
            discard(entry)
    except OSError as error:
        if disk_full(error):
            raise cache_full(entry.parent, error) from None
        raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def cached_array(entry: Path | None, build: Callable[[], np.ndarray], length: int, dtype: np.dtype) -> np.ndarray:
    """A (length,) array kept as the cache entry `entry` (None: not kept): read back when the entry is
    intact and fits, else built, written and returned. A damaged entry is removed with a warning."""
    if entry is not None and intact(entry):
        try:
            array = np.load(entry / "array.npy")
            if array.shape == (length,) and array.dtype == dtype:
                return array
            raise ValueError("it does not fit the rows it was made from")
        except FileNotFoundError:  # removed by another process since it was checked
            pass
        except (OSError, ValueError, EOFError) as error:
            discard_damaged(entry, error)
    array = build()
    if entry is not None:
        write_entry(entry, lambda scratch: np.save(scratch / "array.npy", array))
    return array


def cache_full(where: Path | str, error: OSError) -> DataError:
    """The error for a write in the datasets cache at `where` that failed because the disk, a quota
    or the largest file size allowed is reached (`errors.disk_full`)."""
    if error.errno == errno.EFBIG:
        return DataError(f"cannot write the datasets cache {where}: a file reached the largest size this process or "
                         f"filesystem allows ({error.strerror or error}); raise the process's file size limit "
                         "(ulimit -f), or point HF_DATASETS_CACHE at another filesystem, and rerun")
    return DataError(f"cannot write the datasets cache {where}: the disk is full ({error.strerror or error}); free "
                     "space there, or point HF_DATASETS_CACHE at a disk with room, and rerun")


def cache_unwritable(error: OSError, cache: Path | str) -> DataError:
    """The error for a write in datasets' cache `cache` that the system refused (no permission, a
    read-only filesystem, a file where a folder should be): `error.filename` names where, in the cache
    or a folder on the way to it that could not be made."""
    where = os.path.abspath(os.fsdecode(error.filename))
    if not Path(where).is_relative_to(os.path.abspath(cache)):
        return DataError(f"cannot write the datasets cache {cache} ({where}: {error.strerror or error}); point "
                         "HF_DATASETS_CACHE at a folder you can write, and rerun")
    return DataError(f"cannot write the datasets cache {os.fsdecode(error.filename)}: {error.strerror or error}; "
                     "point HF_DATASETS_CACHE at a folder you can write, and rerun")


__all__ = ["MANIFEST", "KEY_CHARS", "content_key", "code_digest", "file_sha256", "damage", "intact",
           "discard_damaged", "discard", "write_entry", "cached_array", "cache_full", "cache_unwritable"]
