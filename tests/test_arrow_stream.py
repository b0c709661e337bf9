"""Tests for transformer/data/arrow_stream.py: reading a cached dataset's files with plain reads gives
exactly its rows, in its order, through filters and concatenations, and it declines what it
cannot read that way."""

from __future__ import annotations

import datasets
import pytest

from transformer.data.arrow_stream import stream_batches
from transformer.data.pairs import SRC_IDS, TGT_IDS


def rows(batches) -> list[tuple]:
    return [row for batch in batches for row in zip(*(column.to_pylist() for column in batch.columns))]


def expected_rows(dataset: datasets.Dataset, columns: list[str]) -> list[tuple]:
    return list(zip(*(dataset[column][:] for column in columns)))


@pytest.mark.parametrize("batch_size", [1, 7, 1000])
def test_streamed_rows_are_the_dataset_rows_through_filters_and_selects(tiny_encoded, batch_size):
    train = tiny_encoded.train  # encoded, then filtered: an indices mapping over the Arrow file
    files = [train.cache_files[0]["filename"]] * 2  # the encoded file (its indices file comes after), twice
    views = {
        "filtered": train,
        "filtered again": train.filter(lambda row: len(row[SRC_IDS]) % 3 == 0),
        "concatenated": datasets.concatenate_datasets([datasets.Dataset.from_file(name) for name in files]),
        "sparse": train.filter(lambda row, index: index in (3, len(train) - 1), with_indices=True),
    }
    for name, view in views.items():
        streamed = stream_batches(view, [TGT_IDS, SRC_IDS], batch_size)
        assert streamed is not None, name
        batches = list(streamed)
        assert all(batch.num_rows == batch_size for batch in batches[:-1]), name
        assert rows(batches) == expected_rows(view, [TGT_IDS, SRC_IDS]), name


def test_what_cannot_be_streamed_is_declined(tiny_encoded):
    assert stream_batches(tiny_encoded.train.shuffle(seed=1), [SRC_IDS], 10) is None  # rows out of file order
    assert stream_batches(tiny_encoded.train.select(range(2, 9)), [SRC_IDS], 10) is None  # a slice replayed
    assert stream_batches(datasets.Dataset.from_dict({SRC_IDS: [[1]]}), [SRC_IDS], 10) is None  # in memory
