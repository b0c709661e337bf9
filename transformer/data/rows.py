"""Rows of a table in datasets' cache, chosen by a mask of ours, and read a batch at a time.

The data stage makes its tables with datasets' public calls (a builder's `load_dataset`, `map` under
a key of ours), so each table's rows are exactly its cache files' rows, in order. Which of them a
stage works on (the pairs kept after cleaning, the training split, the pairs that fit) is a boolean
mask held here, a byte a row, never an indices mapping inside datasets. Reading follows the mask
over the table's Arrow files with plain reads, one record batch at a time: a memory-mapped file's
pages, once read, stay in the process's RSS until it is unmapped, so a pass over a corpus of many GB
through datasets' memory map left that much resident. A table held in memory (tests, small held-out
splits) is read through datasets' Arrow format instead.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from transformer.data.cache import cache_full, cache_unwritable
from transformer.errors import UserError, disk_full, find_cause, from_the_system

SOURCE, TARGET = "source", "target"  # the columns of a cleaned table (corpus.py)

# From this many rows on, a table is cleaned and encoded in one process per CPU (`python
# bench/data_memory.py` measures the data stage). Smaller corpora take seconds anyway, not worth the
# workers' start-up and one cache file per worker.
PARALLEL_ROWS = 1_000_000

# Rows per record batch of the Arrow files our maps write (datasets' default is 1,000). Opening a
# cached file reads every record batch's header, and each read faults in the pages around it: with
# small batches, that is nearly the whole file, resident in every process that opens it.
WRITER_BATCH_ROWS = 10_000


def num_proc(n_rows: int, from_rows: int | None = None) -> int | None:
    """Worker processes for a map over `n_rows` rows: None (this process) unless there are `from_rows`
    (default PARALLEL_ROWS) or more."""
    if n_rows < (PARALLEL_ROWS if from_rows is None else from_rows):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus if cpus > 1 else None


@dataclass(frozen=True, eq=False)
class Rows:
    """The rows of `table` where `mask` (N,) is True, in table order; every row when `mask` is None.

    `table` is whole: what a builder or a `map` returned, never a select or filter of one. `key` names
    what these rows hold (cache.content_key of their inputs, settings and code): the cache entries
    built from them (the split, the token files) are found by it.
    """

    table: datasets.Dataset
    key: str
    mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.mask is not None and self.mask.shape != (len(self.table),):
            raise ValueError(f"a mask of {self.mask.shape} for a table of {len(self.table)} rows")

    @functools.cached_property
    def _length(self) -> int:
        return len(self.table) if self.mask is None else int(np.count_nonzero(self.mask))

    def __len__(self) -> int:
        return self._length

    def where(self, chosen: np.ndarray, key: str) -> "Rows":
        """Those of these rows where `chosen` (one entry per row of these) is True, named `key`."""
        if self.mask is None:
            return Rows(self.table, key, np.array(chosen, dtype=bool))
        mask = self.mask.copy()
        mask[self.mask] = chosen
        return Rows(self.table, key, mask)

    @property
    def cache_directory(self) -> Path | None:
        """The folder of the table's cache files, where entries built from these rows go; None for a
        table held in memory."""
        files = self.table.cache_files
        return Path(files[0]["filename"]).parent if files else None

    def batches(self, columns: list[str], batch_size: int = 10_000) -> Iterator[pa.Table]:
        """`columns` of these rows, in order, as Arrow tables of `batch_size` rows (the last may be shorter)."""
        mask, start = self.mask, 0
        # Past the last chosen row nothing more is wanted: the files' rest is not read.
        stop = len(self.table)
        if mask is not None:
            stop = len(mask) - int(np.argmax(mask[::-1])) if mask.any() else 0
        pending: list[pa.Table] = []
        n_pending = 0
        for piece in _table_batches(self.table, columns, batch_size, stop):
            end = start + piece.num_rows
            if mask is not None:
                keep = mask[start:end]
                if not keep.all():
                    piece = piece.filter(pa.array(keep))
            start = end
            if piece.num_rows:
                pending.append(piece)
                n_pending += piece.num_rows
            if n_pending >= batch_size:
                table = pa.concat_tables(pending)
                whole = n_pending - n_pending % batch_size
                for offset in range(0, whole, batch_size):
                    yield table.slice(offset, batch_size)
                pending = [table.slice(whole)] if n_pending > whole else []
                n_pending -= whole
        if n_pending:
            yield pa.concat_tables(pending)

    def take(self, indices: list[int], columns: list[str]) -> dict[str, list]:
        """`columns` of rows `indices` (positions among these rows), as lists: a few rows, read where they are."""
        found = self.table[[int(self._positions[i]) for i in indices]]
        return {column: found[column] for column in columns}

    @functools.cached_property
    def _positions(self) -> np.ndarray:
        # Only for `take` (the training texts BPE-dropout reads): an int64 a row, made when first needed.
        return np.arange(len(self.table)) if self.mask is None else np.flatnonzero(self.mask)


def _table_batches(table: datasets.Dataset, columns: list[str], batch_size: int, stop: int) -> Iterator[pa.Table]:
    """`columns` of `table`'s rows, in order, in pieces, up to row `stop` at least (possibly beyond)."""
    paths = [entry["filename"] for entry in table.cache_files]
    if not paths:  # held in memory
        yield from table.select_columns(columns).with_format("arrow").iter(batch_size=batch_size)
        return
    read = 0
    for batch in _record_batches(paths):
        if read >= stop:
            return
        read += batch.num_rows
        if read > len(table):
            break
        yield pa.Table.from_batches([batch.select(columns)])
    if read != len(table):  # a slice or a selection of a table: not something this package makes
        raise RuntimeError(f"the table's cache files hold {read} rows or more, the table {len(table)}")


def _record_batches(paths: list[str]) -> Iterator[pa.RecordBatch]:
    for path in paths:
        with pa.OSFile(path) as handle:
            yield from pa.ipc.open_stream(handle)


def iter_texts(pairs: Rows, column: str, batch_size: int = 10_000, rows: np.ndarray | None = None) -> Iterator[str]:
    """Stream one text column of `pairs` in Arrow batches; with `rows`, a (N,) boolean mask over them such
    as `sample_rows` draws, only the rows where it is True."""
    start = 0
    for batch in pairs.batches([column], batch_size):
        texts = batch.column(0)
        if rows is not None:
            texts = texts.filter(pa.array(rows[start: start + len(texts)]))
            start += len(batch)
        yield from texts.to_pylist()


def sample_rows(n_rows: int, size: int, seed: int) -> np.ndarray | None:
    """A seeded draw of `size` of `n_rows` rows without replacement, as a (n_rows,) boolean mask for
    `iter_texts` (a byte a row); None, meaning every row, if there are no more rows than that."""
    if n_rows <= size:
        return None
    chosen = np.zeros(n_rows, dtype=bool)
    chosen[np.random.default_rng(seed).choice(n_rows, size, replace=False)] = True
    return chosen


def cache_writes(function):
    """datasets writes an Arrow file for every builder and map, and this package its cache entries
    beside them: a full disk there, or a cache that cannot be written (HF_DATASETS_CACHE naming a
    folder without permission, or under a file), is the user's to fix, and is a DataError naming the
    cache rather than a traceback (or a caller's advice about its own folder). Nothing is lost: the
    run directory is untouched, and the next run rebuilds what the cache lacks. datasets wraps what
    its builders meet in a DatasetGenerationError, so the OSError is looked for along the error's chain."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except UserError:
            raise
        except Exception as error:
            cause = find_cause(error, OSError)
            if cause is None:
                raise
            if disk_full(cause):
                raise cache_full(_cache_location(signature.bind(*args, **kwargs).arguments), cause) from None
            if from_the_system(cause) and _in_datasets_cache(cause.filename):
                raise cache_unwritable(cause, datasets.config.HF_DATASETS_CACHE) from None
            raise

    return wrapper


def _in_datasets_cache(filename: object) -> bool:
    """Whether `filename` (an OSError's) lies in datasets' cache, HF_DATASETS_CACHE, is that folder, or a
    folder on the way to it that could not be made (~/.cache under a read-only HOME, where the variable
    is not set, as for a service account)."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    cache = Path(os.path.abspath(datasets.config.HF_DATASETS_CACHE))
    path = Path(os.path.abspath(os.fsdecode(filename)))
    return path.is_relative_to(cache) or cache.is_relative_to(path)


def _cache_location(arguments: dict) -> Path | str:
    """The cache a data-stage call writes to: the folder of the rows it works on, or datasets' cache."""
    for value in arguments.values():
        rows = getattr(value, "pairs", value)  # a Splits holds its pairs
        if isinstance(rows, Rows) and rows.cache_directory is not None:
            return rows.cache_directory
    return datasets.config.HF_DATASETS_CACHE


__all__ = ["SOURCE", "TARGET", "PARALLEL_ROWS", "WRITER_BATCH_ROWS", "num_proc", "Rows", "iter_texts", "sample_rows", "cache_writes"]
