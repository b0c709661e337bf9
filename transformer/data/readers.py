"""Read a pairs file into a raw Arrow `datasets.Dataset`, one row per pair, with exact errors.

CSV/TSV (one file with a header line, read by pandas) or line-aligned plain text (two files, read
by datasets' `text` builder). Nothing is cleaned or dropped here: that is pairs.py's job, the
same for every format. Messages name the file, the line and the config key.

datasets finds a data file's cached Arrow table by its path and modification time, so a file
rewritten with its old time would give the old rows. Each file is therefore identified by its
content: a SHA-256 of its bytes, taken in one pass before datasets reads it, names the table's
configuration, and with it every cache entry built from it.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import pandas as pd

from transformer.config import DataConfig
from transformer.files import file_sha256
from transformer.errors import DataError

logger = logging.getLogger(__name__)

_STRING = datasets.Value("string")
_DIGEST_CHARS = 32  # hex digits of the SHA-256 kept: ample to tell contents apart, and the cache's paths stay short


@dataclass(frozen=True)
class RawPairs:
    """The file(s) as read: string columns, one row per pair, in file order."""

    table: datasets.Dataset
    source_column: str  # the table's column holding the source language
    target_column: str  # the table's column holding the target language
    # The header's names of those two columns, to spot a repeated header line (two files pasted
    # together); None for text, which has no header.
    header: tuple[str, str] | None


def describe_input(config: DataConfig) -> str:
    """How messages name the input: the file, or both files of a text corpus."""
    return f"{config.path} and {config.target_path}" if config.format == "text" else str(config.path)


def read_pairs_file(config: DataConfig, cache_dir: str | Path | None) -> RawPairs:
    """The pairs file(s) named by `config` as a Dataset; a DataError names the file, line or key at fault."""
    if config.format == "text":
        return _read_parallel_text(config, cache_dir)
    path = _existing(Path(config.path), "data.path")
    n_columns, source_position, target_position = _column_positions(path, config)
    return RawPairs(_read_table(path, config, n_columns, cache_dir), f"c{source_position}", f"c{target_position}",
                    (config.source_column, config.target_column))


def line_numbers(config: DataConfig, rows: list[int]) -> list[int]:
    """1-based file line on which each 0-based row in `rows` starts (only for messages)."""
    if config.format == "text":
        return [row + 1 for row in rows]
    return _csv_line_numbers(Path(config.path), config, rows)


# --------------------------------------------------------------------------- shared


def _existing(path: Path, key: str) -> Path:
    if not path.is_file():
        raise DataError(f"data file not found: {path} ({key})")
    return path


def _first_undecodable_line(path: Path) -> int | None:
    """1-based number of the first line that is not UTF-8; only called once decoding failed."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return None


def _not_utf8(path: Path, error: UnicodeDecodeError) -> DataError:
    line = _first_undecodable_line(path)
    where = f" at line {line}" if line is not None else ""
    return DataError(f"{path}: not UTF-8 text{where} ({error.reason}); re-save the file as UTF-8")


def find_cause(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """`error` or the first exception of type `kind` it was raised from (datasets wraps a builder's errors)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def content_name(path: Path) -> str:
    """The name of `path`'s content for datasets' cache: the SHA-256 of its bytes."""
    started = time.perf_counter()
    digest = file_sha256(path)
    # The price of keying the cache by content, in the log where bench/scale.py reads the stages' times.
    logger.info("%s: content SHA-256 %s... (%.1f MB hashed in %.2f s)", path, digest[:12], path.stat().st_size / 1e6,
                time.perf_counter() - started)
    return f"content-{digest[:_DIGEST_CHARS]}"


# --------------------------------------------------------------------------- CSV / TSV


def _reader_options(config: DataConfig) -> tuple[str, int]:
    """(separator, quoting) for the file format.

    TSV is read without quote handling: a sentence may well start with '"' (French quotes), and
    TSV has no quoting convention (fields simply cannot contain tabs).
    """
    if config.format == "tsv":
        return "\t", csv.QUOTE_NONE
    return ",", csv.QUOTE_MINIMAL


@contextlib.contextmanager
def _records(path: Path, config: DataConfig) -> Iterator[Iterator[list[str]]]:
    """The file's records as the csv module reads them (the header first, blank lines skipped as pandas does)."""
    sep, quoting = _reader_options(config)
    # The csv module refuses fields over 128 KB by default; pandas, which reads the data, does not.
    limit = csv.field_size_limit()
    csv.field_size_limit(sys.maxsize)
    try:
        # utf-8-sig drops a byte-order mark, which would otherwise glue itself to the first name.
        with path.open(encoding="utf-8-sig", newline="") as handle:
            yield csv.reader(handle, delimiter=sep, quoting=quoting)
    finally:
        csv.field_size_limit(limit)


def _read_header(path: Path, config: DataConfig) -> tuple[list[str], bool]:
    """The header's column names, and whether any record follows it."""
    try:
        with _records(path, config) as records:
            header = next(records, [])
            return header, any(True for record in records if record)
    except UnicodeDecodeError as error:
        raise _not_utf8(path, error) from None
    except csv.Error as error:
        raise DataError(f"{path}: cannot read the header line as {config.format.upper()} ({error})") from None


def _csv_line_numbers(path: Path, config: DataConfig, rows: list[int]) -> list[int]:
    wanted, found = set(rows), {}
    with _records(path, config) as records:
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


def _column_positions(path: Path, config: DataConfig) -> tuple[int, int, int]:
    """(number of columns, position of the source column, position of the target column)."""
    header, has_rows = _read_header(path, config)
    if not header:
        raise DataError(f"{path}: the file is empty; expected a header line with the columns "
                        f"{config.source_column!r} and {config.target_column!r}")
    positions = []
    for key, column in (("data.source_column", config.source_column), ("data.target_column", config.target_column)):
        if column not in header:
            raise DataError(f"{path}: no column {column!r} ({key}); the file's columns are "
                            f"{', '.join(map(repr, header))} (read as {config.format.upper()})")
        if header.count(column) > 1:
            raise DataError(f"{path}: the header names the column {column!r} ({key}) more than once")
        positions.append(header.index(column))
    if not has_rows:
        raise DataError(f"{path}: no sentence pairs after the header line")
    return len(header), positions[0], positions[1]


def _read_table(path: Path, config: DataConfig, n_columns: int,
                cache_dir: str | Path | None) -> datasets.Dataset:
    """The raw file as a Dataset with string columns `c0`, `c1`, ... (our names, not the header's:
    a header may have empty or repeated names, which pandas would rename behind our back)."""
    sep, quoting = _reader_options(config)
    names = [f"c{i}" for i in range(n_columns)]
    try:
        with warnings.catch_warnings():
            # pandas only *warns* when the first data line has more fields than the header,
            # then drops the extra ones; an unquoted comma in a sentence must not pass silently.
            warnings.simplefilter("error", pd.errors.ParserWarning)
            return datasets.load_dataset(
                "csv",
                name=content_name(path),
                data_files=str(path),
                split="train",
                cache_dir=None if cache_dir is None else str(cache_dir),
                header=0,
                names=names,
                index_col=False,  # never guess that an extra field is a row index
                features=datasets.Features({name: _STRING for name in names}),
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
            raise _not_utf8(path, decode_error) from None
        if find_cause(error, pd.errors.ParserWarning) is not None:
            raise DataError(f"{path}: line 2 has more fields than the header ({n_columns}); "
                            f"a field containing {sep!r} must be quoted") from None
        parse_error = find_cause(error, pd.errors.ParserError)
        if parse_error is not None:
            detail = " ".join(str(parse_error).split())
            hint = f"; a field containing {sep!r} must be quoted" if "Expected" in detail else ""
            raise DataError(f"{path}: not valid {config.format.upper()}: {detail}{hint}") from None
        raise


# --------------------------------------------------------------------------- line-aligned text


def _read_lines(path: Path, key: str, cache_dir: str | Path | None) -> datasets.Dataset:
    """One text file as a Dataset with one string column `text`, a row per line.

    datasets' text builder reads 10 MB at a time into Arrow, so memory stays flat. It opens the file
    in Python's text mode: a line ends at "\\n", "\\r\\n" or a lone "\\r" (which _lone_carriage_return
    points out when the line counts disagree); other Unicode line separators stay inside the line.
    """
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty ({key})")
    try:
        return datasets.load_dataset(
            "text",
            name=content_name(path),
            data_files=str(path),
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
            features=datasets.Features({"text": _STRING}),
            encoding="utf-8-sig",  # a byte-order mark is not part of the first sentence
        )
    except Exception as error:
        decode_error = find_cause(error, UnicodeDecodeError)
        if decode_error is not None:
            raise _not_utf8(path, decode_error) from None
        raise


def _lone_carriage_return(path: Path) -> int | None:
    """1-based number (counting "\\n" only, as `wc -l` and editors do) of the first line holding a "\\r"
    that is not part of a "\\r\\n"; only called once the line counts disagreed."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if b"\r" in line.removesuffix(b"\n").removesuffix(b"\r"):
                return number
    return None


def _read_parallel_text(config: DataConfig, cache_dir: str | Path | None) -> RawPairs:
    source_path, target_path = Path(config.path), Path(config.target_path)
    # Both files must exist before either is read: reading a large file only to fail on a typo wastes minutes.
    _existing(source_path, "data.path")
    _existing(target_path, "data.target_path")
    source_lines = _read_lines(source_path, "data.path", cache_dir)
    target_lines = _read_lines(target_path, "data.target_path", cache_dir)
    if len(source_lines) != len(target_lines):
        hints = [f"; {path} has a carriage return (\\r) inside line {line}, which counts as a line break"
                 for path in (source_path, target_path) if (line := _lone_carriage_return(path)) is not None]
        raise DataError(f"{source_path} (data.path) has {len(source_lines)} lines but {target_path} (data.target_path) "
                        f"has {len(target_lines)}: the files must be line-aligned, line N of one translating line N "
                        f"of the other{''.join(hints)}")
    # Side by side, without a copy: the result is a view of the two memory-mapped tables.
    table = datasets.concatenate_datasets([source_lines.rename_column("text", "c0"), target_lines.rename_column("text", "c1")],
                                          axis=1)
    return RawPairs(table, "c0", "c1", header=None)


__all__ = ["RawPairs", "describe_input", "read_pairs_file", "line_numbers", "find_cause", "content_name"]
