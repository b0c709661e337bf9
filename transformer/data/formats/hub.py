"""The reader of a dataset on the Hugging Face Hub (`data.format: hub`), or in datasets' local cache of
it: `load_dataset(data.path, data.hub_config, split=data.split)` into datasets' cache. Any failure to
load it (no network, offline, a wrong name, configuration or split) is one DataError line naming the
dataset and data.path.
"""

from __future__ import annotations

import os

import datasets

from transformer.data.cache import content_key
from transformer.data.formats.columns import check_columns, check_utf8
from transformer.data.formats.common import Corpus, RawPairs, reason
from transformer.errors import DataError, find_cause


def read_hub(corpus: Corpus) -> RawPairs:
    config = corpus.config
    where = f"{corpus.describe()} ({corpus.key('path')}, split {config.split!r})"
    try:
        # keep_in_memory=False: into the cache even where HF_DATASETS_IN_MEMORY_MAX_SIZE would keep it in
        # memory; the cache files are what the table is known by (below) and what later stages read.
        table = datasets.load_dataset(config.path, config.hub_config or None, split=config.split,
                                      keep_in_memory=False)
    except Exception as error:  # noqa: BLE001 - the network, a name, a config, a split: all the user's to fix
        raise DataError(f"cannot load {where}: {_why(error)}") from None
    if not isinstance(table, datasets.Dataset):
        raise DataError(f"cannot load {where}: load_dataset gave a {type(table).__name__}, not a Dataset")
    check_columns(corpus, table.features, corpus.describe())
    check_utf8(corpus, table, corpus.describe())
    return RawPairs.of_table(table, config.source_column, config.target_column,
                             content_key("hub", *_cache_identity(table), config.path, config.hub_config, config.split))


def _why(error: BaseException) -> str:
    """Why the dataset could not be loaded, in one line; offline, what to do about it."""
    if datasets.config.HF_HUB_OFFLINE and find_cause(error, ConnectionError) is not None:
        return (f"it is not in datasets' cache ({datasets.config.HF_DATASETS_CACHE}) and HF_HUB_OFFLINE (or "
                "HF_DATASETS_OFFLINE) forbids downloading it; load it once with network access, or unset that variable")
    return reason(error)


def _cache_identity(table: datasets.Dataset) -> list[str]:
    """What the loaded table is known by: its cache files' names and sizes. datasets names the folder
    holding them by the dataset's files (their revision on the Hub), so another version of the dataset
    is another name."""
    return sorted(f"{entry['filename']}:{os.path.getsize(entry['filename'])}" for entry in table.cache_files)


__all__ = ["read_hub"]
