"""The readers of Hugging Face datasets' formats: Parquet files (`parquet`), JSON lines (`jsonl`), a
folder written by `save_to_disk` (`dataset`) and a dataset on the Hub (`hub`).

Every table is made by a datasets builder (`load_dataset("parquet" | "json" | "arrow", ...)`), so it
lives in datasets' cache and nothing is ever written into the user's folder; a saved dataset's
`data-*.arrow` files are read by the `arrow` builder in the order its state.json lists them. The
builder's configuration is named by the content of the files (readers.content_name), so a file
replaced in place is read anew. The rows are the files' rows, in order (the files in the order of
their names); the columns are checked before the pairs are used: each side names a column of text,
or a field of a nested one ("translation.en", as opus_books and wmt14 ship their pairs), which
readers.side_values resolves when cleaning. What the user can fix (a missing column, a line that is
not JSON, a file that is not Parquet, a folder that is not a saved dataset, a Hub dataset that
cannot be loaded) is one DataError line naming the file (and the line) and the config key.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from transformer.data.cache import content_key
from transformer.data.readers import RawPairs, Source, content_name, find_cause, not_utf8
from transformer.errors import DataError

PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")
_TEXT_TYPES = frozenset({"string", "large_string", "string_view", "null"})  # null: a column with no value at all
_REASON_CHARS = 300  # of a library's error message quoted in ours


# --------------------------------------------------------------------------- the four readers


def read_parquet(source: Source) -> RawPairs:
    """`data.path`: a Parquet file, a folder of them (*.parquet, by name) or a glob pattern. Only the
    columns holding the two sides are read (a struct column whole)."""
    files = _data_files(source, PARQUET_SUFFIXES)
    schemas = [(file, _parquet_features(file, source)) for file in files]
    columns = _check_files_columns(source, schemas)
    names = [content_name(file) for file in files]
    table = _build(source, "parquet", files, names, "Parquet", columns=columns)
    _check_utf8(source, table, source.describe())
    return _raw_pairs(source, table, content_key("parquet", *names, *columns), _row_numbers, "row")


def read_jsonl(source: Source) -> RawPairs:
    """`data.path`: a file of one JSON object a line, a folder of them (*.jsonl and *.json, by name)
    or a glob pattern. A side may be missing from an object or null: an empty side."""
    files = _data_files(source, JSON_SUFFIXES)
    # An empty file holds no row (and the JSON builder would stop at it).
    filled = [file for file in files if file.stat().st_size > 0]
    if not filled:
        raise DataError(f"{source.describe()}: the file is empty ({source.key('path')})" if len(files) == 1 else
                        f"{source.describe()}: all {len(files)} files are empty ({source.key('path')})")
    names = [content_name(file) for file in filled]
    table = _build(source, "json", filled, names, "JSON lines", diagnose=lambda: _first_bad_json_line(source, filled))
    _check_columns(source, table.features, source.describe(), json_files=filled)
    _check_utf8(source, table, source.describe(), json_files=filled)
    key = content_key("jsonl", *names)
    if len(files) == 1 and not _is_json_array(files[0]):
        return _raw_pairs(source, table, key, lambda rows: _json_line_numbers(files[0], rows), "line")
    return _raw_pairs(source, table, key, _row_numbers, "row")


def read_saved_dataset(source: Source) -> RawPairs:
    """`data.path`: a folder written by `Dataset.save_to_disk`, or by `DatasetDict.save_to_disk`, of which
    `data.split` names the split holding the pairs. Its data-*.arrow files are read, never written."""
    folder = _split_folder(source, Path(source.path))
    files = _saved_arrow_files(source, folder)
    schemas = [(file, _arrow_features(file, source)) for file in files]
    _check_files_columns(source, schemas)
    names = [content_name(file) for file in files]
    table = _build(source, "arrow", files, names, "a saved dataset")
    _check_utf8(source, table, source.describe())
    return _raw_pairs(source, table, content_key("dataset", *names), _row_numbers, "row")


def read_hub(source: Source) -> RawPairs:
    """`data.path`: a dataset on the Hugging Face Hub (or in its local cache), loaded with
    `load_dataset(path, data.hub_config, split=data.split)` into datasets' cache."""
    try:
        table = datasets.load_dataset(source.path, source.hub_config or None, split=source.split)
    except Exception as error:  # noqa: BLE001 - the network, a name, a config, a split: all the user's to fix
        raise DataError(f"cannot load {source.describe()} ({source.key('path')}, split {source.split!r}): "
                        f"{_reason(error)}") from None
    if not isinstance(table, datasets.Dataset):
        raise DataError(f"cannot load {source.describe()} ({source.key('path')}, split {source.split!r}): "
                        f"load_dataset gave a {type(table).__name__}, not a Dataset")
    _check_columns(source, table.features, source.describe())
    _check_utf8(source, table, source.describe())
    key = content_key("hub", table._fingerprint, source.path, source.hub_config, source.split)
    return _raw_pairs(source, table, key, _row_numbers, "row")


# --------------------------------------------------------------------------- which files


def _data_files(source: Source, suffixes: tuple[str, ...]) -> list[Path]:
    """The files `data.path` names: itself, the files of the folder with one of `suffixes` (by name),
    or those a glob pattern matches (`**` crosses folders)."""
    path, key = Path(source.path), source.key("path")
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted((file for file in path.iterdir() if file.is_file() and file.name.lower().endswith(suffixes)),
                       key=lambda file: file.name)
        if not files:
            wanted = " or ".join("*" + suffix for suffix in suffixes)
            raise DataError(f"{path}: no {wanted} file in this folder ({key})")
        return files
    if glob.has_magic(source.path):
        files = sorted(Path(match) for match in glob.glob(source.path, recursive=True) if Path(match).is_file())
        if not files:
            raise DataError(f"{source.path}: no file matches this pattern ({key})")
        return files
    raise DataError(f"data file not found: {path} ({key})")


def _split_folder(source: Source, folder: Path) -> Path:
    """The folder of the Dataset to read: `folder` itself, or its split `data.split` for a DatasetDict."""
    if not folder.exists():
        raise DataError(f"data folder not found: {folder} ({source.key('path')})")
    listing = folder / "dataset_dict.json"
    if listing.is_file():
        try:
            splits = json.loads(listing.read_text(encoding="utf-8"))["splits"]
            splits = [str(split) for split in splits]
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"{listing}: not a DatasetDict's list of splits ({type(error).__name__}: "
                            f"{_one_line(error)}); write the folder with DatasetDict.save_to_disk") from None
        if source.split not in splits:
            raise DataError(f"{folder}: no split {source.split!r} ({source.key('split')}); its splits are: "
                            f"{', '.join(splits)}")
        folder = folder / source.split
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder ({source.key('path')}); {source.key('format')} dataset reads a "
                        "folder written by save_to_disk")
    if not (folder / "state.json").is_file():
        raise DataError(f"{folder}: not a dataset written by save_to_disk ({source.key('path')}): the folder holds "
                        "neither state.json nor dataset_dict.json")
    return folder


def _saved_arrow_files(source: Source, folder: Path) -> list[Path]:
    """The Arrow files of the saved Dataset in `folder`, in the order its state.json lists them."""
    state = folder / "state.json"
    try:
        entries = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
        names = [entry["filename"] for entry in entries]
        if not all(isinstance(name, str) and name and Path(name).name == name for name in names):
            raise ValueError("a data file's name is not a file name")
    except UnicodeDecodeError as error:
        raise not_utf8(state, error) from None
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"{state}: not a saved Dataset's state ({type(error).__name__}: {_one_line(error)}) "
                        f"({source.key('path')})") from None
    if not names:
        raise DataError(f"{state}: lists no data file ({source.key('path')})")
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise DataError(f"{file}: not found, though {state} lists it ({source.key('path')})")
    return files


# --------------------------------------------------------------------------- the columns


def _parquet_features(file: Path, source: Source) -> datasets.Features:
    try:
        return datasets.Features.from_arrow_schema(pq.read_schema(file))
    except (pa.ArrowException, OSError) as error:
        if isinstance(error, OSError) and error.errno is not None:
            raise  # the system's error (permission, I/O): the script names it
        raise DataError(f"{file}: not a Parquet file ({_one_line(error)}) ({source.key('path')})") from None


def _arrow_features(file: Path, source: Source) -> datasets.Features:
    """The features of an Arrow file written by save_to_disk (an IPC stream), read from its schema alone."""
    try:
        with file.open("rb") as handle:
            try:
                schema = pa.ipc.open_stream(handle).schema
            except (pa.ArrowException, OSError):
                handle.seek(0)
                schema = pa.ipc.open_file(handle).schema
        return datasets.Features.from_arrow_schema(schema)
    except (pa.ArrowException, OSError, ValueError) as error:
        if isinstance(error, OSError) and error.errno is not None:
            raise
        raise DataError(f"{file}: not an Arrow file written by save_to_disk ({_one_line(error)}) "
                        f"({source.key('path')})") from None


def _check_files_columns(source: Source, schemas: Sequence[tuple[Path, datasets.Features]]) -> list[str]:
    """Check every file's columns; a message names the input (data.path) when all files agree, else
    the file. The columns to read: the top-level ones holding the sides."""
    if all(features == schemas[0][1] for _, features in schemas):
        return _check_columns(source, schemas[0][1], source.describe())
    for file, features in schemas:
        columns = _check_columns(source, features, str(file))
    return columns


def _side(features: datasets.Features, column: str) -> tuple[str, object] | None:
    """(the top-level column holding `column`, its feature), or None where there is none: `column`
    itself, else the field `field` of a struct column `outer` ("outer.field")."""
    if column in features:
        return column, features[column]
    outer, dot, field = column.partition(".")
    if dot and outer in features:
        nested = features[outer]
        if isinstance(nested, dict) and field in nested:
            return outer, nested[field]
        if isinstance(nested, datasets.Translation) and field in nested.languages:
            return outer, datasets.Value("string")
    return None


def _column_names(features: datasets.Features) -> list[str]:
    """The columns as a side may name them: a struct column's fields dotted ("translation.en")."""
    names = []
    for name, feature in features.items():
        if isinstance(feature, dict):
            names += [f"{name}.{field}" for field in feature]
        elif isinstance(feature, datasets.Translation):
            names += [f"{name}.{language}" for language in feature.languages]
        else:
            names.append(name)
    return names


def _is_text(feature: object) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in _TEXT_TYPES


def _kind(feature: object, column: str) -> str:
    """What a column that is not text holds, for a message."""
    if isinstance(feature, datasets.Value):
        return f"{feature.dtype} values"
    if isinstance(feature, dict):
        return f"a struct of the fields {', '.join(feature)} (name one of them: {column}.{next(iter(feature), '')})"
    if isinstance(feature, datasets.Json):
        return "JSON values of several types"
    if isinstance(feature, (datasets.List, datasets.LargeList, list)):
        return "lists"
    return f"{type(feature).__name__} values"


def _check_columns(source: Source, features: datasets.Features, where: str,
                   json_files: Sequence[Path] = ()) -> list[str]:
    """Each side names a column of text, or a text field of a struct column; one DataError line
    otherwise. Returns the top-level columns holding them (a struct column once)."""
    outers = []
    for key, column in ((source.key("source_column"), source.source_column),
                        (source.key("target_column"), source.target_column)):
        found = _side(features, column)
        if found is None:
            listed = _column_names(features)
            have = f"its columns are: {', '.join(listed)}" if listed else "it has no columns"
            raise DataError(f"{where}: no column {column!r} ({key}); {have}")
        outer, feature = found
        if not _is_text(feature):
            bad_line = _first_bad_json_line(source, json_files) if json_files else None
            if bad_line is not None:
                raise bad_line
            raise DataError(f"{where}: the column {column!r} ({key}) holds {_kind(feature, column)}, not text")
        if outer not in outers:
            outers.append(outer)
    return outers


def _check_utf8(source: Source, table: datasets.Dataset, where: str, json_files: Sequence[Path] = ()) -> None:
    """Both sides hold UTF-8: the Parquet and JSON builders let other bytes into a string column, where
    they would stop the cleaning with a traceback. One pass over the two columns (Arrow's validation);
    a DataError naming the first row (the line of JSON lines) that is not."""
    arrow = table.data.table
    for key, column in ((source.key("source_column"), source.source_column),
                        (source.key("target_column"), source.target_column)):
        outer = column if column in arrow.column_names else column.partition(".")[0]
        field = "" if outer == column else column[len(outer) + 1:]
        start = 0
        for chunk in arrow.column(outer).chunks:
            values = chunk.flatten()[chunk.type.get_field_index(field)] if field else chunk
            if not _valid(values):
                found = _first_bad_json_line(source, json_files) if json_files else None
                if found is not None:
                    raise found
                row = start + _first_invalid(values) + 1
                raise DataError(f"{where}: row {row}: the column {column!r} ({key}) holds text that is not UTF-8; "
                                "re-save the data as UTF-8")
            start += len(chunk)


def _valid(values: pa.Array) -> bool:
    try:
        values.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _first_invalid(values: pa.Array) -> int:
    """The 0-based row of the first invalid value of `values` (which holds one), by halving."""
    low, high = 0, len(values)  # the first invalid row is in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if _valid(values.slice(low, middle - low)):
            low = middle
        else:
            high = middle
    return low


# --------------------------------------------------------------------------- JSON lines


def _json_lines(file: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each line of `file` holding something, as the JSON builder reads
    them: blank lines skipped, a byte-order mark dropped."""
    with file.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield number, line


def _is_json_array(file: Path) -> bool:
    """Whether `file` holds one JSON array (which the JSON builder also reads) rather than JSON lines."""
    first = next(_json_lines(file), (0, b""))[1]
    return first.lstrip().startswith(b"[")


def _json_line_numbers(file: Path, rows: list[int]) -> list[int]:
    wanted, found = set(rows), {}
    for row, (number, _) in enumerate(_json_lines(file)):
        if row in wanted:
            found[row] = number
            if len(found) == len(wanted):
                break
    return [found[row] for row in rows if row in found]


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


def _first_bad_json_line(source: Source, files: Sequence[Path]) -> DataError | None:
    """The first line of `files` that is not UTF-8, not JSON, not an object, or whose side is neither
    text nor null, as a DataError naming the file, the line and the key; None where every line is right.
    Only called once reading failed (or a side came out as other than text), to say where."""
    sides = ((source.key("source_column"), source.source_column), (source.key("target_column"), source.target_column))
    for file in files:
        if _is_json_array(file):
            continue  # one array, not line by line: the builder's message has to do
        for number, line in _json_lines(file):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as error:
                return not_utf8(file, error)
            try:
                value = json.loads(text)
            except ValueError as error:
                reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
                return DataError(f"{file}: line {number} is not JSON ({reason}) ({source.key('path')})")
            if not isinstance(value, dict):
                return DataError(f"{file}: line {number} is {_json_kind(value)}, not a JSON object "
                                 f"({source.key('path')}): JSON lines hold one object a line")
            for key, column in sides:
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


# --------------------------------------------------------------------------- building the table


@contextlib.contextmanager
def _builder_errors_unlogged(builder: str) -> Iterator[None]:
    """datasets' builders log an error before raising it; the error raised becomes our one line, so
    their log line (on standard error) is left out."""
    logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    quiet = lambda record: record.levelno < logging.ERROR  # noqa: E731
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _build(source: Source, builder: str, files: Sequence[Path], names: Sequence[str], what: str,
           diagnose: Callable[[], DataError | None] | None = None, **options: object) -> datasets.Dataset:
    """`files`' rows, in order, as one table in datasets' cache, built by datasets' `builder` under a
    configuration named by the files' content (`names`). An error the user can fix becomes one DataError
    line: `diagnose()`'s if it finds one, else naming the input and the builder's reason."""
    try:
        with _builder_errors_unlogged(builder):
            return datasets.load_dataset(
                builder,
                name=f"content-{content_key(*names)}",
                # Escaped: a file's name holding "[" or "*" names that file, not a pattern.
                data_files=[glob.escape(str(file.resolve())) for file in files],
                split="train",
                **options,
            )
    except Exception as error:
        if _system_error(error) is not None:
            raise  # a full disk, a permission: the script names it with its path
        found = diagnose() if diagnose is not None else None
        if found is None:
            decode_error = find_cause(error, UnicodeDecodeError)
            if decode_error is not None and len(files) == 1:
                found = not_utf8(files[0], decode_error)
        if found is None:
            found = DataError(f"{source.describe()}: cannot read it as {what} ({source.key('path')}): "
                              f"{_reason(error)}")
        raise found from None


def _system_error(error: BaseException) -> OSError | None:
    """The operating system's error behind `error` (one with an errno: not a parser's OSError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


def _reason(error: BaseException) -> str:
    """`error` in one line, as its first informative cause says it (datasets wraps a builder's errors
    in a DatasetGenerationError that says nothing more)."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, datasets.exceptions.DatasetGenerationError) and str(cause).strip():
            return f"{type(cause).__name__}: {_one_line(cause)}"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return type(error).__name__


def _row_numbers(rows: list[int]) -> list[int]:
    return [row + 1 for row in rows]


def _raw_pairs(source: Source, table: datasets.Dataset, key: str, line_numbers: Callable[[list[int]], list[int]],
               unit: str) -> RawPairs:
    return RawPairs(table, source.source_column, source.target_column, header=None, key=key,
                    line_numbers=line_numbers, unit=unit)


__all__ = ["read_parquet", "read_jsonl", "read_saved_dataset", "read_hub", "PARQUET_SUFFIXES", "JSON_SUFFIXES"]
