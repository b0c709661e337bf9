"""A two-corpus weighted run: the shipped CSV split into a small "in-domain" part and the rest, the
small one oversampled; prints each corpus's training pairs, the share of an epoch its weight asks
for and the share the run drew, read from the run's log.

    python bench/weighted_mix.py [--in-domain-share 0.05] [--weights 4 1] [--steps 20] [--work DIR]

The in-domain part is a seeded sample of the CSV's rows (--in-domain-share of them), held out (valid
and test are drawn from it); the rest is the general corpus. Runs `python train.py --config
configs/base.yaml --set data.corpora=[...] --set train.max_steps=STEPS` as a user would, in a fresh
run directory, and reads its train.log.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=ROOT / "data" / "eng_-french.csv")
    parser.add_argument("--in-domain-share", type=float, default=0.05)
    parser.add_argument("--weights", type=float, nargs=2, default=[4.0, 1.0], metavar=("IN_DOMAIN", "GENERAL"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mix-"))
    work.mkdir(parents=True, exist_ok=True)

    with args.csv.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    header, body = rows[0], rows[1:]
    in_domain = np.random.default_rng(args.seed).random(len(body)) < args.in_domain_share
    parts = {"in_domain.csv": [row for row, chosen in zip(body, in_domain) if chosen],
             "general.csv": [row for row, chosen in zip(body, in_domain) if not chosen]}
    for name, part in parts.items():
        with (work / name).open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(part)
    corpora = (f"[{{path: '{work / 'in_domain.csv'}', weight: {args.weights[0]:g}, held_out: true}}, "
               f"{{path: '{work / 'general.csv'}', weight: {args.weights[1]:g}}}]")
    run_dir = work / "run"
    command = [sys.executable, "train.py", "--config", "configs/base.yaml", "--run-dir", str(run_dir),
               "--no-progress", "--set", f"data.corpora={corpora}", "--set", f"train.max_steps={args.steps}",
               "--set", "train.max_minutes=0"]
    print(f"{args.csv}: {len(body)} rows; in-domain {len(parts['in_domain.csv'])}, general "
          f"{len(parts['general.csv'])}\n$ {' '.join(command)}")
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    log = (run_dir / "train.log").read_text(encoding="utf-8")
    for line in log.splitlines():
        if re.search(r"sentence pairs, weight|left out of training|split by groups|training pairs by corpus|"
                     r"epoch 0 draws|filtered out", line):
            print("log:", line.split(": ", 1)[1] if "INFO" in line else line)
    trained = [int(n) for n in re.findall(r"data\.corpora\[\d\] (\d+) \(weight", log)]
    drawn = [int(n) for n in re.findall(r"\) (\d+) \([\d.]+%\)", log.split("epoch 0 draws", 1)[1].splitlines()[0])]
    expected = np.array(trained) * np.array(args.weights)
    print("\n| corpus | training pairs | weight | share the weights ask for | share drawn in epoch 0 | difference |")
    print("|---|---|---|---|---|---|")
    for name, pairs, weight, want, got in zip(("in-domain", "general"), trained, args.weights,
                                              expected / expected.sum(), np.array(drawn) / sum(drawn)):
        print(f"| {name} | {pairs:,} | {weight:g} | {want:.2%} | {got:.2%} | {(got - want) * 100:+.3f} points |")


if __name__ == "__main__":
    main()
