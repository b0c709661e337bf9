"""Where a training run's memory goes over time: run `train.py` in this process and sample, every
--every seconds, the resident set (VmRSS), glibc's heap (in use and free inside it, from mallinfo2)
and the optimiser step reached. Writes a CSV and prints a summary: the resident set at a few
steps, and at the peak how much of the heap held live blocks.

    python bench/memory_timeline.py --out /tmp/rss.csv -- --config configs/base.yaml \\
        --run-dir /tmp/rss-run --no-progress --set train.max_minutes=0 --set train.max_steps=1500

Everything after `--` goes to train.py, so the command measured is the one a user runs (with its
allocator setting and oneDNN cache). On glibc only (mallinfo2, glibc 2.33 or newer); elsewhere the
heap columns are empty.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import runpy
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.hardware import onednn_cache_setting  # noqa: E402 (no torch: before torch loads)

os.environ.setdefault(*onednn_cache_setting())  # as train.py does, before torch loads
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

FIELDS = ["seconds", "step", "rss_mib", "heap_mib", "heap_in_use_mib", "heap_free_mib", "mmapped_mib"]


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def heap_reader():
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    return mallinfo2


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Sampler:
    def __init__(self, every: float):
        self.every = every
        self.step = 0
        self.rows: list[dict] = []
        self.heap = heap_reader()
        self.start = time.perf_counter()
        self.stopped = threading.Event()
        register_optimizer_step_post_hook(self.count_step)

    def count_step(self, *_args) -> None:
        self.step += 1

    def sample(self) -> None:
        row = {"seconds": round(time.perf_counter() - self.start, 1), "step": self.step,
               "rss_mib": round(resident_mib(), 1)}
        if self.heap is not None:
            info = self.heap()
            mib = 2**20
            row |= {"heap_mib": round(info.arena / mib, 1), "heap_in_use_mib": round(info.uordblks / mib, 1),
                    "heap_free_mib": round(info.fordblks / mib, 1), "mmapped_mib": round(info.hblkhd / mib, 1)}
        self.rows.append(row)

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.sample()


def summary(rows: list[dict]) -> list[str]:
    lines = []
    peak = max(rows, key=lambda row: row["rss_mib"])
    marks = sorted({250, 500, 1000, 2000, 4000, 8000, rows[-1]["step"]})
    for mark in marks:
        at = next((row for row in rows if row["step"] >= mark), None)
        if at is not None:
            lines.append(f"step {at['step']:>6}: resident {at['rss_mib']:8.1f} MiB")
    lines.append(f"peak resident {peak['rss_mib']:.0f} MiB at step {peak['step']}")
    if "heap_mib" in peak:
        lines.append(f"  glibc heap there: {peak['heap_mib']:.0f} MiB, of which live blocks "
                     f"{peak['heap_in_use_mib']:.0f} MiB and free blocks kept {peak['heap_free_mib']:.0f} MiB; "
                     f"mmapped blocks {peak['mmapped_mib']:.0f} MiB")
    return lines


def positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=positive_seconds, default=2.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, required=True, help="the CSV of samples")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    args = parser.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not args.out.parent.is_dir():  # said now, not after the whole run
        parser.error(f"--out {args.out}: no such directory {args.out.parent}")

    sampler = Sampler(args.every)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    sys.argv = [str(ROOT / "train.py"), *train_args]
    status = 0
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sampler.sample()
        sampler.stopped.set()
    with args.out.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(sampler.rows)
    for line in summary(sampler.rows):
        print(line)
    sys.exit(status)


if __name__ == "__main__":
    main()
