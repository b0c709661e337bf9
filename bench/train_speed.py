"""Training throughput of a config's model on real batches from its CSV.

    python bench/train_speed.py --config configs/small.yaml [--precision bf16] [--batch-tokens 4096]
    python bench/train_speed.py --config configs/small.yaml --levers    # each speed lever's effect

Times full training steps (forward, backward, clipping, Adam) after warm-up steps and prints
target tokens/s (real target tokens including EOS, as JoeyNMT and fairseq count them) and
source+target tokens/s as medians over repeats, the padding share of the batches, peak RSS,
and model FLOP utilisation against a matmul peak measured here at the same precision.
With --levers it first times each speed lever against the default, on the same batches, by
switching one thing off (or on) at a time.
The last line is `tokens/s: N` (target tokens per second).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import dataclasses
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from transformer.hardware import onednn_cache_setting  # noqa: E402

os.environ.setdefault(*onednn_cache_setting())  # as train.py does, before torch loads oneDNN

from transformer.training.allocator import reuse_freed_memory  # noqa: E402
from transformer.data.batching import PairCorpus  # noqa: E402
from transformer.config import load_config  # noqa: E402
from transformer.data.corpus import SOURCE, TARGET, load_pairs  # noqa: E402
from transformer.data.encode import corpus_of, encode_splits  # noqa: E402
from transformer.data.rows import iter_texts  # noqa: E402
from transformer.data.split import split_pairs  # noqa: E402
from transformer.data.batching import Batch  # noqa: E402
from transformer.training.loss import TrainingLoss, batch_loss  # noqa: E402
import transformer.model  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.training.optim import build_optimizer, learning_rate  # noqa: E402
from transformer.training.row_padding import ROW_MULTIPLE, pad_linear_rows  # noqa: E402
from transformer.runtime import autocast, fast_bf16, resolve_precision, seed_everything  # noqa: E402
from transformer.data.tokenizer import PAD_ID  # noqa: E402
from transformer.data.tokenizer import load_tokenizers, train_tokenizers  # noqa: E402


def matmul_peak(precision: str, size: int = 2048, repeats: int = 10) -> float:
    """Best-of-N GFLOP/s of one (size x size) @ (size x size) matmul at `precision`."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    best = float("inf")
    for _ in range(3 + repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        if best > 1.0:  # emulated bf16 (no AMX / AVX-512-BF16) takes about a minute a matmul: one is enough
            break
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
    return corpus_of(encoded.train), tokenizers.source_vocab_size, tokenizers.target_vocab_size


def padding_share(corpus: PairCorpus, batches: list[np.ndarray], multiple: int = 1) -> float:
    """Share of padding among the source + target positions of the padded batches, lengths padded up
    to a multiple of `multiple`."""
    real = padded = 0
    for indices in batches:
        s, t = corpus.src_lengths[indices] + 1, corpus.tgt_lengths[indices] + 1
        real += int(s.sum() + t.sum())
        padded += len(indices) * (-(-int(s.max()) // multiple) + -(-int(t.max()) // multiple)) * multiple
    return 1 - real / padded


def padded(batch: Batch, multiple: int) -> Batch:
    """`batch` with its lengths padded up to a multiple of `multiple` (--pad-multiple: fewer distinct
    shapes for oneDNN's kernels, more padding)."""
    def pad(tensor: torch.Tensor) -> torch.Tensor:
        return F.pad(tensor, (0, -tensor.shape[1] % multiple), value=PAD_ID)
    return Batch(pad(batch.src), pad(batch.tgt_in), pad(batch.tgt_out))


def batch_shapes(corpus: PairCorpus, batches, multiple: int = 1) -> int:
    """Distinct (sentences, source length, target length) shapes among `batches`, lengths padded up to a
    multiple of `multiple`: in bf16 on a CPU, oneDNN compiles kernels for each new shape."""
    src_lengths, tgt_lengths = corpus.src_lengths, corpus.tgt_lengths
    shapes = {(len(indices), -(-(int(src_lengths[indices].max()) + 1) // multiple),
               -(-(int(tgt_lengths[indices].max()) + 1) // multiple)) for indices in batches}
    return len(shapes)


def unbucketed_batches(corpus: PairCorpus, batch_tokens: int, seed: int) -> list[np.ndarray]:
    """Batches of the same token budget over randomly ordered pairs: no length bucketing."""
    order = np.random.default_rng(seed).permutation(len(corpus))
    longest = np.maximum(corpus.src_lengths, corpus.tgt_lengths)[order] + 1
    batches, start, width = [], 0, 0
    for position in range(len(order)):
        width = max(width, int(longest[position]))
        if position > start and width * (position - start + 1) > batch_tokens:
            batches.append(order[start:position])
            start, width = position, int(longest[position])
    batches.append(order[start:])
    return batches


# --------------------------------------------------------------------------- the levers switched off


def naive_attention(q, k, v, attn_mask=None, is_causal=False, **_):
    """Attention as tutorials write it: explicit scores, masked_fill, softmax, matmul."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class HandFusedCrossEntropy(torch.autograd.Function):
    """The label-smoothed loss of earlier versions of transformer/training/loss.py: its own backward pass,
    three passes over the (tokens x vocabulary) logits. Kept here to measure what F.cross_entropy
    costs against it (the lever "hand-fused loss")."""

    @staticmethod
    def forward(ctx, logits, targets, eps):
        lse = torch.logsumexp(logits, dim=-1)
        nll = lse - logits.gather(1, targets[:, None]).squeeze(1)
        loss = nll if eps == 0.0 else (1.0 - eps) * nll + eps * (lse - logits.mean(dim=-1))
        ctx.save_for_backward(logits, targets, lse)
        ctx.eps = eps
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return loss.sum(), nll_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        logits, targets, lse = ctx.saved_tensors
        eps, vocab = ctx.eps, logits.shape[-1]
        grad = torch.sub(logits, lse[:, None]).exp_()
        if eps:
            grad.sub_(eps / vocab)
        grad.scatter_add_(1, targets[:, None], grad.new_full((len(targets), 1), -(1.0 - eps)))
        return grad.mul_(grad_loss), None, None


def hand_fused_loss(model: Transformer, batch: Batch, label_smoothing: float = 0.0):
    memory = model.encode(batch.src, batch.src_pad_mask)
    states = model.decode(batch.tgt_in, memory, batch.src_pad_mask)
    real = batch.tgt_out != PAD_ID
    logits = model.project(states[real]).float()
    return HandFusedCrossEntropy.apply(logits, batch.tgt_out[real], float(label_smoothing))


def full_projection_loss(model: Transformer, batch: Batch, label_smoothing: float = 0.0):
    """Project every target position, padding included, then ignore padding in the loss."""
    memory = model.encode(batch.src, batch.src_pad_mask)
    logits = model.project(model.decode(batch.tgt_in, memory, batch.src_pad_mask)).float()  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID,
                           label_smoothing=label_smoothing, reduction="sum")
    return loss, loss.detach()


def sdpa_everywhere(q, k, v, attend_mask=None, causal=False):
    """transformer.model.attend before it wrote 16-bit CPU attention out: the fused kernel always."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask, is_causal=causal)


def foreach_optimizer(model: Transformer, train) -> torch.optim.Optimizer:
    """build_optimizer before it chose the fused kernel: Adam's `foreach` implementation."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.Adam(parameters, lr=learning_rate(1, train, model.config), betas=train.adam_betas,
                            eps=train.adam_eps, foreach=True)


def two_pass_loss(model: Transformer, batch: Batch, label_smoothing: float = 0.0):
    """batch_loss before it shared one log-softmax: F.cross_entropy for the loss, again for nll."""
    memory = model.encode(batch.src, batch.src_pad_mask)
    states = model.decode(batch.tgt_in, memory, batch.src_pad_mask)
    real = batch.tgt_out != PAD_ID
    logits = model.project(states[real]).float()
    targets = batch.tgt_out[real]
    loss = F.cross_entropy(logits, targets, label_smoothing=label_smoothing, reduction="sum")
    with torch.no_grad():
        nll = F.cross_entropy(logits, targets, reduction="sum")
    return loss, nll


def module_loss(model: Transformer, batch: Batch, label_smoothing: float = 0.0):
    """The step as the trainer runs it: through TrainingLoss, the module DistributedDataParallel wraps."""
    return TrainingLoss(model, label_smoothing)(batch.src, batch.tgt_in, batch.tgt_out)


@contextlib.contextmanager
def patched(owner, name: str, value) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


# --------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Measurement:
    target_rates: list[float]
    total_rates: list[float]
    flop_rates: list[float]
    batch_build_share: float  # share of wall time spent building batches (numpy -> padded tensors)

    @property
    def target(self) -> float:
        return statistics.median(self.target_rates)


def measure(model: Transformer, optimizer, corpus: PairCorpus, batches: list[np.ndarray], train,
            loss_fn: Callable, warmup: int, steps: int, repeats: int, pad_multiple: int = 1) -> Measurement:
    """Time full training steps on batches[0:...]; the same batches for every call."""
    device = torch.device("cpu")

    def step(batch) -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, train.precision):
            loss, _ = loss_fn(model, batch, train.label_smoothing)
        (loss / batch.n_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad_norm or float("inf"))
        optimizer.step()

    order = iter(batches)
    for _ in range(warmup):
        step(padded(corpus.batch(next(order), model.config.decoder_start_id), pad_multiple))
    target_rates, total_rates, flop_rates = [], [], []
    building = stepping = 0.0
    for _ in range(repeats):
        tgt = src = 0
        flops = elapsed = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            batch = padded(corpus.batch(next(order), model.config.decoder_start_id), pad_multiple)
            building += time.perf_counter() - start
            start = time.perf_counter()
            step(batch)
            elapsed += time.perf_counter() - start
            tgt += batch.n_tgt_tokens
            src += batch.n_src_tokens
            flops += step_flops(model, batch.n_src_tokens, batch.n_tgt_tokens, attention_pairs(batch, model))
        stepping += elapsed
        target_rates.append(tgt / elapsed)
        total_rates.append((src + tgt) / elapsed)
        flop_rates.append(flops / elapsed / 1e9)
    return Measurement(target_rates, total_rates, flop_rates, building / (building + stepping))


def run_levers(config, train, corpus: PairCorpus, batches, src_vocab: int, tgt_vocab: int, args) -> None:
    """One lever at a time against the default; each variant starts from the same initial weights."""
    def fresh(train_config, optimizer_fn=build_optimizer) -> tuple[Transformer, torch.optim.Optimizer]:
        seed_everything(train_config.seed)
        model = Transformer(config.model, src_vocab, tgt_vocab)
        pad_linear_rows(model, args.row_multiple)  # as training does
        return model, optimizer_fn(model, train_config)

    other = "fp32" if train.precision == "bf16" else "bf16"
    slow_bf16 = not fast_bf16(torch.device("cpu"))
    threads = torch.get_num_threads()
    variants = [
        ("default (all levers on)", {}),
        ("no length bucketing (random batches)", {"batches": unbucketed_batches(corpus, train.batch_tokens,
                                                                              train.seed)}),
        ("the step before: SDPA, foreach Adam, two-pass loss", {"patch": (transformer.model, "attend", sdpa_everywhere),
                                                                "optimizer": foreach_optimizer,
                                                                "loss_fn": two_pass_loss}),
        ("SDPA's fused kernel for 16-bit CPU attention", {"patch": (transformer.model, "attend", sdpa_everywhere)}),
        ("Adam's foreach implementation instead of fused", {"optimizer": foreach_optimizer}),
        ("the loss's log-softmax computed twice (for nll)", {"loss_fn": two_pass_loss}),
        ("naive attention instead of SDPA", {"patch": (F, "scaled_dot_product_attention", naive_attention)}),
        ("hand-fused loss (earlier versions) instead of F.cross_entropy", {"loss_fn": hand_fused_loss}),
        ("through the trainer's loss module (what DDP wraps)", {"loss_fn": module_loss}),
        ("output projection over padding too", {"loss_fn": full_projection_loss}),
        ("1 thread instead of %d" % threads, {"threads": 1}),
        ("glibc malloc defaults (freed memory unmapped)", {"malloc_defaults": True}),
        ("torch.compile", {"compile": True}),
        (f"{other} instead of {train.precision}" + (" (no fast bf16 here: 1 step)" if slow_bf16 and other == "bf16"
                                                    else ""), {"train": dataclasses.replace(train, precision=other)}),
    ]
    if args.only:
        variants = [variants[0]] + [v for v in variants[1:] if any(word in v[0] for word in args.only)]
    # Rounds: every variant once per round, so that each ratio compares two runs made minutes apart
    # at most, and the medians over rounds hold when the machine's speed drifts.
    rates: dict[str, list[float]] = {name: [] for name, _ in variants}
    ratios: dict[str, list[float]] = {name: [] for name, _ in variants}
    failed: dict[str, str] = {}
    for _ in range(args.rounds):
        default = None
        for name, change in variants:
            if name in failed:
                continue
            result = _measure_variant(change, fresh, corpus, batches, train, slow_bf16, threads, args)
            if isinstance(result, str):
                failed[name] = result
                continue
            default = default or result.target
            rates[name].append(result.target)
            ratios[name].append(result.target / default)
    print(f"{'lever':<52} {'tok/s':>8} {'vs default':>10} {'padding':>8}   (medians over {args.rounds} round(s))")
    for name, change in variants:
        if name in failed:
            print(f"{name:<52} failed: {failed[name]}")
            continue
        variant_batches = change.get("batches", batches)
        print(f"{name:<52} {statistics.median(rates[name]):>8.0f} {statistics.median(ratios[name]):>9.2f}x "
              f"{padding_share(corpus, variant_batches[: args.warmup + args.lever_steps * args.lever_repeats]):>8.1%}",
              flush=True)
    print()


def _measure_variant(change: dict, fresh: Callable, corpus: PairCorpus, batches, train, slow_bf16: bool,
                     threads: int, args) -> Measurement | str:
    """One variant's measurement from fresh weights, or why it failed."""
    variant_train = change.get("train", train)
    model, optimizer = fresh(variant_train, change.get("optimizer", build_optimizer))
    if change.get("compile"):
        try:
            model = torch.compile(model)
        except Exception as error:  # noqa: BLE001 - report and go on
            return f"{type(error).__name__}: {error}"
    steps, repeats, warmup = args.lever_steps, args.lever_repeats, args.warmup
    if variant_train.precision == "bf16" and slow_bf16:
        steps, repeats, warmup = 1, 1, 1
    context = patched(*change["patch"]) if "patch" in change else contextlib.nullcontext()
    torch.set_num_threads(change.get("threads", threads))
    if change.get("malloc_defaults"):
        reuse_freed_memory(False)
    try:
        with context:
            return measure(model, optimizer, corpus, change.get("batches", batches), variant_train,
                           change.get("loss_fn", batch_loss), warmup, steps, repeats, args.pad_multiple)
    except Exception as error:  # noqa: BLE001 - e.g. torch.compile without a C++ compiler
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    finally:
        torch.set_num_threads(threads)
        reuse_freed_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], help="default: the config's")
    parser.add_argument("--batch-tokens", type=int, help="default: the config's")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levers", action="store_true", help="first time each speed lever against the default")
    parser.add_argument("--lever-steps", type=int, default=5, help="timed steps per repeat of a lever")
    parser.add_argument("--lever-repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="measure every lever this many times, in turn")
    parser.add_argument("--only", nargs="+", metavar="WORD", help="only the levers whose name has one of these words")
    parser.add_argument("--tokenizer-dir", type=Path, help="reuse a run's tokenizer/ instead of training one")
    parser.add_argument("--pad-multiple", type=int, default=1, help="pad batch lengths up to a multiple of N")
    parser.add_argument("--row-multiple", type=int, default=ROW_MULTIPLE,
                        help="round a linear layer's rows up to a multiple of N in bf16, as training does (1: off)")
    args = parser.parse_args()
    for name in ("pad_multiple", "row_multiple"):  # rows or positions: past a batch's size it only pads
        if not 1 <= getattr(args, name) <= 4096:
            parser.error(f"--{name.replace('_', '-')}: expected a whole number from 1 to 4096, got {getattr(args, name)}")

    config = load_config(args.config)
    train = config.train
    train = dataclasses.replace(train, precision=args.precision or train.precision,
                                batch_tokens=args.batch_tokens or train.batch_tokens)
    if args.threads:
        torch.set_num_threads(args.threads)
    train = dataclasses.replace(train, precision=resolve_precision(train.precision, torch.device("cpu")))
    reuse_freed_memory()  # as train.py does on a CPU

    corpus, src_vocab, tgt_vocab = load_corpus(config, args.tokenizer_dir)
    batches = corpus.batches(train.batch_tokens, train.seed, epoch=0)
    needed = args.warmup + args.steps * args.repeats
    if len(batches) < needed:
        raise SystemExit(f"only {len(batches)} batches; lower --steps/--repeats")
    if args.levers:
        run_levers(config, train, corpus, batches, src_vocab, tgt_vocab, args)

    seed_everything(train.seed)
    model = Transformer(config.model, src_vocab, tgt_vocab)
    pad_linear_rows(model, args.row_multiple)  # as training does
    optimizer = build_optimizer(model, train)
    result = measure(model, optimizer, corpus, batches, train, batch_loss, args.warmup, args.steps, args.repeats,
                     args.pad_multiple)
    peak = matmul_peak(train.precision)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    achieved = statistics.median(result.flop_rates)
    print(f"config: {args.config}  precision: {train.precision}  batch_tokens: {train.batch_tokens}  "
          f"threads: {torch.get_num_threads()}  batches timed: {args.steps} x {args.repeats}")
    print(f"padding share of batch tokens: {padding_share(corpus, batches, args.pad_multiple):.1%} "
          f"(without length bucketing: {padding_share(corpus, unbucketed_batches(corpus, train.batch_tokens, 0)):.1%})")
    print(f"distinct batch shapes in an epoch ({len(batches)} batches): {batch_shapes(corpus, batches, args.pad_multiple)}"
          f" (lengths padded to a multiple of {args.pad_multiple})")
    print(f"building batches (numpy -> padded tensors): {result.batch_build_share:.1%} of the step time")
    print(f"target tokens/s per repeat: {', '.join(f'{r:.0f}' for r in result.target_rates)}")
    print(f"source+target tokens/s (median): {statistics.median(result.total_rates):.0f}")
    print(f"model FLOP/s: {achieved:.1f} GFLOP/s; matmul peak ({train.precision}, 2048^2): {peak:.1f} GFLOP/s; "
          f"MFU {achieved / peak:.1%}")
    print(f"peak RSS: {rss_gib:.2f} GiB")
    print(f"tokens/s: {result.target:.0f}")


if __name__ == "__main__":
    main()
