"""Which of a run's checkpoints translates best, and which rule for `best` finds it.

    python bench/checkpoint_choice.py --run runs/base
    python bench/checkpoint_choice.py --run runs/base --test step_00007720   # once, for the finalist

Every step checkpoint under RUN/checkpoints (keep them all with `--set train.keep_checkpoints=1000`,
or copy them aside as the run goes, into a directory that also holds or links the run's heldout/,
tokenizer/ and config.yaml) is scored on the run's whole validation split
(RUN/heldout/valid.*, all references): greedy BLEU, as validation translates. Then the candidates
each rule would have made `best`, with the run's decode settings (beam 5 in configs/base.yaml), as
translate.py translates:

- sample BLEU: the highest greedy BLEU on the validation sample (train.valid_max_pairs), the figure
  each validation logged; the first of equal ones;
- whole-split BLEU: the highest greedy BLEU on the whole validation split;
- validation loss: the lowest NLL per target token on the whole validation split (each validation
  computes it on every pair);
- last: the newest checkpoint.

With --test CHECKPOINT, that checkpoint alone is scored on the test split (RUN/heldout/test.*), with
the run's decode settings: do it once, for the rule that won on the validation split.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.checkpoints.format import read_meta  # noqa: E402
from transformer.errors import UserError  # noqa: E402
from transformer.translation.metrics import score  # noqa: E402
from transformer.translation.texts import translate_texts  # noqa: E402
from transformer.translation.torch_engine import load_translator  # noqa: E402


def read_split(run: Path, name: str) -> tuple[list[str], list[list[str]]]:
    """The sources of RUN/heldout/<name>.en (or the run's source suffix) and every sentence's references."""
    heldout = run / "heldout"
    sources_file = next(path for path in sorted(heldout.glob(f"{name}.*")) if path.suffix[1:].isalpha()
                        and not path.name.startswith(f"{name}_"))
    sources = sources_file.read_text(encoding="utf-8").splitlines()
    streams = [path.read_text(encoding="utf-8").splitlines() for path in sorted(heldout.glob(f"{name}.*.*"))]
    references = [[stream[i] for stream in streams if stream[i].strip()] for i in range(len(sources))]
    return sources, references


def bleu(checkpoint: Path, sources: list[str], references: list[list[str]], **decode) -> float:
    translator = load_translator(checkpoint_dir=checkpoint, device="cpu", **decode)
    return score([best[0] for best in translate_texts(translator, sources, 1, warn_unknown=False)], references).bleu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--test", metavar="CHECKPOINT", help="score this step checkpoint on the test split, alone")
    args = parser.parse_args()
    try:
        choose(parser, args)
    except UserError as error:  # a checkpoint without its run's tokenizer, a damaged one: one line
        parser.error(str(error))


def choose(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    checkpoints = args.run / "checkpoints"
    split = "test" if args.test else "valid"
    if not list((args.run / "heldout").glob(f"{split}.*.*")):
        parser.error(f"{args.run / 'heldout'}: no {split} split with references here: --run takes a run "
                     "directory that train.py wrote")
    if args.test and not (checkpoints / args.test).is_dir():
        parser.error(f"--test {args.test}: no such checkpoint in {checkpoints}")

    if args.test:
        sources, references = read_split(args.run, "test")
        print(f"{args.test}: test BLEU {bleu(checkpoints / args.test, sources, references):.2f} "
              f"({len(sources)} sentences, the run's decode settings)")
        return

    sources, references = read_split(args.run, "valid")
    rows = []
    for path in sorted(checkpoints.glob("step_*")):
        metrics = read_meta(path, verify=False).get("metrics") or {}
        if "valid_bleu" not in metrics:
            continue  # saved between validations
        started = time.perf_counter()
        whole = bleu(path, sources, references, beam_size=1)
        rows.append({"name": path.name, "step": int(read_meta(path, verify=False)["step"]),
                     "sample": metrics["valid_bleu"], "nll": metrics["valid_nll"], "whole": whole,
                     "seconds": time.perf_counter() - started})
        print(f"{path.name}: sample BLEU {metrics['valid_bleu']:.2f}, valid NLL {metrics['valid_nll']:.4f}, "
              f"whole-split greedy BLEU {whole:.2f} ({rows[-1]['seconds']:.1f} s)", flush=True)
    if not rows:
        parser.error(f"{checkpoints}: no validated step checkpoint")

    def first_best(key, sign=1):
        best = rows[0]
        for row in rows[1:]:
            if sign * row[key] > sign * best[key]:
                best = row
        return best

    candidates = {"sample BLEU (the rule before)": first_best("sample"), "whole-split BLEU": first_best("whole"),
                  "validation loss": first_best("nll", -1), "last": rows[-1]}
    beam: dict[str, float] = {}
    print(f"\n{len(sources)} validation sentences; beam BLEU with the run's decode settings")
    print(f"{'rule':<28} {'checkpoint':<14} {'sample':>7} {'NLL':>7} {'greedy':>7} {'beam':>7}")
    for rule, row in candidates.items():
        if row["name"] not in beam:
            beam[row["name"]] = bleu(checkpoints / row["name"], sources, references)
        print(f"{rule:<28} {row['name']:<14} {row['sample']:>7.2f} {row['nll']:>7.4f} {row['whole']:>7.2f} "
              f"{beam[row['name']]:>7.2f}")


if __name__ == "__main__":
    main()
