"""Pins: a reader (translation, serving, export) holds a checkpoint while it reads it, and the run's
writer leaves a pinned checkpoint on disk when it prunes, removing it at a later save instead. A pin
is a shared flock on the checkpoint's meta.json; a removal takes the exclusive lock without waiting,
and holds it while it deletes, so that no reader pins a checkpoint half gone. Where the filesystem
has no flock (Windows, some network filesystems) nothing is pinned and pruning goes on as before.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Iterator

from transformer.checkpoints.format import META_FILE
from transformer.checkpoints.layout import checkpoint_location
from transformer.errors import CheckpointError


class CheckpointGone(CheckpointError):
    """The checkpoint was removed (pruned by a training run) before it could be pinned."""


def _lock(handle: IO[bytes], shared: bool, wait: bool) -> bool | None:
    """Lock `handle`'s file: True when locked, False when another process holds a conflicting lock
    (only without `wait`), None where this filesystem cannot lock."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _still_there(handle: IO[bytes], path: Path) -> bool:
    """Whether `path` still names the file `handle` has open (not removed, nor replaced, meanwhile)."""
    try:
        here, opened = os.stat(path), os.fstat(handle.fileno())
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (opened.st_dev, opened.st_ino)


@contextlib.contextmanager
def pin(checkpoint: Path) -> Iterator[Path]:
    """Keep `checkpoint` on disk until the block ends; yields its real path (its own links followed:
    checkpoints/best moves on as training goes on), which the block should read through.
    CheckpointGone if it was removed before it could be pinned."""
    real = checkpoint_location(checkpoint)
    meta = real / META_FILE
    try:
        handle = open(meta, "rb")
    except FileNotFoundError:
        raise CheckpointGone(f"{checkpoint}: not a checkpoint ({META_FILE} is missing)") from None
    except OSError:  # unreadable: reading it will say so in its own words
        yield real
        return
    with handle:
        # A removal holds the exclusive lock while it deletes: waiting for it, then checking that
        # meta.json is still the file locked, tells a pinned checkpoint from a removed one.
        if _lock(handle, shared=True, wait=True) and not _still_there(handle, meta):
            raise CheckpointGone(f"{checkpoint}: was removed by its training run (which keeps only its newest "
                                 "checkpoints) as it was being opened")
        yield real


@contextlib.contextmanager
def claim_for_removal(checkpoint: Path) -> Iterator[bool]:
    """True while `checkpoint` may be removed: no reader pins it, and none can until the block ends.
    False while a reader pins it."""
    try:
        handle = open(Path(checkpoint) / META_FILE, "rb")
    except OSError:  # no meta.json: nothing can pin it
        yield True
        return
    with handle:
        yield _lock(handle, shared=False, wait=False) is not False


__all__ = ["CheckpointGone", "pin", "claim_for_removal"]
