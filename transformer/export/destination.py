"""What every export format shares, as CTranslate2's `Converter` base does: `Exporter` finds and pins
the checkpoint, refuses a destination that lies in a run or a checkpoint, is (or holds) the current
directory, or holds anything but an earlier export of that format, reclaims what a killed export left beside it, and publishes the new
export in one rename. A format (ctranslate2.py, huggingface.py) only says what it needs installed,
how to recognise its own exports, and which files it writes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformer.checkpoints.format import META_FILE
from transformer.checkpoints.layout import CHECKPOINTS, RUN_CONFIG, STATE_FILE, TOKENIZER_DIR
from transformer.checkpoints.lookup import pinned_checkpoint
from transformer.checkpoints.pins import pin
from transformer.errors import UserError
from transformer.files import remove_leftovers, write_directory_atomic


def _run_or_checkpoint(directory: Path) -> bool:
    """Whether `directory` is a checkpoint or a run directory (trained, or still before its first save)."""
    return ((directory / META_FILE).is_file() or (directory / STATE_FILE).is_file()
            or ((directory / RUN_CONFIG).is_file() and ((directory / CHECKPOINTS).is_dir()
                                                         or (directory / TOKENIZER_DIR).is_dir())))


def check_destination(out_dir: Path, holds_only_an_export: Callable[[Path], bool]) -> None:
    """Refuse an `out_dir` whose contents an export would destroy: one inside (or equal to) a run
    directory or a checkpoint, the current directory or one holding it, or one for which
    `holds_only_an_export` is False. An empty or missing directory is fine; so is an earlier export,
    which the new one replaces."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    resolved = out_dir.resolve()  # links and other spellings count as where they lead
    try:
        here = Path.cwd().resolve()
    except OSError:  # the current directory was removed: then it is no destination either
        here = None
    if here is not None and (resolved == here or resolved in here.parents):
        # The export replaces its directory whole, by a rename: the process's (and the shell's) current
        # directory would be moved away with it, leaving them in a directory that no longer exists.
        where = "is the current directory" if resolved == here else f"holds the current directory ({here})"
        raise UserError(f"{out_dir} {where}, which an export replaces whole; export into a directory of its "
                        f"own, e.g. {out_dir / 'export'}")
    # As spelt, too: runs/base/checkpoints may be a link to another disk, whose real folders above it
    # are no run, while the run is the folder it is spelt in.
    spelt = out_dir.absolute()
    for chain in ((resolved, *resolved.parents), (spelt, *spelt.parents)):
        for directory in chain:
            if _run_or_checkpoint(directory):
                where = "is" if directory in (resolved, spelt) else f"lies inside {directory}, which is"
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
    `check_destination` allowed), so a reader sees all of the new export or the old one. What an
    earlier export killed midway left beside `out_dir` is reclaimed first. `what` names the export
    in the error of a failed write ("the CTranslate2 export")."""
    try:
        remove_leftovers(Path(out_dir))
        write_directory_atomic(Path(out_dir), write)
    except OSError as error:
        raise UserError(f"cannot write {what} {out_dir}: {error.strerror or error}") from None
    return out_dir


class Exporter:
    """The scaffold of one export format; subclasses fill in the three methods below."""

    what = "the export"  # names it in messages: "the CTranslate2 export"

    def import_backend(self) -> Any:
        """The package the format needs, or a UserError saying how to install it."""
        raise NotImplementedError

    def holds_only_an_export(self, directory: Path) -> bool:
        """Whether `directory` holds an earlier export of this format and nothing else."""
        raise NotImplementedError

    def write_files(self, found: Path, directory: Path) -> None:
        """Write the export of checkpoint `found` into the empty `directory`."""
        raise NotImplementedError

    def check_destination(self, out_dir: Path) -> None:
        check_destination(out_dir, self.holds_only_an_export)

    def export_checkpoint(self, found: Path, out_dir: Path) -> Path:
        """Export checkpoint `found` into `out_dir` (see `check_destination` for which are refused),
        holding the checkpoint while it is read: a run still training may prune it meanwhile."""
        self.import_backend()  # the clearest error first
        self.check_destination(Path(out_dir))
        with pin(found) as real:
            return publish_export(Path(out_dir), lambda tmp: self.write_files(real, tmp), self.what)

    def export_run(self, run: Path | None, checkpoint_dir: Path | None, out_dir: Path,
                   runs_root: Path = Path("runs")) -> Path:
        """Export the best checkpoint of `run` (or `checkpoint_dir`; default: the newest run) to `out_dir`."""
        with pinned_checkpoint(run, checkpoint_dir, runs_root) as found:
            return self.export_checkpoint(found, out_dir)


__all__ = ["check_destination", "publish_export", "Exporter"]
