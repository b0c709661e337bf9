"""The readers of the data formats, one module each, and READERS, the table that picks one by
`data.format`. A reader turns one corpus (common.Corpus: its config and the config section naming it)
into RawPairs: the raw rows, one per pair, in file order, in datasets' cache; nothing cleaned or
dropped (that is corpus.py's job, the same for every format). common.py holds what every reader
shares (the builder call, the errors), columns.py the column checks of typed formats, data_files.py
which files a folder or a glob names, by split. docs/data-formats.md shows how to add a format.
"""

from __future__ import annotations

from collections.abc import Callable

from transformer.data.formats.common import Corpus, RawPairs
from transformer.data.formats.delimited import read_delimited
from transformer.data.formats.hub import read_hub
from transformer.data.formats.jsonl import read_jsonl
from transformer.data.formats.parallel_text import read_parallel_text
from transformer.data.formats.parquet import read_parquet
from transformer.data.formats.saved_dataset import read_saved_dataset

# The reader of each data.format (config.DataFormat names the same formats).
READERS: dict[str, Callable[[Corpus], RawPairs]] = {
    "csv": read_delimited,  # CSV and TSV: one file with a header line
    "tsv": read_delimited,
    "text": read_parallel_text,  # two line-aligned files
    "parquet": read_parquet,
    "jsonl": read_jsonl,
    "dataset": read_saved_dataset,  # a folder written by save_to_disk
    "hub": read_hub,
}

__all__ = ["READERS", "Corpus", "RawPairs"]
