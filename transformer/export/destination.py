"""Where an export may be written, and how: every format's export refuses a destination that lies in
a run or a checkpoint, or holds anything but an earlier export of that format (which format counts
is the caller's `holds_only_an_export`), and appears there in one rename. No format knowledge here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformer.checkpoints.format import META_FILE
from transformer.checkpoints.layout import CHECKPOINTS, RUN_CONFIG, STATE_FILE, TOKENIZER_DIR
from transformer.errors import UserError
from transformer.files import write_directory_atomic


def _run_or_checkpoint(directory: Path) -> bool:
    """Whether `directory` is a checkpoint or a run directory (trained, or still before its first save)."""
    return ((directory / META_FILE).is_file() or (directory / STATE_FILE).is_file()
            or ((directory / RUN_CONFIG).is_file() and ((directory / CHECKPOINTS).is_dir()
                                                         or (directory / TOKENIZER_DIR).is_dir())))


def check_destination(out_dir: Path, holds_only_an_export: Callable[[Path], bool]) -> None:
    """Refuse an `out_dir` whose contents an export would destroy: one inside (or equal to) a run
    directory or a checkpoint, or one for which `holds_only_an_export` is False. An empty or missing
    directory is fine; so is an earlier export, which the new one replaces."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    resolved = out_dir.resolve()  # links and other spellings count as where they lead
    for directory in (resolved, *resolved.parents):
        if _run_or_checkpoint(directory):
            where = "is" if directory == resolved else f"lies inside {directory}, which is"
            raise UserError(f"{out_dir} {where} a run or a checkpoint; export into a directory of its own")
    try:
        occupied = out_dir.is_dir() and any(out_dir.iterdir()) and not holds_only_an_export(out_dir)
    except OSError as error:
        raise UserError(f"cannot read {out_dir}: {error.strerror or error}") from None
    if occupied:
        raise UserError(f"{out_dir} holds files other than an earlier export, which an export would delete; "
                        "export into a new or empty directory")


def publish_export(out_dir: Path, write: Callable[[Path], None], what: str) -> Path:
    """Call `write` on an empty directory beside `out_dir`, then rename it over `out_dir` (which
    `check_destination` allowed), so a reader sees all of the new export or the old one. `what`
    names the export in the error of a failed write ("the CTranslate2 export")."""
    try:
        write_directory_atomic(Path(out_dir), write)
    except OSError as error:
        raise UserError(f"cannot write {what} {out_dir}: {error.strerror or error}") from None
    return out_dir


__all__ = ["check_destination", "publish_export"]
