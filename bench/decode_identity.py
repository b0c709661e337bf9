"""Translate the first N lines of a run's test split with both engines and every decoding method
(greedy, beam 5, n-best 3, seeded sampling, a prefix) and, on the torch engine, terminology (a required
phrase a line from its reference, an avoided word, a glossary), one file per case, so that a refactoring
of the decode path can be checked byte for byte: run it before into one folder, after into another, and diff.

  python bench/decode_identity.py --run RUN --out /tmp/before [--lines 200]
  diff -r /tmp/before /tmp/after && echo identical
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

CASES = {
    "greedy": ["--greedy"],
    "beam5": ["--beam", "5"],
    "nbest3": ["--beam", "5", "--n-best", "3"],
    "sample": ["--sample", "--top-k", "10", "--seed", "7"],
    "prefix": ["--beam", "5", "--prefix", "Je"],
}

# Terminology runs on the torch engine only; {glossary} is the glossary file this script writes.
TERMINOLOGY = {
    "constraints": ["--beam", "5", "--constraints-column"],
    "avoid": ["--beam", "5", "--avoid", "est", "--avoid", "pas"],
    "glossary": ["--beam", "5", "--glossary", "{glossary}"],
}
GLOSSARY = {"station": "gare", "doctor": "médecin", "ticket": "billet", "computer": "ordinateur",
            "house": "maison", "car": "voiture", "book": "livre", "dog": "chien", "money": "argent",
            "time": "temps", "French": "français", "school": "école", "work": "travail"}
WORD = re.compile(r"[^\W\d_]{4,}")  # a reference word of four letters or more is a line's phrase


def column_file(sources: list[str], references: list[str], path: Path) -> Path:
    """source<TAB>phrase lines: each line's first reference word of 4+ letters (none where it has none)."""
    lines = []
    for source, reference in zip(sources, references):
        words = WORD.findall(reference)
        lines.append(source + ("\t" + words[0] if words else ""))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--engines", nargs="+", default=["torch", "ctranslate2"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    heldout = args.run / "heldout"
    sources = (heldout / "test.en").read_text(encoding="utf-8").splitlines()[: args.lines]
    references = (heldout / "test.fr.1").read_text(encoding="utf-8").splitlines()[: args.lines]
    source = args.out / "source.en"
    source.write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    column = column_file(sources, references, args.out / "source.constraints.tsv")
    glossary = args.out / "glossary.tsv"
    glossary.write_text("".join(f"{s}\t{t}\n" for s, t in GLOSSARY.items()), encoding="utf-8")
    runs = [(engine, case, flags, source) for engine in args.engines for case, flags in CASES.items()]
    if "torch" in args.engines:
        runs += [("torch", case, [f.format(glossary=glossary) for f in flags],
                  column if case == "constraints" else source) for case, flags in TERMINOLOGY.items()]
    for engine, case, flags, input_file in runs:
        out = args.out / f"{engine}.{case}.fr"
        subprocess.run([sys.executable, "translate.py", "--run", str(args.run), "--engine", engine, "--quiet",
                        "--input", str(input_file), "--output", str(out), *flags], check=True)
        print(f"{engine:12s} {case:12s} {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
