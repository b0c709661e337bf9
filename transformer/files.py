"""Writing files so that a reader sees the old content or the new, never half of either: every
atomic write of the project goes through here. A temporary file (or directory) is written beside
the destination, flushed to disk, then renamed over it in one step; a failure leaves the old
destination as it was and removes the temporary. What a run directory holds, and who may replace
it, is checkpoints/rundir.py's business; this module only knows how.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import IO, Any, Callable, Iterator

TEMPORARY_PREFIX = ".tmp-"  # every temporary this module makes starts with it, then the final name
_OLD_PREFIX = f"{TEMPORARY_PREFIX}old-"  # a final directory moved aside for its replacement


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    """The SHA-256 of a file's bytes in hex, read once in large blocks into one buffer (hashlib
    releases the GIL while it hashes a block)."""
    digest, buffer = hashlib.sha256(), bytearray(block)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


# The most bytes one name in a directory may have (NAME_MAX: ext4, XFS, Btrfs, tmpfs, APFS all say 255).
NAME_MAX = 255
# What a temporary's name adds after the final name: "-" and this process's id (Linux's pid_max is at
# most 4,194,304: 7 digits; room is kept for 10).
_PID_ROOM = 11
_HASH_CHARS = 16


def derived_name(prefix: str, name: str, room: int = _PID_ROOM) -> str:
    """`prefix` + `name`, a name made from a user's: when that, with `room` more bytes, would be longer
    than a name may be (NAME_MAX), `name` is cut short (whole UTF-8 characters) and ends in a hash of
    the whole of it instead, so that any name the user could give leaves room for what is added."""
    whole = prefix + name
    if len(os.fsencode(whole)) + room <= NAME_MAX:
        return whole
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:_HASH_CHARS]
    keep = NAME_MAX - room - len(os.fsencode(prefix)) - len(digest) - 1
    return f"{prefix}{os.fsencode(name)[:keep].decode('utf-8', 'ignore')}~{digest}"


def real_destination(path: Path) -> Path:
    """Where a write of `path` lands: its absolute real path, through links. A rename replaces what
    it names, so a link to another disk (a run's checkpoints kept on a larger one) would be replaced
    by a folder on this one; its target is what changes instead, and a temporary is written beside
    the target (a rename is only atomic within one filesystem). Spellings such as `.` or `dir/..`
    get the name a temporary is derived from."""
    real = Path(os.path.realpath(path))
    if not real.name:  # "/": nothing can be renamed over it
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
    return real


def temporary_path(path: Path) -> Path:
    """The temporary that stands in for `path` while it is written: hidden, in the same directory
    (a rename is only atomic within one filesystem), and unique to this process. A name too long to
    take the prefix and the process id is shortened (`derived_name`). `path` must name its file
    (not `.` nor `..`): pass what `real_destination` returns where it may not."""
    return path.with_name(f"{derived_name(TEMPORARY_PREFIX, path.name)}-{os.getpid()}")


def fsync_directory(path: Path) -> None:
    """Make a rename inside `path` survive a power cut, where the filesystem allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary for writing; on a clean exit it replaces `path`, on an exception it is
    removed and `path` keeps its old content. Text modes write UTF-8 with '\\n' line ends. A link
    at `path` is followed: its target is replaced (`real_destination`)."""
    path = real_destination(path)
    tmp = temporary_path(path)
    text = "b" not in mode
    try:
        with open(tmp, mode, **({"encoding": "utf-8", "newline": "\n"} if text else {})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_writer(path) as handle:
        handle.write(text)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def publish_directory(tmp: Path, final: Path) -> None:
    """Make the fully written directory `tmp` appear as `final` in one rename, replacing an older
    `final` (moved aside first, then removed): a reader sees the old directory or the new one."""
    fsync_directory(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{derived_name(_OLD_PREFIX, final.name)}-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_directory(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_directory_atomic(final: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a fresh temporary directory beside `final`, which then replaces `final` in one
    rename (`publish_directory`); on any failure the temporary is removed and `final` is as it was.
    A link at `final` is followed: its target is replaced (`real_destination`)."""
    final = real_destination(final)
    tmp = temporary_path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover, if any
        tmp.mkdir()
        write(tmp)
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: alive
        return True
    return True


def remove_leftovers(final: Path) -> None:
    """Reclaim what a `write_directory_atomic` of `final` killed midway (SIGKILL, a power cut) left
    beside it: its temporary directory is removed, and an older `final` moved aside to be replaced is
    put back where its replacement never appeared. A process still running keeps its temporaries."""
    final = real_destination(final)
    pattern = re.compile(f"(?:{re.escape(derived_name(TEMPORARY_PREFIX, final.name))}"
                         f"|({re.escape(derived_name(_OLD_PREFIX, final.name))}))" + r"-(\d+)")
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or _running(int(match.group(2))):
            continue
        if match.group(1) and not final.exists():
            os.replace(entry, final)
        else:
            shutil.rmtree(entry, ignore_errors=True)


# No process id is larger on Linux (pid_max's highest setting, 2**22); larger numbers are no temporary's.
_PID_LIMIT = 1 << 22


def remove_file_leftovers(final: Path) -> None:
    """Reclaim what an `atomic_writer` of `final` killed midway (SIGKILL, a power cut) left beside it:
    its temporary, known by the name `temporary_path` gives it (the prefix, the final name, and the id
    of a process no longer running), if it is a regular file of this user's. Anything else stays as it
    is: another name, a link, a folder, a file of another user's or of a process still running."""
    final = real_destination(final)
    pattern = re.compile(re.escape(derived_name(TEMPORARY_PREFIX, final.name)) + r"-([1-9]\d{0,6})")
    owner = os.getuid() if hasattr(os, "getuid") else None
    try:
        entries = list(os.scandir(final.parent))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match or int(match[1]) > _PID_LIMIT or _running(int(match[1])):
            continue
        with contextlib.suppress(OSError):
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and owner in (None, info.st_uid):
                os.unlink(entry.path)


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through links, `..` or another spelling); False if either is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
