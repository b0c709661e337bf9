"""Tests for the readers of Hugging Face datasets' formats (transformer/data/formats/: parquet.py,
jsonl.py, saved_dataset.py, hub.py, and the files of a split, data_files.py): the tiny
pairs written as Parquet (one file, a folder of shards, a glob), JSON lines, a save_to_disk folder (a
Dataset, a DatasetDict's split) and with a nested translation column read as exactly the CSV's raw
rows; the cache keyed by content; one DataError line for each input the user can fix; train.py's
one line for a missing column."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import SOURCE_COLUMN, TARGET_COLUMN, write_csv
from transformer.config import CorpusConfig
from transformer.data.formats.common import Corpus, RawPairs, side_values
from transformer.data.formats.delimited import read_delimited
from transformer.data.formats.hub import read_hub
from transformer.data.formats.jsonl import read_jsonl
from transformer.data.formats.parquet import read_parquet
from transformer.data.formats.saved_dataset import read_saved_dataset
from transformer.errors import DataError

ROOT = Path(__file__).resolve().parent.parent


def source_of(path: Path | str, format: str, source_column: str = SOURCE_COLUMN, target_column: str = TARGET_COLUMN,
              section: str = "data", **fields) -> Corpus:
    """The corpus at `path` as a reader is given it: its config, and the config section naming it."""
    return Corpus(CorpusConfig(path=str(path), format=format, source_column=source_column,
                               target_column=target_column, **fields), section)


def sides(raw: RawPairs) -> list[tuple[str | None, str | None]]:
    """The two sides of every raw row, in order, as the cleaning reads them."""
    batch = raw.table[:]
    return list(zip(side_values(batch, raw.source_column), side_values(batch, raw.target_column)))


@pytest.fixture
def csv_sides(tmp_path: Path, tiny_pairs, fresh_datasets_cache) -> list[tuple[str, str]]:
    """The tiny pairs' raw rows as the CSV reader gives them: what every format must give."""
    raw = read_delimited(source_of(write_csv(tmp_path / "tiny.csv", tiny_pairs), "csv"))
    rows = sides(raw)
    assert rows == tiny_pairs  # the reference itself: raw, nothing cleaned
    return rows


def columns_of(pairs: list[tuple[str, str]], nested: bool = False) -> dict[str, list]:
    """The pairs as columns: the CSV's two, and an id column that no side names; or opus_books'
    {"id", "translation": {"en", "fr"}}."""
    if nested:
        return {"id": [str(i) for i in range(len(pairs))], "translation": [{"en": s, "fr": t} for s, t in pairs]}
    return {"id": list(range(len(pairs))), SOURCE_COLUMN: [s for s, _ in pairs], TARGET_COLUMN: [t for _, t in pairs]}


def write_parquet(path: Path, pairs: list[tuple[str, str]], nested: bool = False) -> Path:
    pq.write_table(pa.table(columns_of(pairs, nested)), path)
    return path


def write_jsonl(path: Path, pairs: list[tuple[str, str]], nested: bool = False, blank_after: int | None = None) -> Path:
    columns = columns_of(pairs, nested)
    lines = [json.dumps({name: values[i] for name, values in columns.items()}, ensure_ascii=False)
             for i in range(len(pairs))]
    if blank_after is not None:
        lines.insert(blank_after, "   ")
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def listing(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_mtime_ns for path in sorted(folder.rglob("*"))}


def in_cache(raw: RawPairs, cache: Path) -> bool:
    return bool(raw.table.cache_files) and all(Path(entry["filename"]).is_relative_to(cache)
                                               for entry in raw.table.cache_files)


# --------------------------------------------------------------------------- the same rows as the CSV


def test_parquet_file_reads_like_the_same_csv(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    raw = read_parquet(source_of(write_parquet(tmp_path / "tiny.parquet", tiny_pairs), "parquet"))
    assert sides(raw) == csv_sides
    assert in_cache(raw, fresh_datasets_cache) and raw.header is None
    # Only the sides' columns are read: the id column stays in the file.
    assert raw.table.column_names == [SOURCE_COLUMN, TARGET_COLUMN]
    assert (raw.unit, raw.line_numbers([0, 5])) == ("row", [1, 6])
    flipped = read_parquet(source_of(tmp_path / "tiny.parquet", "parquet", TARGET_COLUMN, SOURCE_COLUMN))
    assert sides(flipped) == [(t, s) for s, t in csv_sides]


def test_parquet_folder_of_shards_and_a_glob_read_like_the_same_csv(tmp_path, tiny_pairs, csv_sides,
                                                                    fresh_datasets_cache):
    folder = tmp_path / "shards"
    folder.mkdir()
    # Named so that their order by name is the rows' order, written in the other order.
    write_parquet(folder / "train-00001.parquet", tiny_pairs[20:])
    write_parquet(folder / "train-00000.parquet", tiny_pairs[:20])
    (folder / "README.md").write_text("not a shard\n", encoding="utf-8")
    before = listing(folder)
    by_folder = read_parquet(source_of(folder, "parquet"))
    by_glob = read_parquet(source_of(folder / "train-*.parquet", "parquet"))
    assert sides(by_folder) == sides(by_glob) == csv_sides
    assert by_folder.key == by_glob.key  # the same files, the same content
    assert listing(folder) == before  # nothing written beside the user's files
    assert by_folder.line_numbers([0, 20, 41]) == [1, 21, 42] and by_folder.unit == "row"


def test_json_lines_read_like_the_same_csv_with_line_numbers(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    path = write_jsonl(tmp_path / "tiny.jsonl", tiny_pairs, blank_after=1)  # line 2 is blank
    raw = read_jsonl(source_of(path, "jsonl"))
    assert sides(raw) == csv_sides
    assert in_cache(raw, fresh_datasets_cache)
    # One file: the line where each row is, past the blank line.
    assert (raw.unit, raw.line_numbers([0, 1, 2, 41])) == ("line", [1, 3, 4, 43])


def test_a_folder_of_json_files_reads_like_the_same_csv(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    folder = tmp_path / "json"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", tiny_pairs[:10])
    write_jsonl(folder / "b.json", tiny_pairs[10:30])
    (folder / "c.jsonl").write_bytes(b"")  # an empty shard: no rows
    write_jsonl(folder / "d.jsonl", tiny_pairs[30:])
    raw = read_jsonl(source_of(folder, "jsonl"))
    assert sides(raw) == csv_sides
    assert (raw.unit, raw.line_numbers([0, 41])) == ("row", [1, 42])


def test_a_json_file_holding_one_array_reads_like_the_same_csv(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps([{SOURCE_COLUMN: s, TARGET_COLUMN: t} for s, t in tiny_pairs], ensure_ascii=False,
                               indent=1), encoding="utf-8")
    raw = read_jsonl(source_of(path, "jsonl"))
    assert sides(raw) == csv_sides
    assert (raw.unit, raw.line_numbers([0, 41])) == ("row", [1, 42])  # not line by line: rows


def test_what_load_dataset_reads_is_read_as_a_hub_dataset(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    """No network here: a local folder that load_dataset reads stands in for a Hub dataset."""
    folder = tmp_path / "hub_like"
    folder.mkdir()
    write_parquet(folder / "train-00000.parquet", tiny_pairs, nested=True)
    source = source_of(folder, "hub", "translation.en", "translation.fr")
    raw = read_hub(source)
    assert sides(raw) == csv_sides and in_cache(raw, fresh_datasets_cache)
    assert (raw.unit, raw.line_numbers([2])) == ("row", [3])
    assert read_hub(source).key == raw.key
    with pytest.raises(DataError) as error:
        read_hub(source_of(folder, "hub", "translation.de", "translation.fr"))
    assert str(error.value) == (f"the Hub dataset {folder}: no column 'translation.de' (data.source_column); its "
                                "columns are: id, translation.en, translation.fr")


@pytest.mark.parametrize("format", ["parquet", "jsonl", "dataset"])
def test_a_nested_translation_column_reads_like_the_same_csv(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache,
                                                            format):
    """opus_books / wmt14: {"translation": {"en": ..., "fr": ...}}, the sides named translation.en and
    translation.fr; the struct column comes back whole, side_values picks the fields."""
    if format == "parquet":
        path = write_parquet(tmp_path / "books.parquet", tiny_pairs, nested=True)
    elif format == "jsonl":
        path = write_jsonl(tmp_path / "books.jsonl", tiny_pairs, nested=True)
    else:
        path = tmp_path / "books"
        features = datasets.Features({"id": datasets.Value("string"),
                                      "translation": datasets.Translation(languages=["en", "fr"])})
        datasets.Dataset.from_dict(columns_of(tiny_pairs, nested=True), features=features).save_to_disk(path)
    reader = {"parquet": read_parquet, "jsonl": read_jsonl, "dataset": read_saved_dataset}[format]
    raw = reader(source_of(path, format, "translation.en", "translation.fr"))
    assert (raw.source_column, raw.target_column) == ("translation.en", "translation.fr")
    assert "translation" in raw.table.column_names
    assert sides(raw) == csv_sides
    # And the other way round: a direction is a choice of fields.
    flipped = reader(source_of(path, format, "translation.fr", "translation.en"))
    assert sides(flipped) == [(t, s) for s, t in csv_sides]


def test_a_saved_dataset_reads_like_the_same_csv_and_stays_untouched(tmp_path, tiny_pairs, csv_sides,
                                                                     fresh_datasets_cache):
    folder = tmp_path / "saved"
    # Two shards, so that the files' order (state.json's) matters.
    datasets.Dataset.from_dict(columns_of(tiny_pairs)).save_to_disk(folder, num_shards=2)
    assert len(list(folder.glob("data-*.arrow"))) == 2
    before = listing(folder)
    raw = read_saved_dataset(source_of(folder, "dataset"))
    assert sides(raw) == csv_sides
    assert in_cache(raw, fresh_datasets_cache) and listing(folder) == before
    assert (raw.unit, raw.line_numbers([3])) == ("row", [4])


def test_a_saved_dataset_dict_reads_the_split_named(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    folder = tmp_path / "saved_dict"
    datasets.DatasetDict(train=datasets.Dataset.from_dict(columns_of(tiny_pairs)),
                         validation=datasets.Dataset.from_dict(columns_of(tiny_pairs[:3]))).save_to_disk(folder)
    before = listing(folder)
    assert sides(read_saved_dataset(source_of(folder, "dataset"))) == csv_sides  # split: train by default
    assert sides(read_saved_dataset(source_of(folder, "dataset", split="validation"))) == csv_sides[:3]
    assert listing(folder) == before


def test_a_saved_dataset_without_splits_refuses_a_split(tmp_path, tiny_pairs, fresh_datasets_cache):
    """Issue 58: `data.split: test` on a save_to_disk folder of one Dataset read the whole dataset, where one
    Parquet or JSON lines file refuses it."""
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(columns_of(tiny_pairs)).save_to_disk(folder)
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset", split="test"))
    assert str(error.value) == (f"{folder}: a saved Dataset holds no splits (data.split: 'test'); save a DatasetDict "
                                "with its test split and name its folder in data.path, or remove data.split")


def test_a_file_replaced_in_place_is_read_anew(tmp_path, tiny_pairs, fresh_datasets_cache):
    """datasets would find its cached table by the file's path and modification time: the content names it."""
    path = write_parquet(tmp_path / "pairs.parquet", tiny_pairs[:4])
    first = read_parquet(source_of(path, "parquet"))
    stat = path.stat()
    write_parquet(path, [(s.upper(), t) for s, t in tiny_pairs[:4]])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = read_parquet(source_of(path, "parquet"))
    assert sides(second) == [(s.upper(), t) for s, t in tiny_pairs[:4]] and second.key != first.key
    assert read_parquet(source_of(path, "parquet")).key == second.key  # the same content, the same key


# --------------------------------------------------------------------------- errors: one line naming the input


def test_a_missing_column_lists_the_columns_with_a_struct_dotted(tmp_path, fresh_datasets_cache):
    table = pa.table({"a": ["x"], "b": ["y"], "translation": [{"en": "Hi.", "fr": "Salut !"}]})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError) as error:
        read_parquet(source_of(path, "parquet", "x", "translation.fr"))
    assert str(error.value) == (f"{path}: no column 'x' (data.source_column); its columns are: a, b, translation.en, "
                                "translation.fr")
    with pytest.raises(DataError) as error:
        read_parquet(source_of(path, "parquet", "a", "translation.de", section="data.corpora[1]"))
    assert str(error.value) == (f"{path}: no column 'translation.de' (data.corpora[1].target_column); its columns "
                                "are: a, b, translation.en, translation.fr")
    # The same from JSON lines and a saved dataset.
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps(table.to_pylist()[0]) + "\n", encoding="utf-8")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(table.to_pylist()).save_to_disk(saved)
    for reader, where, format in ((read_jsonl, jsonl, "jsonl"), (read_saved_dataset, saved, "dataset")):
        with pytest.raises(DataError) as error:
            reader(source_of(where, format, "x", "translation.fr"))
        assert str(error.value) == (f"{where}: no column 'x' (data.source_column); its columns are: a, b, "
                                    "translation.en, translation.fr")


def test_a_column_that_is_not_text_is_one_line(tmp_path, fresh_datasets_cache):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"n": [1, 2], "fr": ["a", "b"], "translation": [{"en": "a"}, {"en": "b"}]}), path)
    with pytest.raises(DataError) as error:
        read_parquet(source_of(path, "parquet", "n", "fr"))
    assert str(error.value) == f"{path}: the column 'n' (data.source_column) holds int64 values, not text"
    with pytest.raises(DataError) as error:
        read_parquet(source_of(path, "parquet", "translation", "fr"))
    assert str(error.value) == (f"{path}: the column 'translation' (data.source_column) holds a struct of the "
                                "fields en (name one of them: translation.en), not text")


def test_a_json_side_that_is_not_text_names_its_line(tmp_path, fresh_datasets_cache):
    path = tmp_path / "t.jsonl"
    path.write_text('{"en": "Hi.", "fr": "Salut !"}\n\n{"en": 1984, "fr": "1984"}\n', encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(path, "jsonl", "en", "fr"))
    assert str(error.value) == f"{path}: line 3: 'en' (data.source_column) is a number (1984), not text"


@pytest.mark.parametrize("text, expected", [
    ('{"en": "Hi.", "fr": "Salut !"}\n\n{"en": "Go.", fr: "Va !"}\n',
     "line 3 is not JSON (Expecting property name enclosed in double quotes) (data.path)"),
    ('{"en": "Hi.", "fr": "Salut !"}\n["Go.", "Va !"]\n',
     "line 2 is a list, not a JSON object (data.path): JSON lines hold one object a line"),
    ('{"en": "Hi.", "fr": "Salut !"}\n{"en": "Go.", "fr": "Va !"} trailing\n',
     "line 2 is not JSON (Extra data) (data.path)"),
])
def test_a_json_line_that_is_not_an_object_names_the_file_and_line(tmp_path, fresh_datasets_cache, text, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(path, "jsonl", "en", "fr"))
    assert str(error.value) == f"{path}: {expected}"


def test_json_lines_not_utf8_and_empty_name_the_file(tmp_path, fresh_datasets_cache):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"en": "Hi.", "fr": "Salut !"}\n{"en": "Go.", "fr": "Déjà"}\n'.encode("latin-1"))
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(path, "jsonl", "en", "fr"))
    assert str(error.value).startswith(f"{path}: not UTF-8 text at line 2 (")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(empty, "jsonl", "en", "fr"))
    assert str(error.value) == f"{empty}: the file is empty (data.path)"


def test_parquet_text_that_is_not_utf8_names_the_row(tmp_path, fresh_datasets_cache):
    path = tmp_path / "latin1.parquet"
    not_utf8 = pa.array([b"Salut !", "Déjà".encode("latin-1"), b"Va !"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"en": ["Hi.", "Already", "Go."], "fr": not_utf8}), path)
    with pytest.raises(DataError) as error:
        read_parquet(source_of(path, "parquet", "en", "fr"))
    assert str(error.value) == (f"{path}: row 2: the column 'fr' (data.target_column) holds text that is not UTF-8; "
                                "re-save the data as UTF-8")


def test_a_file_that_is_not_parquet_names_the_file(tmp_path, tiny_pairs, fresh_datasets_cache):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "a.parquet", tiny_pairs)
    bad = folder / "b.parquet"
    bad.write_text("English,French\nHi.,Salut !\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_parquet(source_of(folder, "parquet"))
    message = str(error.value)
    assert message.startswith(f"{bad}: not a Parquet file (") and message.endswith(" (data.path)")
    assert "\n" not in message


def test_no_data_files_name_the_path_and_key(tmp_path, fresh_datasets_cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x", encoding="utf-8")
    cases = [
        (read_parquet, source_of(empty, "parquet"), f"{empty}: no *.parquet file in this folder (data.path)"),
        (read_jsonl, source_of(empty, "jsonl"), f"{empty}: no *.jsonl or *.json file in this folder (data.path)"),
        (read_parquet, source_of(tmp_path / "x-*.parquet", "parquet"),
         f"{tmp_path / 'x-*.parquet'}: no file matches this pattern (data.path)"),
        (read_jsonl, source_of(tmp_path / "nope.jsonl", "jsonl", section="data.corpora[0]"),
         f"data file not found: {tmp_path / 'nope.jsonl'} (data.corpora[0].path)"),
        (read_saved_dataset, source_of(tmp_path / "nope", "dataset"),
         f"data folder not found: {tmp_path / 'nope'} (data.path)"),
    ]
    for reader, source, expected in cases:
        with pytest.raises(DataError) as error:
            reader(source)
        assert str(error.value) == expected


def test_a_folder_that_is_not_a_saved_dataset_is_one_line(tmp_path, tiny_pairs, fresh_datasets_cache):
    plain = tmp_path / "plain"
    plain.mkdir()
    write_parquet(plain / "a.parquet", tiny_pairs)
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(plain, "dataset"))
    assert str(error.value) == (f"{plain}: not a dataset written by save_to_disk (data.path): the folder holds "
                                "neither state.json nor dataset_dict.json")
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(plain / "a.parquet", "dataset"))
    assert str(error.value) == (f"{plain / 'a.parquet'}: not a folder (data.path); data.format dataset reads a folder "
                                "written by save_to_disk")


def test_a_saved_dataset_dict_without_the_split_lists_its_splits(tmp_path, tiny_pairs, fresh_datasets_cache):
    folder = tmp_path / "saved_dict"
    one = datasets.Dataset.from_dict(columns_of(tiny_pairs[:3]))
    datasets.DatasetDict(train=one, validation=one).save_to_disk(folder)
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset", split="test"))
    assert str(error.value) == f"{folder}: no split 'test' (data.split); its splits are: train, validation"


def test_a_damaged_saved_dataset_names_the_file(tmp_path, tiny_pairs, fresh_datasets_cache):
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(columns_of(tiny_pairs)).save_to_disk(folder, num_shards=3)
    first, middle, last = sorted(folder.glob("data-*.arrow"))
    middle.write_bytes(b"not arrow at all")
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value).startswith(f"{middle}: not an Arrow file written by save_to_disk (")
    middle.unlink()
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value) == (f"{middle}: not found, though the folder holds the other shards of its 3 "
                                "(data.path)")
    (folder / "data-00005-of-00003.arrow").write_bytes(first.read_bytes())
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value) == (f"{folder / 'data-00005-of-00003.arrow'}: not one of the 3 shards its name says there "
                                "are (data.path)")
    for arrow in folder.glob("data-*.arrow"):
        arrow.unlink()
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value) == f"{folder}: holds no data-*.arrow file, which save_to_disk writes (data.path)"


def test_a_saved_dataset_is_read_in_the_order_of_its_shards_without_its_private_state(tmp_path, tiny_pairs, csv_sides,
                                                                                     fresh_datasets_cache):
    """Its files were once listed from state.json's `_data_files`, a field datasets keeps to itself:
    save_to_disk's shard names say the same, in the same order, for a Dataset and a DatasetDict's splits."""
    folder, saved_dict = tmp_path / "saved", tmp_path / "saved_dict"
    table = datasets.Dataset.from_dict(columns_of(tiny_pairs))
    table.save_to_disk(folder, num_shards=4)
    datasets.DatasetDict(train=table, test=table.select(range(5))).save_to_disk(saved_dict, num_shards={"train": 3,
                                                                                                       "test": 1})
    (folder / "state.json").write_text("{}", encoding="utf-8")  # not read: its listing is not needed
    assert sides(read_saved_dataset(source_of(folder, "dataset"))) == csv_sides
    assert sides(read_saved_dataset(source_of(saved_dict, "dataset"))) == csv_sides
    assert sides(read_saved_dataset(source_of(saved_dict, "dataset", split="test"))) == csv_sides[:5]
    datasets.Dataset.from_dict(columns_of(tiny_pairs[:3])).save_to_disk(folder, num_shards=1)  # over the first save
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value) == (f"{folder}: holds the shards of 2 saves (data-*-of-00001.arrow, data-*-of-00004.arrow) "
                                "(data.path); save_to_disk leaves an earlier save's shards behind: save into an empty "
                                "folder")


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line(monkeypatch, fresh_datasets_cache):
    """No network here: offline, load_dataset fails at once; any failure is one line naming the dataset."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    source = source_of("nobody/no-such-dataset", "hub", "translation.en", "translation.fr", hub_config="en-fr")
    with pytest.raises(DataError) as error:
        read_hub(source)
    message = str(error.value)
    assert message.startswith("cannot load the Hub dataset nobody/no-such-dataset (en-fr) (data.path, split 'train'): ")
    assert "\n" not in message


# --------------------------------------------------------------------------- splits: what data.split reads


def write_pairs(path: Path, pairs: list[tuple[str, str]]) -> Path:
    """The pairs as Parquet or JSON lines, by the file's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_parquet(path, pairs) if path.suffix == ".parquet" else write_jsonl(path, pairs)


# Folders of split files as datasets names them: (files of the train split, of the other split, its name).
SPLIT_LAYOUTS = {
    "sharded": (["train-00000-of-00001"], ["test-00000-of-00001"], "test"),  # Dataset.to_parquet per split
    "hub": (["data/train-00000-of-00002", "data/train-00001-of-00002"], ["data/test-00000-of-00001"], "test"),
    "folders": (["train/part-0"], ["test/part-0"], "test"),
    "dev": (["train"], ["dev"], "validation"),  # datasets calls dev, valid and val files validation
}


@pytest.mark.slow
@pytest.mark.parametrize("format, layout", [("parquet", name) for name in SPLIT_LAYOUTS] + [("jsonl", "hub"),
                                                                                            ("jsonl", "dev")])
def test_a_folder_of_split_files_reads_the_split_named(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache, format,
                                                       layout):
    """Issue 47: data.split on a folder of train-*/test-* files once read every file, the test split's too."""
    train_names, other_names, other = SPLIT_LAYOUTS[layout]
    folder, suffix = tmp_path / "corpus", ".parquet" if format == "parquet" else ".jsonl"
    train, held = tiny_pairs[:30], tiny_pairs[30:]
    shard = len(train) // len(train_names)
    for index, name in enumerate(train_names):
        write_pairs(folder / (name + suffix), train[index * shard:(index + 1) * shard])
    write_pairs(folder / (other_names[0] + suffix), held)
    assert sides(READ[format](source_of(folder, format))) == csv_sides[:30]  # data.split: train, the default
    assert sides(READ[format](source_of(folder, format, split=other))) == csv_sides[30:]
    assert sides(READ[format](source_of(folder / "**" / ("*" + suffix), format, split=other))) == csv_sides[30:]


READ = {"parquet": read_parquet, "jsonl": read_jsonl}


def test_data_split_test_on_a_parquet_folder_trains_on_the_test_files_alone(tmp_path, tiny_pairs, fresh_datasets_cache):
    """The case of issue 47 whole: load_pairs with data.split: test read all 42 rows, the train file's too."""
    from transformer.config import DataConfig
    from transformer.data.corpus import load_pairs

    folder = tmp_path / "wmt"
    write_pairs(folder / "train-00000-of-00001.parquet", tiny_pairs[:30])
    write_pairs(folder / "test-00000-of-00001.parquet", tiny_pairs[30:])
    _, (report,) = load_pairs(DataConfig(path=str(folder), format="parquet", split="test"))
    assert report.rows_read == 12


def test_a_split_the_folder_lacks_lists_the_splits_it_has(tmp_path, tiny_pairs, fresh_datasets_cache):
    folder = tmp_path / "wmt"
    write_pairs(folder / "train-00000-of-00001.parquet", tiny_pairs[:30])
    write_pairs(folder / "validation-00000-of-00001.parquet", tiny_pairs[30:])
    with pytest.raises(DataError) as error:
        read_parquet(source_of(folder, "parquet", split="test", section="data.corpora[1]"))
    assert str(error.value) == f"{folder}: no split 'test' (data.corpora[1].split); its splits are: train, validation"
    only_test = tmp_path / "only_test"
    write_pairs(only_test / "test.jsonl", tiny_pairs)
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(only_test, "jsonl"))  # the default split, train: not there either
    assert str(error.value) == f"{only_test}: no split 'train' (data.split); its splits are: test"


def test_a_folder_without_split_names_is_read_whole_and_has_no_other_split(tmp_path, tiny_pairs, csv_sides,
                                                                           fresh_datasets_cache):
    folder = tmp_path / "shards"
    write_pairs(folder / "a.parquet", tiny_pairs[:20])
    write_pairs(folder / "more" / "b.parquet", tiny_pairs[20:])  # below it too, as datasets reads a folder
    assert sides(read_parquet(source_of(folder, "parquet"))) == csv_sides
    with pytest.raises(DataError) as error:
        read_parquet(source_of(folder, "parquet", split="test"))
    assert str(error.value) == (f"{folder}: no file is named for a split, so there is no split 'test' (data.split); "
                                "it holds a.parquet, more/b.parquet. Name a split's files as datasets does "
                                "(test-00000-of-00001.parquet, or a folder test/), or remove data.split")


def test_files_named_for_no_split_beside_split_files_are_left_out_with_a_warning(tmp_path, tiny_pairs, csv_sides,
                                                                                 caplog, fresh_datasets_cache):
    folder = tmp_path / "corpus"
    write_pairs(folder / "train.parquet", tiny_pairs[:30])
    write_pairs(folder / "extra.parquet", tiny_pairs[30:])
    assert sides(read_parquet(source_of(folder, "parquet"))) == csv_sides[:30]  # as load_dataset reads it
    assert "1 file(s) named for no split (extra.parquet) left out" in caplog.text


@pytest.mark.parametrize("format", ["parquet", "jsonl"])
def test_one_file_has_no_splits(tmp_path, tiny_pairs, fresh_datasets_cache, format):
    """Issue 47 (b): data.split: validation on one JSON lines file was ignored, every row read."""
    path = write_pairs(tmp_path / f"pairs.{format}", tiny_pairs)
    with pytest.raises(DataError) as error:
        READ[format](source_of(path, format, split="validation"))
    assert str(error.value) == (f"{path}: one file holds no splits (data.split: 'validation'); name the folder "
                                "holding the validation files in data.path, or remove data.split")


def test_a_glob_reads_the_files_it_names_and_splits_are_found_among_them_alone(tmp_path, tiny_pairs, csv_sides,
                                                                             fresh_datasets_cache, monkeypatch):
    """Splits were once found among every file below where the pattern starts (datasets' ~30 recursive
    globs of get_data_patterns: for "*.parquet", over the whole working folder), not among its matches:
    `data/wmt/test-*.parquet` was refused, "no split 'train'"."""
    from datasets import data_files as hf_data_files

    monkeypatch.setattr(hf_data_files, "get_data_patterns", None)  # nothing globs the folder for splits
    folder = tmp_path / "wmt"
    write_pairs(folder / "train-00000-of-00001.parquet", tiny_pairs[:30])
    write_pairs(folder / "test-00000-of-00001.parquet", tiny_pairs[30:])
    write_pairs(folder / "data" / "other-00000-of-00001.parquet", tiny_pairs[:1])  # matched by no glob below
    assert sides(read_parquet(source_of(folder / "test-*.parquet", "parquet"))) == csv_sides[30:]
    assert sides(read_parquet(source_of(folder / "test-*.parquet", "parquet", split="test"))) == csv_sides[30:]
    assert sides(read_parquet(source_of(folder / "t*.parquet", "parquet"))) == csv_sides[:30]  # two splits: train's
    with pytest.raises(DataError) as error:
        read_parquet(source_of(folder / "test-*.parquet", "parquet", split="validation"))
    assert str(error.value) == f"{folder / 'test-*.parquet'}: no split 'validation' (data.split); its splits are: test"


def test_a_split_name_datasets_refuses_is_one_line_not_the_whole_folder(tmp_path, tiny_pairs, csv_sides,
                                                                        fresh_datasets_cache):
    """datasets refuses "news-commentary" as a split's name (a ValueError), which once read the folder whole."""
    folder = tmp_path / "hub_copy"
    write_pairs(folder / "data" / "train-00000-of-00001.parquet", tiny_pairs[:30])
    write_pairs(folder / "data" / "news-commentary-00000-of-00001.parquet", tiny_pairs[30:])
    with pytest.raises(DataError) as error:
        read_parquet(source_of(folder, "parquet"))
    assert str(error.value) == (
        f"{folder}: data/news-commentary-00000-of-00001.parquet is named for the split 'news-commentary', which "
        "datasets refuses as a split's name (letters, digits and _ only), so the folder's splits are unknown "
        "(data.path); rename the files (news_commentary-00000-of-00001...), or name the files to read with a glob "
        "pattern in data.path")
    named = folder / "data" / "news-commentary-*.parquet"  # a glob names the files: they are read
    assert sides(read_parquet(source_of(named, "parquet"))) == csv_sides[30:]


def test_a_folder_is_read_in_path_order_folder_by_folder(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    """Sorted as strings, "wmt-extra/a.parquet" came before "wmt/a.parquet" ("-" < "/"): another row
    order, and another content key, than the Paths' order the files were read in before."""
    root = tmp_path / "corpora"
    write_pairs(root / "wmt" / "a.parquet", tiny_pairs[:20])
    write_pairs(root / "wmt-extra" / "a.parquet", tiny_pairs[20:])
    for path in (root, root / "**" / "*.parquet"):
        assert sides(read_parquet(source_of(path, "parquet"))) == csv_sides


def test_which_files_a_folder_gives_is_logged_with_what_was_left_out(tmp_path, tiny_pairs, csv_sides, caplog,
                                                                    fresh_datasets_cache):
    folder = tmp_path / "corpus"
    write_pairs(folder / "a.jsonl", tiny_pairs[:20])
    write_pairs(folder / "more" / "b.jsonl", tiny_pairs[20:])
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / ".a.jsonl.crc").write_bytes(b"crc")
    (folder / "notes.txt").write_text("x", encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="transformer.data.formats.data_files"):
        assert sides(read_jsonl(source_of(folder, "jsonl"))) == csv_sides
    assert [record.getMessage() for record in caplog.records if record.name.endswith(".data_files")] == [
        f"{folder} (data.path): reading 2 file(s), 1 of them in subfolders: a.jsonl, more/b.jsonl",
        f"{folder}: left out 2 entries under a name starting with '.' or '_' (Spark's _SUCCESS, .crc files, "
        "_temporary/): .a.jsonl.crc, _SUCCESS",
        f"{folder}: left out 1 entry not named *.jsonl or *.json: notes.txt"]
    splits = tmp_path / "splits"
    write_pairs(splits / "train" / "a.parquet", tiny_pairs[:30])
    write_pairs(splits / "test" / "a.parquet", tiny_pairs[30:])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="transformer.data.formats.data_files"):
        read_parquet(source_of(splits, "parquet"))
    assert [record.getMessage() for record in caplog.records if record.name.endswith(".data_files")] == [
        f"{splits} (data.path): reading 1 file(s), 1 of them in subfolders: train/a.parquet",
        f"{splits}: left out 1 entry of the split test (data.split: train): test/a.parquet"]


def test_a_data_file_both_plain_and_compressed_is_refused(tmp_path, tiny_pairs, fresh_datasets_cache):
    """Both are read, as datasets reads both: the rows twice."""
    import gzip

    folder = tmp_path / "corpus"
    plain = write_pairs(folder / "sub" / "train.jsonl", tiny_pairs)
    (folder / "sub" / "train.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    for path in (folder, folder / "**" / "*"):
        with pytest.raises(DataError) as error:
            read_jsonl(source_of(path, "jsonl"))
        assert str(error.value) == (f"{path}: sub/train.jsonl and sub/train.jsonl.gz are the same data file, plain "
                                    "and compressed, whose rows would be read twice (data.path); remove one of them")


def test_a_subfolder_that_cannot_be_listed_is_named_not_left_out(tmp_path, tiny_pairs, monkeypatch,
                                                                 fresh_datasets_cache):
    """os.walk leaves out a folder it cannot list, unless told otherwise: its files went unread, unsaid."""
    import errno

    from transformer.config import DataConfig
    from transformer.data.corpus import load_pairs

    folder = tmp_path / "corpus"
    write_pairs(folder / "a.parquet", tiny_pairs[:20])
    locked = folder / "locked"
    write_pairs(locked / "b.parquet", tiny_pairs[20:])
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path) == str(locked):  # as chmod 000 would, for a user other than root
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(DataError) as error:
        load_pairs(DataConfig(path=str(folder), format="parquet"))
    assert str(error.value) == f"cannot read {locked} (data.path): Permission denied"


@pytest.mark.parametrize("kind, cut", [("gzip", 6), ("gzip", 0.5), ("xz", 0.5)])
def test_a_truncated_compressed_json_lines_file_is_one_line(tmp_path, tiny_pairs, fresh_datasets_cache, kind, cut):
    """A download stopped halfway: the decompressors' EOFError (zlib.error, lzma.LZMAError, BadGzipFile
    for a damaged one) ended in a traceback, in the first line's reading or once the builder failed."""
    import gzip
    import lzma

    plain = write_pairs(tmp_path / "pairs.jsonl", tiny_pairs * 20)
    data = (gzip.compress if kind == "gzip" else lzma.compress)(plain.read_bytes())
    path = tmp_path / ("pairs.jsonl.gz" if kind == "gzip" else "pairs.jsonl.xz")
    path.write_bytes(data[:cut if isinstance(cut, int) else int(len(data) * cut)])
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(path, "jsonl"))
    assert str(error.value) == (f"{path}: cannot decompress it (data.path): Compressed file ended before the "
                                f"end-of-stream marker was reached; the {kind} file is damaged or cut short: download "
                                "or compress it again")


@pytest.mark.parametrize("data, expected", [
    ({"path": "x.csv", "split": "validation"},
     "data.split is only for data.format parquet, jsonl, dataset or hub; a csv corpus has no splits and is read "
     "whole (remove data.split, and name the validation split's file in data.path)"),
    ({"path": "x.en", "format": "text", "target_path": "x.fr", "split": "test"},
     "data.split is only for data.format parquet, jsonl, dataset or hub; a text corpus has no splits and is read "
     "whole (remove data.split, and name the test split's file in data.path)"),
    ({"path": "x.csv", "hub_config": "en-fr"},
     "data.hub_config is only for data.format: hub, a Hub dataset's configuration; a csv corpus has none (remove "
     "data.hub_config)"),
    ({"path": "x", "format": "dataset", "hub_config": "en-fr"},
     "data.hub_config is only for data.format: hub, a Hub dataset's configuration; a dataset corpus has none "
     "(remove data.hub_config)"),
    ({"corpora": [{"path": "a.csv"}, {"path": "b.tsv", "format": "tsv", "split": "test"}]},
     "data.corpora[1].split is only for data.corpora[1].format parquet, jsonl, dataset or hub; a tsv corpus has no "
     "splits and is read whole (remove data.corpora[1].split, and name the test split's file in "
     "data.corpora[1].path)"),
], ids=["csv-split", "text-split", "csv-hub_config", "dataset-hub_config", "corpora-tsv-split"])
def test_a_key_no_reader_of_the_format_reads_is_refused(data, expected):
    """Issue 47 (c): data.hub_config on a CSV, and data.split where no reader reads it, were silently ignored."""
    from transformer.config import DataConfig, config_from_dict
    from transformer.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        config_from_dict({"data": data})
    assert str(error.value) == expected
    for format in ("parquet", "jsonl", "dataset", "hub"):  # the formats whose data.path may hold splits
        assert DataConfig(path="x", format=format, split="test").split == "test"
    assert DataConfig(path="x", format="hub", hub_config="en-fr").hub_config == "en-fr"


def test_every_declared_format_has_a_reader_and_is_a_choice_of_data_format():
    """The formats' names are written once, in their readers' declarations: READERS and data.format's
    choices are both made from them, in their order."""
    import typing

    from transformer.config import CorpusConfig, DataConfig
    from transformer.data.formats import FORMATS
    from transformer.data.formats.readers import READERS

    assert list(READERS) == list(FORMATS) == ["csv", "tsv", "text", "parquet", "jsonl", "dataset", "hub"]
    for section in (CorpusConfig, DataConfig):
        assert typing.get_args(typing.get_type_hints(section)["format"]) == tuple(FORMATS)


def test_a_runs_stored_config_with_a_key_its_format_never_read_still_loads(tmp_path, caplog):
    """A run trained before such keys were refused (they did nothing then) could no longer be resumed,
    translated with or exported: load_run_config loads its config.yaml through the same check."""
    import yaml

    from transformer.checkpoints.lookup import load_run_config
    from transformer.config import ConfigError, config_to_dict, load_config

    shipped = load_config(ROOT / "configs" / "tiny.yaml")
    stored = config_to_dict(shipped)
    stored["data"].update(split="validation")  # on the default format, csv
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(stored), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="transformer.config"):
        config = load_run_config(run)
    assert config.data.split == "train" and config.data == shipped.data
    assert (f"{run / 'config.yaml'}: data.split: 'validation' ignored, as it was when this run trained: its data "
            "format does not read it") in caplog.text
    with pytest.raises(ConfigError):  # a config the user gives is still refused
        load_config(run / "config.yaml")
    stored["data"] = {"corpora": [{"path": "a.csv"}, {"path": "b.tsv", "format": "tsv", "hub_config": "en-fr"}]}
    (run / "config.yaml").write_text(yaml.safe_dump(stored), encoding="utf-8")
    assert load_run_config(run).data.corpora[1].hub_config == ""
    assert "data.corpora[1].hub_config: 'en-fr' ignored" in caplog.text


# --------------------------------------------------------------------------- as Spark, pandas and datasets write


def test_a_parquet_folder_as_spark_writes_it(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    """Spark: part-*.snappy.parquet files, an empty partition's file without a row, _SUCCESS, hidden .crc
    files, a _temporary/ folder of an unfinished job. The empty file once stopped the parquet builder
    ("BatchSize must be greater than 0"), and a glob matched _SUCCESS ("not a Parquet file")."""
    folder = tmp_path / "spark"
    write_parquet(folder.mkdir() or folder / "part-00000-5a1c-c000.snappy.parquet", tiny_pairs[:20])
    pq.write_table(pa.table({SOURCE_COLUMN: pa.array([], pa.string()), TARGET_COLUMN: pa.array([], pa.string())}),
                   folder / "part-00001-5a1c-c000.snappy.parquet")
    write_parquet(folder / "part-00002-5a1c-c000.snappy.parquet", tiny_pairs[20:])
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / ".part-00000-5a1c-c000.snappy.parquet.crc").write_bytes(b"crc\x00")
    (folder / "_temporary" / "0").mkdir(parents=True)
    write_parquet(folder / "_temporary" / "0" / "part-00009.parquet", tiny_pairs[:1])
    assert sides(read_parquet(source_of(folder, "parquet"))) == csv_sides
    assert sides(read_parquet(source_of(folder / "*", "parquet"))) == csv_sides
    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pa.table({SOURCE_COLUMN: pa.array([], pa.string()), TARGET_COLUMN: pa.array([], pa.string())}),
                   empty / "part-00000.parquet")
    with pytest.raises(DataError) as error:
        read_parquet(source_of(empty, "parquet"))
    assert str(error.value) == f"{empty}: its 1 Parquet file holds no row (data.path)"


def test_json_lines_as_spark_and_pandas_write_them(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    """Spark: part-*.json, gzip-compressed or not, an empty part, _SUCCESS, .crc files; pandas'
    to_json(orient="records", lines=True): escaped accents, and a last line without a newline."""
    import gzip

    import pandas as pd

    folder = tmp_path / "spark_json"
    folder.mkdir()
    write_jsonl(folder / "part-00000-5a1c.json", tiny_pairs[:10])
    (folder / "part-00001-5a1c.json").write_bytes(b"")
    with gzip.open(folder / "part-00002-5a1c.json.gz", "wb") as handle:
        handle.write(write_jsonl(tmp_path / "middle.jsonl", tiny_pairs[10:30]).read_bytes())
    frame = pd.DataFrame(tiny_pairs[30:], columns=[SOURCE_COLUMN, TARGET_COLUMN])
    text = frame.to_json(orient="records", lines=True).rstrip("\n")  # escaped: "\u00e9"
    assert "\\u00" in text
    (folder / "part-00003-5a1c.json").write_text(text, encoding="ascii")
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / ".part-00000-5a1c.json.crc").write_bytes(b"crc\x00")
    raw = read_jsonl(source_of(folder, "jsonl"))
    assert sides(raw) == csv_sides
    one = folder / "part-00002-5a1c.json.gz"  # one compressed file: lines counted in the decompressed text
    assert read_jsonl(source_of(one, "jsonl")).line_numbers([0, 19]) == [1, 20]


def test_parquet_as_pandas_and_datasets_write_it(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    """pandas' to_parquet keeps an index other than a RangeIndex as __index_level_0__; datasets' to_parquet and
    to_json write shards of their own."""
    import pandas as pd

    frame = pd.DataFrame(tiny_pairs, columns=[SOURCE_COLUMN, TARGET_COLUMN],
                         index=[f"tatoeba-{i}" for i in range(len(tiny_pairs))])  # not a RangeIndex
    frame.to_parquet(tmp_path / "pandas.parquet")
    assert "__index_level_0__" in pq.read_schema(tmp_path / "pandas.parquet").names
    assert sides(read_parquet(source_of(tmp_path / "pandas.parquet", "parquet"))) == csv_sides
    table = datasets.Dataset.from_dict(columns_of(tiny_pairs))
    table.to_parquet(tmp_path / "datasets.parquet")
    table.to_json(tmp_path / "datasets.jsonl")
    assert sides(read_parquet(source_of(tmp_path / "datasets.parquet", "parquet"))) == csv_sides
    assert sides(read_jsonl(source_of(tmp_path / "datasets.jsonl", "jsonl"))) == csv_sides


def test_a_parquet_map_column_beside_the_sides_is_left_unread(tmp_path, tiny_pairs, csv_sides, fresh_datasets_cache):
    """Issue 58: a map<string, string> column beside the two text columns ended in "ValueError: Arrow type
    map<string, string ('meta')> does not have a datasets dtype equivalent". Columns a run does not read
    stop nothing; named as a side, the map column is one line."""
    columns = columns_of(tiny_pairs)
    meta = pa.array([[("origin", "tatoeba"), ("row", str(i))] for i in range(len(tiny_pairs))],
                    type=pa.map_(pa.string(), pa.string()))
    path = tmp_path / "meta.parquet"
    pq.write_table(pa.table({**columns, "meta": meta}), path)
    assert pa.types.is_map(pq.read_schema(path).field("meta").type)
    raw = read_parquet(source_of(path, "parquet"))
    assert sides(raw) == csv_sides and raw.table.column_names == [SOURCE_COLUMN, TARGET_COLUMN]
    with pytest.raises(DataError) as error:
        read_parquet(source_of(path, "parquet", "meta", TARGET_COLUMN))
    assert str(error.value) == (f"{path}: the column 'meta' (data.source_column) holds map<string, string> values, "
                                "not text")


def test_json_compressed_other_than_gzip_bzip2_or_xz_is_one_line(tmp_path, tiny_pairs, fresh_datasets_cache):
    """Once "not UTF-8 text at line 1; re-save the file as UTF-8": advice that cannot help a compressed file."""
    zstd = tmp_path / "pairs.jsonl.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    snappy = tmp_path / "part-00000.json.snappy"  # Hadoop's snappy has no magic bytes: known by its name
    snappy.write_bytes(b"\x00\x00\x01\x00" + bytes(range(200)))
    for path, kind in ((zstd, "zstd"), (snappy, "snappy")):
        with pytest.raises(DataError) as error:
            read_jsonl(source_of(path, "jsonl"))
        assert str(error.value) == (f"{path}: compressed with {kind}, which is not read (data.path); decompress it, "
                                    "or compress it with gzip, bzip2 or xz")
    import gzip
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"en": "Hi.", "fr": "Salut"}\n{"en": 3, "fr": "trois"}\n'))
    with pytest.raises(DataError) as error:
        read_jsonl(source_of(bad, "jsonl", "en", "fr"))
    assert str(error.value) == f"{bad}: line 2: 'en' (data.source_column) is a number (3), not text"


# --------------------------------------------------------------------------- datasets' environment


def test_tables_stay_in_the_cache_whatever_hf_datasets_in_memory_max_size(tmp_path, tiny_pairs, monkeypatch,
                                                                          fresh_datasets_cache):
    """HF_DATASETS_IN_MEMORY_MAX_SIZE would keep a small table in memory, without cache files: the
    Hub's table would then be known by nothing of its content."""
    monkeypatch.setattr(datasets.config, "IN_MEMORY_MAX_SIZE", 10**12)
    path = write_parquet(tmp_path / "pairs.parquet", tiny_pairs)
    assert in_cache(read_parquet(source_of(path, "parquet")), fresh_datasets_cache)
    folder = tmp_path / "hub_like"
    write_parquet(folder.mkdir() or folder / "train-00000.parquet", tiny_pairs)
    first = read_hub(source_of(folder, "hub"))
    assert in_cache(first, fresh_datasets_cache)
    write_parquet(folder / "train-00000.parquet", tiny_pairs[:5])  # another version of the dataset
    second = read_hub(source_of(folder, "hub"))
    assert len(second.table) == 5 and second.key != first.key


def test_an_offline_hub_dataset_not_in_the_cache_names_the_variable(monkeypatch, fresh_datasets_cache):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as error:
        read_hub(source_of("nobody/no-such-dataset", "hub", "translation.en", "translation.fr", hub_config="en-fr"))
    assert str(error.value) == (
        "cannot load the Hub dataset nobody/no-such-dataset (en-fr) (data.path, split 'train'): it is not in "
        f"datasets' cache ({fresh_datasets_cache}) and HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) forbids downloading "
        "it; load it once with network access, or unset that variable")


def test_a_corpus_file_the_system_refuses_names_the_file_and_key(tmp_path, tiny_pairs, monkeypatch,
                                                                 fresh_datasets_cache):
    """Not "cannot write ...: Training needs a writable run directory", as train.py once said of a read."""
    import errno

    from transformer.config import DataConfig
    from transformer.data.corpus import load_pairs
    from transformer.data.formats import common

    path = write_parquet(tmp_path / "pairs.parquet", tiny_pairs)

    def refused(file):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))

    monkeypatch.setattr(common, "file_sha256", refused)
    with pytest.raises(DataError) as error:
        load_pairs(DataConfig(path=str(path), format="parquet"))
    assert str(error.value) == f"cannot read {path} (data.path): Permission denied"


# --------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_train_py_names_a_missing_parquet_column_in_one_line(tmp_path, tiny_pairs):
    """Needs the parquet reader in transformer/data/formats/readers.py's READERS."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "train-0.parquet", tiny_pairs[:20])
    write_parquet(folder / "train-1.parquet", tiny_pairs[20:])
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--set", "data.format=parquet",
         "--set", f"data.path={folder}", "--set", "data.source_column=nope", "--set", "train.device=cpu",
         "--run-dir", str(tmp_path / "run"), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if "data.source_column" in line] == [
        f"error: {folder}: no column 'nope' (data.source_column); its columns are: id, {SOURCE_COLUMN}, "
        f"{TARGET_COLUMN}"]


@pytest.mark.slow
def test_runs_from_a_saved_dataset_and_from_parquet_end_bitwise_as_the_csv_run(tmp_path, tiny_pairs):
    """The same pairs in the same order give the same split, tokenizer, batches and weights, whatever
    the format they are read from."""
    import hashlib

    import yaml

    csv_path = write_csv(tmp_path / "tiny.csv", tiny_pairs)
    parquet = write_parquet(tmp_path / "tiny.parquet", tiny_pairs)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(columns_of(tiny_pairs)).save_to_disk(str(saved))
    settings = {"data": {"valid_pairs": 4, "test_pairs": 4}, "tokenizer": {"vocab_size": 200, "min_frequency": 1},
                "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
                "train": {"max_steps": 6, "batch_tokens": 128, "warmup_steps": 3, "valid_every": 6,
                          "checkpoint_every": 6, "device": "cpu", "threads": 1, "attention_images": False,
                          "precision": "fp32"}}  # each process would time auto's precisions anew
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    weights = {}
    for format, path in (("csv", csv_path), ("parquet", parquet), ("dataset", saved)):
        run_dir = tmp_path / f"run-{format}"
        done = subprocess.run([sys.executable, "train.py", "--config", str(config), "--run-dir", str(run_dir),
                               "--no-progress", "--set", f"data.format={format}", "--set", f"data.path={path}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        model = run_dir / "checkpoints" / "step_00000006" / "model.safetensors"
        weights[format] = hashlib.sha256(model.read_bytes()).hexdigest()
    assert weights["parquet"] == weights["csv"] and weights["dataset"] == weights["csv"]


@pytest.mark.slow
def test_train_py_names_a_datasets_cache_it_cannot_write(tmp_path, tiny_pairs):
    """HF_DATASETS_CACHE under a file (or a folder without permission): once "cannot write ...: Not a
    directory. Training needs a writable run directory ...", advice about the wrong folder."""
    parquet = write_parquet(tmp_path / "tiny.parquet", tiny_pairs)
    (tmp_path / "a_file").write_text("not a folder\n", encoding="utf-8")
    cache = tmp_path / "a_file" / "cache"
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--set", "data.format=parquet",
         "--set", f"data.path={parquet}", "--set", "train.device=cpu", "--run-dir", str(tmp_path / "run"),
         "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (f"error: cannot write the datasets cache {cache}: Not a directory; point "
                                            "HF_DATASETS_CACHE at a folder you can write, and rerun")


@pytest.mark.slow
def test_train_py_names_the_datasets_cache_under_a_read_only_home(tmp_path, tiny_pairs):
    """Issue 58: with HOME read-only and no HF_DATASETS_CACHE (as for a service account), datasets' default
    cache cannot be made, and that was blamed on the run directory: "cannot write …/.cache: Permission
    denied. Training needs a writable run directory…". The line names the datasets cache and the variable."""
    from faults import READ_ONLY, command, made_read_only, read_only_unavailable

    if why := read_only_unavailable():
        pytest.skip(why)
    home = tmp_path / "home"
    home.mkdir()
    parquet = write_parquet(tmp_path / "tiny.parquet", tiny_pairs)
    args = ["--config", ROOT / "configs" / "tiny.yaml", "--set", "data.format=parquet", "--set", f"data.path={parquet}",
            "--set", "train.device=cpu", "--run-dir", tmp_path / "run", "--no-progress"]
    env = {name: value for name, value in os.environ.items()
           if name not in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    with made_read_only(home, READ_ONLY):  # as root, a read-only mount of the process's own
        done = subprocess.run(command("train.py", args, READ_ONLY, read_only=home), cwd=tmp_path, capture_output=True,
                              text=True, timeout=300,
                              env={**env, "HOME": str(home), "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    cache, made = home / ".cache" / "huggingface" / "datasets", home / ".cache"
    assert re.fullmatch(re.escape(f"error: cannot write the datasets cache {cache} ({made}: ") +
                        "(Permission denied|Read-only file system)" +
                        re.escape("); point HF_DATASETS_CACHE at a folder you can write, and rerun"),
                        done.stderr.splitlines()[-1]), done.stderr
