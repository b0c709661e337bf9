"""Fine-tune a trained run on a slice of its own data and score it before and after, on held-out
pairs of that slice that neither model ever trained on.

    python bench/finetune.py --parent runs/recipe/default --slice questions --minutes 5
    python bench/finetune.py --parent runs/recipe/default --slice questions --minutes 5 --test

The slice is a "domain" cut from the parent's CSV: `questions` (the source ends in "?") or `long`
(sources of 12 words or more). Its training pairs are the slice's pairs that the parent also trained
on: every pair that shares a side with the parent's held-out valid or test sentences is left out,
so the child's training never touches them. The figure is measured on the parent's *valid*
sentences that fall in the slice (unseen by parent and child); `--test` also scores the parent's
test sentences in the slice, once, for a finalist. The child is `python train.py --init-from
PARENT`: the parent's weights and tokenizer, a fresh optimiser and warm-up, and a time budget of
`--minutes`. Rerunning the command resumes or finds the child finished, and only scores again.
Run it on an otherwise idle machine: the time budget becomes steps over the first steps.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.layout import read_run_state  # noqa: E402
from transformer.checkpoints.lookup import load_run_config  # noqa: E402
from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.data.text import clean_text  # noqa: E402
from transformer.translation.metrics import score  # noqa: E402
from transformer.translation.torch_engine import load_translator, translate  # noqa: E402

SLICES = {
    "questions": lambda source: source.endswith("?"),
    "long": lambda source: len(source.split()) >= 12,
}


def heldout(run: Path, split: str) -> tuple[list[str], list[list[str]]]:
    found = RunDirectory(run).read_heldout(split)
    if found is None:
        sys.exit(f"error: {run}: no held-out {split} files")
    return found


def in_slice(pairs: tuple[list[str], list[list[str]]], keep) -> tuple[list[str], list[list[str]]]:
    sources, references = pairs
    kept = [i for i, source in enumerate(sources) if keep(source)]
    return [sources[i] for i in kept], [references[i] for i in kept]


def write_slice(parent: Path, out: Path, keep) -> tuple[Path, int]:
    """The slice of the parent's training pairs as a CSV with the parent's columns."""
    data = load_run_config(parent).data
    if data.format == "text":
        sys.exit("error: this benchmark reads CSV/TSV data; the parent trained on two text files")
    unseen_sources, unseen_targets = set(), set()
    for split in ("valid", "test"):
        sources, references = heldout(parent, split)
        unseen_sources.update(sources)
        unseen_targets.update(text for refs in references for text in refs)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "slice.csv"
    delimiter = "\t" if data.format == "tsv" else ","
    kept = 0
    with open(ROOT / data.path, newline="", encoding="utf-8") as source_file, \
            open(path, "w", newline="", encoding="utf-8") as slice_file:
        reader = csv.DictReader(source_file, delimiter=delimiter)
        writer = csv.writer(slice_file, delimiter=delimiter)
        writer.writerow([data.source_column, data.target_column])
        for row in reader:
            source, target = clean_text(row[data.source_column]), clean_text(row[data.target_column])
            if source in unseen_sources or target in unseen_targets or not keep(source):
                continue
            writer.writerow([row[data.source_column], row[data.target_column]])
            kept += 1
    return path, kept


def scores(translator, sources, references, beam: int) -> str:
    decode = dataclasses.replace(translator.decode, beam_size=beam)
    result = score(translate(sources, translator.model, translator.tokenizers, decode, translator.device), references)
    return f"{result.bleu:.2f} / {result.chrf:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", type=Path, required=True, help="the trained run to fine-tune")
    parser.add_argument("--slice", choices=sorted(SLICES), default="questions")
    parser.add_argument("--minutes", type=float, default=5.0, help="the child's time budget (default 5)")
    parser.add_argument("--test", action="store_true", help="also score the parent's test sentences in the slice")
    args = parser.parse_args()
    parent = args.parent.resolve()
    keep = SLICES[args.slice]
    out = ROOT / "runs" / "finetune" / f"{parent.name}-{args.slice}"
    csv_path, kept = write_slice(parent, out, keep)
    child = out / "run"
    command = [sys.executable, "train.py", "--config", str(parent / "config.yaml"), "--init-from", str(parent),
               "--run-dir", str(child), "--no-progress", "--set", f"data.path={csv_path}",
               "--set", f"train.max_minutes={args.minutes:g}", "--set", "train.max_epochs=0",
               "--set", "data.valid_pairs=500", "--set", "data.test_pairs=0"]
    subprocess.run(command, cwd=ROOT, check=True)

    splits = ["valid"] + (["test"] if args.test else [])
    evaluation = {split: in_slice(heldout(parent, split), keep) for split in splits}
    state = read_run_state(child)
    print(f"slice {args.slice}: {kept:,} training pairs of the parent's; child: {state.best.step if state.best else '-'} "
          f"best step, {args.minutes:g}-minute budget")
    print("| model | " + " | ".join(f"{split} ({len(evaluation[split][0])} sentences) greedy | {split} beam 5"
                                    for split in splits) + " |")
    for name, run in (("parent", parent), ("fine-tuned", child)):
        translator = load_translator(run, device="cpu")
        cells = [scores(translator, *evaluation[split], beam=beam) for split in splits for beam in (1, 5)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    shown = ["python", "bench/finetune.py", "--parent", str(args.parent), "--slice", args.slice,
             "--minutes", f"{args.minutes:g}"] + (["--test"] if args.test else [])
    print(f"command: `{shlex.join(shown)}`")


if __name__ == "__main__":
    main()
