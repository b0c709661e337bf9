"""READERS: the reader of each `data.format`, by the names its declaration (formats/__init__.py) gives
the format. Apart from the declarations, because the readers load datasets and the config, which reads
the declarations, must not.
"""

from __future__ import annotations

from collections.abc import Callable

from transformer.data.formats import DELIMITED, HUB, JSONL, PARALLEL_TEXT, PARQUET, SAVED_DATASET, Format
from transformer.data.formats.common import Corpus, RawPairs
from transformer.data.formats.delimited import read_delimited
from transformer.data.formats.hub import read_hub
from transformer.data.formats.jsonl import read_jsonl
from transformer.data.formats.parallel_text import read_parallel_text
from transformer.data.formats.parquet import read_parquet
from transformer.data.formats.saved_dataset import read_saved_dataset

_READS: tuple[tuple[Format, Callable[[Corpus], RawPairs]], ...] = (
    (DELIMITED, read_delimited),  # CSV and TSV
    (PARALLEL_TEXT, read_parallel_text),
    (PARQUET, read_parquet),
    (JSONL, read_jsonl),
    (SAVED_DATASET, read_saved_dataset),
    (HUB, read_hub),
)
READERS: dict[str, Callable[[Corpus], RawPairs]] = {name: read for declared, read in _READS for name in declared.names}

__all__ = ["READERS"]
