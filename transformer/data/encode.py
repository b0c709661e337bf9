"""Encoding: the split pairs as subword ids, in a cached `map` keyed by the pairs and the tokenizer,
and the training pairs' ids as token files (token_files.py) a batch reads its pairs from
(`corpus_of`). Tokenizers themselves are tokenizer.py's; batches batching.py's.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from transformer.data.batching import Mix, PairCorpus
from transformer.data.cache import code_digest, content_key
from transformer.data.rows import SOURCE, TARGET, WRITER_BATCH_ROWS, Rows, cache_writes, num_proc
from transformer.data.split import Splits
from transformer.data.token_files import TOKEN_DIR, open_token_files, write_token_files
from transformer.data.tokenizer import Tokenizers, tokenizers_digest

logger = logging.getLogger(__name__)

SRC_IDS, TGT_IDS, SRC_LEN, TGT_LEN = "src_ids", "tgt_ids", "src_len", "tgt_len"

# A table longer than this is encoded in shards of this many rows, each a cache file of its own.
ENCODE_SHARD_ROWS = 1_000_000

# The ids change with this code and the tokenizer's: both are in the key of the encoded table.
_CODE = code_digest("encode.py", "tokenizer.py")

_ENCODED_FEATURES = datasets.Features({
    SRC_IDS: datasets.List(datasets.Value("int32")),
    TGT_IDS: datasets.List(datasets.Value("int32")),
    SRC_LEN: datasets.Value("int32"),
    TGT_LEN: datasets.Value("int32"),
})


@dataclass(frozen=True)
class EncodedSplits:
    """The splits' `src_ids`, `tgt_ids` (subword ids, no BOS/EOS), `src_len` and `tgt_len`."""

    train: Rows  # the training pairs that fit data.max_length
    valid: Rows  # every valid pair, held in memory
    test: Rows  # every test pair, held in memory
    train_too_long: int  # training pairs dropped for exceeding max_length - 1 tokens on a side
    train_texts: Rows  # the `source` and `target` texts of `train`, row for row (BPE-dropout reads them)


def _encode_batch(sources: list[str], targets: list[str], indices: list[int], tokenizers: Tokenizers,
                  chosen: np.ndarray | None) -> dict[str, list]:
    if chosen is not None:  # a row outside the rows asked for gets no ids, at no cost
        keep = chosen[np.asarray(indices)]
        sources = [text if wanted else "" for text, wanted in zip(sources, keep)]
        targets = [text if wanted else "" for text, wanted in zip(targets, keep)]
    src_ids = tokenizers.encode_source(sources)
    tgt_ids = tokenizers.encode_target(targets)
    return {SRC_IDS: src_ids, TGT_IDS: tgt_ids,
            SRC_LEN: [len(ids) for ids in src_ids], TGT_LEN: [len(ids) for ids in tgt_ids]}


def _encode(rows: Rows, tokenizers: Tokenizers, name: str, key: str) -> datasets.Dataset:
    """A table row for row with `rows.table`: the ids of `rows`, no ids in the table's other rows."""
    table = rows.table
    if len(table) == 0:  # map() skips an empty table and would leave the new columns out
        return datasets.Dataset.from_dict({column: [] for column in _ENCODED_FEATURES}, features=_ENCODED_FEATURES)
    workers = num_proc(len(table))  # of the whole table: its shards are as worth spreading

    def encode(part: datasets.Dataset, chosen: np.ndarray | None, part_key: str, desc: str) -> datasets.Dataset:
        # Large batches: the Rust tokenizer spreads a batch over all cores, small ones leave them idle.
        # With worker processes (a large corpus), datasets turns that off (TOKENIZERS_PARALLELISM=false)
        # in the forked workers: one thread each, while the workers keep the cores busy.
        return part.map(_encode_batch, batched=True, batch_size=10_000, writer_batch_size=WRITER_BATCH_ROWS,
                        input_columns=[SOURCE, TARGET], with_indices=True, remove_columns=part.column_names,
                        features=_ENCODED_FEATURES, fn_kwargs={"tokenizers": tokenizers, "chosen": chosen},
                        num_proc=workers, new_fingerprint=part_key, desc=desc)

    if len(table) <= ENCODE_SHARD_ROWS:
        return encode(table, rows.mask, key, f"encoding {name}")
    # Shard by shard, each cached on its own: a run killed while encoding loses only the shard at
    # hand, and the next run finds the others in the cache.
    starts = range(0, len(table), ENCODE_SHARD_ROWS)
    shards = []
    for number, start in enumerate(starts, 1):
        end = min(start + ENCODE_SHARD_ROWS, len(table))
        chosen = None if rows.mask is None else rows.mask[start:end]
        shards.append(encode(table.select(range(start, end)), chosen, content_key(key, start, end),
                             f"encoding {name}, shard {number} of {len(starts)}"))
        logger.debug("encoded %s: shard %d of %d (rows %d to %d)", name, number, len(starts), start, end - 1)
    return datasets.concatenate_datasets(shards)


@cache_writes
def encode_splits(splits: Splits, tokenizers: Tokenizers, max_length: int) -> EncodedSplits:
    """Tokenize every split; drop (and count) training pairs with more than `max_length - 1` tokens a side.

    `max_length - 1` leaves room for the BOS/EOS the batcher adds. Valid and test are never
    filtered: the model is scored on every held-out pair.
    """
    limit = max_length - 1
    # Every pair is encoded in one pass over the corpus, the held-out few thousand too, so that the
    # encoded table does not depend on the split; the training rows that fit are then a mask over it.
    tokenizer_key = content_key(tokenizers_digest(tokenizers), _CODE)
    key = content_key(splits.pairs.key, tokenizer_key)
    encoded = _encode(splits.pairs, tokenizers, "pairs", key)
    train = Rows(encoded, content_key(key, splits.train.key), splits.train.mask)
    src_len, tgt_len = token_lengths(train)
    fits = (src_len <= limit) & (tgt_len <= limit)
    del src_len, tgt_len
    too_long = int(np.count_nonzero(~fits))
    kept = train.where(fits, content_key(train.key, "fits", limit))
    if too_long:
        logger.warning("dropped %d of %d training pairs with more than %d tokens on a side (data.max_length=%d)",
                       too_long, len(train), limit, max_length)
    held_out = []
    for name, rows in (("valid", splits.valid), ("test", splits.test)):
        held_key = content_key(rows.key, tokenizer_key)
        encoded_rows = Rows(_encode(rows, tokenizers, name, held_key), held_key)
        src_len, tgt_len = token_lengths(encoded_rows)
        longer = int(np.count_nonzero((src_len > limit) | (tgt_len > limit)))
        if longer:
            logger.info("%s: %d pairs exceed data.max_length=%d; they are kept", name, longer, max_length)
        held_out.append(encoded_rows)
    return EncodedSplits(train=kept, valid=held_out[0], test=held_out[1], train_too_long=too_long,
                         train_texts=Rows(splits.pairs.table, content_key(kept.key, "texts"), kept.mask))


def token_lengths(rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """(src_len, tgt_len) of encoded rows as int32 arrays (N,), read straight from Arrow."""
    src_len, tgt_len = np.empty(len(rows), dtype=np.int32), np.empty(len(rows), dtype=np.int32)
    start = 0
    for batch in rows.batches([SRC_LEN, TGT_LEN], batch_size=100_000):
        src_len[start: start + batch.num_rows] = batch.column(0).to_numpy()
        tgt_len[start: start + batch.num_rows] = batch.column(1).to_numpy()
        start += batch.num_rows
    return src_len, tgt_len


@cache_writes
def corpus_of(rows: Rows, mix: Mix | None = None) -> PairCorpus:
    """The ids of encoded `rows` as a PairCorpus. Rows of a table in datasets' cache have their ids
    written once to token files beside it, under the rows' key (a later run finds them there), and
    read from there as batches need them; rows held in memory are copied into arrays. Either way
    they are streamed in batches, in two passes: lengths and the largest id, then the ids, stored as
    uint16 when all fit (vocabularies up to 65,536), else int32."""

    def batches():
        return rows.batches([SRC_IDS, TGT_IDS], 100_000)

    if rows.cache_directory is not None:
        directory = rows.cache_directory / TOKEN_DIR / rows.key
        # Written when missing or damaged; written again should another process sharing the cache
        # find it damaged and remove it between this write and the opening.
        for _ in range(2):
            arrays = open_token_files(directory)
            if arrays is not None:
                return PairCorpus(*arrays, directory=directory, mix=mix)
            write_token_files(directory, batches, (SRC_IDS, TGT_IDS))
    with tempfile.TemporaryDirectory() as scratch:
        write_token_files(Path(scratch) / "ids", batches, (SRC_IDS, TGT_IDS))
        arrays = open_token_files(Path(scratch) / "ids")
        return PairCorpus(*(np.array(array) for array in arrays), mix=mix)


__all__ = ["SRC_IDS", "TGT_IDS", "SRC_LEN", "TGT_LEN", "ENCODE_SHARD_ROWS", "EncodedSplits", "encode_splits",
           "token_lengths", "corpus_of"]
