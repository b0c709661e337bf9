"""Checkpoints of a training run: saving, resuming, pruning, and which one is best (one decision,
`CheckpointManager.improves`). Saving and resuming take the same road: the trainer's
`state_dict()` goes into a checkpoint, and `load_state_dict()` gets it back. Which files a
checkpoint holds is format.py's and files.py's business; every write into the run goes through
rundir.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from transformer.checkpoints import files
from transformer.checkpoints.format import read_meta
from transformer.checkpoints.layout import STATE_FILE, Best, RunState, beats, step_dir_name
from transformer.checkpoints.rundir import RunDirectory
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
        self._unremoved: list[str] = []  # pruned from the run state while a reader had them: removed later

    @property
    def best(self) -> Best | None:
        return self.state.best

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether `metrics` beat the best so far (the first validation always does): layout.beats."""
        return beats(metrics, self.state.best)

    # ------------------------------------------------------------------ resuming

    def resume_point(self) -> Path | None:
        """The checkpoint to resume from, or None for a new run. Call while holding the run's lock.

        A step directory the state does not name was being saved when a process was killed, before
        the state recorded it: it is removed, and training redoes those steps exactly. The newest
        checkpoint whose weights and training state both verify is the resume point. A newer one
        whose weights verify stays (translation can use it; the redone steps replace it); one whose
        weights do not is moved aside (kept for inspection), and the best pointer is dropped if it
        pointed there. Where no checkpoint can be resumed, this is refused and nothing changes.
        """
        self.run.remove_temporaries()
        for path in self.run.step_checkpoints():
            if path.name not in self.state.kept and not self.run.remove_checkpoint(
                    path.name, "its save was interrupted before the run state recorded it"):
                self._unremoved.append(path.name)
        resumable, newer = None, []
        for name in reversed(self.state.kept):
            try:
                read_meta(self.run.checkpoint(name), verify=True, need_training_state=True)
                resumable = name
                break
            except CheckpointError as error:
                log.warning("skipping checkpoint: %s", error)
                newer.append(name)
        weights_only = [name for name in newer if self._weights_intact(name)]
        if resumable is None and self.state.kept:
            # Starting over would bury the run's history under new checkpoints: the user decides.
            usable = (f"; the weights of {', '.join(weights_only)} are intact: translate with them, or fine-tune a "
                      "new run from this one (train.init_from)") if weights_only else ""
            raise CheckpointError(f"{self.run.path}: none of its {len(self.state.kept)} checkpoints holds an intact "
                                  f"training state (see the warnings above), so it cannot be resumed{usable}. To "
                                  f"start over, move {self.run.checkpoints} and {self.run.state_file} away, or "
                                  "train in another run directory")
        if resumable is None:
            return None
        damaged = [name for name in newer if name not in weights_only]
        for name in damaged:
            self.run.move_aside(name)
        for name in weights_only:
            log.warning("keeping %s for its weights (translation can use them); training redoes its steps from "
                        "%s and replaces it", name, resumable)
        kept = [name for name in self.state.kept if name not in damaged]
        best = self.state.best
        if best is not None and best.checkpoint not in kept:
            log.warning("the best checkpoint %s is damaged or gone; the next validation sets a new best",
                        best.checkpoint)
            best = None
        state = RunState(latest=resumable, kept=kept, best=best)
        if state != self.state:
            self._commit(state)
        return self.run.checkpoint(resumable)

    def _weights_intact(self, name: str) -> bool:
        try:
            read_meta(self.run.checkpoint(name), verify=True)
        except CheckpointError:
            return False
        return True

    @classmethod
    def rebuild(cls, run: RunDirectory, keep: int) -> "CheckpointManager":
        """The manager of a run whose state.json is written anew from the step checkpoints on disk: every
        one whose weights verify is kept (whether its training state can be resumed is `resume_point`'s
        to find), the newest is the latest, the best validated one is best. One whose weights do not
        verify is moved aside, as a resume does: a rebuild deletes no checkpoint."""
        manager = cls(run, keep, RunState())
        manager._rebuild_state()
        return manager

    def _rebuild_state(self) -> None:
        self.run.remove_temporaries()
        kept, best = [], None
        for path in self.run.step_checkpoints():
            try:
                meta = read_meta(path, verify=True)
            except CheckpointError as error:
                log.warning("not keeping %s in the rebuilt run state: %s", path.name, error)
                self.run.move_aside(path.name)
                continue
            kept.append(path.name)
            metrics = meta.get("metrics") or {}
            if beats(metrics, best):
                best = Best(path.name, int(meta["step"]), dict(metrics))
        state = RunState(latest=kept[-1] if kept else None, kept=kept, best=best)
        log.info("rebuilt %s from %d checkpoint(s): newest %s, best %s", self.run.state_file, len(kept),
                 state.latest, f"{best.checkpoint} (valid NLL {best.score:.4f})" if best else "none yet")
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
        # By step: after a resume from an older checkpoint, newer ones kept for their weights come last.
        kept = sorted(set(self.state.kept) | {name})
        protected = {name} | ({best.checkpoint} if best else set())
        excess = [old for old in kept[:-self.keep] if old not in protected]
        self._commit(RunState(latest=name, kept=[old for old in kept if old not in excess], best=best))
        pending, self._unremoved = self._unremoved + excess, []
        for old in pending:
            if not self.run.remove_checkpoint(old, f"only the newest {self.keep} are kept", announce=False):
                self._unremoved.append(old)
        return path

    def _commit(self, state: RunState) -> None:
        self.run.commit_state(state)
        self.state = state


__all__ = ["Checkpointable", "CheckpointManager", "load_checkpoint", "STATE_FILE"]
