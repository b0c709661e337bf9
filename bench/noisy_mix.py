"""A noisy corpus made from the shipped CSV, for measuring the data filters (docs/corpora.md).

    python bench/noisy_mix.py --exclude runs/recipe/wsd08-idle --out runs/noisy-data

Writes <out>/noisy.csv: every clean pair of the CSV that shares no sentence with the held-out valid
and test files of the run given by --exclude, plus noise added on top of them, in a seeded random
order, as a web-crawled corpus brings it:

- copies (20% of the clean pairs' count): the source sentence copied as the target, untranslated;
- swapped (10%): the two sides exchanged, French on the source side;
- misaligned (10%): a source with the target of the next pair in the file;
- duplicates (10%): clean pairs repeated.

and <out>/clean.csv, the clean pairs alone (the ideal a filter aims at). The noisy pairs come from
the same clean pairs, so a perfect filter gives back clean.csv less its misaligned lines (which no
filter of a single pair can see). Scoring every trial on the --exclude run's valid split (`python
bench/recipe.py ... --score-on RUN`) gives the same sentences to the clean, filtered and unfiltered
runs, none of which trained on them.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.data.text import clean_text  # noqa: E402

SOURCE_COLUMN, TARGET_COLUMN = "English words/sentences", "French words/sentences"
NOISE = {"copies": 0.20, "swapped": 0.10, "misaligned": 0.10, "duplicates": 0.10}


def held_out_sentences(run: Path) -> tuple[set[str], set[str]]:
    """The cleaned source and target sentences of the run's valid and test files."""
    sources, targets = set(), set()
    for split in ("valid", "test"):
        found = RunDirectory(run).read_heldout(split)
        if found is None:
            sys.exit(f"error: {run}: no held-out {split} files")
        split_sources, references = found
        sources.update(split_sources)
        targets.update(text for translations in references for text in translations if text)
    return sources, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=ROOT / "data" / "eng_-french.csv")
    parser.add_argument("--exclude", type=Path, required=True,
                        help="a run directory whose heldout/ valid and test sentences are left out")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    held_sources, held_targets = held_out_sentences(args.exclude)
    with args.csv.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    pairs = [(clean_text(row[SOURCE_COLUMN]), clean_text(row[TARGET_COLUMN])) for row in rows]
    clean = [(s, t) for s, t in pairs if s and t and s not in held_sources and t not in held_targets]
    rng = np.random.default_rng(args.seed)
    n = len(clean)
    picks = {name: rng.choice(n, round(share * n), replace=False) for name, share in NOISE.items()}
    noise = ([(clean[i][0], clean[i][0]) for i in picks["copies"]]
             + [(clean[i][1], clean[i][0]) for i in picks["swapped"]]
             + [(clean[i][0], clean[(i + 1) % n][1]) for i in picks["misaligned"]]
             + [clean[i] for i in picks["duplicates"]])
    mixed = clean + noise
    order = rng.permutation(len(mixed))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in (("clean.csv", clean), ("noisy.csv", [mixed[i] for i in order])):
        with (args.out / name).open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow([SOURCE_COLUMN, TARGET_COLUMN])
            writer.writerows(table)
    print(f"{args.csv}: {len(pairs)} pairs; {n} clean pairs share no sentence with {args.exclude}'s valid and test")
    for name, chosen in picks.items():
        print(f"  {name}: {len(chosen)} pairs added ({NOISE[name]:.0%} of the clean pairs)")
    print(f"wrote {args.out / 'noisy.csv'} ({len(mixed)} pairs) and {args.out / 'clean.csv'} ({n} pairs)")


if __name__ == "__main__":
    main()
