"""The whole training command on a corpus N times the shipped CSV: time of each stage and peak memory.

    python bench/scale.py --scale 30 [--steps 20] [--resume-steps 3] [--config configs/base.yaml]
                          [--data data/eng_-french.csv] [--work DIR] [--repo DIR] [--keep] [--nproc N]
                          [--corpora K]

Synthesises the Nx CSV (every row repeated N times, copy k > 0 with " (copy k)" appended to both
sides, so every pair stays its own group), then runs, as a subprocess in a fresh datasets cache and
a fresh run directory, `python train.py --config CONFIG --set data.path=Nx.csv --set
train.max_steps=STEPS --set train.log_every=1 --no-progress`, and then the resume: the same command
with max_steps raised by --resume-steps, on the cache and run the first one left.

Per run it prints the stages, read from the timestamps of train.log (start-up to the first line,
reading and cleaning, split, BPE, encoding and the training corpus, model and batch plan up to the
first step, the remaining steps and the final validation), with the main process's peak resident
memory during each; the peak RSS of the main process (VmHWM) with the peaks of its anonymous and file-backed parts (RssAnon, RssFile, sampled every 50
ms), the same for the largest worker process (datasets' map workers), and the size of the datasets
cache. RssFile is pages of memory-mapped files (Arrow, token ids) that the kernel may drop under
pressure; RssAnon is what the process really holds. Worker processes are forked, so their RssAnon
counts pages they still share with the main process; the whole command's memory is therefore also
sampled as the sum of PSS (proportional set size: a shared page split between its sharers) over every
process of the command, every 0.25 s, and printed per stage and at its peak.
--nproc 2 runs the same under `torchrun --standalone --nproc_per_node=2` and prints each training
process's peak and their sum.
--corpora K writes the same Nx rows as K corpora (copies 0 to N/K - 1 in the first, and so on) and
trains on them as data.corpora: the first held out (valid and test drawn from it) with weight 2,
the others with weight 0.5, so that a run draws and plans a weighted mix.
--repo runs train.py of another checkout (e.g. `git worktree add /tmp/before main`) to compare.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_memory import write_scaled_csv  # noqa: E402

MIB = 1024 * 1024

# (stage name, pattern of the train.log line that ends it); a stage missing from a run (a resume
# trains no BPE) is skipped, and its time counts in the next one found.
STAGES = (
    ("start-up (imports)", r"INFO transformer\.data\.\w+: reading "),  # pairs.py before, corpus.py now
    ("read + clean", r"sentence pairs$"),
    ("split", r"split by groups"),
    ("BPE", r"trained (joint|separate) BPE|tokenizers: reusing"),
    ("encode + corpus", r"INFO transformer\.training\.run: model: "),
    ("model + batch plan -> step 1", r"the first step of this session"),
    ("steps 2.. + validation", r"trainer: step \d+  valid"),
)


@dataclass
class Peak:
    hwm: int = 0  # VmHWM, bytes
    anon: int = 0
    file: int = 0


@dataclass
class Sampler:
    """Polls /proc/<pid>/status of a process and every descendant until stopped. With `ranks`, the
    process is torchrun's launcher and its children are the training processes: each gets its own
    peaks, and the timeline sums them."""

    pid: int
    ranks: bool = False
    main: Peak = field(default_factory=Peak)
    workers: Peak = field(default_factory=Peak)  # the largest of each figure over the worker processes
    n_workers: int = 0
    rank_peaks: dict[int, Peak] = field(default_factory=dict)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (time, RssAnon, RssFile) of training
    # (time, PSS summed over the command's processes: launcher, training processes, workers)
    tree: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._seen: set[int] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _status(pid: int) -> dict[str, int]:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return {}
        values = {}
        for key in ("VmHWM", "RssAnon", "RssFile"):
            match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
            if match:
                values[key] = int(match.group(1)) * 1024
        return values

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            return 0
        match = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
        return int(match.group(1)) * 1024 if match else 0

    @property
    def tree_peak(self) -> int:
        return max((pss for _, pss in self.tree), default=0)

    @staticmethod
    def _add(peak: Peak, values: dict[str, int]) -> None:
        peak.hwm = max(peak.hwm, values.get("VmHWM", 0))
        peak.anon = max(peak.anon, values.get("RssAnon", 0))
        peak.file = max(peak.file, values.get("RssFile", 0))

    def _run(self) -> None:
        polls = 0
        while not self._stop.is_set():
            try:
                children = psutil.Process(self.pid).children(recursive=True)
                direct = {child.pid for child in psutil.Process(self.pid).children()} if self.ranks else set()
            except psutil.Error:
                children, direct = [], set()
            status = self._status(self.pid)
            self._add(self.main, status)
            training = [status] if not self.ranks else []
            for child in children:
                child_status = self._status(child.pid)
                if child.pid in direct:
                    self._add(self.rank_peaks.setdefault(child.pid, Peak()), child_status)
                    training.append(child_status)
                else:
                    self._seen.add(child.pid)
                    self._add(self.workers, child_status)
            if any(training):
                self.timeline.append((time.time(), sum(s.get("RssAnon", 0) for s in training),
                                      sum(s.get("RssFile", 0) for s in training)))
            if polls % 5 == 0:  # PSS walks the page tables: costlier than status, so less often
                self.tree.append((time.time(), self._pss(self.pid) + sum(self._pss(c.pid) for c in children)))
            polls += 1
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.n_workers = len(self._seen)


def _log_time(line: str) -> float:
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def stage_times(log: Path, offset: int, started: float, ended: float) -> list[tuple[str, float, float]]:
    """(stage, seconds, time it ended) from the lines train.log gained after byte `offset`."""
    lines = log.read_bytes()[offset:].decode("utf-8").splitlines()
    stamped = [(line, _log_time(line)) for line in lines if re.match(r"\d{4}-\d\d-\d\d ", line)]
    times, previous, position = [], started, 0
    for name, pattern in STAGES:
        for index in range(position, len(stamped)):
            if re.search(pattern, stamped[index][0]):
                times.append((name, stamped[index][1] - previous, stamped[index][1]))
                previous, position = stamped[index][1], index + 1
                break
    times.append(("exit", ended - previous, ended))
    return times


def directory_size(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def run_train(command: list[str], env: dict[str, str], run_dir: Path, cwd: Path) -> dict:
    log = run_dir / "train.log"
    offset = log.stat().st_size if log.exists() else 0
    started = time.time()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = Sampler(process.pid, ranks=command[1:3] == ["-m", "torch.distributed.run"])
    _, stderr = process.communicate()
    ended = time.time()
    sampler.stop()
    if process.returncode:
        sys.exit(f"train.py failed ({process.returncode}):\n{stderr.decode()[-3000:]}")
    stages = stage_times(log, offset, started, ended)
    # The time budget's own measurement of a step (its log line), to see that steps do not slow with the corpus.
    step = re.findall(r"at ([0-9.]+) s a step \(measured over (\d+) steps\)", log.read_bytes()[offset:].decode("utf-8"))
    first_step = sum(seconds for name, seconds, _ in stages[: [n for n, _, _ in stages].index(STAGES[5][0]) + 1]) \
        if any(name == STAGES[5][0] for name, _, _ in stages) else float("nan")
    return {"stages": stages, "wall": ended - started, "first_step": first_step, "sampler": sampler,
            "step": step[-1] if step else None}


def report(title: str, result: dict, cache: Path) -> None:
    sampler: Sampler = result["sampler"]
    print(f"\n== {title}")
    who = "the ranks together" if sampler.ranks else "main process"
    print(f"  {'stage':32s} {'time':>10s}   {who + ' during it, peak of:':>33s} RssAnon  RssFile  their sum"
          "   all processes' PSS")
    for name, seconds, end in result["stages"]:
        during = [(anon, file) for at, anon, file in sampler.timeline if end - seconds <= at <= end]
        peaks = (f"{max(a for a, _ in during) / MIB:7.0f}  {max(f for _, f in during) / MIB:7.0f}  "
                 f"{max(a + f for a, f in during) / MIB:7.0f}") if during else f"{'(no sample)':>25s}"
        tree = [pss for at, pss in sampler.tree if end - seconds <= at <= end]
        print(f"  {name:32s} {seconds:8.1f} s   {'':33s}{peaks}   {max(tree) / MIB if tree else float('nan'):9.0f}")
    print(f"  {'wall':32s} {result['wall']:8.1f} s   (to step 1: {result['first_step']:.1f} s)")
    if result["step"]:
        print(f"  a training step: {result['step'][0]} s (train.py's time budget, measured over {result['step'][1]} steps)")
    main, workers = sampler.main, sampler.workers
    for number, (pid, peak) in enumerate(sorted(sampler.rank_peaks.items())):
        print(f"  training process {number} (pid {pid}): peak RSS {peak.hwm / MIB:8.0f} MiB   RssAnon peak "
              f"{peak.anon / MIB:6.0f} MiB   RssFile peak {peak.file / MIB:6.0f} MiB")
    if sampler.rank_peaks:
        print(f"  the training processes' peak RSS summed: {sum(p.hwm for p in sampler.rank_peaks.values()) / MIB:.0f} MiB")
    print(f"  main process: peak RSS {main.hwm / MIB:8.0f} MiB   RssAnon peak {main.anon / MIB:6.0f} MiB   "
          f"RssFile peak {main.file / MIB:6.0f} MiB")
    if sampler.n_workers:
        print(f"  {sampler.n_workers} worker processes, the largest: peak RSS {workers.hwm / MIB:6.0f} MiB   "
              f"RssAnon {workers.anon / MIB:6.0f} MiB   RssFile {workers.file / MIB:6.0f} MiB")
    print(f"  the whole command (every process, PSS summed): peak {sampler.tree_peak / MIB:8.0f} MiB")
    print(f"  datasets cache: {directory_size(cache) / MIB:8.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume-steps", type=int, default=3, help="steps the resume adds (0: no resume)")
    parser.add_argument("--config", default="configs/base.yaml")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "eng_-french.csv", help="the 1x CSV")
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose train.py runs")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--nproc", type=int, default=1,
                        help="training processes: more than 1 runs train.py under torchrun (gloo on a CPU)")
    parser.add_argument("--corpora", type=int, default=1, help="the rows as this many weighted corpora")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="more config overrides for both runs")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        bf16 = ", avx512_bf16" if re.search(r"\bavx512_bf16\b", Path("/proc/cpuinfo").read_text()) else ""
        print(f"CPU: {cpu}, {len(os.sched_getaffinity(0))} cores{bf16}; train.py of {args.repo.resolve()}")
        started = time.time()
        if args.corpora > 1:
            if args.scale % args.corpora:
                sys.exit("error: --scale must be a multiple of --corpora")
            each = args.scale // args.corpora
            parts = [work / f"x{args.scale}-part{k}.csv" for k in range(args.corpora)]
            for k, part in enumerate(parts):
                write_scaled_csv(args.data, part, each, first_copy=k * each)
            corpora = ", ".join(f"{{path: '{part}', weight: {2 if k == 0 else 0.5}, held_out: {str(k == 0).lower()}}}"
                                for k, part in enumerate(parts))
            data_sets = [f"data.corpora=[{corpora}]"]
        else:
            parts = [work / f"x{args.scale}.csv"]
            if args.scale == 1:
                shutil.copy(args.data, parts[0])
            else:
                write_scaled_csv(args.data, parts[0], args.scale)
            data_sets = [f"data.path={parts[0]}"]
        rows = sum(sum(1 for _ in part.open("rb")) - 1 for part in parts)
        print(f"{args.scale}x corpus: {rows} rows in {len(parts)} file(s), "
              f"{sum(part.stat().st_size for part in parts) / MIB:.0f} MiB CSV (written in {time.time() - started:.0f} s)")
        cache, run_dir = work / "datasets-cache", work / "run"
        env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(args.repo.resolve())}
        sets = [*data_sets, "train.log_every=1", *args.overrides]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"] \
            if args.nproc > 1 else [sys.executable]
        command = [*launcher, "train.py", "--config", str((ROOT / args.config).resolve())
                   if not Path(args.config).is_absolute() else args.config,
                   "--run-dir", str(run_dir), "--no-progress"]
        first = run_train(command + [w for s in sets + [f"train.max_steps={args.steps}"] for w in ("--set", s)],
                          env, run_dir, args.repo)
        report(f"{args.scale}x: a new run to step {args.steps}", first, cache)
        if args.resume_steps:
            steps = args.steps + args.resume_steps
            resumed = run_train(command + [w for s in sets + [f"train.max_steps={steps}"] for w in ("--set", s)],
                                env, run_dir, args.repo)
            report(f"{args.scale}x: the resume, to step {steps}", resumed, cache)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
