"""Token-budget batches: which pairs go together (`token_batches`, and each rank's share of one
under data parallelism, `shard_batch`) and the padded tensors of one batch (`Batch`,
`PairCorpus.batch`). Reading and tokenizing text lives in pairs.py and tokenizer.py.

Conventions: source = tokens + EOS; decoder input = BOS + tokens; labels = tokens + EOS.
Every sequence is right-padded with PAD_ID, per batch (never to a global length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    """One padded batch. Masks are True at padding."""

    src: Tensor  # (B, S) source ids + EOS
    tgt_in: Tensor  # (B, T) BOS + target ids
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


def make_batch(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]) -> Batch:
    """Teacher forcing: the decoder reads BOS + target and learns to predict target + EOS."""
    return Batch(
        src=pad_rows(src_ids, suffix=EOS_ID),
        tgt_in=pad_rows(tgt_ids, prefix=BOS_ID),
        tgt_out=pad_rows(tgt_ids, suffix=EOS_ID),
    )


def token_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, batch_tokens: int,
                  seed: int, epoch: int, shuffle: bool = True) -> list[np.ndarray]:
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
    src_lengths = np.asarray(src_lengths, dtype=np.int64) + 1
    tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64) + 1
    if len(src_lengths) != len(tgt_lengths):
        raise ValueError("source and target length arrays differ in size")
    n = len(src_lengths)
    if n == 0:
        return []
    rng = np.random.default_rng([seed, epoch])
    tie_break = rng.random(n) if shuffle else np.arange(n)
    # lexsort sorts by the last key first: source length, then target length, then chance.
    order = np.lexsort((tie_break, tgt_lengths, src_lengths))
    longest = np.maximum(src_lengths, tgt_lengths)[order]

    batches: list[np.ndarray] = []
    start, width = 0, 0
    for position in range(n):
        new_width = max(width, int(longest[position]))
        if position > start and new_width * (position - start + 1) > batch_tokens:
            batches.append(order[start:position])
            start, new_width = position, int(longest[position])
        width = new_width
    batches.append(order[start:])
    if shuffle:
        permutation = rng.permutation(len(batches))
        batches = [batches[i] for i in permutation]
    return batches


def shard_batch(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s share of one global batch under data parallelism: a contiguous slice of its
    length-sorted indices, so that all shards hold similar lengths. Sizes differ by at most one
    sentence; a shard is empty only when the batch has fewer sentences than there are ranks.
    With world_size 1 the batch is returned whole."""
    if world_size == 1:
        return indices
    return np.array_split(indices, world_size)[rank]


class PairCorpus:
    """Tokenized pairs held as two flat arrays of ids (int32, or uint16 from a dataset whose ids
    fit) plus offsets: compact, and a batch is a few slices (no per-pair Python objects, so
    memory stays small for large corpora)."""

    def __init__(self, src_tokens: np.ndarray, src_offsets: np.ndarray,
                 tgt_tokens: np.ndarray, tgt_offsets: np.ndarray) -> None:
        self.src_tokens, self.src_offsets = src_tokens, src_offsets
        self.tgt_tokens, self.tgt_offsets = tgt_tokens, tgt_offsets
        self.src_lengths = np.diff(src_offsets)
        self.tgt_lengths = np.diff(tgt_offsets)

    @classmethod
    def from_lists(cls, src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]) -> "PairCorpus":
        def flat(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(r) for r in rows])
            tokens = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
            return tokens, offsets

        return cls(*flat(src_ids), *flat(tgt_ids))

    @classmethod
    def from_dataset(cls, dataset, src_column: str = "src_ids", tgt_column: str = "tgt_ids",
                     batch_size: int = 100_000) -> "PairCorpus":
        """From a HuggingFace `datasets.Dataset` with list-of-int columns, via Arrow, without Python lists.

        Streamed in batches of rows (following any select/filter indices mapping), in two passes:
        lengths, then ids into arrays of the final size. So memory peaks at the result plus one
        batch, not at a copy of the whole table with its text columns. Ids are stored as uint16
        when all fit (vocabularies up to 65,536), halving the largest array; else int32.
        """
        # Imported here: translate.py uses this module and need not load datasets and pyarrow (slow to import).
        import pyarrow.compute as pc

        from transformer.data.pairs import arrow_batches

        columns = [src_column, tgt_column]
        offsets = {column: np.zeros(len(dataset) + 1, dtype=np.int64) for column in columns}
        largest, start = 0, 0
        for batch in arrow_batches(dataset, columns, batch_size):
            for column, column_offsets in offsets.items():
                lengths = pc.list_value_length(batch.column(column)).to_numpy()
                column_offsets[start + 1: start + 1 + len(lengths)] = lengths
                largest = max(largest, pc.max(pc.list_flatten(batch.column(column))).as_py() or 0)
            start += batch.num_rows
        dtype = np.uint16 if largest <= np.iinfo(np.uint16).max else np.int32
        tokens = {}
        for column, column_offsets in offsets.items():
            np.cumsum(column_offsets, out=column_offsets)
            tokens[column] = np.empty(int(column_offsets[-1]), dtype=dtype)
        start = 0
        for batch in arrow_batches(dataset, columns, batch_size):
            for column, column_offsets in offsets.items():
                values = pc.list_flatten(batch.column(column)).to_numpy()
                tokens[column][column_offsets[start]: column_offsets[start + batch.num_rows]] = values
            start += batch.num_rows
        return cls(tokens[src_column], offsets[src_column], tokens[tgt_column], offsets[tgt_column])

    def __len__(self) -> int:
        return len(self.src_lengths)

    def source(self, index: int) -> np.ndarray:
        return self.src_tokens[self.src_offsets[index]: self.src_offsets[index + 1]]

    def target(self, index: int) -> np.ndarray:
        return self.tgt_tokens[self.tgt_offsets[index]: self.tgt_offsets[index + 1]]

    def batch(self, indices: Sequence[int]) -> Batch:
        return make_batch([self.source(i) for i in indices], [self.target(i) for i in indices])

    def batches(self, batch_tokens: int, seed: int, epoch: int, shuffle: bool = True) -> list[np.ndarray]:
        return token_batches(self.src_lengths, self.tgt_lengths, batch_tokens, seed, epoch, shuffle)
