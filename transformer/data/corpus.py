"""A corpus read and cleaned: the reader of its format (READERS) gives the raw rows, text.clean_text
cleans both sides in a cached `map`, and rows no sentence pair can come from are dropped, counted
and logged with their line numbers. The result is `Rows` of the cleaned table: nothing here holds a
Python object per pair, so corpora larger than memory work. Splitting is split.py's job, encoding
encode.py's.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import logging
import os
from dataclasses import dataclass, field

import datasets
import numpy as np
import pyarrow.compute as pc

from transformer.config import DataConfig, FilterConfig
from transformer.data.cache import cached_array, code_digest, content_key
from transformer.data.filters import PAIR_FILTERS, check_languages, duplicate_mask, pair_masks
from transformer.data.formats.readers import READERS
from transformer.data.formats.common import Corpus, RawPairs, side_values
from transformer.data.rows import SOURCE, TARGET, WRITER_BATCH_ROWS, Rows, cache_writes, num_proc
from transformer.data.text import clean_text
from transformer.errors import DataError, UserError, find_cause, from_the_system

logger = logging.getLogger(__name__)


# A side longer than data.max_length * this many characters is dropped on reading. No subword
# of natural text is that long on average, so such a row would be dropped as too long after
# encoding anyway; dropping it first spares the BPE trainer, whose cost grows with the square of
# a word's length (one 1 MB "word" takes it many minutes).
MAX_CHARS_PER_TOKEN = 32
_LINES_SHOWN = 5  # line numbers named in a warning about dropped rows

# The cleaned rows change with this code and the cleaning's: both are in the key of the cleaned table.
_CODE = code_digest("corpus.py", "text.py", "filters.py")
_FILTER_DIR = "filters"  # beside the cleaned table: why each row is left out, per setting
_DUPLICATES_DIR = "duplicates"  # beside the first corpus's table: the rows repeating an earlier pair
# Why a row is left out, as stored (0: kept): the cleaning's rules, then the filters in their order.
REASONS = ("kept", "empty", "header", "long", *PAIR_FILTERS)
_EXAMPLES_SHOWN = 2  # dropped pairs quoted in the log, per filter and corpus


@dataclass(frozen=True)
class LoadReport:
    """What `load_pairs` read of one corpus, what it dropped and why, and where its rows are."""

    path: str
    rows_read: int
    rows_dropped_empty: int  # rows where either side was empty after cleaning
    rows_dropped_header: int = 0  # rows repeating the header line (e.g. two files pasted together)
    rows_dropped_long: int = 0  # rows with a side longer than data.max_length * MAX_CHARS_PER_TOKEN characters
    target_path: str = ""  # the target-language file, for data.format text (`path` is then the source one)
    # Rows each filter dropped (filters.PAIR_FILTERS, then "duplicates"); a row counts under one reason.
    rows_filtered: dict[str, int] = field(default_factory=dict)
    section: str = "data"  # the config section naming the corpus: data, or data.corpora[N]
    weight: float = 1.0
    held_out: bool = True  # whether valid and test pairs are drawn from it
    rows: tuple[int, int] = (0, 0)  # [start, end) of its rows in the table of all corpora's pairs

    @property
    def rows_kept(self) -> int:
        return (self.rows_read - self.rows_dropped_empty - self.rows_dropped_header - self.rows_dropped_long
                - sum(self.rows_filtered.values()))


def _clean_batch(batch: dict[str, list], source_column: str, target_column: str) -> dict[str, list[str]]:
    # A row with a missing trailing field arrives as None; it becomes "" and is dropped as empty.
    return {
        SOURCE: [clean_text(text) if text is not None else "" for text in side_values(batch, source_column)],
        TARGET: [clean_text(text) if text is not None else "" for text in side_values(batch, target_column)],
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
    """'line 7' / 'lines 7, 9, ...' (or rows) for the rows where `mask` is True."""
    rows = np.flatnonzero(mask)
    lines = raw.line_numbers([int(r) for r in rows[:_LINES_SHOWN]])
    more = ", ..." if len(rows) > len(lines) else ""
    return raw.unit + ("" if len(lines) == 1 and not more else "s") + " " + ", ".join(map(str, lines)) + more


def _examples(raw: RawPairs, cleaned: Rows, mask: np.ndarray) -> str:
    """A few of the rows where `mask` is True, quoted: 'line 7: "Hello." -> "Hello."'."""
    rows = [int(row) for row in np.flatnonzero(mask)[:_EXAMPLES_SHOWN]]
    found = cleaned.take(rows, [SOURCE, TARGET])
    lines = raw.line_numbers(rows)
    return "; ".join(f"{raw.unit} {line}: {_quote(source)} -> {_quote(target)}"
                     for line, source, target in zip(lines, found[SOURCE], found[TARGET]))


def _quote(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


_FILTER_REASONS = {
    "copies": "the same on both sides once case, spaces and punctuation are set aside (filter.copies)",
    "letters": "a side with fewer letters than filter.min_letter_share={filters.min_letter_share:g} of its characters",
    "length_ratio": "one side over filter.max_length_ratio={filters.max_length_ratio:g} times as long as the other",
    "language": "a side in the other language (filter.language, confidence {filters.language_confidence:g})",
    "duplicates": "a pair already read (filter.duplicates)",
}


@cache_writes
def load_pairs(config: DataConfig, filters: FilterConfig | None = None) -> tuple[Rows, tuple[LoadReport, ...]]:
    """Read every corpus `config` names into one table of rows with exactly the columns `source` and
    `target`, cleaned, corpus after corpus; with a report of each.

    Rows with an empty side (after cleaning), rows repeating the header line (CSV/TSV), rows with a
    side longer than data.max_length * MAX_CHARS_PER_TOKEN characters and the rows `filters` drop
    are left out, counted in the reports and logged with their line numbers and examples. datasets
    keeps its Arrow files in its cache (HF_DATASETS_CACHE). A DataError names the file and key for a
    missing file or column, non-UTF-8 bytes, malformed CSV, text files of different lengths, or a
    corpus with no pair left.
    """
    filters = filters or FilterConfig()
    check_languages(filters)
    tables, masks, keys, reports, start = [], [], [], [], 0
    for corpus, section in config.corpus_list():
        cleaned, kept, report = _load_corpus(Corpus(corpus, section), config.max_length, filters)
        report = dataclasses.replace(report, section=section, weight=corpus.weight, held_out=corpus.held_out,
                                     rows=(start, start + len(cleaned)))
        tables.append(cleaned.table)
        masks.append(kept)
        keys.append(content_key(cleaned.key, _mask_digest(kept)))
        reports.append(report)
        start += len(cleaned)
    if len(tables) == 1:  # one corpus: its own table, as it was before several were possible
        table, key = tables[0], keys[0]
    else:
        table, key = datasets.concatenate_datasets(tables), content_key("corpora", *keys)
    kept = np.concatenate(masks)
    if filters.duplicates:
        reports = _drop_duplicates(Rows(table, key), kept, reports)
        key = content_key(key, "unique")
    pairs = Rows(table, key) if kept.all() else Rows(table, content_key(key, "kept"), kept)
    if len(reports) > 1:
        for report in reports:
            logger.info("%s (%s): %d sentence pairs, weight %g%s", report.section, report.path, report.rows_kept,
                        report.weight, ", valid and test drawn from it" if report.held_out else "")
    logger.info("%s: %d sentence pairs", reports[0].path if len(reports) == 1 else "all corpora", len(pairs))
    return pairs, tuple(reports)


def _mask_digest(mask: np.ndarray) -> str:
    """Which rows a mask keeps, as a digest (an eighth of a byte a row hashed): part of the key of
    the rows kept, whatever rule and setting chose them."""
    return hashlib.sha256(np.packbits(mask).tobytes() + len(mask).to_bytes(8, "little")).hexdigest()


def _load_corpus(corpus: Corpus, max_length: int, filters: FilterConfig) -> tuple[Rows, np.ndarray, LoadReport]:
    """One corpus cleaned (every row), the mask of the rows kept, and its report."""
    name = corpus.describe()
    logger.info("reading %s", name)  # minutes for a corpus of millions of pairs
    raw = _read(corpus)
    cleaned = _clean(raw)
    reasons = _reasons(raw, cleaned, max_length, filters)
    counts = np.bincount(reasons, minlength=len(REASONS))
    report = LoadReport(path=corpus.config.path, rows_read=len(cleaned), rows_dropped_empty=int(counts[1]),
                        rows_dropped_header=int(counts[2]), rows_dropped_long=int(counts[3]),
                        target_path=corpus.config.target_path,
                        rows_filtered={reason: int(counts[code]) for code, reason in enumerate(REASONS) if code > 3})
    if report.rows_dropped_empty:
        logger.warning("%s: dropped %d of %d rows with an empty source or target side (%s)",
                       name, report.rows_dropped_empty, report.rows_read, _where(raw, reasons == 1))
    if report.rows_dropped_header:
        logger.warning("%s: dropped %d of %d rows repeating the header line (%s); were two files pasted together?",
                       name, report.rows_dropped_header, report.rows_read, _where(raw, reasons == 2))
    if report.rows_dropped_long:
        logger.warning("%s: dropped %d of %d rows with a side longer than %d characters (%s): far beyond "
                       "data.max_length=%d tokens", name, report.rows_dropped_long, report.rows_read,
                       max_length * MAX_CHARS_PER_TOKEN, _where(raw, reasons == 3), max_length)
    for code, reason in enumerate(REASONS):
        if code > 3 and counts[code]:
            logger.info("%s: filtered out %d of %d pairs, %s; e.g. %s", name, counts[code], report.rows_read,
                        _FILTER_REASONS[reason].format(filters=filters), _examples(raw, cleaned, reasons == code))
    if not report.rows_kept:
        raise DataError(f"{name} ({corpus.key('path')}): no usable sentence pairs: of {report.rows_read} rows, "
                        f"{_dropped_summary(report)}")
    return cleaned, reasons == 0, report


def _read(corpus: Corpus) -> RawPairs:
    """The raw rows, read by the reader of the corpus's format. The system's refusal to read one of its
    files (a permission, an I/O error) is one line naming the file and its config key, rather than an
    OSError a caller may take for its own (the run directory's); one to write datasets' cache goes up
    to cache_writes."""
    try:
        return READERS[corpus.config.format](corpus)
    except UserError:
        raise
    except Exception as error:
        cause = find_cause(error, OSError, from_the_system)
        key = _input_key(corpus, cause.filename) if cause is not None else None
        if key is None:
            raise
        raise DataError(f"cannot read {os.fsdecode(cause.filename)} ({corpus.key(key)}): "
                        f"{cause.strerror or cause}") from None


def _input_key(corpus: Corpus, filename: object) -> str | None:
    """The config key naming the input file `filename` (an OSError's) is, or lies in; None if none does."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return None
    file, config = os.path.abspath(os.fsdecode(filename)), corpus.config
    if config.target_path and file == os.path.abspath(config.target_path):
        return "target_path"
    given = os.path.abspath(config.path)
    if file == given or file.startswith(given + os.sep):
        return "path"
    if glob.has_magic(config.path) and fnmatch.fnmatch(file, given):  # a file the pattern matches
        return "path"
    return None


def _reasons(raw: RawPairs, cleaned: Rows, max_length: int, filters: FilterConfig) -> np.ndarray:
    """(N,) int8: why each cleaned row is left out, as its index in REASONS (0: kept). Kept in the cache
    beside the cleaned table, under its key and the settings, so that a resume filters nothing again."""
    settings = {name: value for name, value in dataclasses.asdict(filters).items() if name != "duplicates"}
    key = content_key(cleaned.key, "reasons", max_length, raw.header, sorted(settings.items()), _CODE)
    entry = cleaned.cache_directory / _FILTER_DIR / key if cleaned.cache_directory is not None else None

    def build() -> np.ndarray:
        drop = _drop_masks(cleaned, max_length, raw.header)
        masks = {**drop, **pair_masks(cleaned, filters, drop["empty"] | drop["header"] | drop["long"])}
        reasons = np.zeros(len(cleaned), dtype=np.int8)
        for code, reason in enumerate(REASONS):
            if code:
                reasons[masks[reason]] = code
        return reasons

    return cached_array(entry, build, len(cleaned), np.dtype(np.int8))


def _dropped_summary(report: LoadReport) -> str:
    reasons = {"have an empty source or target side": report.rows_dropped_empty,
               "repeat the header line": report.rows_dropped_header, "are too long": report.rows_dropped_long,
               **{f"were dropped by filter {reason}": count for reason, count in report.rows_filtered.items()}}
    return ", ".join(f"{count} {reason}" for reason, count in reasons.items() if count) or "none kept"


def _drop_duplicates(pairs: Rows, kept: np.ndarray, reports: list[LoadReport]) -> list[LoadReport]:
    """Leave out of `kept` (in place) every pair an earlier kept row holds, in this corpus or an earlier
    one; count them in each corpus's report."""
    kept_rows = pairs.where(kept, content_key(pairs.key, "kept-before-duplicates"))
    directory = pairs.cache_directory
    entry = directory / _DUPLICATES_DIR / content_key(pairs.key, _CODE) if directory is not None else None
    repeated = np.zeros(len(kept), dtype=bool)
    repeated[kept] = cached_array(entry, lambda: duplicate_mask(kept_rows), len(kept_rows), np.dtype(bool))
    updated = []
    for report in reports:
        start, end = report.rows
        count = int(repeated[start:end].sum())
        report = dataclasses.replace(report, rows_filtered={**report.rows_filtered, "duplicates": count})
        if count:
            logger.info("%s: filtered out %d of %d pairs, %s", report.path, count, report.rows_read,
                        _FILTER_REASONS["duplicates"])
        if not report.rows_kept:
            raise DataError(f"{report.path} ({report.section}.path): no usable sentence pairs: every one of its "
                            f"{report.rows_read} rows was dropped ({_dropped_summary(report)})")
        updated.append(report)
    kept &= ~repeated
    return updated


__all__ = ["SOURCE", "TARGET", "MAX_CHARS_PER_TOKEN", "LoadReport", "load_pairs"]
