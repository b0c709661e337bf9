"""The CSV and TSV reader: one file with a header line naming its columns, read by pandas through
datasets' `csv` builder into Arrow, with exact errors naming the file, the line and the config key.
The columns holding the two sides are found by their names in the header (data.source_column and
data.target_column), among any others.
"""

from __future__ import annotations

import contextlib
import csv
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import datasets
import pandas as pd

from transformer.data.cache import content_key
from transformer.data.formats.common import (STRING, Corpus, RawPairs, build, content_name, existing,
                                             line_numbers_of, not_utf8)
from transformer.errors import DataError, find_cause


def read_delimited(corpus: Corpus) -> RawPairs:
    """`data.path` as a table of string columns `c0`, `c1`, ... (our names, not the header's: a header
    may have empty or repeated names, which pandas would rename behind our back)."""
    config = corpus.config
    path = existing(Path(config.path), corpus.key("path"))
    n_columns, source_position, target_position = _column_positions(path, corpus)
    name = content_name(path)
    return RawPairs(_read_table(path, corpus, n_columns, name), f"c{source_position}", f"c{target_position}",
                    header=(config.source_column, config.target_column), key=content_key(config.format, name),
                    line_numbers=lambda rows: _line_numbers(path, corpus, rows))


def _reader_options(corpus: Corpus) -> tuple[str, int]:
    """(separator, quoting) for the file format.

    TSV is read without quote handling: a sentence may well start with '"' (French quotes), and
    TSV has no quoting convention (fields simply cannot contain tabs).
    """
    if corpus.config.format == "tsv":
        return "\t", csv.QUOTE_NONE
    return ",", csv.QUOTE_MINIMAL


@contextlib.contextmanager
def _records(path: Path, corpus: Corpus) -> Iterator[Iterator[list[str]]]:
    """The file's records as the csv module reads them (the header first, blank lines skipped as pandas does)."""
    sep, quoting = _reader_options(corpus)
    # The csv module refuses fields over 128 KB by default; pandas, which reads the data, does not.
    limit = csv.field_size_limit()
    csv.field_size_limit(sys.maxsize)
    try:
        # utf-8-sig drops a byte-order mark, which would otherwise glue itself to the first name.
        with path.open(encoding="utf-8-sig", newline="") as handle:
            yield csv.reader(handle, delimiter=sep, quoting=quoting)
    finally:
        csv.field_size_limit(limit)


def _read_header(path: Path, corpus: Corpus) -> tuple[list[str], bool]:
    """The header's column names, and whether any record follows it."""
    try:
        with _records(path, corpus) as records:
            header = next(records, [])
            return header, any(True for record in records if record)
    except UnicodeDecodeError as error:
        raise not_utf8(path, error, key=corpus.key("path")) from None
    except csv.Error as error:
        raise DataError(f"{path}: cannot read the header line as {corpus.config.format.upper()} ({error})") from None


def _line_numbers(path: Path, corpus: Corpus, rows: list[int]) -> list[int]:
    with _records(path, corpus) as records:
        return line_numbers_of(_row_starts(records), rows)


def _row_starts(records: Iterator[list[str]]) -> Iterator[int]:
    """The 1-based line on which each row starts (a quoted field may span lines), after the header."""
    next(records, None)  # the header
    line = records.line_num + 1
    for record in records:
        if record:  # pandas skips blank lines, so they are not rows
            yield line
        line = records.line_num + 1


def _column_positions(path: Path, corpus: Corpus) -> tuple[int, int, int]:
    """(number of columns, position of the source column, position of the target column)."""
    config = corpus.config
    header, has_rows = _read_header(path, corpus)
    if not header:
        raise DataError(f"{path}: the file is empty; expected a header line with the columns "
                        f"{config.source_column!r} and {config.target_column!r}")
    positions = []
    for key, column in ((corpus.key("source_column"), config.source_column),
                        (corpus.key("target_column"), config.target_column)):
        if column not in header:
            raise DataError(f"{path}: no column {column!r} ({key}); the file's columns are "
                            f"{', '.join(map(repr, header))} (read as {config.format.upper()})")
        if header.count(column) > 1:
            raise DataError(f"{path}: the header names the column {column!r} ({key}) more than once")
        positions.append(header.index(column))
    if not has_rows:
        raise DataError(f"{path}: no sentence pairs after the header line")
    return len(header), positions[0], positions[1]


def _read_table(path: Path, corpus: Corpus, n_columns: int, name: str) -> datasets.Dataset:
    sep, quoting = _reader_options(corpus)
    names = [f"c{i}" for i in range(n_columns)]

    # What to do about a line with more fields than the header: TSV has no quoting to offer.
    hint = (f"a field containing {sep!r} must be quoted" if corpus.config.format == "csv" else
            "TSV has no quoting, so a sentence cannot hold a tab: remove it, or write the file as CSV")

    def diagnose(error: BaseException) -> DataError | None:
        if find_cause(error, pd.errors.ParserWarning) is not None:  # pandas' complaint about the first row
            line = next(iter(_line_numbers(path, corpus, [0])), 2)
            return DataError(f"{path}: line {line} has more fields than the header ({n_columns}); {hint}")
        parse_error = find_cause(error, pd.errors.ParserError)
        if parse_error is not None:
            detail = " ".join(str(parse_error).split())
            return DataError(f"{path}: not valid {corpus.config.format.upper()}: {detail}"
                             + (f"; {hint}" if "Expected" in detail else ""))
        return None

    with warnings.catch_warnings():
        # pandas only *warns* when the first data line has more fields than the header,
        # then drops the extra ones; an unquoted comma in a sentence must not pass silently.
        warnings.simplefilter("error", pd.errors.ParserWarning)
        return build(
            corpus, "csv", [path], [name], corpus.config.format.upper(), diagnose=diagnose,
            header=0,
            names=names,
            index_col=False,  # never guess that an extra field is a row index
            features=datasets.Features({column: STRING for column in names}),
            sep=sep,
            quoting=quoting,
            encoding="utf-8",
            # pandas would turn "NA", "null", "None", "nan" ... into missing values.
            keep_default_na=False,
            na_filter=False,
        )


__all__ = ["read_delimited"]
