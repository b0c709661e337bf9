"""The leak-free split: train, valid and test take whole groups of pairs that share a sentence, so
no held-out source sentence is on the source side of train and no held-out target sentence on its
target side. Each row's split is stored beside the datasets cache (a cache entry, cache.py), keyed by
the pairs' key and the split's settings; the held-out splits (thousands of pairs) are read into
memory, the training split stays a mask over the corpus. Memory: a few 8-byte numbers a row.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from transformer.config import DataConfig
from transformer.data.cache import code_digest, content_key, discard_damaged, intact, write_entry
from transformer.data.rows import SOURCE, TARGET, Rows, cache_writes
from transformer.errors import DataError

logger = logging.getLogger(__name__)

# Each row's split, as stored. EXCLUDED: a pair of a corpus valid and test are not drawn from that
# shares a sentence with a valid or test pair: in no split, so that training never sees that sentence.
TRAIN, VALID, TEST, EXCLUDED = 0, 1, 2, 3
_SPLIT_DIR = "splits"  # beside the datasets cache: each row's split and the fingerprint, per setting
_CODE = code_digest("split.py")


@dataclass(frozen=True)
class Splits:
    """Train, validation and test pairs; no source sentence and no target sentence is in two of them."""

    train: Rows  # a mask over the corpus
    valid: Rows  # held in memory
    test: Rows  # held in memory
    fingerprint: str  # of the set of pairs, whatever their order (checkpoints record it)
    pairs: Rows  # the pairs split
    row_side: np.ndarray  # (len(pairs),) int8: TRAIN, VALID or TEST for each of them


@cache_writes
def split_pairs(pairs: Rows, config: DataConfig, held_out: np.ndarray | None = None) -> Splits:
    """Hold out whole groups of pairs: >= `valid_pairs` rows for valid, >= `test_pairs` for test.
    `held_out` (one entry per pair): the pairs of the corpora valid and test are drawn from; None: all.

    Tatoeba gives one source sentence several translations, and one translation to several source
    sentences (paraphrases). A group is every pair connected to another through a shared source or
    target sentence; groups are assigned whole, so no held-out source sentence occurs on the source
    side of train and no held-out target sentence on its target side. Groups are taken in a seeded
    random order (a hash), so the split depends only on the seed and the set of pairs, not on row
    order; a group larger than a split's size stays in train. With several corpora, only a group
    holding a pair of a `held_out` corpus may be held out, and only those pairs of it are; its pairs
    of the other corpora are left out of training (EXCLUDED).
    """
    layout = () if held_out is None else (hashlib.sha256(np.packbits(held_out).tobytes()).hexdigest(),)
    key = content_key(pairs.key, config.split_seed, config.valid_pairs, config.test_pairs, *layout, _CODE)
    stored = pairs.cache_directory / _SPLIT_DIR / key if pairs.cache_directory is not None else None
    found = _load_split(stored, len(pairs)) if stored else None
    row_side, fingerprint = found or _assign_sides(pairs, config, held_out)
    if stored and not found:
        _save_split(stored, row_side, fingerprint)
    counts = np.bincount(row_side, minlength=4)
    logger.info("split by groups of pairs that share a sentence: %d train, %d valid, %d test pairs",
                *(int(count) for count in counts[:3]))
    if counts[EXCLUDED]:
        logger.info("left out of training: %d pairs of other corpora that share a sentence with a valid or test "
                    "pair", int(counts[EXCLUDED]))
    valid, test = _held_out(pairs, row_side)
    return Splits(train=pairs.where(row_side == TRAIN, content_key(key, "train")),
                  valid=Rows(valid, content_key(key, "valid")), test=Rows(test, content_key(key, "test")),
                  fingerprint=fingerprint, pairs=pairs, row_side=row_side)


def _held_out(pairs: Rows, row_side: np.ndarray) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The valid and the test pairs, in corpus order, as tables in memory, from one pass over the corpus.

    Their rows lie scattered over the whole corpus, and every later use (encoding, references,
    held-out files) reads them again: held in memory, they are read from the corpus once."""
    found: dict[int, list[pa.Table]] = {VALID: [], TEST: []}
    start = 0
    for batch in pairs.batches([SOURCE, TARGET], batch_size=100_000):
        sides = row_side[start: start + batch.num_rows]
        start += batch.num_rows
        for side, tables in found.items():
            if (sides == side).any():
                tables.append(batch.filter(pa.array(sides == side)))
    features = datasets.Features({SOURCE: datasets.Value("string"), TARGET: datasets.Value("string")})
    return tuple(datasets.Dataset.from_dict(pa.concat_tables(tables).to_pydict() if tables else
                                            {SOURCE: [], TARGET: []}, features=features)
                 for tables in found.values())


def _load_split(directory: Path, n_rows: int) -> tuple[np.ndarray, str] | None:
    """The stored split of `n_rows` rows; None if there is none, or if it is damaged (then removed, with a
    warning, and split again)."""
    if not intact(directory):
        return None
    # Read into memory (a byte a row): every stage after this one reads it whole.
    try:
        row_side, fingerprint = np.load(directory / "sides.npy"), (directory / "fingerprint").read_text()
        if row_side.shape != (n_rows,) or row_side.dtype != np.int8 or \
                len(fingerprint) != 2 * hashlib.sha256().digest_size:
            raise ValueError("it does not fit the pairs it was made from")
    except FileNotFoundError:  # removed by another process since it was checked
        return None
    except (OSError, ValueError, EOFError) as error:
        discard_damaged(directory, error)
        return None
    return row_side, fingerprint


def _save_split(directory: Path, row_side: np.ndarray, fingerprint: str) -> None:
    def fill(scratch: Path) -> None:
        np.save(scratch / "sides.npy", row_side)
        (scratch / "fingerprint").write_text(fingerprint)

    write_entry(directory, fill)


_MASK64 = (1 << 64) - 1


def _sentence_hashes(pairs: Rows) -> tuple[np.ndarray, np.ndarray]:
    """(N,) uint64 each: a 64-bit hash of every row's source and target sentence, streamed in Arrow
    batches: 16 bytes a row, not a Python string."""
    hashes = np.empty((2, len(pairs)), dtype=np.uint64)
    start = 0
    for batch in pairs.batches([SOURCE, TARGET]):
        for side in (0, 1):
            digests = b"".join(hashlib.blake2b(text.encode(), digest_size=8).digest()
                               for text in batch.column(side).to_pylist())
            hashes[side, start: start + batch.num_rows] = np.frombuffer(digests, dtype=">u8")
        start += batch.num_rows
    return hashes[0], hashes[1]


def _mix(values: np.ndarray, seed: int) -> np.ndarray:
    """A seeded permutation of 64-bit values (splitmix64's finaliser): the split's random order."""
    with np.errstate(over="ignore"):
        z = values ^ np.uint64((seed * 0x9E3779B97F4A7C15) & _MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _node_ids(hashes: np.ndarray) -> np.ndarray:
    """(N,) int32: the rank of each row's hash among the distinct hashes (np.unique's inverse, in
    int32 and with fewer temporary arrays: at 16M rows, np.unique held about 0.5 GiB more)."""
    order = np.argsort(hashes)
    sorted_hashes = hashes[order]
    new = np.empty(len(hashes), dtype=bool)
    new[:1] = True
    np.not_equal(sorted_hashes[1:], sorted_hashes[:-1], out=new[1:])
    del sorted_hashes
    ranks = np.cumsum(new, dtype=np.int32)
    del new
    ranks -= 1
    ids = np.empty(len(hashes), dtype=np.int32)
    ids[order] = ranks
    return ids


def _groups(source_hashes: np.ndarray, target_hashes: np.ndarray) -> np.ndarray:
    """(N,) a group id per row: rows sharing a source or a target sentence, directly or through other
    rows, share a group (the connected components of the graph whose nodes are the distinct
    sentences of each side and whose edges are the pairs). Union-find by label propagation in numpy:
    each round hooks every root onto the smallest root it is paired with, then compresses paths.
    Node ids are int32 (a corpus has fewer than 2**31 rows), halving these arrays."""
    source_node = _node_ids(source_hashes)
    target_node = _node_ids(target_hashes)
    target_node += source_node.max() + 1 if len(source_node) else 0
    parent = np.arange(int(target_node.max()) + 1 if len(target_node) else 0, dtype=np.int32)
    while True:
        source_root, target_root = parent[source_node], parent[target_node]
        if np.array_equal(source_root, target_root):
            return source_root
        low = np.minimum(source_root, target_root)
        np.minimum.at(parent, source_root, low)
        np.minimum.at(parent, target_root, low)
        del source_root, target_root, low
        while not np.array_equal(parent[parent], parent):
            parent = parent[parent]


def _assign_sides(pairs: Rows, config: DataConfig, held_out: np.ndarray | None) -> tuple[np.ndarray, str]:
    """(N,) int8: TRAIN, VALID, TEST or EXCLUDED for every row; and the fingerprint of the set of pairs."""
    source_hashes, target_hashes = _sentence_hashes(pairs)
    group = _groups(source_hashes, target_hashes)
    # A group's place in the order: the smallest seeded hash of its source sentences.
    rank = np.full(int(group.max()) + 1 if len(group) else 0, np.iinfo(np.uint64).max, dtype=np.uint64)
    np.minimum.at(rank, group, _mix(source_hashes, config.split_seed))
    # What a group would give a held-out split: its pairs of the held-out corpora.
    sizes = np.bincount(group, minlength=len(rank)) if held_out is None else \
        np.bincount(group[held_out], minlength=len(rank))
    present = np.flatnonzero(sizes)
    order = present[np.lexsort((present, rank[present]))]

    side = np.zeros(len(rank), dtype=np.int8)  # group -> 0 train, 1 valid, 2 test
    position = 0
    for split_id, wanted in ((1, config.valid_pairs), (2, config.test_pairs)):
        taken = 0
        while taken < wanted and position < len(order):
            candidate = order[position]
            position += 1
            if sizes[candidate] <= wanted:
                side[candidate] = split_id
                taken += int(sizes[candidate])
    row_side = side[group]
    if held_out is not None:
        row_side[~held_out & (row_side != TRAIN)] = EXCLUDED
    train, valid, test = (int(np.count_nonzero(row_side == split_id)) for split_id in (TRAIN, VALID, TEST))
    if not train or valid < config.valid_pairs or test < config.test_pairs:
        counted = len(pairs) if held_out is None else int(np.count_nonzero(held_out))
        whose = "" if held_out is None else " of the corpora marked held_out"
        raise DataError(
            f"{counted} pairs{whose} ({len(present)} groups of pairs that share a sentence) are too few for "
            f"data.valid_pairs={config.valid_pairs} and data.test_pairs={config.test_pairs} "
            "with pairs left for training; lower them"
        )
    return row_side, _set_fingerprint(source_hashes, target_hashes)


def _set_fingerprint(source_hashes: np.ndarray, target_hashes: np.ndarray, chunk: int = 1 << 20) -> str:
    """A digest of the set of (source, target) hash pairs, whatever their order: the source hashes
    sorted by (source, target), then the target hashes in that order. Hashed a chunk at a time
    rather than from one stacked and reordered copy of both arrays (0.5 GiB at 16M pairs)."""
    order = np.lexsort((target_hashes, source_hashes))
    digest = hashlib.sha256()
    for hashes in (source_hashes, target_hashes):
        for start in range(0, len(order), chunk):
            digest.update(hashes[order[start: start + chunk]].tobytes())
    return digest.hexdigest()


__all__ = ["TRAIN", "VALID", "TEST", "EXCLUDED", "Splits", "split_pairs"]
