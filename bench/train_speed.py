"""Training throughput of a config's model on real batches from its CSV.

    python bench/train_speed.py --config configs/small.yaml [--precision bf16] [--batch-tokens 4096]

Times full training steps (forward, backward, clipping, Adam) after warm-up steps and prints
target tokens/s (real target tokens including EOS, as JoeyNMT and fairseq count them) and
source+target tokens/s as medians over repeats, the padding share of the batches, peak RSS,
and model FLOP utilisation against a matmul peak measured here at the same precision.
The last line is `tokens/s: N` (target tokens per second).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.batching import PairCorpus  # noqa: E402
from transformer.config import load_config  # noqa: E402
from transformer.data import SOURCE, TARGET, encode_splits, iter_texts, load_pairs, split_pairs  # noqa: E402
from transformer.loss import batch_loss  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.optim import build_optimizer  # noqa: E402
from transformer.runtime import autocast, seed_everything  # noqa: E402
from transformer.tokenizer import load_tokenizers, train_tokenizers  # noqa: E402


def matmul_peak(precision: str, size: int = 2048, repeats: int = 10) -> float:
    """Best-of-N GFLOP/s of one (size x size) @ (size x size) matmul at `precision`."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def step_flops(model: Transformer, src_tokens: int, tgt_tokens: int, src_pairs: float) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward).

    src_pairs = sum over sentences of S*T (attention score and mixing work of cross-attention);
    self-attention work is approximated the same way with S*S and T*T inside it.
    """
    c = model.config
    d, ff = c.d_model, c.d_ff
    encoder = c.n_encoder_layers * src_tokens * 2 * (4 * d * d + 2 * d * ff)
    decoder = c.n_decoder_layers * (tgt_tokens * 2 * (6 * d * d + 2 * d * ff) + src_tokens * 2 * 2 * d * d)
    attention = 4 * d * src_pairs  # QK^T and AV, summed over layers by the caller's src_pairs
    output = tgt_tokens * 2 * d * model.tgt_vocab_size
    return 3 * (encoder + decoder + attention + output)


def attention_pairs(batch, model: Transformer) -> float:
    c = model.config
    s = (batch.src != 0).sum(1).double()
    t = (batch.tgt_out != 0).sum(1).double()
    per_sentence = c.n_encoder_layers * s * s + c.n_decoder_layers * (t * (t + 1) / 2 + t * s)
    return float(per_sentence.sum())


def load_corpus(config, tokenizer_dir: Path | None) -> tuple[PairCorpus, int, int]:
    pairs, _ = load_pairs(config.data)
    splits = split_pairs(pairs, config.data)
    if tokenizer_dir is not None:
        tokenizers = load_tokenizers(tokenizer_dir)
    else:
        tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE), iter_texts(splits.train, TARGET),
                                      config.tokenizer)
    encoded = encode_splits(splits, tokenizers, config.data.max_length)
    return PairCorpus.from_dataset(encoded.train), tokenizers.source_vocab_size, tokenizers.target_vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: the config's")
    parser.add_argument("--batch-tokens", type=int, help="default: the config's")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer-dir", type=Path, help="reuse a run's tokenizer/ instead of training one")
    args = parser.parse_args()

    config = load_config(args.config)
    train = config.train
    train = dataclasses.replace(train, precision=args.precision or train.precision,
                                batch_tokens=args.batch_tokens or train.batch_tokens)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")

    corpus, src_vocab, tgt_vocab = load_corpus(config, args.tokenizer_dir)
    seed_everything(train.seed)
    model = Transformer(config.model, src_vocab, tgt_vocab)
    optimizer = build_optimizer(model, train)
    batches = corpus.batches(train.batch_tokens, train.seed, epoch=0)
    needed = args.warmup + args.steps * args.repeats
    if len(batches) < needed:
        raise SystemExit(f"only {len(batches)} batches; lower --steps/--repeats")

    real = padded = 0
    for indices in batches:
        s, t = corpus.src_lengths[indices] + 1, corpus.tgt_lengths[indices] + 1
        real += int(s.sum() + t.sum())
        padded += len(indices) * int(s.max() + t.max())
    padding_share = 1 - real / padded

    def step(batch) -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, train.precision):
            loss, _ = batch_loss(model, batch, train.label_smoothing)
        (loss / batch.n_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad_norm or float("inf"))
        optimizer.step()

    order = iter(batches)
    for _ in range(args.warmup):
        step(corpus.batch(next(order)))
    target_rates, total_rates, flop_rates = [], [], []
    for _ in range(args.repeats):
        tgt = src = 0
        flops = 0.0
        elapsed = 0.0
        for _ in range(args.steps):
            batch = corpus.batch(next(order))  # building the batch is part of a real step
            start = time.perf_counter()
            step(batch)
            elapsed += time.perf_counter() - start
            tgt += batch.n_tgt_tokens
            src += batch.n_src_tokens
            flops += step_flops(model, batch.n_src_tokens, batch.n_tgt_tokens, attention_pairs(batch, model))
        target_rates.append(tgt / elapsed)
        total_rates.append((src + tgt) / elapsed)
        flop_rates.append(flops / elapsed / 1e9)

    peak = matmul_peak(train.precision)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    achieved = statistics.median(flop_rates)
    print(f"config: {args.config}  precision: {train.precision}  batch_tokens: {train.batch_tokens}  "
          f"threads: {torch.get_num_threads()}  batches timed: {args.steps} x {args.repeats}")
    print(f"padding share of batch tokens: {padding_share:.1%}")
    print(f"target tokens/s per repeat: {', '.join(f'{r:.0f}' for r in target_rates)}")
    print(f"source+target tokens/s (median): {statistics.median(total_rates):.0f}")
    print(f"model FLOP/s: {achieved:.1f} GFLOP/s; matmul peak ({train.precision}, 2048^2): {peak:.0f} GFLOP/s; "
          f"MFU {achieved / peak:.1%}")
    print(f"peak RSS: {rss_gib:.2f} GiB")
    print(f"tokens/s: {statistics.median(target_rates):.0f}")


if __name__ == "__main__":
    main()
