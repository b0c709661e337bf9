"""The two translation engines measured as a user runs them: whole `translate.py` processes.

    python bench/engines.py --run runs/base                          # the figures: median of 3
    python bench/engines.py --run runs/base --repeats 1 --limit 20   # a smoke check, no figures

Run it on an otherwise idle machine: with two cores, anything beside it (tests, training, a second
benchmark) measures nothing.

Each measurement is one child process, `python translate.py --run RUN --engine E --quiet ...
--input FILE --output OUT`, timed as wall time (start-up, imports, model loading and
translating), with the peak RSS of that child alone (os.wait4). Per setting the engines alternate,
torch, ctranslate2, torch, ...; the first pair is a warm-up and is discarded (it also writes the
run's CTranslate2 export, RUN/ctranslate2/, if there is none yet); each cell is the median of
--repeats pairs, and torch / CTranslate2 the median of the pairs' ratios. Settings: greedy, beam 5
and greedy --int8 (each engine's own int8) at --batch-size 64 over the run's test split
(RUN/heldout/test.en, --limit N for its first N) and at --batch-size 1 over its first
--batch1-sentences; and a cold start, one sentence given as an argument with the run's own decode
settings. Per setting also how many output lines the two engines share, and BLEU / chrF of each
against all the test references. Prints a markdown table, under a line naming the machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402  (no torch: the children import it)
from transformer.hardware import cpu_flags, cpu_model  # noqa: E402
from transformer.translation.metrics import score  # noqa: E402

ENGINES = ("torch", "ctranslate2")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Setting:
    name: str
    args: tuple[str, ...]  # translate.py's options for it
    sentences: int  # how many test sentences it translates; 0: a cold start, one sentence as an argument


@dataclass
class Measured:
    walls: list[float]
    peaks_mib: list[float]
    lines: list[str]  # the outputs of the last repeat


def settings(test_sentences: int, batch1_sentences: int) -> list[Setting]:
    batch1 = min(batch1_sentences, test_sentences)
    return [
        Setting("greedy, batch 64", ("--greedy", "--batch-size", "64"), test_sentences),
        Setting("beam 5, batch 64", ("--beam", "5", "--batch-size", "64"), test_sentences),
        Setting("greedy --int8, batch 64", ("--greedy", "--int8", "--batch-size", "64"), test_sentences),
        Setting(f"greedy, batch 1 ({batch1} sentences)", ("--greedy", "--batch-size", "1"), batch1),
        Setting(f"beam 5, batch 1 ({batch1} sentences)", ("--beam", "5", "--batch-size", "1"), batch1),
        Setting(f"greedy --int8, batch 1 ({batch1} sentences)", ("--greedy", "--int8", "--batch-size", "1"), batch1),
        Setting("cold start: one sentence, the run's decode settings", (), 0),
    ]


def run_child(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process, which must succeed."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not the largest child's so far
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            err.seek(0)
            sys.exit(f"failed ({child.returncode}): {shlex.join(command)}\n{err.read().decode(errors='replace')}")
    return wall, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def measure(setting: Setting, run: Path, sources: list[str], work: Path, repeats: int, device: str | None,
            threads: int, extra: list[str]) -> dict[str, Measured]:
    """Both engines on `setting`, alternating, after one discarded warm-up pair."""
    source = work / "input.en"
    if setting.sentences:
        source.write_text("".join(line + "\n" for line in sources[:setting.sentences]), encoding="utf-8")
    results = {engine: Measured([], [], []) for engine in ENGINES}
    for repeat in range(repeats + 1):
        for engine in ENGINES:
            output = work / f"{engine}.out"
            command = [sys.executable, str(ROOT / "translate.py"), "--run", str(run), "--engine", engine, "--quiet",
                       *(["--device", device] if device else []), *(["--threads", str(threads)] if threads else []),
                       *setting.args, *extra]
            command += (["--input", str(source), "--output", str(output)] if setting.sentences
                        else ["--output", str(output), sources[0]])
            wall, peak = run_child(command)
            if repeat:  # the first pair warms the page cache (and writes the export)
                results[engine].walls.append(wall)
                results[engine].peaks_mib.append(peak)
            results[engine].lines = output.read_text(encoding="utf-8").splitlines()
    return results


def cpu_line(threads: int) -> str:
    """The CPU's model name, its flags that matter to the kernels, cores, threads asked for."""
    present = [flag for flag in CPU_FLAGS if flag in cpu_flags()] or ["none of " + " ".join(CPU_FLAGS)]
    asked = f"--threads {threads}" if threads else "each engine's default threads"
    return f"{cpu_model()}; flags: {' '.join(present)}; {os.cpu_count()} logical CPUs; {asked}"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a trained run; its heldout/test.* are the input")
    parser.add_argument("--repeats", type=int, default=3, help="measured pairs per setting, after the warm-up pair")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N test sentences (0: all)")
    parser.add_argument("--batch1-sentences", type=int, default=200, metavar="N",
                        help="test sentences of the batch-size-1 settings (the first N)")
    parser.add_argument("--translate-args", default="", metavar="ARGS",
                        help="more translate.py flags for every command, e.g. \"--max-length-a 0 --max-length-b 16\"")
    parser.add_argument("--no-int8", action="store_true", help="leave out the --int8 settings")
    parser.add_argument("--threads", type=int, default=0, help="translate.py --threads for both engines (0: theirs)")
    parser.add_argument("--device", help="translate.py --device for both engines (default: theirs, auto); the "
                                         "torch engine's --int8 needs the CPU")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    heldout = RunDirectory(args.run).read_heldout("test")
    if heldout is None:
        sys.exit(f"{args.run}: no heldout/test.en; give a run that train.py has written")
    sources, references = heldout
    if args.limit:
        sources, references = sources[:args.limit], references[:args.limit]

    print(f"CPU: {cpu_line(args.threads)}")
    print(f"commit {commit()}, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; torch {version('torch')}, "
          f"ctranslate2 {version('ctranslate2')}; run {args.run}, {len(sources)} test sentences; "
          f"median of {args.repeats} after a warm-up pair")
    print(f"command: python bench/{Path(__file__).name} {shlex.join(sys.argv[1:])}")
    print()
    print("| setting | torch: wall, peak RSS | CTranslate2: wall, peak RSS | torch / CTranslate2 | identical lines "
          "| BLEU / chrF torch | BLEU / chrF CTranslate2 |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as work:
        for setting in settings(len(sources), args.batch1_sentences):
            if args.no_int8 and "--int8" in setting.args:
                continue
            measured = measure(setting, args.run, sources, Path(work), args.repeats, args.device, args.threads,
                               shlex.split(args.translate_args))
            torch_run, ct2_run = measured["torch"], measured["ctranslate2"]
            ratio = statistics.median(a / b for a, b in zip(torch_run.walls, ct2_run.walls))
            same = sum(a == b for a, b in zip(torch_run.lines, ct2_run.lines))
            cells = [setting.name]
            cells += [f"{statistics.median(m.walls):.2f} s, {max(m.peaks_mib):.0f} MiB" for m in (torch_run, ct2_run)]
            cells += [f"{ratio:.2f}×", f"{same} / {len(torch_run.lines)}"]
            if setting.sentences:
                wanted = references[:setting.sentences]
                cells += [f"{s.bleu:.2f} / {s.chrf:.2f}" for s in (score(m.lines, wanted) for m in (torch_run, ct2_run))]
            else:
                cells += ["", ""]
            print("| " + " | ".join(cells) + " |", flush=True)
    print()
    print("Wall: the median over the repeats; peak RSS: the largest; torch / CTranslate2: the median of the "
          "pairs' wall-time ratios (above 1: CTranslate2 is faster).")


if __name__ == "__main__":
    main()
