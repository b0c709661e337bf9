"""What every reader of a data format shares: the corpus it is asked to read (`Source`), what it
returns (`RawPairs`: a raw Arrow table, one row per pair, in file order) and the helpers for its
errors. The readers themselves are delimited.py (CSV/TSV) and parallel_text.py (two line-aligned text
files); corpus.py's READERS table picks one by data.format. Nothing is cleaned or dropped by a
reader: that is corpus.py's job, the same for every format. docs/data-formats.md shows how to add one.

datasets finds a data file's cached Arrow table by its path and modification time, so a file
rewritten with its old time would give the old rows. Each file is therefore identified by its
content: a SHA-256 of its bytes, taken in one pass before datasets reads it, names the table's
configuration (`content_name`), and with it (`RawPairs.key`) every cache entry built from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets

from transformer.config import CorpusConfig
from transformer.errors import DataError
from transformer.files import file_sha256

logger = logging.getLogger(__name__)

STRING = datasets.Value("string")
_DIGEST_CHARS = 32  # hex digits of the SHA-256 kept: ample to tell contents apart, and the cache's paths stay short


@dataclass(frozen=True)
class Source:
    """One corpus to read: its file(s), their format, the columns holding the two sides, and the config
    section whose keys name them in messages (`data.path`, `data.source_column`, ...)."""

    path: str
    format: str
    target_path: str  # the target-language file of a pair of text files; "" otherwise
    source_column: str  # a column, or a field of a nested one: "translation.en"
    target_column: str
    section: str = "data"  # or data.corpora[N]
    split: str = "train"  # dataset (a DatasetDict's) and hub: the split holding the pairs
    hub_config: str = ""  # hub: the dataset's configuration

    @classmethod
    def of(cls, corpus: CorpusConfig, section: str = "data") -> "Source":
        return cls(corpus.path, corpus.format, corpus.target_path, corpus.source_column, corpus.target_column,
                   section, corpus.split, corpus.hub_config)

    def key(self, name: str) -> str:
        """The config key of field `name`, as messages write it."""
        return f"{self.section}.{name}"

    def describe(self) -> str:
        """How messages name the input: the file, both files of a pair of text files, or the Hub dataset."""
        if self.format == "hub":
            return f"the Hub dataset {self.path}" + (f" ({self.hub_config})" if self.hub_config else "")
        return f"{self.path} and {self.target_path}" if self.target_path else str(self.path)


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


def side_values(batch: dict[str, list], column: str) -> list:
    """One side's values in a batch of raw rows: `column`, or a field of a nested column
    ("translation.en": batch["translation"][i]["en"]). A missing field is None (an empty side)."""
    if column in batch:
        return batch[column]
    outer, field = column.split(".", 1)
    return [None if value is None else value.get(field) for value in batch[outer]]


def existing(path: Path, key: str) -> Path:
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


def not_utf8(path: Path, error: UnicodeDecodeError) -> DataError:
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


__all__ = ["STRING", "Source", "RawPairs", "side_values", "existing", "not_utf8", "find_cause", "content_name"]
