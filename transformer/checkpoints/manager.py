"""Which checkpoints a run has and which one is best: the run state, `runs/<name>/state.json`.

The state names the newest step checkpoint (where a resume starts), the ones kept, and the best
one with its step and score. It is the run's single commit point: a checkpoint directory is
written first (atomically, by checkpoint.py), then the state that names it, in one rename. So
`best` is a pointer that moves only when a save says so, never a copy whose metadata can drift,
and pruning never removes what it points to. `checkpoints/best` is a symbolic link to the same
directory, for people and tools that look there. How a checkpoint's files are written and read
lives in checkpoint.py; this module decides which exist.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from transformer.checkpoints import files as checkpoint
from transformer.errors import CheckpointError
from transformer.model import Transformer
from transformer.checkpoints.rundir import (BEST, BEST_METRIC, CHECKPOINTS, STATE_FILE, STATE_FORMAT, Best, RunState, find_checkpoint, read_run_state,
                     step_dir_name)

log = logging.getLogger(__name__)


class CheckpointManager:
    """Owns a run's step checkpoints, its best pointer, pruning and state.json. Rank 0 only."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.run_dir, self.keep = Path(run_dir), keep
        self.directory = self.run_dir / CHECKPOINTS
        self.state = read_run_state(self.run_dir) or RunState()

    @property
    def best(self) -> Best | None:
        return self.state.best

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether `metrics` beat the best so far (the first validation always does)."""
        return self.state.best is None or metrics[BEST_METRIC] > self.state.best.score

    # ------------------------------------------------------------------ resuming

    def resume_point(self) -> Path | None:
        """The checkpoint to resume from, or None for a new run. Call while holding the run's lock.

        Step directories the state does not name were being saved when a process was killed, before
        the state recorded them: they are removed, and training redoes those steps exactly. A named
        checkpoint that fails verification is moved aside (kept for inspection) and the newest intact
        one before it is used; the best pointer is dropped if it pointed at a damaged or newer one.
        """
        checkpoint.remove_temporaries(self.run_dir)
        on_disk = checkpoint.list_checkpoints(self.run_dir)
        if not (self.run_dir / STATE_FILE).is_file():
            if any(not _written_by_manager(path) for path in on_disk):
                raise CheckpointError(
                    f"{self.run_dir}: was trained by an earlier version of this project (it has no {STATE_FILE}), "
                    "so it cannot be resumed; translate.py still reads it. Train in a new --run-dir")
            for path in on_disk:  # saved, but killed before the first state recorded them
                self._remove(path, "its save was interrupted before the run state recorded it")
            return None
        for path in on_disk:
            if path.name not in self.state.kept:
                self._remove(path, "its save was interrupted before the run state recorded it")
        intact = None
        for name in reversed(self.state.kept):
            try:
                checkpoint.read_meta(self.directory / name, verify=True, need_training_state=True)
                intact = name
                break
            except CheckpointError as error:
                log.warning("skipping checkpoint: %s", error)
        if intact is None and self.state.kept:
            # Starting over would bury the run's history under new checkpoints: the user decides.
            raise CheckpointError(f"{self.run_dir}: none of its {len(self.state.kept)} checkpoints is intact (see "
                                  f"the warnings above), so it cannot be resumed; move {self.directory} and "
                                  f"{self.run_dir / STATE_FILE} away to start over, or train in another --run-dir")
        if intact is None:
            return None
        damaged = self.state.kept[self.state.kept.index(intact) + 1:]
        for name in damaged:
            aside = self.directory / f"corrupt-{name}-{os.getpid()}"
            log.warning("moving the damaged %s aside to %s", self.directory / name, aside)
            os.replace(self.directory / name, aside)
        best = self.state.best
        if best is not None and (best.checkpoint in damaged or not (self.directory / best.checkpoint).is_dir()):
            log.warning("the best checkpoint %s is damaged or gone; the next validation sets a new best",
                        best.checkpoint)
            best = None
        if damaged or best is not self.state.best:
            self._commit(RunState(latest=intact, kept=self.state.kept[: self.state.kept.index(intact) + 1],
                                  best=best))
        return self.directory / intact

    # ------------------------------------------------------------------ saving

    def save(self, model: Transformer, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
             rng_state: dict[str, Any], *, metrics: dict[str, float] | None = None,
             grad_scaler_state: dict[str, Any] | None = None,
             rank_rng_states: list[dict[str, Any]] | None = None) -> Path:
        """Checkpoint step `meta['step']` with this step's validation `metrics` (if it was validated),
        record it in the run state (and as best if the metrics improve on it), then prune."""
        step = int(meta["step"])
        meta = dict(meta, metrics=metrics or {}, manager_format=STATE_FORMAT)
        path = checkpoint.save_checkpoint(self.run_dir, model, optimizer, meta, rng_state,
                                          grad_scaler_state=grad_scaler_state, rank_rng_states=rank_rng_states)
        best = self.state.best
        if metrics and self.improves(metrics):
            best = Best(path.name, step, dict(metrics))
        kept = [name for name in self.state.kept if name != path.name] + [path.name]
        protected = {best.checkpoint} if best else set()
        excess = [name for name in kept[:-self.keep] if name not in protected]
        self._commit(RunState(latest=path.name, kept=[name for name in kept if name not in excess], best=best))
        for name in excess:
            shutil.rmtree(self.directory / name, ignore_errors=True)
        return path

    def save_weights(self, name: str, model: Transformer, meta: dict[str, Any], metrics: dict[str, float]) -> Path:
        """A weights-only checkpoint `checkpoints/<name>` (e.g. averaged weights), made best if its
        metrics improve on the best step checkpoint's."""
        path = checkpoint.save_weights(self.run_dir, name, model, dict(meta, metrics=metrics))
        if self.improves(metrics):
            self._commit(RunState(latest=self.state.latest, kept=self.state.kept,
                                  best=Best(name, int(meta["step"]), dict(metrics))))
        return path

    def list_kept(self) -> list[Path]:
        return [self.directory / name for name in self.state.kept]

    # ------------------------------------------------------------------ internals

    def _commit(self, state: RunState) -> None:
        """Write state.json atomically (temporary file, fsync, rename), then point checkpoints/best."""
        data = asdict(state)
        path = self.run_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(data, indent=2) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"cannot write the run state {path}: {error.strerror or error}. Training stopped "
                                  "so that no work goes unsaved; fix that, then rerun to resume") from error
        self.state = state
        self._link_best()

    def _link_best(self) -> None:
        """Point checkpoints/best at the best checkpoint (a relative link, replaced in one rename)."""
        link = self.directory / BEST
        target = self.state.best.checkpoint if self.state.best else None
        if link.is_symlink() and os.readlink(link) == target:
            return
        if target is None:
            if link.is_symlink():
                link.unlink()
            return
        tmp = link.with_name(f".tmp-link-{os.getpid()}")
        try:
            tmp.unlink(missing_ok=True)
            os.symlink(target, tmp)
            if link.is_dir() and not link.is_symlink():  # a copy from an earlier version of this project
                shutil.rmtree(link)
            os.replace(tmp, link)
        except OSError as error:  # e.g. a filesystem without links: state.json still says which one
            tmp.unlink(missing_ok=True)
            log.warning("cannot link %s to %s (%s); translate.py finds the best checkpoint through %s anyway",
                        link, target, error.strerror or error, STATE_FILE)

    def _remove(self, path: Path, why: str) -> None:
        log.info("removing %s: %s", path, why)
        shutil.rmtree(path, ignore_errors=True)


def _written_by_manager(path: Path) -> bool:
    try:
        return "manager_format" in checkpoint.read_meta(path, verify=False)
    except CheckpointError:
        return True  # unreadable: not evidence of an older version; verification deals with it


def step_checkpoint(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / step_dir_name(step)


__all__ = ["STATE_FILE", "Best", "RunState", "read_run_state", "CheckpointManager", "find_checkpoint",
           "step_checkpoint"]  # the run state's readers, re-exported from rundir.py
