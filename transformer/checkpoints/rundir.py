"""The layout of a run directory: file names, the run state (state.json: which checkpoints exist and
which is best), which checkpoint translation uses, a checkpoint's meta.json and the run's config.
Reading only, and no torch, so that translate.py's CTranslate2 engine finds its model without
loading it; checkpoint.py writes checkpoints and reads their weights, checkpoint_manager.py writes
the run state.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformer.config import Config, DecodeConfig, load_config
from transformer.errors import CheckpointError

CHECKPOINTS = "checkpoints"
BEST = "best"  # checkpoints/best: a link to the best checkpoint (a copy in runs of earlier versions)
STATE_FILE = "state.json"  # the run state: which checkpoints exist, which is newest, which is best
STATE_FORMAT = 1
BEST_METRIC = "valid_bleu"  # higher is better
AVERAGED = "averaged"  # weights-only mean of the newest step checkpoints (average.py)
MODEL_FILE, TRAINING_FILE, META_FILE = "model.safetensors", "training.pt", "meta.json"
RUN_CONFIG = "config.yaml"  # the resolved config, saved in the run directory
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer files, next to its checkpoints
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def read_meta(checkpoint: Path, verify: bool = True, need_training_state: bool = False) -> dict[str, Any]:
    """Read meta.json of `checkpoint` and (with `verify`) check the size and SHA-256 of its files."""
    checkpoint = Path(checkpoint)
    meta_path = checkpoint / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{checkpoint}: not a checkpoint ({META_FILE} is missing)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    if not isinstance(meta, dict) or "files" not in meta or "model_config" not in meta:
        raise CheckpointError(f"{meta_path}: not a checkpoint description of this project")
    if verify:
        names = [MODEL_FILE] + ([TRAINING_FILE] if need_training_state else [])
        for name in names:
            expected = meta["files"].get(name)
            path = checkpoint / name
            if expected is None or not path.is_file():
                raise CheckpointError(f"{path}: missing from the checkpoint")
            size = path.stat().st_size
            if size != expected["bytes"]:
                raise CheckpointError(f"{path}: truncated or corrupt ({size} bytes, expected {expected['bytes']})")
            if _sha256(path) != expected["sha256"]:
                raise CheckpointError(f"{path}: corrupt (SHA-256 differs from the one recorded at save time)")
    return meta


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Step checkpoints of a run, oldest first (temporary and best directories excluded)."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


@dataclass(frozen=True)
class Best:
    """The best checkpoint so far: its directory name under checkpoints/, step and metrics."""

    checkpoint: str
    step: int
    metrics: dict[str, float]

    @property
    def score(self) -> float:
        return self.metrics[BEST_METRIC]


@dataclass
class RunState:
    """What state.json holds."""

    latest: str | None = None  # the newest step checkpoint: a resume starts there
    kept: list[str] = field(default_factory=list)  # step checkpoints on disk, oldest first
    best: Best | None = None
    format: int = STATE_FORMAT

    @classmethod
    def from_json(cls, data: dict[str, Any], path: Path) -> "RunState":
        try:
            best = Best(**data["best"]) if data.get("best") else None
            state = cls(latest=data.get("latest"), kept=list(data.get("kept", [])), best=best,
                        format=int(data.get("format", 0)))
        except (TypeError, ValueError, KeyError) as error:
            raise CheckpointError(f"{path}: not a run state of this project ({error})") from None
        if state.format != STATE_FORMAT:
            raise CheckpointError(f"{path}: run state format {state.format}, but this version reads "
                                  f"format {STATE_FORMAT}")
        return state


def read_run_state(run_dir: Path) -> RunState | None:
    """The run state of `run_dir`, or None if it has none (a new run, or one of an earlier version)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a run state of this project")
    return RunState.from_json(data, path)


def find_checkpoint(run: Path | None = None, checkpoint_dir: Path | None = None,
                    runs_root: Path = Path("runs")) -> Path:
    """The checkpoint translation should use: `checkpoint_dir` if given; else the best (or newest) one
    of `run`; else of the run under `runs_root` whose run state or checkpoints changed last."""
    if checkpoint_dir is not None:
        checkpoint_dir = Path(checkpoint_dir)
        if not (checkpoint_dir / META_FILE).is_file():
            looks_like_run = (checkpoint_dir / CHECKPOINTS).is_dir()
            hint = f"; it looks like a run directory: use --run {checkpoint_dir}" if looks_like_run else ""
            raise CheckpointError(f"{checkpoint_dir}: not a checkpoint directory (no {META_FILE}){hint}")
        return checkpoint_dir
    if run is None:
        candidates = []
        if Path(runs_root).is_dir():
            for run_dir in Path(runs_root).iterdir():
                written = [p.stat().st_mtime for p in (run_dir / CHECKPOINTS).glob(f"*/{META_FILE}")]
                if written:
                    candidates.append((max(written), run_dir))
        if not candidates:
            raise CheckpointError(
                f"no trained run found under {runs_root}/: train one first "
                "(python train.py --config configs/base.yaml) or pass --run DIR / --checkpoint DIR"
            )
        run = max(candidates)[1]
    run = Path(run)
    if not run.is_dir():
        raise CheckpointError(f"run directory not found: {run}")
    state = read_run_state(run)
    if state is not None:
        name = state.best.checkpoint if state.best else state.latest
        if name is None:
            raise CheckpointError(f"{run}: has no checkpoint yet (train it first, or wait for its first save)")
        return run / CHECKPOINTS / name
    legacy_best = run / CHECKPOINTS / BEST  # runs of earlier versions kept a copy there
    if (legacy_best / META_FILE).is_file():
        return legacy_best
    steps = list_checkpoints(run)
    if not steps:
        raise CheckpointError(f"{run}: has no checkpoint yet (train it first, or wait for its first save)")
    return steps[-1]


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run was started with (`config.yaml` in its directory)."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (is {run_dir} a run directory?)")
    return load_config(path)


def run_dir_of(checkpoint_dir: Path) -> Path:
    """runs/<name>/checkpoints/<step or best>  ->  runs/<name>"""
    return Path(checkpoint_dir).resolve().parent.parent


def load_decode_config(run_dir: Path) -> DecodeConfig:
    """The run's decode section (config.yaml), or the defaults where the run directory has no config."""
    if (Path(run_dir) / RUN_CONFIG).is_file():
        return load_run_config(run_dir).decode
    return DecodeConfig()
