"""Errors a user can cause and fix (bad config, bad data, missing run). The CLIs print
these as one clear message and exit with code 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import typing

_OPTION = re.compile("\u27e8([a-z0-9_]+)\u27e9")


def option(name: str) -> str:
    """An option named in a message by its generic name ("top_k"), which each face of the package
    (a script's flag, an API field) replaces with its own name: see UserError.naming."""
    return f"\u27e8{name}\u27e9"


def name_options(text: str, names: dict[str, str]) -> str:
    """`text` with each option marked by `option` called by its name in `names`, else by its generic name."""
    return _OPTION.sub(lambda match: names.get(match[1], match[1]), text)


class UserError(Exception):
    """Base class: a problem in the user's input, not in the code. The library names no command-line
    flag: an option in the message is marked with `option`, and reads by its generic name unless
    `naming` gives it another."""

    def __str__(self) -> str:
        return self.naming({})

    def naming(self, names: dict[str, str]) -> str:
        """The message with each marked option called by its name in `names` (e.g. {"top_k": "--top-k"})."""
        return name_options(super().__str__(), names)


class ConfigError(UserError):
    """The YAML config or a --set override is invalid."""


class DataError(UserError):
    """The training data file cannot be read as sentence pairs."""


class CheckpointError(UserError):
    """A run directory or checkpoint is missing, corrupt or does not match."""


class ExportCacheError(CheckpointError):
    """The CTranslate2 export a run keeps of a checkpoint could not be written there (no permission, a
    full disk): a caller that can translate without it (the torch engine) may."""


class EngineUnavailableError(UserError):
    """CTranslate2 imports but cannot run on the device it found (its wheel's CUDA build without the CUDA
    libraries it loads): engine auto translates with the torch engine instead, with a note."""


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
        except BrokenPipeError:
            raise  # the reader left (`| head`): the script decides, usually a quiet exit
        except OSError as error:
            self._fail(error)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
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


class DecodeOptionError(UserError):
    """A decode option (beam size, n-best, length penalty or limits, sampling) out of the range every
    engine computes, or given with one it excludes: `option` (generic name) and the `reason`."""

    def __init__(self, option_name: str, reason: str) -> None:
        super().__init__(f"{option(option_name)} {reason}")
        self.option, self.reason = option_name, reason
