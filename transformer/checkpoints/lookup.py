"""Read-only lookup of a run or a checkpoint, for whatever translates or exports with one: which
checkpoint to use, the run it belongs to, the config and decode settings it was trained with, and
`pinned_checkpoint`, which holds the checkpoint while it is read. No torch; nothing here writes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from transformer.checkpoints.format import META_FILE
from transformer.checkpoints.layout import (CHECKPOINTS, RUN_CONFIG, STATE_FILE, checkpoint_location, list_checkpoints,
                                            read_run_state)
from transformer.checkpoints.pins import CheckpointGone, pin
from transformer.config import Config, DecodeConfig, load_config
from transformer.errors import CheckpointError, option


def find_checkpoint(run: Path | None = None, checkpoint_dir: Path | None = None,
                    runs_root: Path = Path("runs")) -> Path:
    """The checkpoint translation should use: `checkpoint_dir` if given; else the best (or newest) one
    of `run`; else of the run under `runs_root` whose run state changed last."""
    if checkpoint_dir is not None:
        checkpoint_dir = Path(checkpoint_dir)
        if not (checkpoint_dir / META_FILE).is_file():
            looks_like_run = (checkpoint_dir / STATE_FILE).is_file()
            hint = "; it looks like a run directory: pass it as the run instead" if looks_like_run else ""
            raise CheckpointError(f"{checkpoint_dir}: not a checkpoint directory (no {META_FILE}){hint}")
        return checkpoint_dir
    if run is None:
        root = Path(runs_root)
        candidates = sorted((path.stat().st_mtime, run_dir) for run_dir in (root.iterdir() if root.is_dir() else [])
                            if (path := run_dir / STATE_FILE).is_file() and list_checkpoints(run_dir))
        if not candidates:
            raise CheckpointError(f"no trained run found under {root}/: train one first "
                                  f"(python train.py --config configs/base.yaml) or name one with {option('run')} DIR "
                                  f"or {option('checkpoint')} DIR")
        run = candidates[-1][1]
    run = Path(run)
    if not run.is_dir():
        raise CheckpointError(f"{run}: is a file, not a run directory" if run.exists()
                              else f"run directory not found: {run}")
    state = read_run_state(run)
    if state is None:
        raise CheckpointError(f"{run}: not a run of this project ({STATE_FILE} is missing)")
    name = state.best.checkpoint if state.best else state.latest
    if name is None:
        raise CheckpointError(f"{run}: has no checkpoint yet (train it first, or wait for its first save)")
    return run / CHECKPOINTS / name


@contextlib.contextmanager
def pinned_checkpoint(run: Path | None = None, checkpoint_dir: Path | None = None,
                      runs_root: Path = Path("runs")) -> Iterator[Path]:
    """`find_checkpoint`'s checkpoint, pinned for the block (pins.py): a training run pruning
    meanwhile leaves it on disk. Yields its real path; read it through that. Where the run pruned it
    between the lookup and the pin, the lookup is made again: the run state then names a newer one."""
    tried: list[Path] = []
    while True:
        found = find_checkpoint(run, checkpoint_dir, runs_root)
        held = contextlib.ExitStack()
        try:
            real = held.enter_context(pin(found))
        except CheckpointGone:
            if checkpoint_dir is not None or found in tried:  # named by the user, or the run state stands still
                raise
            tried.append(found)
            continue
        with held:
            yield real
        return


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run was started with (`config.yaml` in its directory). Loaded as stored:
    a corpus key its format does not read, which the run's version accepted and ignored, is dropped
    with a warning rather than refused (load_config)."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (is {run_dir} a run directory?)")
    return load_config(path, stored=True)


def run_dir_of(checkpoint_dir: Path) -> Path:
    """runs/<name>/checkpoints/<step or best>  ->  runs/<name> (absolute; through a checkpoints/ that
    is a link to another disk, still runs/<name>: layout.checkpoint_location)"""
    return checkpoint_location(checkpoint_dir).parent.parent


def load_decode_config(run_dir: Path) -> DecodeConfig:
    """The run's decode section (config.yaml), or the defaults where the run directory has no config."""
    if (Path(run_dir) / RUN_CONFIG).is_file():
        return load_run_config(run_dir).decode
    return DecodeConfig()


__all__ = ["find_checkpoint", "pinned_checkpoint", "load_run_config", "run_dir_of", "load_decode_config"]
