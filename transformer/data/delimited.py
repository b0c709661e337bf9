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
from transformer.data.readers import STRING, RawPairs, Source, content_name, existing, find_cause, not_utf8
from transformer.errors import DataError


def read_delimited(source: Source) -> RawPairs:
    """`source.path` as a table of string columns `c0`, `c1`, ... (our names, not the header's: a header
    may have empty or repeated names, which pandas would rename behind our back)."""
    path = existing(Path(source.path), source.key("path"))
    n_columns, source_position, target_position = _column_positions(path, source)
    name = content_name(path)
    return RawPairs(_read_table(path, source, n_columns, name), f"c{source_position}", f"c{target_position}",
                    header=(source.source_column, source.target_column), key=content_key(source.format, name),
                    line_numbers=lambda rows: _line_numbers(path, source, rows))


def _reader_options(source: Source) -> tuple[str, int]:
    """(separator, quoting) for the file format.

    TSV is read without quote handling: a sentence may well start with '"' (French quotes), and
    TSV has no quoting convention (fields simply cannot contain tabs).
    """
    if source.format == "tsv":
        return "\t", csv.QUOTE_NONE
    return ",", csv.QUOTE_MINIMAL


@contextlib.contextmanager
def _records(path: Path, source: Source) -> Iterator[Iterator[list[str]]]:
    """The file's records as the csv module reads them (the header first, blank lines skipped as pandas does)."""
    sep, quoting = _reader_options(source)
    # The csv module refuses fields over 128 KB by default; pandas, which reads the data, does not.
    limit = csv.field_size_limit()
    csv.field_size_limit(sys.maxsize)
    try:
        # utf-8-sig drops a byte-order mark, which would otherwise glue itself to the first name.
        with path.open(encoding="utf-8-sig", newline="") as handle:
            yield csv.reader(handle, delimiter=sep, quoting=quoting)
    finally:
        csv.field_size_limit(limit)


def _read_header(path: Path, source: Source) -> tuple[list[str], bool]:
    """The header's column names, and whether any record follows it."""
    try:
        with _records(path, source) as records:
            header = next(records, [])
            return header, any(True for record in records if record)
    except UnicodeDecodeError as error:
        raise not_utf8(path, error) from None
    except csv.Error as error:
        raise DataError(f"{path}: cannot read the header line as {source.format.upper()} ({error})") from None


def _line_numbers(path: Path, source: Source, rows: list[int]) -> list[int]:
    wanted, found = set(rows), {}
    with _records(path, source) as records:
        next(records, None)  # the header
        row, line = 0, records.line_num + 1
        for record in records:
            if record:  # pandas skips blank lines, so they are not rows
                if row in wanted:
                    found[row] = line
                    if len(found) == len(wanted):
                        break
                row += 1
            line = records.line_num + 1
    return [found[row] for row in rows if row in found]


def _column_positions(path: Path, source: Source) -> tuple[int, int, int]:
    """(number of columns, position of the source column, position of the target column)."""
    header, has_rows = _read_header(path, source)
    if not header:
        raise DataError(f"{path}: the file is empty; expected a header line with the columns "
                        f"{source.source_column!r} and {source.target_column!r}")
    positions = []
    for key, column in ((source.key("source_column"), source.source_column),
                        (source.key("target_column"), source.target_column)):
        if column not in header:
            raise DataError(f"{path}: no column {column!r} ({key}); the file's columns are "
                            f"{', '.join(map(repr, header))} (read as {source.format.upper()})")
        if header.count(column) > 1:
            raise DataError(f"{path}: the header names the column {column!r} ({key}) more than once")
        positions.append(header.index(column))
    if not has_rows:
        raise DataError(f"{path}: no sentence pairs after the header line")
    return len(header), positions[0], positions[1]


def _read_table(path: Path, source: Source, n_columns: int, config_name: str) -> datasets.Dataset:
    sep, quoting = _reader_options(source)
    names = [f"c{i}" for i in range(n_columns)]
    try:
        with warnings.catch_warnings():
            # pandas only *warns* when the first data line has more fields than the header,
            # then drops the extra ones; an unquoted comma in a sentence must not pass silently.
            warnings.simplefilter("error", pd.errors.ParserWarning)
            return datasets.load_dataset(
                "csv",
                name=config_name,
                data_files=str(path),
                split="train",
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
    except Exception as error:
        decode_error = find_cause(error, UnicodeDecodeError)
        if decode_error is not None:
            raise not_utf8(path, decode_error) from None
        if find_cause(error, pd.errors.ParserWarning) is not None:
            raise DataError(f"{path}: line 2 has more fields than the header ({n_columns}); "
                            f"a field containing {sep!r} must be quoted") from None
        parse_error = find_cause(error, pd.errors.ParserError)
        if parse_error is not None:
            detail = " ".join(str(parse_error).split())
            hint = f"; a field containing {sep!r} must be quoted" if "Expected" in detail else ""
            raise DataError(f"{path}: not valid {source.format.upper()}: {detail}{hint}") from None
        raise


__all__ = ["read_delimited"]
