"""Terminology a user imposes (issue 49), measured on a run's own test split, torch engine, beam 5.

    python bench/terminology.py --run runs/base [--lines 500] [--speed-lines 200]

Term use: for each test sentence, up to two words of its first reference (4 letters or more, letters
only) that the unconstrained beam-5 translation lacks; how many translations contain them (as words,
any case) without constraints and with them as translate.py --constraints-column phrases; BLEU and
chrF both ways (all references). Avoidance: for each sentence, the longest word of its unconstrained
translation, avoided (as --avoid does, one sentence at a time since each has its own
word); the share of translations without it. Speed: sentences/s of the test split with 0, 1 and 2
constraints a sentence (the reference words above, then the reference's other words of 4+ letters), each count
in a process of its own, translation time only (the model loaded before the clock starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORD = re.compile(r"[^\W\d_]{4,}")  # letters only, 4 or more


def words(text: str) -> list[str]:
    return [w.casefold() for w in re.findall(r"[^\W\d_]+", text)]


def terms_missing(reference: str, output: str, most: int = 2) -> list[str]:
    """Up to `most` words of `reference` (4+ letters) that `output` lacks, in reference order, each once."""
    have = set(words(output))
    found = [w for w in dict.fromkeys(WORD.findall(reference)) if w.casefold() not in have]
    return found[:most]


def translate(run: Path, lines: list[str], *flags: str) -> list[str]:
    """translate.py's torch engine at beam 5 over `lines` (each a whole input line): the best translations."""
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "in.txt", Path(tmp) / "out.txt"
        source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        subprocess.run([sys.executable, str(ROOT / "translate.py"), "--run", str(run), "--engine", "torch", "--beam",
                        "5", "--quiet", "--input", str(source), "--output", str(out), *flags], check=True)
        return out.read_text(encoding="utf-8").split("\n")[: len(lines)]


def speed_child(run: Path, column_file: Path) -> None:
    """One process: the sentences/s of translating `column_file`'s lines (source<TAB>phrases...)."""
    from transformer.runtime import set_threads
    from transformer.translation.torch_engine import load_translator

    set_threads(0)
    rows = [line.split("\t") for line in column_file.read_text(encoding="utf-8").splitlines()]
    sources, phrases = [row[0] for row in rows], [row[1:] for row in rows]
    held = any(phrases)
    translator = load_translator(run, device="cpu", beam_size=5, per_text_constraints=held)
    translator.translate(sources[:8], text_constraints=[p for p in phrases[:8]] if held else None)  # warm-up
    start = time.perf_counter()
    translator.translate(sources, text_constraints=phrases if held else None)
    print(json.dumps({"sentences": len(sources), "seconds": time.perf_counter() - start}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=0, help="test sentences to use (0: all)")
    parser.add_argument("--speed-lines", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="processes per constraint count (the median is shown)")
    parser.add_argument("--speed-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.speed_child:
        speed_child(args.run, args.speed_child)
        return 0
    from transformer.translation.metrics import score

    heldout = args.run / "heldout"
    sources = (heldout / "test.en").read_text(encoding="utf-8").splitlines()
    ref_files = sorted(heldout.glob("test.fr.*"))
    references = [[r for r in refs if r.strip()] for refs in
                  zip(*[path.read_text(encoding="utf-8").splitlines() for path in ref_files])]
    if args.lines:
        sources, references = sources[: args.lines], references[: args.lines]
    plain = translate(args.run, sources)
    terms = [terms_missing(refs[0], output) for refs, output in zip(references, plain)]
    column = [source + "".join("\t" + t for t in ts) for source, ts in zip(sources, terms)]
    held = translate(args.run, column, "--constraints-column")
    asked = sum(len(ts) for ts in terms)
    used_plain = sum(t.casefold() in set(words(o)) for ts, o in zip(terms, plain) for t in ts)
    used_held = sum(t.casefold() in set(words(o)) for ts, o in zip(terms, held) for t in ts)
    print(f"{len(sources)} test sentences, {sum(bool(ts) for ts in terms)} with reference words the "
          f"unconstrained beam-5 output lacks, {asked} words in all")
    print(f"term use: without constraints {used_plain}/{asked} ({100 * used_plain / max(asked, 1):.1f}%), "
          f"with --constraints-column {used_held}/{asked} ({100 * used_held / max(asked, 1):.1f}%)")
    print(f"BLEU / chrF: without {score(plain, references)}; with {score(held, references)}")

    from transformer.translation.torch_engine import load_translator

    translator = load_translator(args.run, device="cpu", beam_size=5)
    avoided = absent = 0
    for source, output in zip(sources, plain):
        word = max(re.findall(r"[^\W\d_]{2,}", output), key=len, default=None)  # its longest word
        if word is None:
            continue
        translator.decode = dataclasses.replace(translator.decode, avoid=(word,))
        avoided += 1
        absent += word.casefold() not in set(words(translator.translate([source])[0][0]))
    if avoided:
        print(f"avoid: {absent}/{avoided} translations without the avoided word ({100 * absent / avoided:.1f}%)")
    else:
        print("avoid: no unconstrained translation has a word to avoid")

    for count in (0, 1, 2):
        rows = []
        for source, ts, refs in zip(sources[: args.speed_lines], terms, references):
            # the missing reference words first, then other words of the reference
            chosen = (ts + [w for w in WORD.findall(refs[0]) if w not in ts])[:count] if count else []
            rows.append(source + "".join("\t" + t for t in chosen))
        with tempfile.NamedTemporaryFile("w", suffix=".tsv", encoding="utf-8", delete=False) as handle:
            handle.write("".join(row + "\n" for row in rows))
        seconds = []
        for _ in range(args.repeats):
            result = subprocess.run([sys.executable, __file__, "--run", str(args.run), "--speed-child", handle.name],
                                    check=True, capture_output=True, text=True)
            seconds.append(json.loads(result.stdout.strip().splitlines()[-1])["seconds"])
        Path(handle.name).unlink()
        median = statistics.median(seconds)
        print(f"speed, {count} constraint(s) a sentence: {len(rows) / median:.1f} sentences/s ({len(rows)} sentences, "
              f"median of {args.repeats} processes: {median:.2f} s; all: {', '.join(f'{t:.2f}' for t in seconds)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
