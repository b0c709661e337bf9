"""Write the reference toolkit's (JoeyNMT 2.3) inputs from *our* split of the data.

    python bench/reference/prepare.py --config configs/base.yaml --out /tmp/ref

Both systems must train on the same pairs and be scored on the same held-out sentences, so this
uses the project's own loader and split (by English sentence, seeded) rather than a second one:
- train.en / train.fr, valid.en / valid.fr: one sentence a line, cleaned exactly as our trainer
  sees them (the reference validates on all of our valid pairs);
- test.en and test.fr.1 ... test.fr.K: our test split, one line per distinct English sentence,
  every French translation as a reference stream (the same files train.py writes to heldout/);
- joey.yaml: the reference configuration with its REF/ paths pointed at --out.
The sentencepiece vocabulary is trained by `bench/reference/run.sh` in the reference's own
virtualenv, which has sentencepiece; this script runs in ours.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transformer.config import load_config  # noqa: E402
from transformer.data.corpus import SOURCE, TARGET, load_pairs  # noqa: E402
from transformer.data.rows import iter_texts  # noqa: E402
from transformer.data.split import split_pairs  # noqa: E402

HERE = Path(__file__).resolve().parent


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def grouped_references(sources: list[str], targets: list[str]) -> tuple[list[str], list[list[str]]]:
    """Distinct sources in first-seen order, each with all of its translations."""
    by_source: dict[str, list[str]] = defaultdict(list)
    for source, target in zip(sources, targets):
        by_source[source].append(target)
    return list(by_source), list(by_source.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/base.yaml"))
    parser.add_argument("--out", required=True, help="folder for the reference's data, vocabulary and YAML")
    parser.add_argument("--template", default=str(HERE / "joey_enfr.yaml"))
    args = parser.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    pairs, _ = load_pairs(config.data)
    splits = split_pairs(pairs, config.data)
    for name in ("train", "valid"):
        dataset = getattr(splits, name)
        write_lines(out / f"{name}.en", list(iter_texts(dataset, SOURCE)))
        write_lines(out / f"{name}.fr", list(iter_texts(dataset, TARGET)))
    sources, references = grouped_references(list(iter_texts(splits.test, SOURCE)),
                                              list(iter_texts(splits.test, TARGET)))
    write_lines(out / "test.en", sources)
    for k in range(max(map(len, references))):
        write_lines(out / f"test.fr.{k + 1}", [refs[k] if k < len(refs) else "" for refs in references])

    (out / "joey.yaml").write_text(Path(args.template).read_text(encoding="utf-8").replace("REF/", f"{out}/"),
                                   encoding="utf-8")
    print(f"{out}: {len(splits.train)} train, {len(splits.valid)} valid pairs, {len(sources)} test sentences "
          f"with up to {max(map(len, references))} references")


if __name__ == "__main__":
    main()
