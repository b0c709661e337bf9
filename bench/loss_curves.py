"""Two runs' training loss, step by step, side by side: the largest and the mean difference.

    python bench/loss_curves.py RUN_A RUN_B

For "the same math" checks: train both runs with the same config and seed and `--set
train.log_every=1` (every step's loss goes to TensorBoard), e.g. on two trees of this repository:

    python train.py --config configs/base.yaml --run-dir /tmp/curve-a --no-progress \\
        --set train.max_minutes=0 --set train.max_steps=300 --set train.valid_every=10000 \\
        --set train.checkpoint_every=10000 --set train.log_every=1

Reads `train/smoothed_loss` (with log_every=1, the step's own loss) from each run's tensorboard/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def losses(run: Path) -> dict[int, float]:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars("train/smoothed_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args()
    a, b = losses(args.run_a), losses(args.run_b)
    steps = sorted(set(a) & set(b))
    if not steps:
        raise SystemExit("the runs share no logged step")
    differences = {step: abs(a[step] - b[step]) for step in steps}
    worst = max(differences, key=differences.get)
    print(f"{len(steps)} steps in common; largest difference {differences[worst]:.4f} at step {worst} "
          f"({a[worst]:.4f} against {b[worst]:.4f}); mean difference {sum(differences.values()) / len(steps):.4f}")
    for step in (1, 10, 50, 100, 200, 300):
        if step in differences:
            print(f"step {step}: {a[step]:.4f}  {b[step]:.4f}")


if __name__ == "__main__":
    main()
