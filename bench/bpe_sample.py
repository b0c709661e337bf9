"""What BPE loses when it learns from a sample of the training pairs (tokenizer.sample_pairs).

    python bench/bpe_sample.py [--config configs/base.yaml] [--sizes 0 80000 20000 5000]

Reads and splits the config's data as train.py does, then trains the config's BPE on a seeded
sample of SIZE training pairs (0: all of them) for each size, and prints per size: the share of the
corpus sampled, the training time, subwords per sentence on the valid split (source and target:
a worse vocabulary splits words into more pieces), how many of its subwords the full-data
vocabulary also has, and the share of valid sentences split exactly as the full-data tokenizer
splits them. Translation quality is measured by training on each tokenizer (bench/README.md
shows the commands).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import datasets
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.config import load_config  # noqa: E402
from transformer.data.corpus import SOURCE, TARGET, load_pairs  # noqa: E402
from transformer.data.rows import iter_texts, sample_rows  # noqa: E402
from transformer.data.split import split_pairs  # noqa: E402
from transformer.data.tokenizer import train_tokenizers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/base.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 80_000, 20_000, 5_000],
                        help="sample sizes in pairs; 0 is every training pair (the reference)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if any(size < 0 for size in args.sizes):
        parser.error(f"--sizes: a sample size is 0 (every pair) or more, not {min(args.sizes)}")
    datasets.disable_progress_bars()
    config = load_config(args.config, args.overrides)
    pairs, _ = load_pairs(config.data)
    splits = split_pairs(pairs, config.data)
    n_train = len(splits.train)
    valid_source = list(iter_texts(splits.valid, SOURCE))
    valid_target = list(iter_texts(splits.valid, TARGET))
    print(f"{config.data.path}: {n_train} training pairs, {len(valid_source)} valid; BPE vocabulary "
          f"{config.tokenizer.vocab_size} ({'joint' if config.tokenizer.joint else 'separate'}), seed "
          f"{config.train.seed}")
    print("| sample | of the training pairs | BPE time | valid subwords/sentence (source / target) "
          "| vocabulary shared with all-data BPE | valid sentences split as all-data BPE splits them |")
    print("|---|---|---|---|---|---|")
    reference = None
    for size in args.sizes:
        rows = sample_rows(n_train, size, config.train.seed) if size else None
        started = time.perf_counter()
        tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE, rows=rows),
                                      iter_texts(splits.train, TARGET, rows=rows), config.tokenizer)
        seconds = time.perf_counter() - started
        source = tokenizers.encode_source(valid_source)
        target = tokenizers.encode_target(valid_target)
        pieces = [[tokenizers.source.id_to_token(i) for i in ids] for ids in source] + \
                 [[tokenizers.target.id_to_token(i) for i in ids] for ids in target]
        vocabulary = set(tokenizers.source.get_vocab()) | set(tokenizers.target.get_vocab())
        if reference is None:
            reference = (pieces, vocabulary)
        shared = len(vocabulary & reference[1]) / len(vocabulary)
        same = np.mean([a == b for a, b in zip(pieces, reference[0])])
        taken = rows.sum() if rows is not None else n_train
        print(f"| {'all' if not size else f'{size:,}'} | {taken / n_train:.1%} | {seconds:.1f} s "
              f"| {np.mean([len(s) for s in source]):.2f} / {np.mean([len(t) for t in target]):.2f} "
              f"| {shared:.1%} | {same:.1%} |")


if __name__ == "__main__":
    main()
