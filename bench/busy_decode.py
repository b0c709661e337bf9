"""Constrained search beside other work (issue 58): translate.py's torch engine at beam 5 over long sentences
with 0, 1 and 2 constraints a line (and CTranslate2 without constraints), each command a process of its own,
timed whole (start-up included, as a user meets it), alone and beside busy processes this script starts
(`python -c "while True: pass"`), under each setting asked for: an environment (OMP_WAIT_POLICY=PASSIVE,
GOMP_SPINCOUNT=0, ...) and/or translate.py flags (--threads 1). Prints sentences/s, medians over --repeats,
each command's slowdown beside the busy processes (sharing the cores alone explains about (busy + the
command's threads) / its threads, at most) and the CPU seconds it used (threads spinning while they wait
for work show there).

    python bench/busy_decode.py --run runs/base [--lines 100] [--repeats 3] [--hogs 2] \\
        [--setting ""] [--setting "GOMP_SPINCOUNT=300000"] [--setting "--threads 1"]

The default settings are "" (translate.py as shipped: OpenMP's idle threads sleep, hardware.OPENMP_WAIT) and
"GOMP_SPINCOUNT=300000", libgomp's own default, which translate.py ran with before it set OMP_WAIT_POLICY
(it leaves the environment's choice alone).

Sentences: `--sentences FILE` (source<TAB>reference lines), else the run's test split's lines of 20 to 50
words (heldout/test.en, its first reference), topped up with the shipped CSV's longest English lines of 20 to
50 words. A line's constraints are the first words of 4 letters or more of its reference.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.hardware import cpu_model  # noqa: E402

HOG = "while True: pass"
WORD = re.compile(r"[^\W\d_]{4,}")  # letters only, 4 or more
SHIPPED_CSV = ROOT / "data" / "eng_-french.csv"
# libgomp's spin count when the environment sets no wait policy: with it set, translate.py leaves the wait
# policy as libgomp's default, as it was before it set OMP_WAIT_POLICY=PASSIVE.
AS_BEFORE = "GOMP_SPINCOUNT=300000"


def long_pairs(run: Path, count: int, low: int = 20, high: int = 50) -> list[tuple[str, str]]:
    """Up to `count` (source, reference) pairs of `low` to `high` source words: the run's test split's first,
    then the shipped CSV's longest, each source once."""
    pairs: dict[str, str] = {}
    heldout = run / "heldout"
    if (heldout / "test.en").is_file() and (heldout / "test.fr.1").is_file():
        sources = (heldout / "test.en").read_text(encoding="utf-8").splitlines()
        references = (heldout / "test.fr.1").read_text(encoding="utf-8").splitlines()
        for source, reference in zip(sources, references):
            if low <= len(source.split()) <= high:
                pairs.setdefault(source, reference)
    if len(pairs) < count and SHIPPED_CSV.is_file():
        with SHIPPED_CSV.open(encoding="utf-8", newline="") as handle:
            rows = [row for row in list(csv.reader(handle))[1:] if len(row) >= 2]
        rows.sort(key=lambda row: -len(row[0].split()))
        for source, reference in rows:
            if low <= len(source.split()) <= high:
                pairs.setdefault(source, reference)
    return list(pairs.items())[:count]


def column_file(pairs: list[tuple[str, str]], constraints: int, directory: Path) -> Path:
    """source<TAB>phrase... lines, each with the first `constraints` words (4+ letters) of its reference."""
    path = directory / f"lines-{constraints}.tsv"
    lines = []
    for source, reference in pairs:
        phrases = list(dict.fromkeys(WORD.findall(reference)))[:constraints]
        lines.append("\t".join([source.replace("\t", " "), *phrases]))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def parse_setting(text: str) -> tuple[dict[str, str], list[str]]:
    """A setting's environment (NAME=VALUE words) and translate.py flags (the other words)."""
    env, flags = {}, []
    for word in shlex.split(text):
        name, equals, value = word.partition("=")
        if equals and not word.startswith("-") and name.isupper():
            env[name] = value
        else:
            flags.append(word)
    return env, flags


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Seconds `command` takes as a process of its own, and the CPU seconds it used (user and system)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--sentences", type=Path, help="source<TAB>reference lines (default: see above)")
    parser.add_argument("--lines", type=int, default=100, help="sentences a command translates (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per cell; the median is shown")
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the command (default 2)")
    parser.add_argument("--constraints", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--engines", nargs="+", choices=["torch", "ctranslate2"], default=["torch", "ctranslate2"],
                        help="CTranslate2 runs the lines without constraints only (default: both)")
    parser.add_argument("--setting", action="append", default=None, metavar="'NAME=VALUE ... --flag ...'",
                        help=f"repeatable; default: as shipped (\"\"), and {AS_BEFORE!r}, what translate.py ran "
                             "with before it set OMP_WAIT_POLICY")
    args = parser.parse_args()
    settings = args.setting if args.setting is not None else ["", AS_BEFORE]
    if args.sentences:
        rows = [line.split("\t") for line in args.sentences.read_text(encoding="utf-8").splitlines() if line.strip()]
        pairs = [(row[0], row[1] if len(row) > 1 else "") for row in rows][: args.lines]
    else:
        pairs = long_pairs(args.run, args.lines)
    if not pairs:
        print("no sentences of 20 to 50 words found: give --sentences FILE", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    words = [len(source.split()) for source, _ in pairs]
    print(f"{cpu_model()}, {cores} cores; {len(pairs)} sentences of {min(words)}-{max(words)} words "
          f"(mean {statistics.mean(words):.1f}); translate.py --engine torch --beam 5, whole process, "
          f"median of {args.repeats}; busy: {args.hogs} x python -c {HOG!r}")
    cells = [(engine, count) for engine in args.engines for count in args.constraints
             if engine == "torch" or count == 0]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # each setting says its own
        environment.pop(name, None)
    with tempfile.TemporaryDirectory() as tmp:
        files = {count: column_file(pairs, count, Path(tmp)) for count in args.constraints}
        if cells and any(engine == "ctranslate2" for engine, _ in cells):  # exported into the run before any clock
            subprocess.run([sys.executable, str(ROOT / "translate.py"), "--run", str(args.run), "--engine",
                            "ctranslate2", "--quiet", "Hi."], check=True, env=environment, stdout=subprocess.DEVNULL)
        measured: dict[tuple[str, str, int, bool], list[tuple[float, float]]] = {}
        for _ in range(args.repeats):  # interleaved, so that a drift of the machine touches every cell alike
            for setting in settings:
                env, flags = parse_setting(setting)
                for engine, count in cells:
                    command = [sys.executable, str(ROOT / "translate.py"), "--run", str(args.run), "--engine", engine,
                               "--beam", "5", "--quiet", "--input", str(files[count]), *flags]
                    if count:
                        command.append("--constraints-column")
                    for busy in (False, True):
                        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs if busy else 0)]
                        try:
                            measured.setdefault((setting, engine, count, busy), []).append(
                                timed(command, {**environment, **env}))
                        finally:
                            for hog in hogs:
                                hog.kill()
                                hog.wait()
    print(f"| setting | engine | constraints a line | sentences/s alone | sentences/s beside {args.hogs} busy | "
          "slowdown | CPU s alone | CPU s beside busy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for setting in settings:
        for engine, count in cells:
            alone = measured[(setting, engine, count, False)]
            busy = measured[(setting, engine, count, True)]
            wall_alone, wall_busy = (statistics.median(wall for wall, _ in runs) for runs in (alone, busy))
            cpu_alone, cpu_busy = (statistics.median(cpu for _, cpu in runs) for runs in (alone, busy))
            print(f"| {setting or 'as shipped'} | {engine} | {count} | {len(pairs) / wall_alone:.2f} | "
                  f"{len(pairs) / wall_busy:.2f} | {wall_busy / wall_alone:.1f}x | {cpu_alone:.1f} | {cpu_busy:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
