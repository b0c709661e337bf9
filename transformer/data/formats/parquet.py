"""The reader of Parquet files (`data.format: parquet`): one file, a folder of them or a glob pattern,
as pandas, Spark and datasets write them, read by datasets' `parquet` builder into its cache (nothing
is written beside the user's files). Only the columns holding the two sides are read, so the other
columns (an id, pandas' `__index_level_0__`) cost nothing.
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
    schemas = [(file, datasets.Features.from_arrow_schema(schema)) for file, schema in filled]
    columns = check_files_columns(corpus, schemas)
    names = [content_name(file) for file in files]
    table = build(corpus, "parquet", files, names, "Parquet", columns=columns)
    check_utf8(corpus, table, corpus.describe())
    return RawPairs.of_table(table, corpus.config.source_column, corpus.config.target_column,
                             content_key("parquet", *names, *columns))


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
