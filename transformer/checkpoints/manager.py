"""Checkpoints of a training run: saving, resuming, pruning, and which one is best (one decision,
`CheckpointManager.improves`). Saving and resuming take the same road: the trainer's
`state_dict()` goes into a checkpoint, and `load_state_dict()` gets it back. Which files a
checkpoint holds is files.py's business; every write into the run goes through rundir.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from transformer.checkpoints import files
from transformer.checkpoints.rundir import (BEST_METRIC, STATE_FILE, Best, RunDirectory, RunState, read_meta,
                                            step_dir_name)
from transformer.errors import CheckpointError
from transformer.model import Transformer

log = logging.getLogger(__name__)


class Checkpointable(Protocol):
    """What a checkpoint saves and restores: a model, and the rest of the state as
    {"training": tensors and numbers (training.pt), "meta": JSON (meta.json)}."""

    model: Transformer

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def load_checkpoint(path: Path, target: Checkpointable) -> None:
    """Put checkpoint `path` back into `target`: its weights, then the rest of its state. The model
    must have the checkpoint's shape; what else must match is `target`'s to check."""
    meta = read_meta(path, verify=False)
    files.check_model_fits(path, meta, target.model)
    files.load_weights(target.model, path / files.MODEL_FILE)
    training = files.load_training_state(path)
    try:
        target.load_state_dict({"training": training, "meta": meta})
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: its training state does not fit this run "
                              f"({type(error).__name__}: {error})") from None


class CheckpointManager:
    """Owns a run's step checkpoints, its best pointer, pruning and state.json. Rank 0 only."""

    def __init__(self, run: RunDirectory, keep: int, state: RunState | None = None) -> None:
        """`state`: the run state to start from (default: the run's state.json)."""
        self.run, self.keep = run, keep
        self.state = state if state is not None else run.state()

    @property
    def best(self) -> Best | None:
        return self.state.best

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether `metrics` beat the best so far (the first validation always does)."""
        return self.state.best is None or metrics[BEST_METRIC] > self.state.best.score

    # ------------------------------------------------------------------ resuming

    def resume_point(self) -> Path | None:
        """The checkpoint to resume from, or None for a new run. Call while holding the run's lock.

        A step directory the state does not name was being saved when a process was killed, before
        the state recorded it: it is removed, and training redoes those steps exactly. A named
        checkpoint that fails verification is moved aside (kept for inspection) and the newest intact
        one before it is used; the best pointer is dropped if it pointed at a damaged one.
        """
        self.run.remove_temporaries()
        for path in self.run.step_checkpoints():
            if path.name not in self.state.kept:
                self.run.remove_checkpoint(path.name, "its save was interrupted before the run state recorded it")
        intact = None
        for name in reversed(self.state.kept):
            try:
                read_meta(self.run.checkpoint(name), verify=True, need_training_state=True)
                intact = name
                break
            except CheckpointError as error:
                log.warning("skipping checkpoint: %s", error)
        if intact is None and self.state.kept:
            # Starting over would bury the run's history under new checkpoints: the user decides.
            raise CheckpointError(f"{self.run.path}: none of its {len(self.state.kept)} checkpoints is intact (see "
                                  f"the warnings above), so it cannot be resumed; move {self.run.checkpoints} and "
                                  f"{self.run.state_file} away to start over, or train in another run directory")
        if intact is None:
            return None
        kept = self.state.kept[: self.state.kept.index(intact) + 1]
        damaged = self.state.kept[len(kept):]
        for name in damaged:
            self.run.move_aside(name)
        best = self.state.best
        if best is not None and best.checkpoint not in kept:
            log.warning("the best checkpoint %s is damaged or gone; the next validation sets a new best",
                        best.checkpoint)
            best = None
        if damaged or best is not self.state.best:
            self._commit(RunState(latest=intact, kept=kept, best=best))
        return self.run.checkpoint(intact)

    @classmethod
    def rebuild(cls, run: RunDirectory, keep: int) -> "CheckpointManager":
        """The manager of a run whose state.json is written anew from the step checkpoints on disk: every
        intact one is kept, the newest is where training resumes, the best validated one is best.
        Damaged ones are left alone."""
        manager = cls(run, keep, RunState())
        manager._rebuild_state()
        return manager

    def _rebuild_state(self) -> None:
        self.run.remove_temporaries()
        kept, best = [], None
        for path in self.run.step_checkpoints():
            try:
                meta = read_meta(path, verify=True, need_training_state=True)
            except CheckpointError as error:
                log.warning("not keeping %s in the rebuilt run state: %s", path.name, error)
                continue
            kept.append(path.name)
            metrics = meta.get("metrics") or {}
            if BEST_METRIC in metrics and (best is None or metrics[BEST_METRIC] > best.score):
                best = Best(path.name, int(meta["step"]), dict(metrics))
        state = RunState(latest=kept[-1] if kept else None, kept=kept, best=best)
        log.info("rebuilt %s from %d checkpoint(s): resuming from %s, best %s", self.run.state_file, len(kept),
                 state.latest, f"{best.checkpoint} (valid BLEU {best.score:.2f})" if best else "none yet")
        self._commit(state)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, model: Transformer, state: dict[str, Any],
             metrics: dict[str, float] | None = None) -> Path:
        """Checkpoint `model` and `state` (a `Checkpointable.state_dict()`) at `step` with this step's
        validation `metrics` (if it was validated), record it in the run state (and as best if the
        metrics improve on it), then prune."""
        meta = dict(state["meta"], step=step, metrics=metrics or {})
        name = step_dir_name(step)
        path = self.run.publish_checkpoint(step, lambda directory: files.write_checkpoint(
            directory, model, state["training"], meta, replaces=self.run.checkpoint(name)))
        best = self.state.best
        if metrics and self.improves(metrics):
            best = Best(name, step, dict(metrics))
        kept = [old for old in self.state.kept if old != name] + [name]
        protected = {best.checkpoint} if best else set()
        excess = [old for old in kept[:-self.keep] if old not in protected]
        self._commit(RunState(latest=name, kept=[old for old in kept if old not in excess], best=best))
        for old in excess:
            self.run.remove_checkpoint(old, f"only the newest {self.keep} are kept", announce=False)
        return path

    def _commit(self, state: RunState) -> None:
        self.run.commit_state(state)
        self.state = state


__all__ = ["Checkpointable", "CheckpointManager", "load_checkpoint", "STATE_FILE"]
