"""What the moving average of the weights (`train.ema_decay`) costs: time per step and memory.

    python bench/averaging_cost.py [--config configs/base.yaml] [--steps 120] [--rounds 3] [--decay 0.999]

First, in this process: the median time of one update of the average (a lerp over every parameter)
on the config's model, and the bytes the average's copy of the weights holds. Then the whole command
a user runs, each in its own process, alternating with and without the average, `--rounds` times:
`python train.py --config CONFIG --set train.max_steps=STEPS --set train.max_minutes=0 --set
train.ema_decay=D` in a fresh run directory, printing each run's seconds per step of training (the
state's train_seconds over its steps) and the peak resident memory of its process, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from transformer.config import load_config  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.training.averaging import WeightAverage  # noqa: E402


def in_process(config_path: str, decay: float) -> None:
    config = load_config(config_path, [])
    vocab = config.tokenizer.vocab_size
    model = Transformer(config.model, vocab, vocab)
    average = WeightAverage(model, decay)
    for _ in range(5):
        average.update(model)
    times = []
    for _ in range(50):
        started = time.perf_counter()
        average.update(model)
        times.append(time.perf_counter() - started)
    held = sum(t.numel() * t.element_size() for t in average.model.state_dict().values())
    print(f"in process: one update of the average {statistics.median(times) * 1000:.2f} ms (median of 50); "
          f"the average holds {held / 2**20:.1f} MiB ({sum(p.numel() for p in model.parameters()):,} parameters)")


def whole_command(config_path: str, steps: int, decay: float, work: Path) -> tuple[float, float]:
    """Seconds per step of training and peak RSS (GiB) of one train.py run."""
    run_dir = work / f"run-{decay:g}-{time.monotonic_ns()}"
    command = [sys.executable, "train.py", "--config", config_path, "--run-dir", str(run_dir), "--no-progress",
               "--set", f"train.max_steps={steps}", "--set", "train.max_minutes=0",
               "--set", f"train.ema_decay={decay}", "--set", "train.attention_images=false"]
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)  # the child's own rusage: its peak RSS alone
        if os.waitstatus_to_exitcode(status):
            stderr.seek(0)
            sys.exit(f"error: training failed:\n{stderr.read()[-2000:]}")
    state = json.loads((run_dir / "state.json").read_text())
    meta = json.loads((run_dir / "checkpoints" / state["latest"] / "meta.json").read_text())["state"]
    return meta["train_seconds"] / meta["step"], usage.ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/base.yaml")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decay", type=float, default=0.999)
    args = parser.parse_args()
    in_process(args.config, args.decay)
    figures: dict[float, list[tuple[float, float]]] = {0.0: [], args.decay: []}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            for decay in figures:
                seconds, gib = whole_command(args.config, args.steps, decay, Path(work))
                figures[decay].append((seconds, gib))
                print(f"round {round_ + 1}, ema_decay {decay:g}: {seconds:.3f} s a step, peak RSS {gib:.2f} GiB")
    for decay, runs in figures.items():
        print(f"ema_decay {decay:g}: median {statistics.median(s for s, _ in runs):.3f} s a step, "
              f"peak RSS {statistics.median(g for _, g in runs):.2f} GiB")


if __name__ == "__main__":
    main()
