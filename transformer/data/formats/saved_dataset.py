"""The reader of a folder written by datasets' `save_to_disk` (`data.format: dataset`): a Dataset's,
or a DatasetDict's, of which `data.split` names the split holding the pairs. Its `data-*.arrow`
files are read by datasets' `arrow` builder, in the order of their shards' numbers, into datasets'
cache: the folder is read, never opened in place or written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pyarrow as pa

from transformer.data.cache import content_key
from transformer.data.formats.columns import check_files_columns, check_utf8
from transformer.data.formats.common import Corpus, RawPairs, build, content_name, one_line
from transformer.data.formats.data_files import DEFAULT_SPLIT
from transformer.errors import DataError, from_the_system

_SHARD = re.compile(r"data-[0-9]+-of-(?P<count>[0-9]+)\.arrow")  # save_to_disk's names


def read_saved_dataset(corpus: Corpus) -> RawPairs:
    """`data.path`: a folder written by `Dataset.save_to_disk`, or by `DatasetDict.save_to_disk`."""
    folder = _split_folder(corpus, Path(corpus.config.path))
    files = _saved_arrow_files(corpus, folder)
    schemas = [(file, _arrow_features(file, corpus)) for file in files]
    check_files_columns(corpus, schemas)
    names = [content_name(file) for file in files]
    table = build(corpus, "arrow", files, names, "a saved dataset")
    check_utf8(corpus, table, corpus.describe())
    return RawPairs.of_table(table, corpus.config.source_column, corpus.config.target_column,
                             content_key("dataset", *names))


def _split_folder(corpus: Corpus, folder: Path) -> Path:
    """The folder of the Dataset to read: `folder` itself, or its split `data.split` for a DatasetDict. A
    Dataset's folder has no splits: a split other than datasets' default is refused, as one Parquet file's is
    (data_files.py), not read as every row."""
    split = corpus.config.split
    if not folder.exists():
        raise DataError(f"data folder not found: {folder} ({corpus.key('path')})")
    listing = folder / "dataset_dict.json"
    if listing.is_file():
        try:
            splits = json.loads(listing.read_text(encoding="utf-8"))["splits"]
            splits = [str(name) for name in splits]
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"{listing}: not a DatasetDict's list of splits ({type(error).__name__}: "
                            f"{one_line(error)}); write the folder with DatasetDict.save_to_disk") from None
        if split not in splits:
            raise DataError(f"{folder}: no split {split!r} ({corpus.key('split')}); its splits are: "
                            f"{', '.join(splits)}")
        folder = folder / split
    elif split != DEFAULT_SPLIT and (folder / "state.json").is_file():  # a Dataset's folder: read whole
        raise DataError(f"{folder}: a saved Dataset holds no splits ({corpus.key('split')}: {split!r}); save a "
                        f"DatasetDict with its {split} split and name its folder in {corpus.key('path')}, or remove "
                        f"{corpus.key('split')}")
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder ({corpus.key('path')}); {corpus.key('format')} dataset reads a "
                        "folder written by save_to_disk")
    if not (folder / "state.json").is_file():
        raise DataError(f"{folder}: not a dataset written by save_to_disk ({corpus.key('path')}): the folder holds "
                        "neither state.json nor dataset_dict.json")
    return folder


def _saved_arrow_files(corpus: Corpus, folder: Path) -> list[Path]:
    """The Arrow files of the saved Dataset in `folder`, in the order of their shards: save_to_disk
    names them `data-00000-of-00003.arrow`, `data-00001-of-00003.arrow`, ..., so their names' order is
    the rows' order. (state.json lists them too, but in a field datasets keeps to itself, and datasets
    has no public call listing them without opening the folder in place, which later stages would
    write beside.) A shard missing from the numbering is one line naming it."""
    shards = {}  # name: the number of shards it says there are
    for file in folder.glob("data-*.arrow"):
        found = _SHARD.fullmatch(file.name)
        if found is None:
            raise DataError(f"{file}: not named as save_to_disk names a shard (data-00000-of-00001.arrow) "
                            f"({corpus.key('path')})")
        shards[file.name] = int(found["count"])
    if not shards:
        raise DataError(f"{folder}: holds no data-*.arrow file, which save_to_disk writes ({corpus.key('path')})")
    counts = sorted(set(shards.values()))
    if len(counts) > 1:  # save_to_disk leaves an earlier save's shards in the folder
        saves = ", ".join(f"data-*-of-{count:05d}.arrow" for count in counts)
        raise DataError(f"{folder}: holds the shards of {len(counts)} saves ({saves}) ({corpus.key('path')}); "
                        "save_to_disk leaves an earlier save's shards behind: save into an empty folder")
    count = counts[0]
    expected = [f"data-{index:05d}-of-{count:05d}.arrow" for index in range(count)]
    unexpected = sorted(set(shards) - set(expected))
    if unexpected:
        raise DataError(f"{folder / unexpected[0]}: not one of the {count} shards its name says there are "
                        f"({corpus.key('path')})")
    missing = [name for name in expected if name not in shards]
    if missing:
        raise DataError(f"{folder / missing[0]}: not found, though the folder holds the other shards of its "
                        f"{count} ({corpus.key('path')})")
    return [folder / name for name in expected]


def _arrow_features(file: Path, corpus: Corpus) -> datasets.Features:
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
        if from_the_system(error):
            raise
        raise DataError(f"{file}: not an Arrow file written by save_to_disk ({one_line(error)}) "
                        f"({corpus.key('path')})") from None


__all__ = ["read_saved_dataset"]
