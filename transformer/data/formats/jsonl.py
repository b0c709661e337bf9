"""The reader of JSON lines (`data.format: jsonl`): one JSON object a line, in one file, a folder of
them or a glob pattern, as pandas (`to_json(orient="records", lines=True)`), Spark and datasets write
them, plain or compressed with gzip, bzip2 or xz; read by datasets' `json` builder into its cache. A
file holding one JSON array is read too. A line that is not an object, or whose side is not text, is
one DataError line naming the file and the line, found by reading the files again only once reading
failed.
"""

from __future__ import annotations

import codecs
import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from transformer.data.cache import content_key
from transformer.data.formats.columns import check_columns, check_utf8
from transformer.data.formats.common import (DECOMPRESSED, Corpus, RawPairs, build, compression, content_name,
                                             data_lines, line_numbers_of, not_utf8)
from transformer.data.formats.data_files import data_files
from transformer.errors import DataError

# How Spark and others name a compressed file datasets cannot read here (no codec installed, or none
# known by its first bytes): refused by name rather than read as bytes that are not UTF-8.
_UNREAD = {".zst": "zstd", ".lz4": "lz4", ".snappy": "snappy", ".deflate": "deflate", ".zip": "zip", ".7z": "7z"}
SUFFIXES = tuple(suffix + compressed for suffix in (".jsonl", ".json")
                 for compressed in ("", ".gz", ".bz2", ".xz", *_UNREAD))


def read_jsonl(corpus: Corpus) -> RawPairs:
    """`data.path`: a file of one JSON object a line, a folder of them (its *.jsonl and *.json files, of
    data.split where their names say splits) or a glob pattern. A side may be missing from an object or
    null: an empty side."""
    files = data_files(corpus, SUFFIXES, "*.jsonl or *.json")
    for file in files:
        _check_compression(corpus, file)
    # A file without a line of JSON holds no row (and the JSON builder would stop at it).
    key = corpus.key("path")
    filled = [file for file in files if _first_line(file, key)]
    if not filled:
        what = ("the file is" if Path(corpus.config.path).is_file() else
                f"its {len(files)} file{'s are' if len(files) > 1 else ' is'}")
        raise DataError(f"{corpus.describe()}: {what} empty ({corpus.key('path')})")
    names = [content_name(file) for file in filled]
    table = build(corpus, "json", filled, names, "JSON lines", diagnose=lambda _: _first_bad_line(corpus, filled))
    check_columns(corpus, table.features, corpus.describe(), diagnose=lambda: _first_bad_line(corpus, filled))
    check_utf8(corpus, table, corpus.describe(), diagnose=lambda: _first_bad_line(corpus, filled))
    config, content = corpus.config, content_key("jsonl", *names)
    if len(files) == 1 and not _is_json_array(files[0], key):
        return RawPairs(table, config.source_column, config.target_column, header=None, key=content,
                        line_numbers=lambda rows: _json_line_numbers(files[0], key, rows), unit="line")
    return RawPairs.of_table(table, config.source_column, config.target_column, content)


def _check_compression(corpus: Corpus, file: Path) -> None:
    """Refuse a file compressed other than with gzip, bzip2 or xz (the ones read), naming the compression."""
    kind = compression(file)
    if kind in DECOMPRESSED:
        return
    kind = kind or next((name for suffix, name in _UNREAD.items() if file.name.lower().endswith(suffix)), None)
    if kind is not None:
        raise DataError(f"{file}: compressed with {kind}, which is not read ({corpus.key('path')}); decompress it, "
                        "or compress it with gzip, bzip2 or xz")


def _json_lines(file: Path, key: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each line of `file` (named by the config key `key`) holding
    something, as the JSON builder reads them: decompressed, blank lines skipped, a byte-order mark
    dropped."""
    with contextlib.closing(data_lines(file, key)) as lines:
        for number, line in enumerate(lines, start=1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield number, line


def _first_line(file: Path, key: str) -> bytes:
    """The first line of `file` holding something; empty if there is none."""
    with contextlib.closing(_json_lines(file, key)) as lines:
        return next(lines, (0, b""))[1]


def _is_json_array(file: Path, key: str) -> bool:
    """Whether `file` holds one JSON array (which the JSON builder also reads) rather than JSON lines."""
    return _first_line(file, key).lstrip().startswith(b"[")


def _json_line_numbers(file: Path, key: str, rows: list[int]) -> list[int]:
    with contextlib.closing(_json_lines(file, key)) as lines:
        return line_numbers_of((number for number, _ in lines), rows)


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "null"


def _first_bad_line(corpus: Corpus, files: Sequence[Path]) -> DataError | None:
    """The first line of `files` that is not UTF-8, not JSON, not an object, or whose side is neither
    text nor null, as a DataError naming the file, the line and the key; None where every line is right.
    Only called once reading failed (or a side came out as other than text), to say where."""
    path_key = corpus.key("path")
    for file in files:
        if _is_json_array(file, path_key):
            continue  # one array, not line by line: the builder's message has to do
        for number, line in _json_lines(file, path_key):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as error:
                return not_utf8(file, error, DECOMPRESSED, key=path_key)
            try:
                value = json.loads(text)
            except ValueError as error:
                reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
                return DataError(f"{file}: line {number} is not JSON ({reason}) ({path_key})")
            if not isinstance(value, dict):
                return DataError(f"{file}: line {number} is {_json_kind(value)}, not a JSON object "
                                 f"({path_key}): JSON lines hold one object a line")
            for key, column in corpus.sides():
                side = _json_side(value, column)
                if side is not None and not isinstance(side, str):
                    return DataError(f"{file}: line {number}: {column!r} ({key}) is {_json_kind(side)}, not text")
    return None


def _json_side(value: dict, column: str) -> object:
    if column in value:
        return value[column]
    outer, dot, field = column.partition(".")
    nested = value.get(outer) if dot else None
    return nested.get(field) if isinstance(nested, dict) else None


__all__ = ["read_jsonl", "SUFFIXES"]
