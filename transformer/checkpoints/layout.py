"""What a run directory holds and what its names are, and state.json, the run state that names its
checkpoints: shared by the run's writer (rundir.py) and its readers (lookup.py). No torch, no writes.

    config.yaml  state.json  tokenizer/  heldout/  checkpoints/step_*/  checkpoints/best -> step_*/
    tensorboard/  train.log  .lock  ctranslate2/<weights hash>/ (translate.py's cached export)
    imported.json (a run imported from another toolkit: where its model came from)
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformer.errors import CheckpointError

RUN_CONFIG = "config.yaml"  # the resolved config the run was started with
STATE_FILE = "state.json"  # which checkpoints exist, which is newest, which is best
STATE_FORMAT = 2
TOKENIZER_DIR = "tokenizer"
HELDOUT_DIR = "heldout"  # <name>.en and <name>.fr.1..K: distinct sources and their references
CHECKPOINTS = "checkpoints"
BEST = "best"  # checkpoints/best: a link to the best checkpoint, for people and tools that look there
TENSORBOARD_DIR = "tensorboard"
LOG_FILE = "train.log"
LOCK_FILE = ".lock"
EXPORTS_DIR = "ctranslate2"
IMPORT_RECORD = "imported.json"  # an imported run's source: the model's id or path, revision, file hashes
# What makes a checkpoint the best: the lowest loss on the whole validation split (NLL per target token,
# teacher-forced). Greedy BLEU on the validation sample, the rule before, picked an earlier, weaker
# checkpoint than the run's last on held-out sets: on a sample BLEU moves between validations by chance,
# while the loss covers every pair and falls steadily (bench/README.md, "Which checkpoint is best").
BEST_METRIC = "valid_nll"  # lower is better
CORRUPT_PREFIX = "corrupt-"  # a damaged checkpoint moved aside: corrupt-<its name>-<pid>
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_location(checkpoint: Path) -> Path:
    """The absolute path of `checkpoint` with its own links followed (checkpoints/best -> step_*),
    its folders spelt as given: a run whose checkpoints/ is a link to a larger disk is still the folder
    above them, with its tokenizer and config, which the fully resolved path would miss. A link that
    leads out of its folder is resolved whole: its target's folders are where its run is."""
    path = Path(checkpoint).absolute()
    for _ in range(40):  # Linux follows at most 40 links in a row
        if not path.is_symlink():
            return path
        target = os.readlink(path)
        if os.sep in target or target in (os.curdir, os.pardir):
            return path.resolve()
        path = path.parent / target
    return path.resolve(strict=True)  # a loop of links: the system's error names it


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_step_dir_name(name: object) -> bool:
    """Whether `name` is a step checkpoint's name as this project writes it (step_ and eight digits)."""
    return isinstance(name, str) and _STEP_DIR.match(name) is not None


class UnusableRunState(CheckpointError):
    """A run's state.json that is missing, or there but not a run state (torn by a crash, edited): what
    it said can be written anew from the checkpoints on disk (train.py says how)."""


@dataclass(frozen=True)
class Best:
    """The best checkpoint so far: its directory name under checkpoints/, step and metrics."""

    checkpoint: str
    step: int
    metrics: dict[str, float]

    @property
    def score(self) -> float:
        """Its BEST_METRIC; infinite for a checkpoint chosen without one (an imported run's only checkpoint)."""
        return self.metrics.get(BEST_METRIC, math.inf)


def beats(metrics: dict[str, float], best: Best | None) -> bool:
    """Whether a validation's `metrics` make a better checkpoint than `best` (always, where there is none
    yet): a lower BEST_METRIC. Equal is not better: the best never moves to an equal checkpoint."""
    return BEST_METRIC in metrics and (best is None or metrics[BEST_METRIC] < best.score)


@dataclass
class RunState:
    """What state.json holds."""

    latest: str | None = None  # the checkpoint a resume starts from (the newest one it can)
    kept: list[str] = field(default_factory=list)  # step checkpoints on disk, oldest first
    best: Best | None = None
    format: int = STATE_FORMAT

    @classmethod
    def from_json(cls, data: Any, path: Path) -> "RunState":
        try:
            if data.get("format") != STATE_FORMAT:
                raise CheckpointError(f"{path}: run state format {data.get('format')}, but this version reads format "
                                      f"{STATE_FORMAT}: the run was trained by another version of this project")
            best = Best(**data["best"]) if data.get("best") else None
            state = cls(latest=data.get("latest"), kept=list(data.get("kept", [])), best=best)
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise UnusableRunState(f"{path}: not a run state of this project ({error})") from None
        names = state.kept + [name for name in (state.latest, best and best.checkpoint) if name is not None]
        for name in names:
            if not is_step_dir_name(name):
                raise UnusableRunState(f"{path}: names the checkpoint {name!r}, which this project never writes; "
                                       "the file was edited or damaged")
        if state.latest is not None and state.latest not in state.kept or best and best.checkpoint not in state.kept:
            raise UnusableRunState(f"{path}: names checkpoints it does not keep; the file was edited or damaged")
        return state


def read_run_state(run_dir: Path) -> RunState | None:
    """The run state of `run_dir`, or None where it has no state.json."""
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:  # the system's refusal: nothing to rebuild
        raise CheckpointError(f"{path}: unreadable ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:  # torn by a crash, or edited
        raise UnusableRunState(f"{path}: unreadable ({error})") from None
    return RunState.from_json(data, path)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Step checkpoints of a run on disk, oldest first (temporaries and the best link excluded)."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(found)]


__all__ = ["RUN_CONFIG", "STATE_FILE", "STATE_FORMAT", "TOKENIZER_DIR", "HELDOUT_DIR", "CHECKPOINTS", "BEST",
           "TENSORBOARD_DIR", "LOG_FILE", "LOCK_FILE", "EXPORTS_DIR", "IMPORT_RECORD", "BEST_METRIC", "CORRUPT_PREFIX",
           "beats", "checkpoint_location", "step_dir_name", "is_step_dir_name", "UnusableRunState", "Best", "RunState",
           "read_run_state", "list_checkpoints"]
