"""Whole-dataset reads that leave no trace in the process's memory: the Arrow files of datasets'
cache read with plain buffered reads, one record batch at a time, instead of through datasets'
memory maps. A memory-mapped file's pages, once read, count in the process's RSS until it unmaps
the file, so a pass over a corpus of many GB left that much resident (clean page cache, but counted
and kept). pairs.arrow_batches uses this where the dataset allows it, and maps otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa


# Table operations datasets replays on a mapped file that leave its rows and columns as they are.
_HARMLESS_REPLAYS = {"replace_schema_metadata"}


def _file_paths(table) -> list[str] | None:
    """The Arrow files whose rows, concatenated, are exactly `table` (a datasets Table); None when it
    is anything else (in memory; sliced, columns renamed or cast: a replay on the mapped file)."""
    from datasets.table import ConcatenationTable, MemoryMappedTable

    blocks = table.blocks if isinstance(table, ConcatenationTable) else [[table]]
    paths = []
    for row in blocks:
        if len(row) != 1 or not isinstance(row[0], MemoryMappedTable) or \
                any(name not in _HARMLESS_REPLAYS for name, _, _ in row[0].replays):
            return None
        paths.append(row[0].path)
    return paths


def _read(paths: list[str], columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    for path in paths:
        with pa.OSFile(path) as handle:
            for batch in pa.ipc.open_stream(handle):
                yield batch.select(columns) if columns is not None else batch


def _index_chunks(paths: list[str]) -> Iterator[np.ndarray]:
    for batch in _read(paths):
        yield batch.column(0).to_numpy().astype(np.int64)


def _ascending(paths: list[str]) -> bool:
    last = -1
    for chunk in _index_chunks(paths):
        if len(chunk) and (chunk[0] < last or np.any(np.diff(chunk) < 0)):
            return False
        last = int(chunk[-1]) if len(chunk) else last
    return True


def stream_batches(dataset, columns: list[str], batch_size: int) -> Iterator[pa.Table] | None:
    """`columns` of `dataset`'s rows in its order, as Arrow tables of `batch_size` rows (the last may
    be shorter), read from its cache files; None if it cannot be read that way: a dataset held in
    memory, sliced or transformed in place, or an indices mapping that is not ascending (a shuffle;
    a filter's is)."""
    data_paths = _file_paths(dataset.data)
    if data_paths is None:
        return None
    index_paths = None
    if dataset._indices is not None:
        index_paths = _file_paths(dataset._indices)
        if index_paths is None or not _ascending(index_paths):
            return None
    return _rows(data_paths, index_paths, columns, batch_size)


def _rows(data_paths: list[str], index_paths: list[str] | None, columns: list[str],
          batch_size: int) -> Iterator[pa.Table]:
    indices = _index_chunks(index_paths) if index_paths is not None else None
    wanted = np.empty(0, dtype=np.int64)  # rows of the mapping not yet taken, ascending
    pending: list[pa.RecordBatch] = []
    n_pending, start, exhausted = 0, 0, False
    for batch in _read(data_paths, columns):
        end = start + batch.num_rows
        if indices is None:
            piece = batch
        else:
            while not len(wanted) or wanted[-1] < end:
                more = next(indices, None)
                if more is None:
                    exhausted = True
                    break
                wanted = np.concatenate([wanted, more])
            cut = int(np.searchsorted(wanted, end))
            rows, wanted = wanted[:cut], wanted[cut:]
            piece = batch.take(pa.array(rows - start)) if cut else None
        start = end
        if piece is not None and piece.num_rows:
            pending.append(piece)
            n_pending += piece.num_rows
        if n_pending >= batch_size:
            table = pa.Table.from_batches(pending)
            whole = n_pending - n_pending % batch_size
            for offset in range(0, whole, batch_size):
                yield table.slice(offset, batch_size)
            pending = table.slice(whole).to_batches()
            n_pending -= whole
        if exhausted and not len(wanted):  # the mapping's last row is taken: the rest is not wanted
            break
    if n_pending:
        yield pa.Table.from_batches(pending)


__all__ = ["stream_batches"]
