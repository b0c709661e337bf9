"""The layout of a run directory: file names, which checkpoint translation uses, a checkpoint's
meta.json and the run's config. No torch here, so that translate.py's CTranslate2 engine finds its
model without loading it; checkpoint.py writes checkpoints and reads their weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from .config import Config, DecodeConfig, load_config
from .errors import CheckpointError

CHECKPOINTS = "checkpoints"
BEST = "best"
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


def find_checkpoint(run: Path | None = None, checkpoint: Path | None = None,
                    runs_root: Path = Path("runs")) -> Path:
    """The checkpoint translation should use: `checkpoint` if given; else the best (or newest) one
    of `run`; else of the run under `runs_root` with the most recently written checkpoint."""
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        if not (checkpoint / META_FILE).is_file():
            looks_like_run = (checkpoint / CHECKPOINTS).is_dir()
            hint = f"; it looks like a run directory: use --run {checkpoint}" if looks_like_run else ""
            raise CheckpointError(f"{checkpoint}: not a checkpoint directory (no {META_FILE}){hint}")
        return checkpoint
    if run is None:
        candidates = []
        if Path(runs_root).is_dir():
            for run_dir in Path(runs_root).iterdir():
                metas = list((run_dir / CHECKPOINTS).glob(f"*/{META_FILE}"))
                if metas:
                    candidates.append((max(m.stat().st_mtime for m in metas), run_dir))
        if not candidates:
            raise CheckpointError(
                f"no trained run found under {runs_root}/: train one first "
                "(python train.py --config configs/base.yaml) or pass --run DIR / --checkpoint DIR"
            )
        run = max(candidates)[1]
    run = Path(run)
    if not run.is_dir():
        raise CheckpointError(f"run directory not found: {run}")
    best = run / CHECKPOINTS / BEST
    if (best / META_FILE).is_file():
        return best
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
