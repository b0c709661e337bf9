"""Tests for the readers of Hugging Face datasets' formats (transformer/data/hf_formats.py): the tiny
pairs written as Parquet (one file, a folder of shards, a glob), JSON lines, a save_to_disk folder (a
Dataset, a DatasetDict's split) and with a nested translation column read as exactly the CSV's raw
rows; the cache keyed by content; one DataError line for each input the user can fix; train.py's
one line for a missing column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import SOURCE_COLUMN, TARGET_COLUMN, write_csv
from transformer.data.delimited import read_delimited
from transformer.data.hf_formats import read_hub, read_jsonl, read_parquet, read_saved_dataset
from transformer.data.readers import RawPairs, Source, side_values
from transformer.errors import DataError

ROOT = Path(__file__).resolve().parent.parent


def source_of(path: Path | str, format: str, source_column: str = SOURCE_COLUMN, target_column: str = TARGET_COLUMN,
              **fields) -> Source:
    return Source(str(path), format, "", source_column, target_column, **fields)


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
    datasets.Dataset.from_dict(columns_of(tiny_pairs)).save_to_disk(folder)
    (arrow,) = folder.glob("data-*.arrow")
    arrow.write_bytes(b"not arrow at all")
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value).startswith(f"{arrow}: not an Arrow file written by save_to_disk (")
    arrow.unlink()
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value) == f"{arrow}: not found, though {folder / 'state.json'} lists it (data.path)"
    (folder / "state.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_saved_dataset(source_of(folder, "dataset"))
    assert str(error.value).startswith(f"{folder / 'state.json'}: not a saved Dataset's state (JSONDecodeError: ")


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line(monkeypatch, fresh_datasets_cache):
    """No network here: offline, load_dataset fails at once; any failure is one line naming the dataset."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    source = Source("nobody/no-such-dataset", "hub", "", "translation.en", "translation.fr", hub_config="en-fr")
    with pytest.raises(DataError) as error:
        read_hub(source)
    message = str(error.value)
    assert message.startswith("cannot load the Hub dataset nobody/no-such-dataset (en-fr) (data.path, split 'train'): ")
    assert "\n" not in message


# --------------------------------------------------------------------------- the command line


def test_train_py_names_a_missing_parquet_column_in_one_line(tmp_path, tiny_pairs):
    """Needs the parquet reader in corpus.py's READERS."""
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
                          "checkpoint_every": 6, "device": "cpu", "threads": 1, "attention_images": False}}
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
