"""How fast a run's tokenizer encodes the training text, per call style and batch size: the Rust
tokenizer's `encode_batch` against `encode_batch_fast` (the same ids, no character offsets), in
calls of N texts, as the data stage uses it (ids taken out as Python lists).

    python bench/encode_speed.py --run runs/base [--data data/eng_-french.csv] [--rows 160000] [--repeats 5]

Times the target side of the first --rows rows of the CSV; median of --repeats. Run it twice to see
both settings the data stage meets: as is (the tokenizer's threads over all cores, as in the main
process) and with TOKENIZERS_PARALLELISM=false (one thread, as in datasets' worker processes).
Checks that every variant gives the same ids.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.data.tokenizer import load_tokenizers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a run directory (its tokenizer is used)")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "eng_-french.csv")
    parser.add_argument("--rows", type=int, default=160_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer = load_tokenizers(RunDirectory(args.run).tokenizer_dir).target
    with args.data.open(encoding="utf-8", newline="") as handle:
        texts = [row[1] for row in itertools.islice(csv.reader(handle), 1, args.rows + 1)]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    print(f"CPU: {cpu}, {os.cpu_count()} cores; TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}; "
          f"{len(texts)} target texts of {args.data.name}")

    reference = None
    for method in ("encode_batch", "encode_batch_fast"):
        encode = getattr(tokenizer, method)
        for size in (32, 256, 1000, 10_000):
            def run() -> list[list[int]]:
                return [encoding.ids for start in range(0, len(texts), size)
                        for encoding in encode(texts[start: start + size], add_special_tokens=False)]

            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                ids = run()
                times.append(time.perf_counter() - started)
            reference = reference if reference is not None else ids
            same = "same ids" if ids == reference else "DIFFERENT IDS"
            median = statistics.median(times)
            print(f"  {method:18s} {size:6d} texts a call: {median:6.2f} s  "
                  f"({median / len(texts) * 1e6:5.1f} µs a text)  {same}")


if __name__ == "__main__":
    main()
