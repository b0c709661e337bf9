"""Errors a user can cause and fix (bad config, bad data, missing run): the package raises them with
the path or key and the reason; the scripts turn them into one line and exit code 2 (cli.py, their
one boundary). Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable

_OPTION = re.compile("\u27e8([a-z0-9_]+)\u27e9")


def option(name: str) -> str:
    """An option named in a message by its generic name ("top_k"), which each face of the package
    (a script's flag, an API field) replaces with its own name: see UserError.naming."""
    return f"\u27e8{name}\u27e9"


def marked_options(text: str) -> list[str]:
    """The generic names of the options `text` marks with `option`."""
    return _OPTION.findall(text)


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


def find_cause(error: BaseException, kind: type[BaseException],
               predicate: Callable[[BaseException], bool] | None = None) -> BaseException | None:
    """`error` or the first exception it was raised from (its cause, else its context, in turn) that is
    a `kind` and satisfies `predicate`; None if there is none. Libraries wrap what they meet (datasets
    a builder's errors in a DatasetGenerationError), so the error to report is along the chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind) and (predicate is None or predicate(error)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def from_the_system(error: BaseException) -> bool:
    """Whether `error` is the operating system's (an OSError with an errno: a permission, a full disk),
    not a parser's or a library's OSError without one."""
    return isinstance(error, OSError) and error.errno is not None


class DecodeOptionError(UserError):
    """A decode option (beam size, n-best, length penalty or limits, sampling) out of the range every
    engine computes, or given with one it excludes: `option` (generic name) and the `reason`."""

    def __init__(self, option_name: str, reason: str) -> None:
        super().__init__(f"{option(option_name)} {reason}")
        self.option, self.reason = option_name, reason


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying the line that says what it left behind (what the next run continues from)."""
