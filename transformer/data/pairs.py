"""Sentence pairs: clean what readers.py read (CSV/TSV or line-aligned text), split into train /
valid / test by groups of pairs that share a sentence, encode.

The corpus stays a memory-mapped `datasets.Dataset`, cached on disk by fingerprint, so a second
run starts fast and corpora larger than memory work: nothing here holds a Python object per pair.
Only the held-out splits (thousands of pairs) are read into memory.
Batching lives in batching.py.
Typical use: load_pairs -> split_pairs -> train_tokenizers(iter_texts(...)) -> encode_splits.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from transformer.config import DataConfig
from transformer.errors import DataError, UserError, disk_full
from transformer.data.readers import describe_input, find_cause, line_numbers, read_pairs_file
from transformer.data.text import clean_text
from transformer.data.tokenizer import Tokenizers
from transformer.data.cache import cache_full, discard_damaged, intact, write_entry
from transformer.data.arrow_stream import stream_batches

logger = logging.getLogger(__name__)

SOURCE, TARGET = "source", "target"
SRC_IDS, TGT_IDS, SRC_LEN, TGT_LEN = "src_ids", "tgt_ids", "src_len", "tgt_len"

# datasets fingerprints a library function by its name, not its code, so an edit to the
# cleaning or encoding would silently reuse stale cached results. Hashing this file and the
# cleaning's (text.py) into every map/filter fixes that.
_CODE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()
                              + Path(__file__).with_name("text.py").read_bytes()
                              + Path(__file__).with_name("tokenizer.py").read_bytes()).hexdigest()[:16]

# A side longer than data.max_length * this many characters is dropped on reading. No subword
# of natural text is that long on average, so such a row would be dropped as too long after
# encoding anyway; dropping it first spares the BPE trainer, whose cost grows with the square of
# a word's length (one 1 MB "word" takes it many minutes).
MAX_CHARS_PER_TOKEN = 32
_LINES_SHOWN = 5  # line numbers named in a warning about dropped rows

# From this many rows on, cleaning and encoding run in one process per CPU (`python
# bench/data_memory.py` measures the data stage). Smaller corpora take seconds anyway, not worth the
# workers' start-up and one cache file per worker.
PARALLEL_ROWS = 1_000_000

# Rows per record batch of the Arrow files our maps and filters write (datasets' default is 1,000).
# Opening a cached file reads every record batch's header, and each read faults in the pages
# around it: with small batches, that is nearly the whole file, resident in every process that
# opens it, even when no row is read.
WRITER_BATCH_ROWS = 10_000

# A split longer than this is encoded in shards of this many rows, each a cache file of its own.
ENCODE_SHARD_ROWS = 1_000_000


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadReport:
    """What `load_pairs` read and what it dropped."""

    path: str
    rows_read: int
    rows_dropped_empty: int  # rows where either side was empty after cleaning
    rows_dropped_header: int = 0  # rows repeating the header line (e.g. two files pasted together)
    rows_dropped_long: int = 0  # rows with a side longer than data.max_length * MAX_CHARS_PER_TOKEN characters
    target_path: str = ""  # the target-language file, for data.format text (`path` is then the source one)

    @property
    def rows_kept(self) -> int:
        return self.rows_read - self.rows_dropped_empty - self.rows_dropped_header - self.rows_dropped_long


def _num_proc(n_rows: int) -> int | None:
    """Worker processes for a map over `n_rows` rows: None (this process) unless the corpus is large."""
    if n_rows < PARALLEL_ROWS:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus if cpus > 1 else None


def _rows_labelled(indices: list[int], labels: np.ndarray, wanted: int, code_digest: str) -> np.ndarray:
    del code_digest
    return labels[indices] == wanted


def _subset(dataset: datasets.Dataset, labels: np.ndarray, wanted: int, desc: str) -> datasets.Dataset:
    """The rows whose entry in `labels` (N,) equals `wanted`, in order.

    A filter, not `select(np.flatnonzero(...))`: select turns its index array into a Python list
    (~40 bytes a row, 60 MB for 1.6M rows) and keeps the mapping in memory; filter writes it to a
    memory-mapped cache file, batch by batch, and finds it there on the next run.
    """
    return dataset.filter(_rows_labelled, with_indices=True, input_columns=[], batched=True, batch_size=100_000,
                          writer_batch_size=WRITER_BATCH_ROWS,
                          fn_kwargs={"labels": labels, "wanted": wanted, "code_digest": _CODE_DIGEST}, desc=desc)


def _where(config: DataConfig, mask: np.ndarray) -> str:
    """'line 7' / 'lines 7, 9, ...' for the rows where `mask` is True."""
    rows = np.flatnonzero(mask)
    lines = line_numbers(config, [int(r) for r in rows[:_LINES_SHOWN]])
    more = ", ..." if len(rows) > len(lines) else ""
    return ("line " if len(lines) == 1 and not more else "lines ") + ", ".join(map(str, lines)) + more


def _clean_batch(batch: dict[str, list], source_column: str, target_column: str,
                 code_digest: str) -> dict[str, list[str]]:
    # A row with a missing trailing field arrives as None; it becomes "" and is dropped as empty.
    del code_digest  # only here to key the cache
    return {
        SOURCE: [clean_text(text) if text is not None else "" for text in batch[source_column]],
        TARGET: [clean_text(text) if text is not None else "" for text in batch[target_column]],
    }


def _drop_masks(cleaned: datasets.Dataset, config: DataConfig,
                header_names: tuple[str, str] | None) -> dict[str, np.ndarray]:
    """(N,) boolean masks of the rows to drop, by reason, computed on the Arrow columns."""
    source_chars, target_chars = np.empty(len(cleaned), np.int32), np.empty(len(cleaned), np.int32)
    header = np.zeros(len(cleaned), dtype=bool)
    start = 0
    for batch in arrow_batches(cleaned, [SOURCE, TARGET], batch_size=100_000):
        rows = slice(start, start + batch.num_rows)
        sources, targets = batch.column(SOURCE), batch.column(TARGET)
        source_chars[rows], target_chars[rows] = pc.utf8_length(sources).to_numpy(), pc.utf8_length(targets).to_numpy()
        if header_names is not None:
            header[rows] = (pc.equal(sources, clean_text(header_names[0])).to_numpy(zero_copy_only=False)
                            & pc.equal(targets, clean_text(header_names[1])).to_numpy(zero_copy_only=False))
        start += batch.num_rows
    empty = (source_chars == 0) | (target_chars == 0)
    limit = config.max_length * MAX_CHARS_PER_TOKEN
    long = ~empty & ((source_chars > limit) | (target_chars > limit))
    return {"empty": empty, "header": header & ~empty, "long": long & ~header}


def _cache_writes(function):
    """datasets writes an Arrow file for every map, filter and split, and this package its cache
    entries beside them: a full disk there is the user's to fix, and is a DataError naming the cache
    rather than a traceback. Nothing is lost: the run directory is untouched, and the next run
    rebuilds what the cache lacks. datasets wraps what its CSV and text builders meet in a
    DatasetGenerationError, so the OSError is looked for along the error's chain."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except UserError:
            raise
        except Exception as error:
            cause = find_cause(error, OSError)
            if cause is None or not disk_full(cause):
                raise
            raise cache_full(_cache_location(signature.bind(*args, **kwargs).arguments), cause) from None

    return wrapper


def _cache_location(arguments: dict) -> str:
    """The datasets cache a data-stage call writes to: its `cache_dir`, or the folder of its dataset's
    cache files, or datasets' default."""
    if arguments.get("cache_dir"):
        return str(arguments["cache_dir"])
    for value in arguments.values():
        dataset = getattr(value, "pairs", value)  # a Splits holds its pairs
        if isinstance(dataset, datasets.Dataset) and dataset.cache_files:
            return str(Path(dataset.cache_files[0]["filename"]).parent)
    return str(datasets.config.HF_DATASETS_CACHE)


@_cache_writes
def load_pairs(config: DataConfig, cache_dir: str | Path | None = None) -> tuple[datasets.Dataset, LoadReport]:
    """Read `config.path` (and `config.target_path`) into a Dataset with exactly the columns `source`
    and `target`, cleaned.

    Rows with an empty side (after cleaning), rows repeating the header line (CSV/TSV) and rows with
    a side longer than data.max_length * MAX_CHARS_PER_TOKEN characters are dropped, counted in the
    report and logged with their line numbers.
    `cache_dir` is where datasets keeps its Arrow files (None = its default, ~/.cache/huggingface).
    A DataError names the file and key for a missing file or column, non-UTF-8 bytes, malformed CSV,
    or text files of different lengths.
    """
    path = describe_input(config)
    logger.info("reading %s", path)  # minutes for a corpus of millions of pairs
    raw = read_pairs_file(config, cache_dir)
    table = raw.table
    cleaned = table.map(
        _clean_batch,
        batched=True,
        batch_size=WRITER_BATCH_ROWS,
        writer_batch_size=WRITER_BATCH_ROWS,
        fn_kwargs={"source_column": raw.source_column, "target_column": raw.target_column,
                   "code_digest": _CODE_DIGEST},
        remove_columns=table.column_names,
        features=datasets.Features({SOURCE: datasets.Value("string"), TARGET: datasets.Value("string")}),
        num_proc=_num_proc(len(table)),
        desc="cleaning pairs",
    )
    drop = _drop_masks(cleaned, config, raw.header)
    report = LoadReport(path=str(config.path), rows_read=len(table), rows_dropped_empty=int(drop["empty"].sum()),
                        rows_dropped_header=int(drop["header"].sum()), rows_dropped_long=int(drop["long"].sum()),
                        target_path=config.target_path)
    if not report.rows_kept:
        raise DataError(f"{path}: no usable sentence pairs: of {report.rows_read} rows, {report.rows_dropped_empty} "
                        f"have an empty source or target side, {report.rows_dropped_header} repeat the header line "
                        f"and {report.rows_dropped_long} are too long")
    if report.rows_dropped_empty:
        logger.warning("%s: dropped %d of %d rows with an empty source or target side (%s)",
                       path, report.rows_dropped_empty, report.rows_read, _where(config, drop["empty"]))
    if report.rows_dropped_header:
        logger.warning("%s: dropped %d of %d rows repeating the header line (%s); were two files pasted together?",
                       path, report.rows_dropped_header, report.rows_read, _where(config, drop["header"]))
    if report.rows_dropped_long:
        logger.warning("%s: dropped %d of %d rows with a side longer than %d characters (%s): far beyond "
                       "data.max_length=%d tokens", path, report.rows_dropped_long, report.rows_read,
                       config.max_length * MAX_CHARS_PER_TOKEN, _where(config, drop["long"]), config.max_length)
    pairs = cleaned
    if report.rows_kept < report.rows_read:
        pairs = _subset(cleaned, drop["empty"] | drop["header"] | drop["long"], False, "dropping rows")
    logger.info("%s: %d sentence pairs", path, len(pairs))
    return pairs, report


# --------------------------------------------------------------------------- splitting


@dataclass(frozen=True)
class Splits:
    """Train, validation and test pairs; no source sentence and no target sentence is in two of them."""

    train: datasets.Dataset
    valid: datasets.Dataset
    test: datasets.Dataset
    fingerprint: str  # of the set of pairs, whatever their order (checkpoints record it)
    # The pairs split and each row's split (0 train, 1 valid, 2 test): the training pairs are encoded
    # from the rows in place, not gathered one by one through the train split's index.
    pairs: datasets.Dataset
    row_side: np.ndarray


_MASK64 = (1 << 64) - 1


def _sentence_hashes(pairs: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(N,) uint64 each: a 64-bit hash of every row's source and target sentence, streamed in Arrow
    batches: 16 bytes a row, not a Python string."""
    hashes = np.empty((2, len(pairs)), dtype=np.uint64)
    start = 0
    for batch in arrow_batches(pairs, [SOURCE, TARGET]):
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


@_cache_writes
def split_pairs(pairs: datasets.Dataset, config: DataConfig) -> Splits:
    """Hold out whole groups of pairs: >= `valid_pairs` rows for valid, >= `test_pairs` for test.

    Tatoeba gives one source sentence several translations, and one translation to several source
    sentences (paraphrases). A group is every pair connected to another through a shared source or
    target sentence; groups are assigned whole, so no held-out source sentence occurs on the source
    side of train and no held-out target sentence on its target side. Groups are taken in a seeded
    random order (a hash), so the split depends only on the seed and the set of pairs, not on row
    order; a group larger than a split's size stays in train. Memory: a few 8-byte numbers a row.
    """
    stored = _split_directory(pairs, config)
    found = _load_split(stored, len(pairs)) if stored else None
    row_side, fingerprint = found or _assign_sides(pairs, config)
    if stored and not found:
        _save_split(stored, row_side, fingerprint)
    logger.info("split by groups of pairs that share a sentence: %d train, %d valid, %d test pairs",
                *(int(count) for count in np.bincount(row_side, minlength=3)[:3]))
    train, valid, test = (_subset(pairs, row_side, split_id, f"taking the {name} split")
                          for split_id, name in enumerate(("train", "valid", "test")))
    return Splits(train, _in_memory(valid), _in_memory(test), fingerprint=fingerprint, pairs=pairs, row_side=row_side)


def _in_memory(held_out: datasets.Dataset) -> datasets.Dataset:
    """A held-out split (thousands of rows) read into memory, with plain reads of the corpus files.

    Its rows lie scattered over the whole corpus: read through datasets' memory map, each row would
    map the pages around it into the process (the kernel's fault-around), hundreds of MB at 16M
    pairs for a few thousand rows; and every later pass (encoding, references, held-out files)
    would read the whole corpus again to find them."""
    tables = list(arrow_batches(held_out, [SOURCE, TARGET]))
    if not tables:
        return held_out
    return datasets.Dataset(pa.concat_tables(tables).combine_chunks(), info=held_out.info)


_SPLIT_DIR = "splits"  # beside the datasets cache: each row's split and the fingerprint, per setting


def _split_directory(pairs: datasets.Dataset, config: DataConfig) -> Path | None:
    if not pairs.cache_files or not getattr(pairs, "_fingerprint", None):
        return None
    key = hashlib.sha256(f"{pairs._fingerprint} {config.split_seed} {config.valid_pairs} {config.test_pairs} "
                         f"{_CODE_DIGEST}".encode()).hexdigest()[:24]
    return Path(pairs.cache_files[0]["filename"]).parent / _SPLIT_DIR / key


def _load_split(directory: Path, n_rows: int) -> tuple[np.ndarray, str] | None:
    """The stored split of `n_rows` rows; None if there is none, or if it is damaged (then removed, with a
    warning, and split again)."""
    if not intact(directory):
        return None
    # Read into memory (a byte a row), not mapped: the filters' cache keys hash the array, and a
    # memmap would hash as another type than the array the first run computed.
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


def _assign_sides(pairs: datasets.Dataset, config: DataConfig) -> tuple[np.ndarray, str]:
    """(N,) int8: 0 train, 1 valid, 2 test for every row; and the fingerprint of the set of pairs."""
    source_hashes, target_hashes = _sentence_hashes(pairs)
    group = _groups(source_hashes, target_hashes)
    # A group's place in the order: the smallest seeded hash of its source sentences.
    rank = np.full(int(group.max()) + 1 if len(group) else 0, np.iinfo(np.uint64).max, dtype=np.uint64)
    np.minimum.at(rank, group, _mix(source_hashes, config.split_seed))
    sizes = np.bincount(group, minlength=len(rank))
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
    train, valid, test = (int(np.count_nonzero(row_side == split_id)) for split_id in (0, 1, 2))
    if not train or valid < config.valid_pairs or test < config.test_pairs:
        raise DataError(
            f"{len(pairs)} pairs ({len(present)} groups of pairs that share a sentence) are too few for "
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


def _take(chunks: list[pa.RecordBatch], starts: np.ndarray, rows: np.ndarray) -> pa.Table:
    """Rows `rows` (table positions) of the table made of `chunks`, which begin at `starts`.

    Taken chunk by chunk: Arrow's take on a chunked string or list column first concatenates
    all the chunks, i.e. copies the whole column into memory, for every call.
    """
    chunk = np.searchsorted(starts, rows, side="right") - 1
    order = np.argsort(chunk, kind="stable")  # the identity for the sorted rows of a select/filter
    groups = np.split(order, np.flatnonzero(np.diff(chunk[order])) + 1)
    pieces = [chunks[chunk[g[0]]].take(pa.array(rows[g] - starts[chunk[g[0]]])) for g in groups if len(g)]
    taken = pa.Table.from_batches(pieces, schema=chunks[0].schema)
    if np.any(order != np.arange(len(order))):  # e.g. after a shuffle: back to the asked order
        taken = taken.combine_chunks().take(pa.array(np.argsort(order)))
    return taken


def arrow_batches(dataset: datasets.Dataset, columns: list[str], batch_size: int = 10_000) -> Iterator[pa.Table]:
    """`columns` of the dataset's rows, in its order, as Arrow tables of up to `batch_size` rows.

    Behind a select or filter (an indices mapping over the Arrow table), datasets reads rows by
    gathering each one as its own slice: ~10 µs and a table chunk per row, so whole-split reads
    took a minute and hundreds of MB at 1.6M pairs. A vectorised take per batch (see _take) does
    it in a fraction of that. The mapping is datasets' private `_indices`; were it ever gone,
    reading falls back to `Dataset.iter`, which is slow but right. A dataset whose rows are exactly
    its cache files in order (through ascending mappings) is read from those files with plain reads
    (arrow_stream.py), so a pass over a large corpus leaves none of it mapped into the process.
    """
    streamed = stream_batches(dataset, columns, batch_size) if hasattr(dataset, "_indices") else None
    if streamed is not None:
        yield from streamed
        return
    if not hasattr(dataset, "_indices"):
        yield from dataset.select_columns(columns).with_format("arrow").iter(batch_size=batch_size)
        return
    table = dataset.data.table.select(columns)
    if dataset._indices is None:  # rows in table order: zero-copy slices
        for start in range(0, table.num_rows, batch_size):
            yield table.slice(start, batch_size)
        return
    chunks = table.to_batches()  # zero-copy views of the (memory-mapped) record batches
    if not chunks:
        return
    starts = np.cumsum([0] + [chunk.num_rows for chunk in chunks[:-1]])
    rows = dataset._indices.column(0)
    for start in range(0, len(rows), batch_size):
        yield _take(chunks, starts, rows.slice(start, batch_size).to_numpy().astype(np.int64))


def iter_texts(dataset: datasets.Dataset, column: str, batch_size: int = 10_000,
               rows: np.ndarray | None = None) -> Iterator[str]:
    """Stream one text column in Arrow batches (iterating `dataset[column]` is far slower); with
    `rows`, a (N,) boolean mask such as `sample_rows` draws, only the rows where it is True."""
    start = 0
    for batch in arrow_batches(dataset, [column], batch_size):
        texts = batch.column(0)
        if rows is not None:
            texts = texts.filter(pa.array(rows[start: start + len(texts)]))
            start += len(batch)
        yield from texts.to_pylist()


def sample_rows(n_rows: int, size: int, seed: int) -> np.ndarray | None:
    """A seeded draw of `size` of `n_rows` rows without replacement, as a (n_rows,) boolean mask for
    `iter_texts` (a byte a row); None, meaning every row, if there are no more rows than that.

    A mask read along a stream, not a filtered dataset: filtering a split, which is itself an
    indices mapping over the corpus, gathers every one of its rows one by one (minutes at 16M pairs)."""
    if n_rows <= size:
        return None
    chosen = np.zeros(n_rows, dtype=bool)
    chosen[np.random.default_rng(seed).choice(n_rows, size, replace=False)] = True
    return chosen


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class EncodedSplits:
    """Splits with `src_ids`, `tgt_ids` (subword ids, no BOS/EOS) and `src_len`, `tgt_len` columns."""

    train: datasets.Dataset
    valid: datasets.Dataset
    test: datasets.Dataset
    train_too_long: int  # training pairs dropped for exceeding max_length - 1 tokens on a side


_ENCODED_FEATURES = {
    SRC_IDS: datasets.List(datasets.Value("int32")),
    TGT_IDS: datasets.List(datasets.Value("int32")),
    SRC_LEN: datasets.Value("int32"),
    TGT_LEN: datasets.Value("int32"),
}


def _encode_batch(batch: dict[str, list], tokenizers: Tokenizers, code_digest: str) -> dict[str, list]:
    del code_digest
    src_ids = tokenizers.encode_source(batch[SOURCE])
    tgt_ids = tokenizers.encode_target(batch[TARGET])
    return {SRC_IDS: src_ids, TGT_IDS: tgt_ids,
            SRC_LEN: [len(ids) for ids in src_ids], TGT_LEN: [len(ids) for ids in tgt_ids]}


def _encode(dataset: datasets.Dataset, tokenizers: Tokenizers, name: str) -> datasets.Dataset:
    features = datasets.Features({**dataset.features, **_ENCODED_FEATURES})
    if len(dataset) == 0:  # map() skips an empty dataset and would leave the new columns out
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)

    num_proc = _num_proc(len(dataset))  # of the whole split: its shards are as worth spreading

    def encode(rows: datasets.Dataset, desc: str) -> datasets.Dataset:
        # Large batches: the Rust tokenizer spreads a batch over all cores, small ones leave them idle.
        # With worker processes (a large corpus), datasets turns that off (TOKENIZERS_PARALLELISM=false)
        # in the forked workers: one thread each, while the workers keep the cores busy.
        return rows.map(_encode_batch, batched=True, batch_size=10_000, writer_batch_size=WRITER_BATCH_ROWS,
                        features=features,
                        fn_kwargs={"tokenizers": tokenizers, "code_digest": _CODE_DIGEST},
                        num_proc=num_proc, desc=desc)

    if len(dataset) <= ENCODE_SHARD_ROWS:
        return encode(dataset, f"encoding {name}")
    # Shard by shard, each cached on its own: a run killed while encoding loses only the shard at
    # hand, and the next run finds the others in the cache.
    starts = range(0, len(dataset), ENCODE_SHARD_ROWS)
    shards = []
    for number, start in enumerate(starts, 1):
        rows = range(start, min(start + ENCODE_SHARD_ROWS, len(dataset)))
        shards.append(encode(dataset.select(rows), f"encoding {name}, shard {number} of {len(starts)}"))
        logger.debug("encoded %s: shard %d of %d (rows %d to %d)", name, number, len(starts), rows[0], rows[-1])
    return datasets.concatenate_datasets(shards)


@_cache_writes
def encode_splits(splits: Splits, tokenizers: Tokenizers, max_length: int) -> EncodedSplits:
    """Tokenize every split; drop (and count) training pairs with more than `max_length - 1` tokens a side.

    `max_length - 1` leaves room for the BOS/EOS the batcher adds. Valid and test are never
    filtered: the model is scored on every held-out pair.
    """
    limit = max_length - 1
    # Every pair is encoded, the held-out few thousand too, then the training rows that fit are kept:
    # reading the corpus's rows in place is faster than gathering them through the train split's index.
    encoded = _encode(splits.pairs, tokenizers, "pairs")
    src_len, tgt_len = token_lengths(encoded)
    train_rows = splits.row_side == 0
    fits = (src_len <= limit) & (tgt_len <= limit)
    del src_len, tgt_len
    too_long, n_train = int(np.count_nonzero(train_rows & ~fits)), int(np.count_nonzero(train_rows))
    kept = _subset(encoded, train_rows & fits, True, "keeping the training pairs that fit")
    if too_long:
        logger.warning("dropped %d of %d training pairs with more than %d tokens on a side (data.max_length=%d)",
                       too_long, n_train, limit, max_length)
    valid = _encode(splits.valid, tokenizers, "valid")
    test = _encode(splits.test, tokenizers, "test")
    for name, dataset in (("valid", valid), ("test", test)):
        src_len, tgt_len = token_lengths(dataset)
        longer = int(np.count_nonzero((src_len > limit) | (tgt_len > limit)))
        if longer:
            logger.info("%s: %d pairs exceed data.max_length=%d; they are kept", name, longer, max_length)
    return EncodedSplits(train=kept, valid=valid, test=test, train_too_long=too_long)


def token_lengths(dataset: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(src_len, tgt_len) of an encoded split as int32 arrays (N,), read straight from Arrow."""
    src_len, tgt_len = np.empty(len(dataset), dtype=np.int32), np.empty(len(dataset), dtype=np.int32)
    start = 0
    for batch in arrow_batches(dataset, [SRC_LEN, TGT_LEN], batch_size=100_000):
        src_len[start: start + batch.num_rows] = batch.column(0).to_numpy()
        tgt_len[start: start + batch.num_rows] = batch.column(1).to_numpy()
        start += batch.num_rows
    return src_len, tgt_len


__all__ = [
    "SOURCE", "TARGET", "SRC_IDS", "TGT_IDS", "SRC_LEN", "TGT_LEN",
    "LoadReport", "load_pairs", "Splits", "split_pairs", "arrow_batches", "iter_texts", "sample_rows",
    "EncodedSplits", "encode_splits", "token_lengths",
]
