"""Translate the first N lines of a run's test split with both engines and every decoding method
(greedy, beam 5, n-best 3, seeded sampling, a prefix), one file per case, so that a refactoring of the
decode path can be checked byte for byte: run it before into one folder, after into another, and diff.

  python bench/decode_identity.py --run RUN --out /tmp/before [--lines 200]
  diff -r /tmp/before /tmp/after && echo identical
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--engines", nargs="+", default=["torch", "ctranslate2"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    source = args.out / "source.en"
    source.write_text("".join((args.run / "heldout" / "test.en").read_text(encoding="utf-8")
                              .splitlines(keepends=True)[: args.lines]), encoding="utf-8")
    for engine in args.engines:
        for case, flags in CASES.items():
            out = args.out / f"{engine}.{case}.fr"
            subprocess.run([sys.executable, "translate.py", "--run", str(args.run), "--engine", engine, "--quiet",
                            "--input", str(source), "--output", str(out), *flags], check=True)
            print(f"{engine:12s} {case:8s} {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
