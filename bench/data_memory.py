"""Peak memory of the data stage on the shipped CSV (1x) and on a synthetic copy N times its size.

    python bench/data_memory.py [--scale 10] [--data data/eng_-french.csv] [--repo DIR]

The data stage is what a run does before the model exists: load_pairs -> split_pairs ->
encode_splits -> corpus_of -> token_batches for one epoch. Each corpus is measured
in a fresh Python process with its own empty datasets cache, so its RSS is its own and nothing is
read from an earlier cache. The Nx CSV repeats every row N times, appending " (copy k)" to both
sides of the k-th copy so that every English sentence stays a distinct group.

The BPE tokenizer is trained once, here, on the 1x corpus, and its files are reused by both
measurements: the figures are the data path's, not the BPE trainer's (whose memory follows the
number of distinct words, which the copies barely change).

Prints, per corpus: pairs, wall seconds by step, RSS after the imports, peak RSS of the process,
what the data stage added to it, the peak RSS of map worker processes (from rows.PARALLEL_ROWS
rows on, cleaning and encoding run in one process per CPU; each worker's RSS is its own), and the
sizes of the CSV and of the datasets cache it left (all in MB). The last line is `peak RSS Nx/1x: R`.
--repo imports `transformer` from another checkout in the measuring processes (e.g. one made with
`git worktree add /tmp/before HEAD`), to compare versions on the same tokenizer.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("load", "split", "encode", "corpus", "batches")


def _peak_rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


class RssSampler:
    """Peak anonymous and file-backed RSS, sampled from /proc/self/status (Linux) every 10 ms.

    ru_maxrss counts both. File-backed pages are the memory-mapped Arrow files datasets reads:
    clean page cache that the kernel drops under memory pressure. Anonymous pages (Python objects,
    numpy arrays, Arrow buffers built in memory) are what the process really holds.
    """

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        try:
            lines = Path("/proc/self/status").read_text().splitlines()
        except OSError:  # not Linux: the peaks stay 0 and are shown as "-"
            return
        for line in lines:
            key, _, value = line.partition(":")
            if key in self.peak:
                self.peak[key] = max(self.peak[key], int(value.split()[0]) / 1024)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def write_scaled_csv(source: Path, target: Path, scale: int, first_copy: int = 0) -> None:
    """`source` repeated `scale` times, streamed (never held in memory); copy k > 0 gets " (copy k)",
    the copies numbered from `first_copy`."""
    csv.field_size_limit(sys.maxsize)
    with target.open("w", encoding="utf-8", newline="") as out:
        writer = csv.writer(out)
        for copy in range(first_copy, first_copy + scale):
            with source.open(encoding="utf-8-sig", newline="") as handle:
                rows = csv.reader(handle)
                header = next(rows)
                if copy == first_copy:
                    writer.writerow(header)
                suffix = f" (copy {copy})" if copy else ""
                writer.writerows([field + suffix for field in row] if suffix else row for row in rows)


def measure(data: Path, tokenizer_dir: Path, cache_dir: Path, batch_tokens: int) -> dict:
    """Run the data stage once in this process; called in a fresh process (--child)."""
    import datasets

    from transformer.config import DataConfig
    from transformer.data.corpus import load_pairs
    from transformer.data.encode import corpus_of, encode_splits
    from transformer.data.split import split_pairs
    from transformer.data.tokenizer import load_tokenizers

    datasets.disable_progress_bars()
    rss_imports = _peak_rss_mb(resource.RUSAGE_SELF)
    imports = RssSampler()
    imports.sample()
    config = DataConfig(path=str(data))
    tokenizers = load_tokenizers(tokenizer_dir)
    seconds, peaks, anon_peaks, start = {}, {}, {}, time.perf_counter()
    sampler = RssSampler()

    def lap(step: str) -> None:
        nonlocal start
        seconds[step] = time.perf_counter() - start
        peaks[step] = _peak_rss_mb(resource.RUSAGE_SELF)
        sampler.sample()
        anon_peaks[step] = sampler.peak["RssAnon"]
        start = time.perf_counter()

    with sampler:
        pairs, _ = load_pairs(config)  # into HF_DATASETS_CACHE, which run_child set to `cache_dir`
        lap("load")
        splits = split_pairs(pairs, config)
        lap("split")
        encoded = encode_splits(splits, tokenizers, config.max_length)
        lap("encode")
        corpus = corpus_of(encoded.train)
        lap("corpus")
        batches = corpus.batches(batch_tokens, seed=42, epoch=0)
        lap("batches")
    return {"pairs": len(pairs), "train_pairs": len(corpus), "batches": len(batches), "seconds": seconds,
            "peak_after_step_mb": peaks, "anon_peak_after_step_mb": anon_peaks,
            "rss_imports_mb": rss_imports, "peak_rss_mb": _peak_rss_mb(resource.RUSAGE_SELF),
            "anon_imports_mb": imports.peak["RssAnon"], "peak_anon_mb": sampler.peak["RssAnon"],
            "peak_file_mb": sampler.peak["RssFile"],
            "worker_peak_rss_mb": _peak_rss_mb(resource.RUSAGE_CHILDREN),
            "cache_mb": sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) / 2**20,
            "file_mb": data.stat().st_size / 2**20}


def run_child(data: Path, tokenizer_dir: Path, work: Path, repo: Path, batch_tokens: int) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="datasets-cache-", dir=work))
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, __file__, "--child", "--data", str(data), "--tokenizer", str(tokenizer_dir),
               "--cache", str(cache), "--repo", str(repo), "--batch-tokens", str(batch_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"measuring {data} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_tokenizer_once(data: Path, work: Path) -> Path:
    """BPE on the 1x corpus's training split, with the default tokenizer config, saved under `work`."""
    import datasets

    from transformer.config import DataConfig, TokenizerConfig
    from transformer.data.corpus import SOURCE, TARGET, load_pairs
    from transformer.data.rows import iter_texts
    from transformer.data.split import split_pairs
    from transformer.data.tokenizer import save_tokenizers, train_tokenizers

    datasets.config.HF_DATASETS_CACHE = work / "tokenizer-cache"  # this process's cache, away from the user's
    config = DataConfig(path=str(data))
    pairs, _ = load_pairs(config)
    splits = split_pairs(pairs, config)
    tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE), iter_texts(splits.train, TARGET),
                                  TokenizerConfig())
    save_tokenizers(tokenizers, work / "tokenizer")
    return work / "tokenizer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "eng_-french.csv", help="the 1x CSV")
    parser.add_argument("--scale", type=int, default=10, help="size of the synthetic corpus, in copies of --data")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="token budget of a batch (train.batch_tokens)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="checkout whose `transformer` is measured")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # The measuring processes import `transformer` from --repo; this one (the tokenizer) from here.
    sys.path.insert(0, str((args.repo if args.child else ROOT).resolve()))
    if args.child:
        print(json.dumps(measure(args.data, args.tokenizer, args.cache, args.batch_tokens)))
        return

    with tempfile.TemporaryDirectory(prefix="data-memory-") as tmp:
        work = Path(tmp)
        scaled = work / f"x{args.scale}.csv"
        write_scaled_csv(args.data, scaled, args.scale)
        start = time.perf_counter()
        tokenizer_dir = train_tokenizer_once(args.data, work)
        print(f"data stage: load_pairs -> split_pairs -> encode_splits -> PairCorpus -> token_batches (1 epoch, "
              f"batch_tokens {args.batch_tokens}); transformer from {args.repo.resolve()}")
        print(f"tokenizer: trained once on the 1x corpus ({time.perf_counter() - start:.0f} s, not measured), "
              "its files reused by both measurements")
        print("each corpus in a fresh process with an empty datasets cache; RSS in MB\n")
        results = {}
        for label, data in (("1x", args.data), (f"{args.scale}x", scaled)):
            results[label] = run_child(data, tokenizer_dir, work, args.repo.resolve(), args.batch_tokens)
        header = (f"{'corpus':<7}{'pairs':>11}{'train':>11}{'wall s':>8}  "
                  + " ".join(f"{step:>7}" for step in STEPS)
                  + f"{'RSS imports':>13}{'peak RSS':>10}{'data stage':>12}{'workers':>9}{'file':>7}{'cache':>7}")
        print(header)
        for label, r in results.items():
            wall = sum(r["seconds"].values())
            steps = " ".join(f"{r['seconds'][step]:>7.1f}" for step in STEPS)
            workers = f"{r['worker_peak_rss_mb']:>9.0f}" if r["worker_peak_rss_mb"] else f"{'-':>9}"
            print(f"{label:<7}{r['pairs']:>11,}{r['train_pairs']:>11,}{wall:>8.1f}  {steps}"
                  f"{r['rss_imports_mb']:>13.0f}{r['peak_rss_mb']:>10.0f}"
                  f"{r['peak_rss_mb'] - r['rss_imports_mb']:>12.0f}{workers}{r['file_mb']:>7.0f}{r['cache_mb']:>7.0f}")
        print(f"\npeak RSS, all / anonymous (MB), of the process by the end of each step:\n{'corpus':<7}"
              + "".join(f"{step:>13}" for step in STEPS))
        for label, r in results.items():
            print(f"{label:<7}" + "".join(f"{r['peak_after_step_mb'][step]:>7.0f} /{r['anon_peak_after_step_mb'][step]:>4.0f}"
                                          for step in STEPS))
        print(f"\nof which (sampled every 10 ms from /proc/self/status): anonymous = what the process holds; "
              "file-backed = memory-mapped\nArrow pages (clean page cache the kernel can drop)\n"
              f"{'corpus':<7}{'anon imports':>13}{'peak anon':>11}{'data stage':>12}{'peak file-backed':>18}")
        for label, r in results.items():
            print(f"{label:<7}{r['anon_imports_mb']:>13.0f}{r['peak_anon_mb']:>11.0f}"
                  f"{r['peak_anon_mb'] - r['anon_imports_mb']:>12.0f}{r['peak_file_mb']:>18.0f}")
        small, large = results["1x"], results[f"{args.scale}x"]
        growth = ((large["peak_rss_mb"] - large["rss_imports_mb"])
                  / max(small["peak_rss_mb"] - small["rss_imports_mb"], 1e-9))
        anon_growth = ((large["peak_anon_mb"] - large["anon_imports_mb"])
                       / max(small["peak_anon_mb"] - small["anon_imports_mb"], 1e-9))
        print(f"\npairs {args.scale}x/1x: {large['pairs'] / small['pairs']:.2f}; "
              f"data-stage RSS {args.scale}x/1x: {growth:.2f} (anonymous: {anon_growth:.2f}); "
              f"peak anonymous RSS {args.scale}x/1x: {large['peak_anon_mb'] / max(small['peak_anon_mb'], 1e-9):.2f}")
        print(f"peak RSS {args.scale}x/1x: {large['peak_rss_mb'] / small['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()
