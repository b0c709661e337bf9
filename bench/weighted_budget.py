"""A time budget over weighted corpora: the minutes a run trains and the pace its budget logs, against
the pace its steps really had, for several weights.

    python bench/weighted_budget.py [--weights 0.05 1 4] [--minutes 0.5] [--config configs/tiny.yaml]

The shipped CSV is halved (even rows, odd rows) into two corpora, both given the same weight; for
each weight, `python train.py --config CONFIG --set data.corpora=[...] --set train.max_steps=0 --set
train.max_minutes=MINUTES --set train.schedule=wsd` runs as a user would, in a fresh run directory.
The real pace is the run's training seconds over its steps (from its last checkpoint); the logged
pace is what the budget planned from ("... at X s a step" in train.log).
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.format import read_meta  # noqa: E402
from transformer.checkpoints.layout import CHECKPOINTS, read_run_state  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=ROOT / "data" / "eng_-french.csv")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--weights", type=float, nargs="+", default=[0.05, 1.0, 4.0])
    parser.add_argument("--minutes", type=float, default=0.5)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="weighted-budget-"))
    work.mkdir(parents=True, exist_ok=True)

    with args.csv.open(newline="", encoding="utf-8") as handle:
        header, *body = list(csv.reader(handle))
    halves = []
    for number, half in enumerate((body[0::2], body[1::2])):
        halves.append(work / f"half{number}.csv")
        with halves[-1].open("w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows([header, *half])

    print(f"| weight (both corpora) | steps | minutes of training (of {args.minutes:g}) | logged pace, s a step "
          "| real pace, s a step | logged / real |")
    print("|---|---|---|---|---|---|")
    for weight in args.weights:
        corpora = (f"[{{path: '{halves[0]}', weight: {weight:g}, held_out: true}}, "
                   f"{{path: '{halves[1]}', weight: {weight:g}}}]")
        run_dir = work / f"run-{weight:g}"
        command = [sys.executable, "train.py", "--config", args.config, "--run-dir", str(run_dir), "--no-progress",
                   "--set", f"data.corpora={corpora}", "--set", "train.max_steps=0",
                   "--set", f"train.max_minutes={args.minutes:g}", "--set", "train.schedule=wsd"]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        state = read_meta(run_dir / CHECKPOINTS / read_run_state(run_dir).latest)["state"]
        steps, seconds = state["step"], state["train_seconds"]
        logged = re.findall(r"at ([\d.]+) s a step", (run_dir / "train.log").read_text(encoding="utf-8"))
        real = seconds / steps
        print(f"| {weight:g} | {steps} | {seconds / 60:.3f} | {', '.join(logged)} | {real:.3f} | "
              f"{', '.join(f'{float(pace) / real:.2f}' for pace in logged)} |")


if __name__ == "__main__":
    main()
