"""A corpus read and cleaned: the reader of its format (READERS) gives the raw rows, text.clean_text
cleans both sides in a cached `map`, and rows no sentence pair can come from are dropped, counted
and logged with their line numbers. The result is `Rows` of the cleaned table: nothing here holds a
Python object per pair, so corpora larger than memory work. Splitting is split.py's job, encoding
encode.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow.compute as pc

from transformer.config import DataConfig
from transformer.data.cache import code_digest, content_key
from transformer.data.delimited import read_delimited
from transformer.data.parallel_text import read_parallel_text
from transformer.data.readers import RawPairs, Source
from transformer.data.rows import WRITER_BATCH_ROWS, Rows, cache_writes, num_proc
from transformer.data.text import clean_text
from transformer.errors import DataError

logger = logging.getLogger(__name__)

SOURCE, TARGET = "source", "target"  # the cleaned table's two columns

# The reader of each data.format: a function from the corpus to its raw rows (readers.py).
READERS: dict[str, Callable[[Source], RawPairs]] = {
    "csv": read_delimited,
    "tsv": read_delimited,
    "text": read_parallel_text,
}

# A side longer than data.max_length * this many characters is dropped on reading. No subword
# of natural text is that long on average, so such a row would be dropped as too long after
# encoding anyway; dropping it first spares the BPE trainer, whose cost grows with the square of
# a word's length (one 1 MB "word" takes it many minutes).
MAX_CHARS_PER_TOKEN = 32
_LINES_SHOWN = 5  # line numbers named in a warning about dropped rows

# The cleaned rows change with this code and the cleaning's: both are in the key of the cleaned table.
_CODE = code_digest("corpus.py", "text.py")


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


def _clean_batch(batch: dict[str, list], source_column: str, target_column: str) -> dict[str, list[str]]:
    # A row with a missing trailing field arrives as None; it becomes "" and is dropped as empty.
    return {
        SOURCE: [clean_text(text) if text is not None else "" for text in batch[source_column]],
        TARGET: [clean_text(text) if text is not None else "" for text in batch[target_column]],
    }


def _clean(raw: RawPairs) -> Rows:
    """Both sides of every raw row cleaned, as a table of its own (cached under the raw content's key)."""
    key = content_key("cleaned", raw.key, raw.source_column, raw.target_column, _CODE)
    table = raw.table.map(
        _clean_batch,
        batched=True,
        batch_size=WRITER_BATCH_ROWS,
        writer_batch_size=WRITER_BATCH_ROWS,
        fn_kwargs={"source_column": raw.source_column, "target_column": raw.target_column},
        remove_columns=raw.table.column_names,
        features=datasets.Features({SOURCE: datasets.Value("string"), TARGET: datasets.Value("string")}),
        num_proc=num_proc(len(raw.table)),
        new_fingerprint=key,
        desc="cleaning pairs",
    )
    return Rows(table, key)


def _drop_masks(cleaned: Rows, max_length: int, header: tuple[str, str] | None) -> dict[str, np.ndarray]:
    """(N,) boolean masks of the rows to drop, by reason, computed on the Arrow columns in one pass."""
    n_rows = len(cleaned)
    source_chars, target_chars = np.empty(n_rows, np.int32), np.empty(n_rows, np.int32)
    repeats_header = np.zeros(n_rows, dtype=bool)
    start = 0
    for batch in cleaned.batches([SOURCE, TARGET], batch_size=100_000):
        rows = slice(start, start + batch.num_rows)
        sources, targets = batch.column(SOURCE), batch.column(TARGET)
        source_chars[rows], target_chars[rows] = pc.utf8_length(sources).to_numpy(), pc.utf8_length(targets).to_numpy()
        if header is not None:
            repeats_header[rows] = (pc.equal(sources, clean_text(header[0])).to_numpy(zero_copy_only=False)
                                    & pc.equal(targets, clean_text(header[1])).to_numpy(zero_copy_only=False))
        start += batch.num_rows
    empty = (source_chars == 0) | (target_chars == 0)
    limit = max_length * MAX_CHARS_PER_TOKEN
    long = ~empty & ((source_chars > limit) | (target_chars > limit))
    return {"empty": empty, "header": repeats_header & ~empty, "long": long & ~repeats_header}


def _where(raw: RawPairs, mask: np.ndarray) -> str:
    """'line 7' / 'lines 7, 9, ...' for the rows where `mask` is True."""
    rows = np.flatnonzero(mask)
    lines = raw.line_numbers([int(r) for r in rows[:_LINES_SHOWN]])
    more = ", ..." if len(rows) > len(lines) else ""
    return ("line " if len(lines) == 1 and not more else "lines ") + ", ".join(map(str, lines)) + more


@cache_writes
def load_pairs(config: DataConfig) -> tuple[Rows, LoadReport]:
    """Read the corpus `config` names into rows with exactly the columns `source` and `target`, cleaned.

    Rows with an empty side (after cleaning), rows repeating the header line (CSV/TSV) and rows with
    a side longer than data.max_length * MAX_CHARS_PER_TOKEN characters are dropped, counted in the
    report and logged with their line numbers. datasets keeps its Arrow files in its cache
    (HF_DATASETS_CACHE). A DataError names the file and key for a missing file or column, non-UTF-8
    bytes, malformed CSV, or text files of different lengths.
    """
    source = Source.of(config)
    name = source.describe()
    logger.info("reading %s", name)  # minutes for a corpus of millions of pairs
    raw = READERS[source.format](source)
    cleaned = _clean(raw)
    drop = _drop_masks(cleaned, config.max_length, raw.header)
    report = LoadReport(path=str(source.path), rows_read=len(cleaned), rows_dropped_empty=int(drop["empty"].sum()),
                        rows_dropped_header=int(drop["header"].sum()), rows_dropped_long=int(drop["long"].sum()),
                        target_path=source.target_path)
    if not report.rows_kept:
        raise DataError(f"{name}: no usable sentence pairs: of {report.rows_read} rows, {report.rows_dropped_empty} "
                        f"have an empty source or target side, {report.rows_dropped_header} repeat the header line "
                        f"and {report.rows_dropped_long} are too long")
    if report.rows_dropped_empty:
        logger.warning("%s: dropped %d of %d rows with an empty source or target side (%s)",
                       name, report.rows_dropped_empty, report.rows_read, _where(raw, drop["empty"]))
    if report.rows_dropped_header:
        logger.warning("%s: dropped %d of %d rows repeating the header line (%s); were two files pasted together?",
                       name, report.rows_dropped_header, report.rows_read, _where(raw, drop["header"]))
    if report.rows_dropped_long:
        logger.warning("%s: dropped %d of %d rows with a side longer than %d characters (%s): far beyond "
                       "data.max_length=%d tokens", name, report.rows_dropped_long, report.rows_read,
                       config.max_length * MAX_CHARS_PER_TOKEN, _where(raw, drop["long"]), config.max_length)
    # The key says which rows are kept: the cleaned table's, less those the rules above drop.
    pairs = cleaned
    if report.rows_kept < report.rows_read:
        dropped = drop["empty"] | drop["header"] | drop["long"]
        pairs = cleaned.where(~dropped, content_key(cleaned.key, "kept", config.max_length * MAX_CHARS_PER_TOKEN))
    logger.info("%s: %d sentence pairs", name, len(pairs))
    return pairs, report


__all__ = ["SOURCE", "TARGET", "READERS", "MAX_CHARS_PER_TOKEN", "LoadReport", "load_pairs"]
