"""What every reader of a data format shares: the corpus it is asked to read (`Corpus`: the corpus's
config and the config section naming it), what it returns (`RawPairs`: a raw Arrow table, one row per
pair, in file order), the one call of a datasets builder (`build`) and the helpers for its errors.

datasets finds a data file's cached Arrow table by its path and modification time, so a file
rewritten with its old time would give the old rows. Each file is therefore identified by its
content: a SHA-256 of its bytes, taken in one pass before datasets reads it, names the table's
configuration (`content_name`), and with it (`RawPairs.key`) every cache entry built from it.
"""

from __future__ import annotations

import bz2
import contextlib
import glob
import gzip
import logging
import lzma
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import datasets

from transformer.config import CorpusConfig
from transformer.data.cache import content_key
from transformer.errors import DataError, find_cause, from_the_system
from transformer.files import file_sha256

logger = logging.getLogger(__name__)

STRING = datasets.Value("string")
_DIGEST_CHARS = 32  # hex digits of the SHA-256 kept: ample to tell contents apart, and the cache's paths stay short
_REASON_CHARS = 300  # of a library's error message quoted in ours

# A compressed file is known by its first bytes, as datasets knows it (not by its name).
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
          (b"\x04\x22\x4d\x18", "lz4"), (b"PK\x03\x04", "zip"))
# The compressions the standard library opens (and datasets' builders read): what open_data decompresses.
_OPENERS = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}
DECOMPRESSED = frozenset(_OPENERS)


@dataclass(frozen=True)
class Corpus:
    """One corpus to read: its config (path, format, columns, split, ...) and the config section whose
    keys name it in messages: `data`, or `data.corpora[N]`."""

    config: CorpusConfig
    section: str = "data"

    def key(self, name: str) -> str:
        """The config key of field `name`, as messages write it: `data.path`, `data.corpora[1].split`."""
        return f"{self.section}.{name}"

    def sides(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """(config key, column) of the source side, then of the target side."""
        config = self.config
        return ((self.key("source_column"), config.source_column), (self.key("target_column"), config.target_column))

    def describe(self) -> str:
        """How messages name the input: the file, both files of a pair of text files, or the Hub dataset."""
        config = self.config
        if config.format == "hub":
            return f"the Hub dataset {config.path}" + (f" ({config.hub_config})" if config.hub_config else "")
        return f"{config.path} and {config.target_path}" if config.target_path else config.path


@dataclass(frozen=True)
class RawPairs:
    """The corpus as read: string columns, one row per pair, in file order."""

    table: datasets.Dataset
    source_column: str  # the table's column holding the source language
    target_column: str  # the table's column holding the target language
    # The header's names of those two columns, to spot a repeated header line (two files pasted
    # together); None for a format without a header.
    header: tuple[str, str] | None
    key: str  # names what was read: the content of the file(s) and the format they were read as
    line_numbers: Callable[[list[int]], list[int]]  # the 1-based line on which each 0-based row starts
    unit: str = "line"  # what line_numbers count: "line" in a text file, "row" in a table

    @classmethod
    def of_table(cls, table: datasets.Dataset, source_column: str, target_column: str, key: str,
                 unit: str = "row") -> RawPairs:
        """A table without a header line whose rows are counted from 1: a table's rows (unit "row"),
        or a text file's lines, one row each (unit "line")."""
        return cls(table, source_column, target_column, header=None, key=key, line_numbers=row_numbers, unit=unit)


def side_values(batch: dict[str, list], column: str) -> list:
    """One side's values in a batch of raw rows: `column`, or a field of a nested column
    ("translation.en": batch["translation"][i]["en"]). A missing field is None (an empty side)."""
    if column in batch:
        return batch[column]
    outer, field = column.split(".", 1)
    return [None if value is None else value.get(field) for value in batch[outer]]


def row_numbers(rows: list[int]) -> list[int]:
    """RawPairs.line_numbers of a table whose rows are counted from 1 (unit "row")."""
    return [row + 1 for row in rows]


def line_numbers_of(starts: Iterable[int], rows: list[int]) -> list[int]:
    """The 1-based line on which each 0-based row of `rows` starts, given the line on which each row
    of the file starts, in order (`starts`, read no further than needed); rows past the end left out."""
    wanted, found = set(rows), {}
    for row, line in enumerate(starts):
        if row in wanted:
            found[row] = line
            if len(found) == len(wanted):
                break
    return [found[row] for row in rows if row in found]


def existing(path: Path, key: str) -> Path:
    """`path`, a file; one DataError line where it is missing or a folder."""
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a file ({key}); name the data file in it")
    if not path.is_file():
        raise DataError(f"data file not found: {path} ({key})")
    return path


# --------------------------------------------------------------------------- compressed files, bytes not UTF-8


def compression(path: Path) -> str | None:
    """The compression `path` is stored in (gzip, bzip2, xz, zstd, lz4, zip), by its first bytes; None if none."""
    with path.open("rb") as handle:
        start = handle.read(6)
    return next((name for magic, name in _MAGIC if start.startswith(magic)), None)


def open_data(path: Path) -> BinaryIO:
    """`path` opened for reading bytes, decompressed where it is gzip, bzip2 or xz (as datasets reads it)."""
    opener = _OPENERS.get(compression(path) or "")
    return opener(path, "rb") if opener is not None else path.open("rb")


def data_lines(path: Path, key: str) -> Iterator[bytes]:
    """The lines of `path` as bytes, decompressed as open_data does. A compressed file that is damaged
    or cut short (a download stopped halfway) is one DataError line naming it and its config key `key`
    (`data.path`): the decompressors say so with errors of their own, not the system's."""
    try:
        with open_data(path) as handle:
            yield from handle
    except (EOFError, zlib.error, lzma.LZMAError, OSError) as error:
        if from_the_system(error):
            raise
        raise DataError(f"{path}: cannot decompress it ({key}): {one_line(error) or type(error).__name__}; the "
                        f"{compression(path) or 'compressed'} file is damaged or cut short: download or "
                        "compress it again") from None


def _first_undecodable_line(path: Path, key: str) -> int | None:
    """1-based number of the first line that is not UTF-8; only called once decoding failed."""
    for number, line in enumerate(data_lines(path, key), start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return number
    return None


def not_utf8(path: Path, error: UnicodeDecodeError, decompressed: frozenset[str] = frozenset(), *,
             key: str) -> DataError:
    """The error for `path` (named by the config key `key`), which failed to decode as UTF-8: a
    compressed file the format does not decompress (`decompressed`: the compressions it does) is named
    as such, for re-saving a compressed file as UTF-8 would not help; else the first line that is not
    UTF-8."""
    kind = compression(path)
    if kind is not None and kind not in decompressed:
        also = f", or compress it with {', '.join(sorted(decompressed))}" if decompressed else ""
        return DataError(f"{path}: a {kind}-compressed file, which this format does not read; decompress it{also}")
    line = _first_undecodable_line(path, key)
    where = f" at line {line}" if line is not None else ""
    return DataError(f"{path}: not UTF-8 text{where} ({error.reason}); re-save the file as UTF-8")


# --------------------------------------------------------------------------- building the table


def content_name(path: Path) -> str:
    """The name of `path`'s content for datasets' cache: the SHA-256 of its bytes."""
    started = time.perf_counter()
    digest = file_sha256(path)
    # The price of keying the cache by content, in the log where bench/scale.py reads the stages' times.
    logger.info("%s: content SHA-256 %s... (%.1f MB hashed in %.2f s)", path, digest[:12], path.stat().st_size / 1e6,
                time.perf_counter() - started)
    return f"content-{digest[:_DIGEST_CHARS]}"


@contextlib.contextmanager
def _builder_errors_unlogged(builder: str) -> Iterator[None]:
    """datasets' builders log an error before raising it; the error raised becomes our one line, so
    their log line (on standard error) is left out."""
    builder_logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    quiet = lambda record: record.levelno < logging.ERROR  # noqa: E731
    builder_logger.addFilter(quiet)
    try:
        yield
    finally:
        builder_logger.removeFilter(quiet)


def build(corpus: Corpus, builder: str, files: Sequence[Path], content_names: Sequence[str], what: str, *,
          where: str | None = None, key: str = "path",
          diagnose: Callable[[BaseException], DataError | None] | None = None, **options: object) -> datasets.Dataset:
    """`files`' rows, in order, as one table in datasets' cache, built by datasets' `builder` ("csv",
    "text", "parquet", "json", "arrow") under a configuration named by the files' content
    (`content_names`, content_name's). `options` go to the builder.

    An error the user can fix becomes one DataError line: `diagnose(error)`'s if it finds one, else
    the file that is not UTF-8, else one naming `where` (default: the corpus), the config key `key`
    and the builder's reason. The system's errors (a permission, a full disk) go up as they are: the
    script names them with their path."""
    try:
        with _builder_errors_unlogged(builder):
            return datasets.load_dataset(
                builder,
                name=f"content-{content_key(*content_names)}",
                # Escaped: a path holding "[" or "*" (a folder "WMT [en-fr]") names that file, not a pattern.
                data_files=[glob.escape(str(file.resolve())) for file in files],
                split="train",
                # Into the cache, even where HF_DATASETS_IN_MEMORY_MAX_SIZE would keep a small table in
                # memory: every later stage works on the table's cache files.
                keep_in_memory=False,
                **options,
            )
    except Exception as error:
        if find_cause(error, OSError, from_the_system) is not None:
            raise
        found = diagnose(error) if diagnose is not None else None
        if found is None:
            decode_error = find_cause(error, UnicodeDecodeError)
            if decode_error is not None and len(files) == 1:  # decompressed by the builder, if it was
                found = not_utf8(files[0], decode_error, DECOMPRESSED, key=corpus.key(key))
        if found is None:
            found = DataError(f"{where or corpus.describe()}: cannot read it as {what} ({corpus.key(key)}): "
                              f"{reason(error)}")
        raise found from None


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


def reason(error: BaseException) -> str:
    """`error` in one line, as its first informative cause says it (datasets wraps a builder's errors
    in a DatasetGenerationError that says nothing more)."""
    cause = find_cause(error, BaseException, lambda cause: not isinstance(
        cause, datasets.exceptions.DatasetGenerationError) and bool(str(cause).strip()))
    return f"{type(cause).__name__}: {one_line(cause)}" if cause is not None else type(error).__name__


__all__ = ["STRING", "DECOMPRESSED", "Corpus", "RawPairs", "side_values", "row_numbers", "line_numbers_of",
           "existing", "compression", "open_data", "data_lines", "not_utf8", "content_name", "build", "one_line",
           "reason"]
