"""Token-budget batches: which pairs go together (`token_batches`, and each rank's share of one
under data parallelism, `shard_batch`) and the padded tensors of one batch (`Batch`,
`PairCorpus.batch`). Reading and tokenizing text lives in corpus.py, encode.py and tokenizer.py.

Conventions: source = tokens + EOS; decoder input = the decoder start id + tokens; labels = tokens +
EOS. The start id is the run's model.decoder_start_id (BOS in runs of this project), which the caller
passes. Every sequence is right-padded with PAD_ID, per batch (never to a global length).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from transformer.data.token_files import FileArray, load_plan, save_plan
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    """One padded batch. Masks are True at padding."""

    src: Tensor  # (B, S) source ids + EOS
    tgt_in: Tensor  # (B, T) the decoder start id (BOS) + target ids
    tgt_out: Tensor  # (B, T) target ids + EOS: what the decoder must predict at each position

    @property
    def src_pad_mask(self) -> Tensor:
        return self.src == PAD_ID

    @property
    def tgt_pad_mask(self) -> Tensor:
        return self.tgt_out == PAD_ID

    @property
    def n_sentences(self) -> int:
        return self.src.shape[0]

    @property
    def n_src_tokens(self) -> int:
        return int((self.src != PAD_ID).sum())

    @property
    def n_tgt_tokens(self) -> int:
        """Real target tokens including EOS: the count tokens/s figures are based on."""
        return int((self.tgt_out != PAD_ID).sum())

    def to(self, device: torch.device | str) -> "Batch":
        non_blocking = torch.device(device).type == "cuda"
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in (self.src, self.tgt_in, self.tgt_out)))


def pad_rows(rows: Sequence[np.ndarray | Sequence[int]], prefix: int | None = None,
             suffix: int | None = None) -> Tensor:
    """Stack id sequences into a right-padded (B, L) int64 tensor, optionally adding a first/last id."""
    extra = (prefix is not None) + (suffix is not None)
    width = max((len(r) for r in rows), default=0) + extra
    out = np.full((len(rows), max(width, 1)), PAD_ID, dtype=np.int64)
    for i, row in enumerate(rows):
        start = 0
        if prefix is not None:
            out[i, 0] = prefix
            start = 1
        out[i, start: start + len(row)] = row
        if suffix is not None:
            out[i, start + len(row)] = suffix
    return torch.from_numpy(out)


def source_tensor(src_ids: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """Source ids of several sentences -> (src (B, S) with EOS, src_pad_mask (B, S))."""
    src = pad_rows(src_ids, suffix=EOS_ID)
    return src, src == PAD_ID


def make_batch(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], start_id: int = BOS_ID
               ) -> Batch:
    """Teacher forcing: the decoder reads the start id (model.decoder_start_id) + target and learns to
    predict target + EOS."""
    return Batch(
        src=pad_rows(src_ids, suffix=EOS_ID),
        tgt_in=pad_rows(tgt_ids, prefix=start_id),
        tgt_out=pad_rows(tgt_ids, suffix=EOS_ID),
    )


class BatchPlan(Sequence[np.ndarray]):
    """An epoch's batches of pair indices as two arrays, not a list of small ones: `order` (N,),
    every pair once, and `bounds` (n_batches, 2), batch i being order[bounds[i, 0]:bounds[i, 1]].
    `order` may stay in its file (a token_files.FileArray). Indexing gives a batch; a slice, a
    list of them."""

    def __init__(self, order: np.ndarray | FileArray, bounds: np.ndarray) -> None:
        self.order, self.bounds = order, bounds

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start, end = self.bounds[index]
        return np.asarray(self.order[start:end])


def plan_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, batch_tokens: int,
                 seed: int, epoch: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds) of `token_batches`: the arrays a BatchPlan is made of."""
    if len(src_lengths) != len(tgt_lengths):
        raise ValueError("source and target length arrays differ in size")
    n = len(src_lengths)
    if n == 0:
        return np.empty(0, dtype=np.int64), np.empty((0, 2), dtype=np.int64)
    # + 1: EOS / BOS. int32 keeps these transient arrays small; sorting on them orders as int64 would.
    src_lengths = np.asarray(src_lengths).astype(np.int32) + 1
    tgt_lengths = np.asarray(tgt_lengths).astype(np.int32) + 1
    rng = np.random.default_rng([seed, epoch])
    tie_break = rng.random(n) if shuffle else np.arange(n)
    # lexsort sorts by the last key first: source length, then target length, then chance.
    order = np.lexsort((tie_break, tgt_lengths, src_lengths))
    del tie_break
    longest = np.maximum(src_lengths, tgt_lengths)
    del src_lengths, tgt_lengths
    longest = longest[order]
    starts = _greedy_starts(longest, batch_tokens)
    bounds = np.stack([starts, np.append(starts[1:], n)], axis=1)
    if shuffle:
        bounds = bounds[rng.permutation(len(bounds))]
    return order, bounds


def _greedy_starts(longest: np.ndarray, batch_tokens: int) -> np.ndarray:
    """Where each batch starts in `longest` (the sorted pairs' widths): a batch takes pairs while
    (its widest pair) x (its pairs) stays within `batch_tokens`; its first pair always goes in.

    Batch by batch on a window of the pairs that could still fit (each is at least 1 wide), so the
    work is a few numpy calls per batch rather than Python per pair."""
    n, window = len(longest), max(batch_tokens, 1) + 1
    starts, start = [], 0
    while start < n:
        starts.append(start)
        widths = np.maximum.accumulate(longest[start: start + window])
        over = np.flatnonzero(widths[1:] * np.arange(2, len(widths) + 1) > batch_tokens)
        start += int(over[0]) + 1 if len(over) else len(widths)
    return np.asarray(starts, dtype=np.int64)


def token_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, batch_tokens: int,
                  seed: int, epoch: int, shuffle: bool = True) -> BatchPlan:
    """Group pair indices into batches of at most `batch_tokens` padded tokens per side.

    A batch of n pairs costs n * (longest sequence in it, source or target, with its EOS/BOS).
    Pairs are sorted by length (ties broken at random) so each batch holds similar lengths and
    little padding; then the batch order is shuffled. The result depends only on
    (lengths, batch_tokens, seed, epoch): resuming a run rebuilds exactly the same batches.
    Every pair appears in exactly one batch; a pair longer than the budget gets a batch alone.
    Ties are between pairs of equal lengths, so the sequence of batch sizes before the shuffle, and
    with it the number of batches, depends on the lengths and batch_tokens alone: every epoch has
    as many batches (budgets count an epoch's steps without planning it).
    """
    return BatchPlan(*plan_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle))


def shard_batch(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s share of one global batch under data parallelism: a contiguous slice of its
    length-sorted indices, so that all shards hold similar lengths. Sizes differ by at most one
    sentence; a shard is empty only when the batch has fewer sentences than there are ranks.
    With world_size 1 the batch is returned whole."""
    if world_size == 1:
        return indices
    return np.array_split(indices, world_size)[rank]


def _diff(offsets: np.ndarray | FileArray) -> np.ndarray:
    return offsets.diff() if isinstance(offsets, FileArray) else np.diff(offsets)


@dataclass(frozen=True)
class Mix:
    """How often the pairs of each of several corpora are drawn in an epoch: the pairs of corpus i are
    indices bounds[i]:bounds[i + 1] of the PairCorpus, and each is drawn weights[i] times on average.

    A weight k + f (k whole, 0 <= f < 1) draws every pair k times, and a share f of them once more.
    That share is taken per length class (pairs with the same source and target lengths) and its
    size in each class is fixed, so every epoch draws the same multiset of lengths: the same number
    of batches, which budgets count on (`token_batches`). Which pairs of a class make up the share
    turns with the epoch (a seeded order, walked on by the share's size each epoch), so over
    epochs every pair of a class is drawn equally often.
    """

    bounds: tuple[int, ...]
    weights: tuple[float, ...]
    names: tuple[str, ...] = ()  # the corpora's names, for the log

    @property
    def trivial(self) -> bool:
        return all(weight == 1 for weight in self.weights)

    def draw(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray, seed: int, epoch: int) -> np.ndarray:
        """The indices drawn for `epoch`, corpus after corpus (a pair repeated as often as it is drawn)."""
        drawn = []
        for number, weight in enumerate(self.weights):
            start, end = self.bounds[number], self.bounds[number + 1]
            whole, share = int(weight), weight - int(weight)
            indices = np.arange(start, end, dtype=np.int64)
            drawn.extend([indices] * whole)
            if share and end > start:
                drawn.append(self._share(indices, src_lengths[start:end], tgt_lengths[start:end], share,
                                         [seed, number], epoch))
        return np.concatenate(drawn) if drawn else np.empty(0, dtype=np.int64)

    @staticmethod
    def _share(indices, src_lengths, tgt_lengths, share, seed, epoch) -> np.ndarray:
        rng = np.random.default_rng(seed)  # not the epoch's: the classes' order and shares stay fixed
        # Pairs by length class, in a seeded order within each class.
        order = np.lexsort((rng.random(len(indices)), tgt_lengths, src_lengths))
        src, tgt = src_lengths[order], tgt_lengths[order]
        new_class = np.ones(len(order), dtype=bool)
        new_class[1:] = (src[1:] != src[:-1]) | (tgt[1:] != tgt[:-1])
        class_start = np.flatnonzero(new_class)
        class_size = np.diff(np.append(class_start, len(order)))
        # Each class's share, so that the shares add up to share x pairs (systematic rounding).
        offset = rng.random()
        taken = np.floor(share * np.append(class_start, len(order)) + offset).astype(np.int64)
        class_share = np.diff(taken)
        # Member r of a class of m with share e is drawn in `epoch` when (r - epoch * e) mod m < e.
        member_class = np.cumsum(new_class) - 1
        rank = np.arange(len(order)) - class_start[member_class]
        size, wanted = class_size[member_class], class_share[member_class]
        chosen = (rank - epoch * wanted) % size < wanted
        return np.sort(indices[order[chosen]])

    def shares(self, drawn: np.ndarray) -> list[tuple[str, int, float]]:
        """(name, pairs drawn, share of the epoch) of each corpus, for the log."""
        counts = np.bincount(np.searchsorted(np.asarray(self.bounds[1:]), drawn, side="right"),
                             minlength=len(self.weights))
        total = max(int(counts.sum()), 1)
        return [(name, int(count), count / total) for name, count in zip(self.names, counts)]


class PairCorpus:
    """Tokenized pairs held as two flat arrays of ids plus offsets (row i is ids[offsets[i]:offsets[i + 1]]):
    a batch is a few slices, with no per-pair Python objects. encode.corpus_of builds one; for pairs
    in datasets' cache the arrays are files (token_files.FileArray) in `directory`, so the ids stay on
    disk and a batch reads only its own pairs; its batch plans are stored there too, and a resume reads
    them back instead of planning again."""

    def __init__(self, src_tokens: np.ndarray | FileArray, src_offsets: np.ndarray | FileArray,
                 tgt_tokens: np.ndarray | FileArray, tgt_offsets: np.ndarray | FileArray,
                 directory: Path | None = None, mix: Mix | None = None) -> None:
        self.src_tokens, self.src_offsets = src_tokens, src_offsets
        self.tgt_tokens, self.tgt_offsets = tgt_tokens, tgt_offsets
        self.directory = directory  # where the token files and plans are; None: all in memory
        self.mix = mix if mix is not None and not mix.trivial else None  # several corpora, weighted

    @property
    def src_lengths(self) -> np.ndarray:
        """(N,) tokens of each source side, computed on each call (not held: 8 bytes a pair)."""
        return _diff(self.src_offsets)

    @property
    def tgt_lengths(self) -> np.ndarray:
        return _diff(self.tgt_offsets)

    @property
    def n_tokens(self) -> int:
        """Source plus target tokens of all pairs, without EOS/BOS."""
        return int(self.src_offsets[-1] - self.src_offsets[0] + self.tgt_offsets[-1] - self.tgt_offsets[0])

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def source(self, index: int) -> np.ndarray:
        start, end = self.src_offsets[index: index + 2]  # one read from a file
        return self.src_tokens[start:end]

    def target(self, index: int) -> np.ndarray:
        start, end = self.tgt_offsets[index: index + 2]
        return self.tgt_tokens[start:end]

    def batch(self, indices: Sequence[int], start_id: int = BOS_ID) -> Batch:
        """The pairs `indices` as a batch whose decoder inputs begin with `start_id` (model.decoder_start_id)."""
        return make_batch([self.source(i) for i in indices], [self.target(i) for i in indices], start_id)

    def batches(self, batch_tokens: int, seed: int, epoch: int, shuffle: bool = True) -> BatchPlan:
        """`token_batches` of these pairs (of those the mix draws for `epoch`, if weighted); with token
        files, stored beside them once planned and read back from there on the next call, in this run
        or a later one."""
        if self.directory is None or len(self) == 0:
            return BatchPlan(*self._plan(batch_tokens, seed, epoch, shuffle))
        setting = f"tokens{batch_tokens}-seed{seed}-shuffle{int(shuffle)}-"
        if self.mix is not None:
            setting += "mix" + hashlib.sha256(repr((self.mix.bounds, self.mix.weights)).encode()).hexdigest()[:16] + "-"
        key = f"{setting}epoch{epoch}"
        stored = load_plan(self.directory, key)
        if stored is None:
            planned = self._plan(batch_tokens, seed, epoch, shuffle)
            save_plan(self.directory, key, *planned, stale=setting)
            # Read back, so that the order stays in its file; kept in memory should another process
            # sharing the cache have removed it already (an earlier epoch of the same settings to it).
            stored = load_plan(self.directory, key) or planned
        return BatchPlan(*stored)

    def _plan(self, batch_tokens: int, seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
        src_lengths, tgt_lengths = self.src_lengths, self.tgt_lengths
        if self.mix is None or not shuffle:  # unshuffled: every pair once (validation's order)
            return plan_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle)
        drawn = self.mix.draw(src_lengths, tgt_lengths, seed, epoch)
        if len(drawn) == 0:  # every epoch draws as many pairs: this run could never take a step
            raise DataError("the weights of data.corpora draw no training pair in an epoch: " + "; ".join(
                f"{name} {count} pairs at weight {weight:g}" for name, count, weight in zip(
                    self.mix.names, np.diff(self.mix.bounds), self.mix.weights)) + "; raise a weight so that "
                "an epoch holds at least one pair")
        logger.info("epoch %d draws %d pairs: %s", epoch, len(drawn), ", ".join(
            f"{name} {count} ({share:.1%})" for name, count, share in self.mix.shares(drawn)))
        order, bounds = plan_batches(src_lengths[drawn], tgt_lengths[drawn], batch_tokens, seed, epoch, shuffle)
        return drawn[order], bounds
