"""Sentence pairs: read the CSV/TSV into Arrow, clean, split by English sentence, encode.

Everything stays a memory-mapped `datasets.Dataset`, cached on disk by fingerprint, so a
second run starts fast and corpora larger than memory work. Batching lives in batching.py.
Typical use: load_pairs -> split_pairs -> train_tokenizers(iter_texts(...)) -> encode_splits.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import logging
import sys
import unicodedata
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow.compute as pc

from .config import DataConfig
from .errors import DataError
from .tokenizer import Tokenizers

logger = logging.getLogger(__name__)

SOURCE, TARGET = "source", "target"
SRC_IDS, TGT_IDS, SRC_LEN, TGT_LEN = "src_ids", "tgt_ids", "src_len", "tgt_len"

# datasets fingerprints a library function by its name, not its code, so an edit to the
# cleaning or encoding here would silently reuse stale cached results. Hashing this file
# into every map/filter fixes that.
_CODE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

# Invisible characters that carry no meaning in a sentence (zero-width space, stray BOM).
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\ufeff"))

# A side longer than data.max_length * this many characters is dropped on reading. No subword
# of natural text is that long on average, so such a row would be dropped as too long after
# encoding anyway; dropping it first spares the BPE trainer, whose cost grows with the square of
# a word's length (one 1 MB "word" takes it many minutes).
MAX_CHARS_PER_TOKEN = 32
_LINES_SHOWN = 5  # line numbers named in a warning about dropped rows


def clean_text(text: str) -> str:
    """NFC, every kind of whitespace (NBSP, narrow/thin spaces, tabs, newlines) -> one space, stripped.

    French typography puts U+00A0 or U+202F before "! ? : ;"; treating them as plain spaces
    makes "Va !" and "Va\u00a0!" one spelling.
    """
    text = unicodedata.normalize("NFC", text).translate(_INVISIBLE)
    return " ".join(text.split())  # str.split() splits on all Unicode whitespace, NBSP included


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadReport:
    """What `load_pairs` read and what it dropped."""

    path: str
    rows_read: int
    rows_dropped_empty: int  # rows where either side was empty after cleaning
    rows_dropped_header: int = 0  # rows repeating the header line (e.g. two files pasted together)
    rows_dropped_long: int = 0  # rows with a side longer than data.max_length * MAX_CHARS_PER_TOKEN characters

    @property
    def rows_kept(self) -> int:
        return self.rows_read - self.rows_dropped_empty - self.rows_dropped_header - self.rows_dropped_long


def _reader_options(config: DataConfig) -> tuple[str, int]:
    """(separator, quoting) for the file format.

    TSV is read without quote handling: a French sentence may well start with '"', and
    TSV has no quoting convention (fields simply cannot contain tabs).
    """
    if config.format == "tsv":
        return "\t", csv.QUOTE_NONE
    return ",", csv.QUOTE_MINIMAL


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


def _line_numbers(path: Path, config: DataConfig, rows: list[int]) -> list[int]:
    """1-based file line on which each 0-based data row in `rows` starts (only for messages)."""
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


def _where(path: Path, config: DataConfig, mask: np.ndarray) -> str:
    """'line 7' / 'lines 7, 9, ...' for the rows where `mask` is True."""
    rows = np.flatnonzero(mask)
    lines = _line_numbers(path, config, [int(r) for r in rows[:_LINES_SHOWN]])
    more = ", ..." if len(rows) > len(lines) else ""
    return ("line " if len(lines) == 1 and not more else "lines ") + ", ".join(map(str, lines)) + more


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


def _find_cause(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


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
                data_files=str(path),
                split="train",
                cache_dir=None if cache_dir is None else str(cache_dir),
                header=0,
                names=names,
                index_col=False,  # never guess that an extra field is a row index
                features=datasets.Features({name: datasets.Value("string") for name in names}),
                sep=sep,
                quoting=quoting,
                encoding="utf-8",
                # pandas would turn "NA", "null", "None", "nan" ... into missing values.
                keep_default_na=False,
                na_filter=False,
            )
    except Exception as error:
        decode_error = _find_cause(error, UnicodeDecodeError)
        if decode_error is not None:
            raise _not_utf8(path, decode_error) from None
        if _find_cause(error, pd.errors.ParserWarning) is not None:
            raise DataError(f"{path}: line 2 has more fields than the header ({n_columns}); "
                            f"a field containing {sep!r} must be quoted") from None
        parse_error = _find_cause(error, pd.errors.ParserError)
        if parse_error is not None:
            detail = " ".join(str(parse_error).split())
            hint = f"; a field containing {sep!r} must be quoted" if "Expected" in detail else ""
            raise DataError(f"{path}: not valid {config.format.upper()}: {detail}{hint}") from None
        raise


def _clean_batch(batch: dict[str, list], source_column: str, target_column: str,
                 code_digest: str) -> dict[str, list[str]]:
    # A row with a missing trailing field arrives as None; it becomes "" and is dropped as empty.
    del code_digest  # only here to key the cache
    return {
        SOURCE: [clean_text(text) if text is not None else "" for text in batch[source_column]],
        TARGET: [clean_text(text) if text is not None else "" for text in batch[target_column]],
    }


def _drop_masks(cleaned: datasets.Dataset, config: DataConfig) -> dict[str, np.ndarray]:
    """(N,) boolean masks of the rows to drop, by reason, computed on the Arrow columns."""
    table = cleaned.data
    sources, targets = table.column(SOURCE), table.column(TARGET)
    source_chars = pc.utf8_length(sources).to_numpy()
    target_chars = pc.utf8_length(targets).to_numpy()
    empty = (source_chars == 0) | (target_chars == 0)
    header = (pc.equal(sources, clean_text(config.source_column)).to_numpy(zero_copy_only=False)
              & pc.equal(targets, clean_text(config.target_column)).to_numpy(zero_copy_only=False))
    limit = config.max_length * MAX_CHARS_PER_TOKEN
    long = ~empty & ((source_chars > limit) | (target_chars > limit))
    return {"empty": empty, "header": header & ~empty, "long": long & ~header}


def load_pairs(config: DataConfig, cache_dir: str | Path | None = None) -> tuple[datasets.Dataset, LoadReport]:
    """Read `config.path` into a Dataset with exactly the columns `source` and `target`, cleaned.

    Rows with an empty side (after cleaning), rows repeating the header line and rows with a side
    longer than data.max_length * MAX_CHARS_PER_TOKEN characters are dropped, counted in the report
    and logged with their line numbers.
    `cache_dir` is where datasets keeps its Arrow files (None = its default, ~/.cache/huggingface).
    A DataError names the file for a missing file or column, non-UTF-8 bytes, or malformed CSV.
    """
    path = Path(config.path)
    if not path.is_file():
        raise DataError(f"data file not found: {path} (data.path)")
    n_columns, source_position, target_position = _column_positions(path, config)
    table = _read_table(path, config, n_columns, cache_dir)
    cleaned = table.map(
        _clean_batch,
        batched=True,
        fn_kwargs={"source_column": f"c{source_position}", "target_column": f"c{target_position}",
                   "code_digest": _CODE_DIGEST},
        remove_columns=table.column_names,
        features=datasets.Features({SOURCE: datasets.Value("string"), TARGET: datasets.Value("string")}),
        desc="cleaning pairs",
    )
    drop = _drop_masks(cleaned, config)
    report = LoadReport(path=str(path), rows_read=len(table), rows_dropped_empty=int(drop["empty"].sum()),
                        rows_dropped_header=int(drop["header"].sum()), rows_dropped_long=int(drop["long"].sum()))
    if not report.rows_kept:
        raise DataError(f"{path}: no usable sentence pairs: of {report.rows_read} rows, {report.rows_dropped_empty} "
                        f"have an empty English or French side, {report.rows_dropped_header} repeat the header line "
                        f"and {report.rows_dropped_long} are too long")
    if report.rows_dropped_empty:
        logger.warning("%s: dropped %d of %d rows with an empty English or French side (%s)",
                       path, report.rows_dropped_empty, report.rows_read, _where(path, config, drop["empty"]))
    if report.rows_dropped_header:
        logger.warning("%s: dropped %d of %d rows repeating the header line (%s); were two files pasted together?",
                       path, report.rows_dropped_header, report.rows_read, _where(path, config, drop["header"]))
    if report.rows_dropped_long:
        logger.warning("%s: dropped %d of %d rows with a side longer than %d characters (%s): far beyond "
                       "data.max_length=%d tokens", path, report.rows_dropped_long, report.rows_read,
                       config.max_length * MAX_CHARS_PER_TOKEN, _where(path, config, drop["long"]), config.max_length)
    pairs = cleaned
    if report.rows_kept < report.rows_read:
        # numpy indices: datasets fingerprints a Python list element by element.
        pairs = cleaned.select(np.flatnonzero(~(drop["empty"] | drop["header"] | drop["long"])))
    logger.info("%s: %d sentence pairs", path, len(pairs))
    return pairs, report


# --------------------------------------------------------------------------- splitting


@dataclass(frozen=True)
class Splits:
    """Train, validation and test pairs; no English sentence is in two of them."""

    train: datasets.Dataset
    valid: datasets.Dataset
    test: datasets.Dataset


def _split_rank(seed: int, source: str) -> bytes:
    return hashlib.blake2b(f"{seed}\0{source}".encode(), digest_size=16).digest()


def split_pairs(pairs: datasets.Dataset, config: DataConfig) -> Splits:
    """Hold out whole English-sentence groups: >= `valid_pairs` rows for valid, >= `test_pairs` for test.

    The same English sentence often has several French translations; splitting by row would
    leak them into valid/test. Groups are taken in the order of a seeded hash of the English
    sentence, so the split depends only on the seed and the set of pairs, not on row order.
    """
    sources = pairs.with_format("arrow")[SOURCE].to_pylist()
    counts = Counter(sources)
    ranked = sorted(counts, key=lambda source: (_split_rank(config.split_seed, source), source))

    side: dict[str, int] = {}  # source sentence -> 1 (valid) or 2 (test); absent = train
    groups = iter(ranked)
    for split_id, wanted in ((1, config.valid_pairs), (2, config.test_pairs)):
        taken = 0
        while taken < wanted:
            source = next(groups, None)
            if source is None:
                break
            side[source] = split_id
            taken += counts[source]

    # numpy indices: datasets fingerprints a Python list element by element (a second here).
    row_side = np.fromiter((side.get(source, 0) for source in sources), dtype=np.int8, count=len(sources))
    train, valid, test = (np.flatnonzero(row_side == split_id) for split_id in (0, 1, 2))
    if not len(train) or len(valid) < config.valid_pairs or len(test) < config.test_pairs:
        raise DataError(
            f"{len(pairs)} pairs ({len(counts)} distinct English sentences) are too few for "
            f"data.valid_pairs={config.valid_pairs} and data.test_pairs={config.test_pairs} "
            "with pairs left for training; lower them"
        )
    logger.info("split by English sentence: %d train, %d valid, %d test pairs", len(train), len(valid), len(test))
    return Splits(train=pairs.select(train), valid=pairs.select(valid), test=pairs.select(test))


def iter_texts(dataset: datasets.Dataset, column: str, batch_size: int = 10_000) -> Iterator[str]:
    """Stream one text column in Arrow batches (iterating `dataset[column]` is far slower)."""
    for batch in dataset.select_columns([column]).iter(batch_size=batch_size):
        yield from batch[column]


# --------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class EncodedSplits:
    """Splits with `src_ids`, `tgt_ids` (subword ids, no BOS/EOS) and `src_len`, `tgt_len` columns."""

    train: datasets.Dataset
    valid: datasets.Dataset
    test: datasets.Dataset
    train_too_long: int  # training pairs dropped for exceeding max_length - 1 tokens on a side


_ENCODED_FEATURES = {
    SRC_IDS: datasets.List(datasets.Value("int32")),
    TGT_IDS: datasets.List(datasets.Value("int32")),
    SRC_LEN: datasets.Value("int32"),
    TGT_LEN: datasets.Value("int32"),
}


def _encode_batch(batch: dict[str, list], tokenizers: Tokenizers, code_digest: str) -> dict[str, list]:
    del code_digest
    src_ids = tokenizers.encode_source(batch[SOURCE])
    tgt_ids = tokenizers.encode_target(batch[TARGET])
    return {SRC_IDS: src_ids, TGT_IDS: tgt_ids,
            SRC_LEN: [len(ids) for ids in src_ids], TGT_LEN: [len(ids) for ids in tgt_ids]}


def _fits(src_len: list[int], tgt_len: list[int], limit: int, code_digest: str) -> list[bool]:
    del code_digest
    return [s <= limit and t <= limit for s, t in zip(src_len, tgt_len)]


def _encode(dataset: datasets.Dataset, tokenizers: Tokenizers, name: str) -> datasets.Dataset:
    features = datasets.Features({**dataset.features, **_ENCODED_FEATURES})
    # Large batches: the Rust tokenizer spreads a batch over all cores, small ones leave them idle.
    return dataset.map(_encode_batch, batched=True, batch_size=10_000, features=features,
                       fn_kwargs={"tokenizers": tokenizers, "code_digest": _CODE_DIGEST},
                       desc=f"encoding {name}")


def encode_splits(splits: Splits, tokenizers: Tokenizers, max_length: int) -> EncodedSplits:
    """Tokenize every split; drop (and count) training pairs with more than `max_length - 1` tokens a side.

    `max_length - 1` leaves room for the BOS/EOS the batcher adds. Valid and test are never
    filtered: the model is scored on every held-out pair.
    """
    limit = max_length - 1
    train = _encode(splits.train, tokenizers, "train")
    kept = train.filter(_fits, batched=True, input_columns=[SRC_LEN, TGT_LEN],
                        fn_kwargs={"limit": limit, "code_digest": _CODE_DIGEST}, desc="dropping long pairs")
    too_long = len(train) - len(kept)
    if too_long:
        logger.warning("dropped %d of %d training pairs with more than %d tokens on a side (data.max_length=%d)",
                       too_long, len(train), limit, max_length)
    valid = _encode(splits.valid, tokenizers, "valid")
    test = _encode(splits.test, tokenizers, "test")
    for name, dataset in (("valid", valid), ("test", test)):
        src_len, tgt_len = token_lengths(dataset)
        longer = int(np.count_nonzero((src_len > limit) | (tgt_len > limit)))
        if longer:
            logger.info("%s: %d pairs exceed data.max_length=%d; they are kept", name, longer, max_length)
    return EncodedSplits(train=kept, valid=valid, test=test, train_too_long=too_long)


def token_lengths(dataset: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(src_len, tgt_len) of an encoded split as int32 arrays (N,), read straight from Arrow."""
    table = dataset.with_format("arrow")
    return (table[SRC_LEN].to_numpy().astype(np.int32, copy=False),
            table[TGT_LEN].to_numpy().astype(np.int32, copy=False))


__all__ = [
    "SOURCE", "TARGET", "SRC_IDS", "TGT_IDS", "SRC_LEN", "TGT_LEN",
    "clean_text", "LoadReport", "load_pairs", "Splits", "split_pairs", "iter_texts",
    "EncodedSplits", "encode_splits", "token_lengths",
]
