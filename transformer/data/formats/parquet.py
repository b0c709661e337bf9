"""The reader of Parquet files (`data.format: parquet`): one file, a folder of them or a glob pattern,
as pandas, Spark and datasets write them, read by datasets' `parquet` builder into its cache (nothing
is written beside the user's files). Only the columns holding the two sides are read, so the other
columns (an id, pandas' `__index_level_0__`, a map datasets has no type for) cost and stop nothing.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from transformer.data.cache import content_key
from transformer.data.formats.columns import check_files_columns, check_utf8
from transformer.data.formats.common import Corpus, RawPairs, build, content_name, one_line
from transformer.data.formats.data_files import data_files
from transformer.errors import DataError, from_the_system

SUFFIXES = (".parquet",)  # Spark's part-00000-<uuid>-c000.snappy.parquet among them


def read_parquet(corpus: Corpus) -> RawPairs:
    """`data.path`: a Parquet file, a folder of them (its *.parquet files, of data.split where their
    names say splits) or a glob pattern. Files without a row (Spark writes one for an empty partition)
    are left out."""
    files = data_files(corpus, SUFFIXES, "*.parquet")
    footers = [(file, *_footer(file, corpus)) for file in files]
    filled = [(file, schema) for file, schema, n_rows in footers if n_rows > 0]
    if not filled:
        what = ("the file holds" if Path(corpus.config.path).is_file() else
                f"its {len(files)} Parquet file{'s hold' if len(files) > 1 else ' holds'}")
        raise DataError(f"{corpus.describe()}: {what} no row ({corpus.key('path')})")
    files = [file for file, _ in filled]
    schemas = [(file, _features(schema)) for file, schema in filled]
    columns = check_files_columns(corpus, schemas)
    names = [content_name(file) for file in files]
    # The features of the columns read, as datasets would infer them from the first file, given so that
    # it infers none from the columns left unread (a map column has no datasets feature, issue 58).
    read = datasets.Features({column: schemas[0][1][column] for column in columns})
    table = build(corpus, "parquet", files, names, "Parquet", columns=columns, features=read)
    check_utf8(corpus, table, corpus.describe())
    return RawPairs.of_table(table, corpus.config.source_column, corpus.config.target_column,
                             content_key("parquet", *names, *columns))


def _features(schema: pa.Schema) -> dict:
    """The file's columns as datasets' features, by name. A column of a type datasets has no feature for
    (a map) keeps its Arrow type: the run reads only the two sides, and it stops the run only if a side
    names it (columns.check_columns says what it holds)."""
    try:
        return dict(datasets.Features.from_arrow_schema(schema))
    except (ValueError, TypeError, NotImplementedError):
        return {field.name: _feature(field, schema.metadata) for field in schema}


def _feature(field: pa.Field, metadata: dict | None) -> object:
    """One column's datasets feature (read with the schema's metadata, where datasets keeps the features
    it wrote, else without), or its Arrow type where datasets has none for it."""
    for kept in (metadata, None):
        try:
            return datasets.Features.from_arrow_schema(pa.schema([field], metadata=kept))[field.name]
        except (ValueError, TypeError, NotImplementedError):
            continue
    return field.type


def _footer(file: Path, corpus: Corpus) -> tuple[pa.Schema, int]:
    """The file's schema and number of rows, from its footer alone."""
    try:
        with pq.ParquetFile(file) as handle:
            return handle.schema_arrow, handle.metadata.num_rows
    except (pa.ArrowException, OSError) as error:
        if from_the_system(error):
            raise  # the system's error (permission, I/O): the script names it
        raise DataError(f"{file}: not a Parquet file ({one_line(error)}) ({corpus.key('path')})") from None


__all__ = ["read_parquet", "SUFFIXES"]
