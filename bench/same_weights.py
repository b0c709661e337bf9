"""Train the same config in two checkouts and compare the weights they end with, bit for bit.

    git worktree add /tmp/before fed6a9a
    python bench/same_weights.py --before /tmp/before --config configs/base.yaml --steps 300

Each checkout's train.py runs `--config CONFIG --set train.max_steps=STEPS --set
train.max_minutes=0` (a step budget: a time budget would end each run at another step) in a
fresh datasets cache and run directory of its own, one after the other. Then every tensor of the two
final checkpoints' model.safetensors is compared with torch.equal, and the first differing ones
are named. Equal weights after the same steps mean the same batches in the same order, the same
tokenizer and the same split: what a change to the data path must leave as it was.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


def train(checkout: Path, config: Path, steps: int, work: Path, overrides: list[str]) -> tuple[Path, float]:
    """Train in `checkout`; the final checkpoint's model file and the wall time."""
    run_dir = work / "run"
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "datasets-cache"), "PYTHONPATH": str(checkout)}
    sets = [f"train.max_steps={steps}", "train.max_minutes=0", *overrides]
    command = [sys.executable, "train.py", "--config", str(config), "--run-dir", str(run_dir), "--no-progress",
               *(word for value in sets for word in ("--set", value))]
    started = time.time()
    result = subprocess.run(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    if result.returncode:
        sys.exit(f"train.py in {checkout} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    checkpoint = run_dir / "checkpoints" / f"step_{steps:08d}" / "model.safetensors"
    if not checkpoint.is_file():
        sys.exit(f"{checkout}: no checkpoint at step {steps} ({checkpoint})")
    return checkpoint, time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    parser.add_argument("--config", type=Path, default=Path("configs/base.yaml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps: at least 1, not {args.steps}")
    for flag, checkout in (("--before", args.before), ("--after", args.after)):
        if not (checkout / "train.py").is_file():
            parser.error(f"{flag} {checkout}: not a checkout of this project (no train.py there)")
    config = args.config if args.config.is_absolute() else (Path.cwd() / args.config).resolve()

    with tempfile.TemporaryDirectory(prefix="same-weights-") as scratch:
        files = {}
        for name, checkout in (("before", args.before), ("after", args.after)):
            work = Path(scratch) / name
            files[name], seconds = train(checkout.resolve(), config, args.steps, work, args.overrides)
            print(f"{name}: {checkout.resolve()}, {args.steps} steps in {seconds:.0f} s")
        before, after = load_file(files["before"]), load_file(files["after"])
        if sorted(before) != sorted(after):
            sys.exit(f"different tensors: {sorted(set(before) ^ set(after))}")
        differing = [name for name in sorted(before) if not torch.equal(before[name], after[name])]
        elements = sum(t.numel() for t in before.values())
        if differing:
            worst = max(float((before[n].float() - after[n].float()).abs().max()) for n in differing)
            print(f"DIFFERENT: {len(differing)} of {len(before)} tensors differ (largest difference {worst:.3g}), "
                  f"first: {', '.join(differing[:5])}")
            sys.exit(1)
        print(f"bitwise equal: all {len(before)} tensors, {elements:,} numbers, after step {args.steps}")


if __name__ == "__main__":
    main()
