"""Tests for transformer/data/rows.py: rows read from a cached table's files with plain reads are
exactly the table's rows that the mask chooses, in order, in batches of the asked size, for tables in
datasets' cache and in memory alike; masks compose; a table that is not whole is refused."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from conftest import in_memory_rows
from transformer.data.encode import SRC_IDS, TGT_IDS
from transformer.data.rows import Rows


def read(rows: Rows, columns: list[str], batch_size: int) -> list[tuple]:
    batches = list(rows.batches(columns, batch_size))
    assert all(batch.num_rows == batch_size for batch in batches[:-1])
    return [row for batch in batches for row in zip(*(column.to_pylist() for column in batch.columns))]


def expected(rows: Rows, columns: list[str]) -> list[tuple]:
    """The chosen rows as datasets itself reads the table."""
    every = list(zip(*(rows.table[column] for column in columns)))
    return every if rows.mask is None else [row for row, chosen in zip(every, rows.mask) if chosen]


@pytest.mark.parametrize("batch_size", [1, 7, 1000])
def test_rows_are_the_chosen_rows_of_the_table_in_order(tiny_encoded, batch_size):
    train = tiny_encoded.train  # a mask over the encoded table in datasets' cache
    assert train.table.cache_files and train.mask is not None and 0 < len(train) < len(train.table)
    whole = Rows(train.table, "whole")
    sparse = whole.where(np.isin(np.arange(len(whole)), [3, len(whole) - 1]), "sparse")
    none = whole.where(np.zeros(len(whole), dtype=bool), "none")
    in_memory = in_memory_rows({SRC_IDS: [[i] * (i % 4) for i in range(30)], TGT_IDS: [[i] for i in range(30)]})
    for rows in (train, whole, sparse, none, in_memory, in_memory.where(np.arange(30) % 3 == 0, "thirds")):
        assert read(rows, [TGT_IDS, SRC_IDS], batch_size) == expected(rows, [TGT_IDS, SRC_IDS]), rows.key
        assert len(rows) == len(expected(rows, [SRC_IDS]))


def test_a_mask_over_rows_chooses_among_those_rows(tiny_encoded):
    train = tiny_encoded.train
    every_other = train.where(np.arange(len(train)) % 2 == 0, "every other")
    assert read(every_other, [SRC_IDS], 5) == read(train, [SRC_IDS], 5)[::2]
    assert every_other.take([0, 2], [SRC_IDS]) == {SRC_IDS: [row[0] for row in read(train, [SRC_IDS], 5)[0:5:4]]}
    assert train.mask.sum() == len(train)  # the rows it was made from are unchanged


def test_a_table_that_is_not_whole_is_refused(tiny_encoded):
    """A slice of a table has its cache files, which hold other rows: read as they are, they would give
    wrong rows, so the read ends in an error."""
    part = tiny_encoded.train.table.select(range(2, 9))
    assert part.cache_files
    with pytest.raises(RuntimeError, match="cache files hold"):
        list(Rows(part, "part").batches([SRC_IDS]))


def test_a_mask_must_fit_its_table():
    with pytest.raises(ValueError):
        Rows(datasets.Dataset.from_dict({SRC_IDS: [[1], [2]]}), "two", np.ones(3, dtype=bool))
