"""The writer of a run directory: the only code that creates, replaces or deletes anything in one
(layout.py names what it holds; lookup.py finds and reads a run for inference without writing).

A folder becomes a run when `RunDirectory.create` writes its state.json; a non-empty folder
without one is refused, never written into. state.json is the commit point: it names the step
checkpoints kept, the newest and the best. A missing or damaged one is refused with the command
that rebuilds it, never read as permission to delete. Only names this module could have written
are accepted, and it deletes only what it wrote: temporaries of its own saves, and checkpoints it
published, never one a reader has pinned (pins.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from transformer.checkpoints.format import CHECKPOINT_FILES
from transformer.checkpoints.layout import (BEST, CHECKPOINTS, CORRUPT_PREFIX, EXPORTS_DIR, HELDOUT_DIR, IMPORT_RECORD,
                                            LOCK_FILE, LOG_FILE, RUN_CONFIG, STATE_FILE, TENSORBOARD_DIR, TOKENIZER_DIR,
                                            RunState, UnusableRunState, is_step_dir_name, list_checkpoints,
                                            read_run_state, step_dir_name)
from transformer.checkpoints.pins import claim_for_removal
from transformer.errors import CheckpointError, ExportCacheError
from transformer.files import (TEMPORARY_PREFIX, fsync_directory, publish_directory, real_destination,
                               remove_leftovers, same_file, temporary_path, write_directory_atomic, write_json_atomic,
                               write_text_atomic)

log = logging.getLogger(__name__)

# What a failed first start may leave in a folder that is not a run yet (train.py opens its log first).
_BEFORE_A_RUN = {LOG_FILE, LOCK_FILE}
# Folders of a run that a user may make ready before its first start, empty: checkpoints/ as a link
# to a larger disk, say. Written through as any folder of the run.
_RUN_FOLDERS = {CHECKPOINTS, TENSORBOARD_DIR, TOKENIZER_DIR, HELDOUT_DIR, EXPORTS_DIR}


def _made_ready(entry: Path) -> bool:
    """Whether `entry` is one of a run's folders, still empty (through a link, where it is one)."""
    try:
        return entry.name in _RUN_FOLDERS and entry.is_dir() and not any(entry.iterdir())
    except OSError:
        return False


# The descriptors of the run locks this process holds. A flock belongs to the open file, which a
# forked child shares: datasets' map workers (forked) would hold the run's lock for as long as they
# live, and after this process was killed they may live on, so that the rerun is refused as "being
# trained by another process". Each child therefore lets go of its copies as it starts.
_HELD_LOCKS: set[int] = set()


def _locks_not_inherited() -> None:
    if not _HELD_LOCKS:
        return
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd in _HELD_LOCKS:
        os.dup2(devnull, fd)  # not a close: the child's file object still owns the number
    os.close(devnull)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_locks_not_inherited)


class MissingRunState(UnusableRunState):
    """A run whose state.json is gone: it can be rebuilt from the checkpoints on disk."""


# ---------------------------------------------------------------------------------------------- the owner


class RunDirectory:
    """One run's folder. Every write into it goes through a method here, and every name it is given
    to touch is checked against the names it writes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / CHECKPOINTS
        self.state_file = self.path / STATE_FILE
        self.config_file = self.path / RUN_CONFIG
        self.tokenizer_dir = self.path / TOKENIZER_DIR
        self.heldout_dir = self.path / HELDOUT_DIR
        self.tensorboard_dir = self.path / TENSORBOARD_DIR

    # -------------------------------------------------------------- what the folder is

    @staticmethod
    def check_trainable(path: Path, rebuilding: bool = False) -> None:
        """Refuse a folder that holds files and is not a run (training would mix its files with the
        user's), and a run that lost its state.json, unless `rebuilding` it."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"{path}: is a file, not a run directory")
        if not path.is_dir() or (path / STATE_FILE).exists():
            return
        if list_checkpoints(path):
            if rebuilding:
                return
            raise MissingRunState(f"{path / STATE_FILE}: missing, so which checkpoints this run keeps, and which is "
                                  "best, is unknown; nothing was changed")
        others = sorted(p.name for p in path.iterdir() if p.name not in _BEFORE_A_RUN and not _made_ready(p))
        if others:
            raise CheckpointError(
                f"{path}: is not empty and is not a run of this project (no {STATE_FILE}; it holds "
                f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); nothing was written. Choose a new "
                "or empty run directory")

    def is_run(self) -> bool:
        return self.state_file.exists()

    @classmethod
    @contextlib.contextmanager
    def written_whole(cls, path: Path) -> Iterator["RunDirectory"]:
        """A new run that appears whole or not at all (an imported one): the block fills the run of a
        temporary folder beside `path`, which becomes `path` in one rename as the block ends. On any
        failure or interruption the temporary, and any parent folder made for it, is removed: nothing is
        left. `path` must be new, or an empty folder (which the rename replaces), and not the current one."""
        path = Path(path)
        if path.is_symlink() and not path.exists():
            raise CheckpointError(f"{path}: a link to nothing stands there; nothing was written. Choose a new "
                                  "run directory")
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            what = "a file" if not path.is_dir() else "a run" if (path / STATE_FILE).exists() else "a folder"
            raise CheckpointError(f"{path}: exists ({what}, not empty); nothing was written. Choose a new run "
                                  "directory")
        if same_file(path, Path.cwd()):
            raise CheckpointError(f"{path}: is the current directory; nothing was written. Choose a new run "
                                  "directory")
        final = real_destination(path)
        remove_leftovers(final)  # of a write of it that was killed midway
        made = [parent for parent in final.parents if not parent.exists()]  # innermost first
        tmp = temporary_path(final)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            yield cls(tmp)
            fsync_directory(tmp)
            os.replace(tmp, final)  # onto an empty folder, or none; one filled meanwhile is refused (ENOTEMPTY)
            fsync_directory(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            for parent in made:
                with contextlib.suppress(OSError):
                    parent.rmdir()
            raise

    def create(self) -> None:
        """Make the folder a run (an empty run state) if it is not one yet."""
        self.check_trainable(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.is_run():
            self.commit_state(RunState())

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Held while training: two processes training one run would interleave their checkpoints.
        The OS releases it when the process ends, even on SIGKILL; a process forked meanwhile (the
        data stage's workers) does not hold it (`_locks_not_inherited`)."""
        try:
            import fcntl
        except ImportError:  # Windows has no flock; the run goes unguarded there
            yield
            return
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / LOCK_FILE, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckpointError(f"{self.path} is being trained by another process; wait for it to stop, "
                                      "or train in another run directory") from None
            except OSError as error:  # e.g. a network filesystem without locks
                log.warning("cannot lock %s (%s); make sure no other process trains in it", self.path, error.strerror)
            _HELD_LOCKS.add(handle.fileno())
            try:
                yield
            finally:
                _HELD_LOCKS.discard(handle.fileno())

    # -------------------------------------------------------------- files of the run

    def state(self) -> RunState:
        state = read_run_state(self.path)
        if state is None:
            raise MissingRunState(f"{self.state_file}: missing, so which checkpoints this run keeps, and which is "
                                  "best, is unknown; nothing was changed")
        return state

    def commit_state(self, state: RunState) -> None:
        """Replace state.json in one rename, then point checkpoints/best at the best checkpoint."""
        try:
            write_json_atomic(self.state_file, asdict(state))
        except OSError as error:
            raise CheckpointError(f"cannot write the run state {self.state_file}: {error.strerror or error}. "
                                  "Training stopped so that no work goes unsaved; fix that, then rerun to "
                                  "resume") from error
        self._link_best(state.best.checkpoint if state.best else None)

    def write_config(self, text: str) -> None:
        write_text_atomic(self.config_file, text)

    def write_import_record(self, record: dict) -> None:
        """imported.json: where an imported run's model came from (layout.IMPORT_RECORD)."""
        write_json_atomic(self.path / IMPORT_RECORD, record)

    def replace_tokenizer(self, save: Callable[[Path], None]) -> None:
        """`save(directory)` writes the tokenizer files into a fresh directory, which then replaces tokenizer/."""
        write_directory_atomic(self.tokenizer_dir, save)

    def copy_tokenizer(self, source: Path) -> None:
        """Copy the files of another run's tokenizer folder `source` as they are, byte for byte (a
        fine-tuned run keeps its parent's vocabulary); they replace tokenizer/ in one rename."""
        names = sorted(p.name for p in Path(source).iterdir() if p.is_file() and not p.is_symlink()
                       and not p.name.startswith(TEMPORARY_PREFIX))

        def copy(directory: Path) -> None:
            for name in names:
                shutil.copyfile(Path(source) / name, directory / name)

        self.replace_tokenizer(copy)

    def write_heldout(self, name: str, sources: list[str], references: list[list[str]]) -> None:
        """`<name>.en` (distinct sources) and `<name>.fr.1..K`, line-aligned references, blank where a
        sentence has fewer than K. (The suffixes name the shipped pair; the files hold whatever
        source and target the data has.)"""
        directory = self.heldout_dir
        directory.mkdir(exist_ok=True)
        width = max((len(r) for r in references), default=0)
        for stale in directory.glob(f"{name}.fr.*"):  # a rewrite with fewer references leaves none behind
            if stale.name.rpartition(".")[2].isdigit() and int(stale.name.rpartition(".")[2]) > width:
                stale.unlink()
        write_text_atomic(directory / f"{name}.en", "".join(s + "\n" for s in sources))
        for k in range(width):
            write_text_atomic(directory / f"{name}.fr.{k + 1}",
                              "".join((refs[k] if k < len(refs) else "") + "\n" for refs in references))

    def read_heldout(self, name: str) -> tuple[list[str], list[list[str]]] | None:
        """What `write_heldout` wrote, or None if it is not there."""
        from transformer.data.text import read_lines  # no torch, no datasets

        directory = self.heldout_dir
        if not (directory / f"{name}.en").is_file():
            return None
        sources = read_lines(directory / f"{name}.en", "held-out file")
        streams = [read_lines(directory / f"{name}.fr.{k}", "held-out file")
                   for k in range(1, len(list(directory.glob(f"{name}.fr.*"))) + 1)]
        if any(len(stream) != len(sources) for stream in streams):
            raise CheckpointError(f"{directory}: the {name} files differ in length; they were edited by hand")
        return sources, [[stream[i] for stream in streams if stream[i]] for i in range(len(sources))]

    # -------------------------------------------------------------- checkpoints

    def checkpoint(self, name: str) -> Path:
        """The path of step checkpoint `name`, which must be a name this module writes."""
        if not is_step_dir_name(name):
            raise CheckpointError(f"{self.checkpoints}: {name!r} is not a checkpoint name this project writes")
        return self.checkpoints / name

    def step_checkpoints(self) -> list[Path]:
        return list_checkpoints(self.path)

    def publish_checkpoint(self, step: int, write: Callable[[Path], None]) -> Path:
        """`write(directory)` fills a fresh temporary directory, which then appears as step_<step> in one
        rename. Returns the checkpoint's path."""
        final = self.checkpoint(step_dir_name(step))
        tmp = temporary_path(final)
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            if write(tmp) is False:  # the same content is on disk already: leave it untouched
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            publish_directory(tmp, final)
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot write checkpoint {final}: {error.strerror or error}. Training stopped so "
                                  "that no work goes unsaved; free space or fix permissions, then rerun to "
                                  "resume.") from error
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def remove_checkpoint(self, name: str, why: str, announce: bool = True) -> bool:
        """Delete a step checkpoint this project wrote (only our files in it); anything else stays, and
        so does a checkpoint a reader has pinned: then this returns False, and the caller tries later."""
        path = self.checkpoint(name)
        if not path.is_dir() or path.is_symlink():
            return True
        foreign = [p.name for p in path.iterdir() if p.name not in CHECKPOINT_FILES]
        if foreign:
            log.warning("not removing %s (%s): it holds files this project did not write: %s", path, why,
                        ", ".join(sorted(foreign)[:3]))
            return True
        with claim_for_removal(path) as free:
            if not free:
                log.info("not removing %s yet (%s): a reader has it open", path, why)
                return False
            log.log(logging.INFO if announce else logging.DEBUG, "removing %s: %s", path, why)
            shutil.rmtree(path)
        return True

    def move_aside(self, name: str) -> Path:
        """Keep a damaged checkpoint for inspection, out of the way of the names training writes."""
        aside = self.checkpoints / f"{CORRUPT_PREFIX}{name}-{os.getpid()}"
        log.warning("moving the damaged %s aside to %s", self.checkpoint(name), aside)
        os.replace(self.checkpoint(name), aside)
        return aside

    def remove_temporaries(self) -> None:
        """Clean up after a save that was killed midway (call while holding the lock). A temporary
        checkpoint is deleted; a checkpoint moved aside to be replaced is put back if its
        replacement never appeared."""
        if not self.checkpoints.is_dir():
            return
        prefix_old = f"{TEMPORARY_PREFIX}old-"
        for path in self.checkpoints.iterdir():
            if path.name.startswith(prefix_old):
                name = path.name[len(prefix_old):].rsplit("-", 1)[0]
                if is_step_dir_name(name) and not (self.checkpoints / name).exists():
                    log.warning("restoring %s from %s, left by an interrupted save", self.checkpoints / name, path)
                    os.replace(path, self.checkpoints / name)
                elif is_step_dir_name(name):
                    shutil.rmtree(path)
            elif path.name.startswith(TEMPORARY_PREFIX) and is_step_dir_name(path.name[len(TEMPORARY_PREFIX):]
                                                                             .rsplit("-", 1)[0]):
                log.info("removing %s, left by an interrupted save", path)
                shutil.rmtree(path)

    def publish_export(self, name: str, write: Callable[[Path], None]) -> Path:
        """`write(directory)` fills a fresh temporary directory, which then replaces ctranslate2/<name>
        (translate.py's export of a checkpoint, named by its weights' hash) in one rename."""
        if not re.fullmatch(r"[0-9a-f]{16}", name):
            raise CheckpointError(f"{self.path / EXPORTS_DIR}: {name!r} is not an export name this project writes")
        final = self.path / EXPORTS_DIR / name
        made_exports_dir = not final.parent.exists()
        try:
            remove_leftovers(final)  # of an export killed midway
            write_directory_atomic(final, write)
        except BaseException as error:
            if made_exports_dir:  # a failed export leaves the directory as it found it
                with contextlib.suppress(OSError):
                    final.parent.rmdir()
            if isinstance(error, OSError):
                raise ExportCacheError(f"cannot write the CTranslate2 export {final}: "
                                       f"{error.strerror or error}") from None
            raise
        return final

    def _link_best(self, target: str | None) -> None:
        """Point checkpoints/best at `target` (a relative link, replaced in one rename)."""
        link = self.checkpoints / BEST
        if link.is_symlink() and os.readlink(link) == target:
            return
        if link.exists() and not link.is_symlink():
            log.warning("%s is not the link this project keeps there; leaving it alone", link)
            return
        if target is None:
            if link.is_symlink():
                link.unlink()
            return
        tmp = temporary_path(link)
        try:
            tmp.unlink(missing_ok=True)
            os.symlink(target, tmp)
            os.replace(tmp, link)
        except OSError as error:  # e.g. a filesystem without links: state.json still says which one
            tmp.unlink(missing_ok=True)
            log.warning("cannot link %s to %s (%s); translate.py finds the best checkpoint through %s anyway",
                        link, target, error.strerror or error, STATE_FILE)


__all__ = ["MissingRunState", "RunDirectory"]
