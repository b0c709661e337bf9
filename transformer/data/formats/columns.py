"""The checks of a table's columns that the readers of typed formats (Parquet, JSON lines, a saved
dataset, the Hub) share, made before the pairs are used: each side names a column of text, or a text
field of a struct column ("translation.en", as opus_books and wmt14 ship their pairs), and both
sides hold UTF-8 (the Parquet and JSON builders let other bytes into a string column, where they
would stop the cleaning with a traceback). Each problem is one DataError line naming the input and
the config key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
import pyarrow as pa

from transformer.data.formats.common import Corpus
from transformer.errors import DataError

_TEXT_TYPES = frozenset({"string", "large_string", "string_view", "null"})  # null: a column with no value at all

# Finds, once a check failed, the line of the input that explains it (JSON lines), or None.
Diagnose = Callable[[], DataError | None]


def check_files_columns(corpus: Corpus, schemas: Sequence[tuple[Path, datasets.Features]]) -> list[str]:
    """Check every file's columns; a message names the input (data.path) when all files agree, else
    the file. The columns to read: the top-level ones holding the sides."""
    if all(features == schemas[0][1] for _, features in schemas):
        return check_columns(corpus, schemas[0][1], corpus.describe())
    for file, features in schemas:
        columns = check_columns(corpus, features, str(file))
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
    if isinstance(feature, pa.DataType):  # a type datasets has no feature for (parquet._features)
        shown = f"map<{feature.key_type}, {feature.item_type}>" if isinstance(feature, pa.MapType) else feature
        return f"{shown} values"
    return f"{type(feature).__name__} values"


def check_columns(corpus: Corpus, features: datasets.Features, where: str,
                  diagnose: Diagnose | None = None) -> list[str]:
    """Each side names a column of text, or a text field of a struct column; one DataError line
    otherwise (`diagnose()`'s where it finds the line to blame). Returns the top-level columns holding
    them (a struct column once)."""
    outers = []
    for key, column in corpus.sides():
        found = _side(features, column)
        if found is None:
            listed = _column_names(features)
            have = f"its columns are: {', '.join(listed)}" if listed else "it has no columns"
            raise DataError(f"{where}: no column {column!r} ({key}); {have}")
        outer, feature = found
        if not _is_text(feature):
            bad_line = diagnose() if diagnose is not None else None
            if bad_line is not None:
                raise bad_line
            raise DataError(f"{where}: the column {column!r} ({key}) holds {_kind(feature, column)}, not text")
        if outer not in outers:
            outers.append(outer)
    return outers


def check_utf8(corpus: Corpus, table: datasets.Dataset, where: str, diagnose: Diagnose | None = None) -> None:
    """Both sides hold UTF-8. One pass over the two columns (Arrow's validation); a DataError naming
    the first row that is not (`diagnose()`'s line where it finds one)."""
    arrow = table.data.table
    for key, column in corpus.sides():
        outer = column if column in arrow.column_names else column.partition(".")[0]
        field = "" if outer == column else column[len(outer) + 1:]
        start = 0
        for chunk in arrow.column(outer).chunks:
            values = chunk.flatten()[chunk.type.get_field_index(field)] if field else chunk
            if not _valid(values):
                found = diagnose() if diagnose is not None else None
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


__all__ = ["check_files_columns", "check_columns", "check_utf8"]
