"""Issue 58's figures for terminology on real text, before and after a change to the decode path: the code
of this tree ("after") against another checkout ("before", e.g. a `git worktree add --detach` of an older
commit), each running its own translate.py on the same run, the same inputs and the same flags. Counts and
scores only: no timings (run it on a shared machine if need be).

    python bench/terminology_edges.py --run runs/base --before /path/to/old/checkout [--out DIR]

1. Blank translations. The longest held-out sentences of the run (its test and valid splits, which it never
   trained on; `--long` of them by words), each with required phrases taken from its first reference
   (`--phrases`: "words", its first word of 4+ letters and on every other line also its last; "pairs", its
   first two words and its last two as two phrases), torch engine, beam 5, `--constraints-column --format
   jsonl`: how many outputs are blank before and after, what the jsonl says of the lines after whose
   phrases are not all met (`"met": false`), and whether every other line is the same before and after; at
   the run's output lengths and at each tighter `--tight A,B` (--max-length-a A --max-length-b B), where a
   search runs out of room more.
   Lines whose phrases cannot fit the tighter length at all are left out of that setting (translate.py
   refuses a whole file for one such line).
2. Alternatives. A hand-made glossary (bench/data/glossary_alternatives.tsv: common terms of the run's
   domain whose French has several accepted forms) on the test split, after only: on the lines where a
   term matches, the term-use rate (the output holds one of the term's accepted forms as whole words, any
   case) and BLEU/chrF against all references, for (a) no glossary, (b) the glossary forcing each term's
   first alternative, (c) the glossary with its alternatives; the untouched lines' outputs compared byte
   for byte with (a).
3. Identity. The test split without phrases, greedy and beam 5, on both engines: before and after byte for
   byte.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GLOSSARY = ROOT / "bench" / "data" / "glossary_alternatives.tsv"
WORD = re.compile(r"[^\W\d_]{4,}")  # a content word: letters only, 4 or more
TOKEN = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")  # a word, with its inner apostrophes and hyphens
PUNCTUATION = ".,;:!?\"«»()…"


@dataclass(frozen=True)
class Tree:
    name: str  # "before" or "after"
    path: Path

    def commit(self) -> str:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=self.path, capture_output=True, text=True).stdout.strip()

        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


@dataclass(frozen=True)
class Output:
    lines: list[str]  # the output file's lines (one JSON object a line with --format jsonl)
    stderr: str


def translate(tree: Tree, run: Path, lines: list[str], flags: list[str], work: Path, name: str) -> Output:
    """`tree`'s own translate.py (its package first on the path) over `lines`, one input line each; the
    output is kept as `work/name`."""
    source, out = work / f"{name}.in", work / name
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    command = [sys.executable, str(tree.path / "translate.py"), "--run", str(run), "--quiet",
               "--input", str(source), "--output", str(out), *flags]
    environment = {**os.environ, "PYTHONPATH": str(tree.path)}
    done = subprocess.run(command, cwd=tree.path, env=environment, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree.name} ({tree.path}): {shlex.join(command)} failed ({done.returncode}):\n"
                         f"{done.stderr.strip()}")
    return Output(out.read_text(encoding="utf-8").split("\n")[: len(lines)], done.stderr)


def read_heldout(run: Path, split: str) -> tuple[list[str], list[list[str]]]:
    """A held-out split's sources and, per line, its non-blank references."""
    heldout = run / "heldout"
    sources = (heldout / f"{split}.en").read_text(encoding="utf-8").splitlines()
    files = sorted(heldout.glob(f"{split}.fr.*"), key=lambda p: int(p.suffix[1:]))
    columns = [path.read_text(encoding="utf-8").splitlines() for path in files]
    return sources, [[r for r in refs if r.strip()] for refs in zip(*columns)]


def content_words(reference: str, two: bool) -> list[str]:
    """One or two required words of a line: its reference's first word of 4+ letters; with `two`, also its
    last one (where that is another word)."""
    found = list(dict.fromkeys(WORD.findall(reference)))
    return found[:1] + (found[-1:] if two and len(found) > 1 else [])


def word_pairs(reference: str) -> list[str]:
    """Two required two-word phrases of a line: its reference's first two words and its last two, as they
    stand next to each other (punctuation at their edges dropped: `Pourquoi n'irions-nous`, `de rythme`);
    a pair with anything but letters, inner apostrophes and hyphens left out, as are references of fewer
    than four words."""
    words = reference.split()
    while words and not words[-1].strip(PUNCTUATION):  # French sets "?" and "!" apart: no word
        words.pop()
    while words and not words[0].strip(PUNCTUATION):
        words.pop(0)
    words = [word.strip(PUNCTUATION) for word in words]
    if len(words) < 4:
        return []
    pairs = [words[:2], words[-2:]]
    return [" ".join(pair) for pair in pairs if all(TOKEN.fullmatch(word) for word in pair)]


PHRASES = {"words": ("one or two words of reference 1 a line (its first word of 4+ letters; on every other line "
                     "also its last)", lambda i, reference: content_words(reference, two=i % 2 == 1)),
           "pairs": ("two two-word phrases of reference 1 a line (its first two words and its last two)",
                     lambda i, reference: word_pairs(reference))}


def fits(run: Path, rows: list[tuple[str, list[str]]], a: float, b: int) -> list[bool]:
    """Whether each row's phrases fit an output of its source at --max-length-a a --max-length-b b, by this
    tree's own check (texts.text_phrases): a row that does not would make translate.py refuse the file."""
    from transformer.decoding import PhraseError
    from transformer.translation.texts import source_ids, text_phrases
    from transformer.translation.torch_engine import load_translator

    translator = load_translator(run, device="cpu", beam_size=5, max_length_a=a, max_length_b=b,
                                 per_text_constraints=True)
    ids = source_ids([source for source, _ in rows], translator.tokenizers, translator.max_len - 1, False)
    kept = []
    for row, (_, phrases) in zip(ids, rows):
        try:
            text_phrases(translator, [row], [phrases])
            kept.append(True)
        except PhraseError:
            kept.append(False)
    return kept


def blanks(run: Path, trees: list[Tree], long: int, kinds: list[str], tights: list[tuple[float, int]],
           work: Path) -> None:
    rows = []
    for split in ("test", "valid"):
        sources, references = read_heldout(run, split)
        rows += [(s, refs[0]) for s, refs in zip(sources, references) if refs]
    rows.sort(key=lambda row: -len(row[0].split()))  # stable: file order among sentences as long
    rows = rows[:long]
    lengths = [len(source.split()) for source, _ in rows]
    print(f"## 1. Blank translations: the {len(rows)} longest held-out sentences (test + valid), "
          f"{min(lengths)}-{max(lengths)} words, torch engine, beam 5, `--constraints-column --format jsonl`\n")
    for kind in kinds:
        print(f"- {kind}: {PHRASES[kind][0]}")
    settings = [("1.5, 10 (the run's)", [], None)]
    settings += [(f"{a:g}, {b}", ["--max-length-a", str(a), "--max-length-b", str(b)], (a, b)) for a, b in tights]
    print("\n| phrases | --max-length-a, -b | lines | blank before | blank after | `\"met\": false` after "
          "| of them blank before | phrases met in them | `warning:` lines after | other lines identical |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    examples, warning = [], None
    for kind in kinds:
        chosen = [(source, PHRASES[kind][1](i, reference)) for i, (source, reference) in enumerate(rows)]
        chosen = [(source, phrases) for source, phrases in chosen if phrases]
        for label, flags, tight in settings:
            rows_here = chosen
            if tight is not None:  # lines whose phrases cannot fit at all are refused, and the file with them
                rows_here = [row for row, ok in zip(chosen, fits(run, chosen, *tight)) if ok]
            column = [source + "".join("\t" + p for p in phrases) for source, phrases in rows_here]
            records, stderr = {}, {}
            for tree in trees:
                name = f"long.{kind}.{tree.name}.{'_'.join(flags) or 'run'}.jsonl"
                out = translate(tree, run, column, ["--engine", "torch", "--beam", "5", "--constraints-column",
                                                    "--format", "jsonl", *flags], work, name)
                records[tree.name] = [json.loads(line) for line in out.lines]
                stderr[tree.name] = out.stderr
            before, after = records["before"], records["after"]
            blank_before = {i for i, r in enumerate(before) if not r["translation"].strip()}
            blank_after = {i for i, r in enumerate(after) if not r["translation"].strip()}
            unmet = [i for i, r in enumerate(after) if r.get("met") is False]
            met_in_unmet = sum(c["met"] for i in unmet for c in after[i]["constraints"])
            asked_in_unmet = sum(len(after[i]["constraints"]) for i in unmet)
            warnings = [line for line in stderr["after"].splitlines() if line.startswith("warning:")]
            others = [i for i in range(len(column)) if i not in blank_before]
            same = sum(before[i]["translation"] == after[i]["translation"] for i in others)
            print(f"| {kind} | {label} | {len(rows_here)} | {len(blank_before)} | {len(blank_after)} | {len(unmet)} "
                  f"| {len(blank_before & set(unmet))} | {met_in_unmet} of {asked_in_unmet} | {len(warnings)} "
                  f"| {same}/{len(others)} |")
            examples += [(kind, label, after[i]) for i in unmet[: 2 - len(examples)]]
            warning = warning or next(iter(warnings), None)
    if examples:
        print("\nRecords after with `\"met\": false` (their n_best left out):\n")
        for kind, label, record in examples:
            shown = {k: v for k, v in record.items() if k != "n_best"}
            print(f"- {kind}, {label}: `{json.dumps(shown, ensure_ascii=False)}`")
    if warning:
        print(f"\nA warning line after (stderr): `{warning}`")
    print()


def read_terms(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split("\t", 1)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def alternatives(run: Path, tree: Tree, sources: list[str], references: list[list[str]], work: Path,
                 plain: list[str]) -> None:
    from transformer.data.text import whole_words
    from transformer.decoding import alternatives_of
    from transformer.translation.glossary import read_glossary
    from transformer.translation.metrics import score

    terms = read_terms(GLOSSARY)
    first = work / "glossary_first.tsv"
    first.write_text("".join(f"{s}\t{alternatives_of(t)[0]}\n" for s, t in terms), encoding="utf-8")
    glossary = read_glossary(GLOSSARY)
    called = [glossary.targets_of(source) for source in sources]  # the target cells each line calls for
    matched = [i for i, targets in enumerate(called) if targets]
    untouched = [i for i, targets in enumerate(called) if not targets]
    flags = ["--engine", "torch", "--beam", "5"]
    outputs = {"(a) no glossary": plain,
               "(b) first alternative only": translate(tree, run, sources, [*flags, "--glossary", str(first)],
                                                       work, "glossary.first.fr").lines,
               "(c) alternatives": translate(tree, run, sources, [*flags, "--glossary", str(GLOSSARY)],
                                             work, "glossary.alternatives.fr").lines}
    asked = [(i, target) for i in matched for target in called[i]]
    with_alternatives = sum("|" in t for _, t in terms)
    print(f"## 2. Alternatives: {GLOSSARY.relative_to(ROOT)} ({len(terms)} terms, {with_alternatives} with "
          f"alternatives) on the test split ({len(sources)} lines), torch engine, beam 5, after only\n")
    print(f"{len(matched)} lines match a term ({len(asked)} terms called for in all); "
          f"{len(untouched)} lines match none.\n")
    print("| glossary | terms used (any accepted form) | terms used as the first form | BLEU (matched lines) "
          "| chrF (matched lines) | BLEU (all lines) | untouched lines identical to (a) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, lines in outputs.items():
        used = sum(whole_words(list(alternatives_of(t))).search(lines[i]) is not None for i, t in asked)
        used_first = sum(whole_words([alternatives_of(t)[0]]).search(lines[i]) is not None for i, t in asked)
        here = score([lines[i] for i in matched], [references[i] for i in matched])
        whole = score(lines, references)
        same = sum(lines[i] == plain[i] for i in untouched)
        print(f"| {label} | {used}/{len(asked)} ({100 * used / len(asked):.1f}%) | {used_first}/{len(asked)} "
              f"({100 * used_first / len(asked):.1f}%) | {here.bleu:.2f} | {here.chrf:.2f} | {whole.bleu:.2f} "
              f"| {same}/{len(untouched)} |")
    print()


def identity(run: Path, trees: list[Tree], sources: list[str], work: Path, engines: list[str],
             done: dict[tuple[str, str, str], list[str]]) -> None:
    print(f"## 3. Identity: the test split ({len(sources)} lines) without phrases, before and after\n")
    print("| engine | method | identical lines | differing |")
    print("|---|---|---:|---:|")
    for engine in engines:
        for method, flags in (("greedy", ["--greedy"]), ("beam 5", ["--beam", "5"])):
            got = {}
            for tree in trees:
                key = (tree.name, engine, method)
                if key not in done:
                    name = f"test.{tree.name}.{engine}.{method.replace(' ', '')}.fr"
                    done[key] = translate(tree, run, sources, ["--engine", engine, *flags], work, name).lines
                got[tree.name] = done[key]
            same = sum(b == a for b, a in zip(got["before"], got["after"]))
            print(f"| {engine} | {method} | {same}/{len(sources)} | {len(sources) - same} |")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a trained run; its heldout/ files are the input")
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before the change")
    parser.add_argument("--long", type=int, default=300, help="part 1: the longest N held-out sentences")
    parser.add_argument("--tight", nargs="*", default=["0.6,2"], metavar="A,B",
                        help="part 1: tighter output lengths to try, each as --max-length-a A --max-length-b B")
    parser.add_argument("--phrases", nargs="+", default=list(PHRASES), choices=list(PHRASES),
                        help="part 1: which required phrases each line gets")
    parser.add_argument("--engines", nargs="+", default=["torch", "ctranslate2"], help="part 3's engines")
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--out", type=Path, help="keep every input and output here (default: a temporary folder)")
    args = parser.parse_args()
    from transformer.hardware import cpu_model

    trees = [Tree("before", args.before.resolve()), Tree("after", ROOT)]
    tights = [(float(a), int(b)) for a, b in (setting.split(",") for setting in args.tight)]
    print(f"`{shlex.join(['python', *sys.argv])}`\n")
    print(f"before: {trees[0].commit()} ({trees[0].path}); after: {trees[1].commit()} ({trees[1].path}); "
          f"run: {args.run}; {cpu_model()}, {os.cpu_count()} logical CPUs\n")
    with tempfile.TemporaryDirectory() as temporary:
        work = args.out or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        sources, references = read_heldout(args.run, "test")
        done: dict[tuple[str, str, str], list[str]] = {}
        if 1 in args.parts:
            blanks(args.run, trees, args.long, args.phrases, tights, work)
        if 2 in args.parts:
            key = ("after", "torch", "beam 5")
            done[key] = translate(trees[1], args.run, sources, ["--engine", "torch", "--beam", "5"], work,
                                  "test.after.torch.beam5.fr").lines
            alternatives(args.run, trees[1], sources, references, work, done[key])
        if 3 in args.parts:
            identity(args.run, trees, sources, work, args.engines, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
