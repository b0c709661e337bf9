"""The data formats: what each format's reader reads, declared here (`FORMATS`), and the readers, one
module each, of which READERS (readers.py) picks one by `data.format`. A reader turns one corpus
(common.Corpus: its config and the config section naming it) into RawPairs: the raw rows, one per
pair, in file order, in datasets' cache; nothing cleaned or dropped (that is corpus.py's job, the same
for every format). common.py holds what every reader shares (the builder call, the errors), columns.py
the column checks of typed formats, data_files.py which files a folder or a glob names, by split.

This module imports nothing, so that the config (config/sections.py) checks a corpus's keys against
the declarations, and lists the formats, without loading datasets, which the readers need.
docs/data-formats.md shows how to add a format.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    """What a reader declares of the format(s) it reads: their `data.format` names; the corpus keys it
    reads besides `path` and `format` (one it does not read is refused, not ignored: a split asked for
    and not applied would train on every split's pairs); whether `path` may hold several splits, of
    which `split` names one; and what `path` names."""

    names: tuple[str, ...]
    keys: frozenset[str]
    splits: bool = False
    path: str = "a path"

    def reads(self, key: str) -> bool:
        """Whether the reader reads the corpus key `key` (`split` where `path` holds splits)."""
        return key in ("path", "format") or key in self.keys or (key == "split" and self.splits)


_COLUMNS = frozenset({"source_column", "target_column"})  # the names of the columns holding the two sides

# Each reader's declaration, in the order messages list the formats.
DELIMITED = Format(("csv", "tsv"), _COLUMNS)  # delimited.py: one file with a header line
# parallel_text.py: two line-aligned files, `path` the source language's, `target_path` the target's
PARALLEL_TEXT = Format(("text",), frozenset({"target_path"}))
# parquet.py and jsonl.py: a file, a folder of them (split files: train-*, test-*, ...) or a glob
PARQUET = Format(("parquet",), _COLUMNS, splits=True)
JSONL = Format(("jsonl",), _COLUMNS, splits=True)
# saved_dataset.py: a folder written by save_to_disk: a DatasetDict's splits, or one Dataset, which has none
# (a split other than "train" refused, as for one Parquet file)
SAVED_DATASET = Format(("dataset",), _COLUMNS, splits=True)
# hub.py: a Hugging Face Hub dataset, with its configuration (`hub_config`)
HUB = Format(("hub",), _COLUMNS | {"hub_config"}, splits=True, path="a dataset's name")

FORMATS: dict[str, Format] = {name: declared for declared in (DELIMITED, PARALLEL_TEXT, PARQUET, JSONL,
                                                                SAVED_DATASET, HUB) for name in declared.names}


def formats_reading(key: str) -> tuple[str, ...]:
    """The names of the formats whose reader reads corpus key `key`, in FORMATS' order."""
    return tuple(name for name, declared in FORMATS.items() if declared.reads(key))


__all__ = ["Format", "FORMATS", "formats_reading", "DELIMITED", "PARALLEL_TEXT", "PARQUET", "JSONL", "SAVED_DATASET",
           "HUB"]
