"""Errors a user can cause and fix (bad config, bad data, missing run). The CLIs print
these as one clear message and exit with code 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import typing


class UserError(Exception):
    """Base class: a problem in the user's input, not in the code."""


class ConfigError(UserError):
    """The YAML config or a --set override is invalid."""


class DataError(UserError):
    """The training data file cannot be read as sentence pairs."""


class CheckpointError(UserError):
    """A run directory or checkpoint is missing, corrupt or does not match."""


class ExportCacheError(CheckpointError):
    """The CTranslate2 export a run keeps of a checkpoint could not be written there (no permission, a
    full disk): a caller that can translate without it (the torch engine) may."""


class OutputError(UserError):
    """Standard output could not be written: a full disk, a full or closed pipe."""


# A write that fails for one of these is the user's disk or pipe, not a bug.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def disk_full(error: OSError) -> bool:
    """Whether `error` says the disk (or quota) is full. pyarrow's IO errors may carry no errno, only
    the system's message."""
    return error.errno in DISK_FULL_ERRNOS or os.strerror(errno.ENOSPC) in str(error)


class CheckedOutput:
    """A script's standard output whose failed writes are an OutputError (a UserError, so the script's
    usual mapping prints one line and exits 2) instead of a traceback. After a failure the descriptor
    is pointed at os.devnull: what stayed in the buffer is lost either way, and the interpreter's own
    flush at exit must not fail a second time. For scripts only: it replaces a process-wide stream.

        sys.stdout = CheckedOutput(sys.stdout)
    """

    def __init__(self, stream: typing.TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._fail(error)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._fail(error)

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self._stream, name)

    def _fail(self, error: OSError) -> typing.NoReturn:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        reason = "the disk is full" if disk_full(error) else (error.strerror or str(error))
        raise OutputError(f"cannot write standard output: {reason}; what was written before is complete, "
                          "the rest is not (write it where there is room)") from None
