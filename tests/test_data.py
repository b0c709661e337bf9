"""Tests for transformer/data.py and readers.py: cleaning, strict CSV/TSV and line-aligned text
reading, splitting by English sentence, encoding."""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SOURCE_COLUMN, TARGET_COLUMN, write_csv
from transformer.config import DataConfig
from transformer import data
from transformer.data import (
    arrow_batches, encode_splits, iter_texts, load_pairs, split_pairs, token_lengths,
)
from transformer.errors import DataError
from transformer.text import clean_text
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

REAL_DATA = Path(__file__).resolve().parent.parent / "data" / "eng_-french.csv"


def config_for(path: Path, **overrides) -> DataConfig:
    return DataConfig(path=str(path), **overrides)


def rows_of(dataset: datasets.Dataset) -> list[tuple[str, str]]:
    return list(zip(dataset["source"][:], dataset["target"][:]))


# --------------------------------------------------------------------------- load_pairs


def test_tiny_csv_loads_cleaned(tiny_config, tiny_pairs, datasets_cache):
    pairs, report = load_pairs(tiny_config.data, cache_dir=datasets_cache)
    assert pairs.column_names == ["source", "target"]
    assert report.rows_read == len(tiny_pairs) and report.rows_dropped_empty == 0 and report.rows_kept == len(pairs)
    assert rows_of(pairs) == [(clean_text(s), clean_text(t)) for s, t in tiny_pairs]
    targets = set(pairs["target"][:])
    assert {"Va !", "Qui êtes-vous ?", "Oui, je sais.", "Il a dit « oui ».", "Je suis content 😀"} <= targets


def test_na_like_strings_are_kept(tmp_path: Path):
    words = ["NA", "N/A", "#N/A", "null", "NULL", "None", "nan", "NaN", "-nan", "1984", "0", "True"]
    path = write_csv(tmp_path / "na.csv", [(w, w) for w in words])
    pairs, report = load_pairs(config_for(path), cache_dir=tmp_path / "cache")
    assert report.rows_dropped_empty == 0
    assert rows_of(pairs) == [(w, w) for w in words]


def test_empty_rows_are_dropped_and_counted(tmp_path: Path, caplog):
    rows = [("Hi.", "Salut !"), ("", "Vide"), ("Empty", ""), (" \u00a0 ", "Espace"), ("Go.", "Va !"), ("", "")]
    path = write_csv(tmp_path / "empty.csv", rows)
    with caplog.at_level(logging.WARNING, logger="transformer.data"):
        pairs, report = load_pairs(config_for(path), cache_dir=tmp_path / "cache")
    assert rows_of(pairs) == [("Hi.", "Salut !"), ("Go.", "Va !")]
    assert (report.rows_read, report.rows_dropped_empty, report.rows_kept) == (6, 4, 2)
    assert "dropped 4 of 6 rows" in caplog.text


def test_missing_file_names_the_path(tmp_path: Path):
    with pytest.raises(DataError, match="not found.*nope.csv"):
        load_pairs(config_for(tmp_path / "nope.csv"), cache_dir=tmp_path / "cache")


def test_missing_column_names_it_and_the_existing_ones(tmp_path: Path):
    path = write_csv(tmp_path / "cols.csv", [("Hi.", "Salut !")], header=("English", SOURCE_COLUMN))
    with pytest.raises(DataError) as error:
        load_pairs(config_for(path), cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert str(path) in message and repr(TARGET_COLUMN) in message and "data.target_column" in message
    assert "'English'" in message and repr(SOURCE_COLUMN) in message


def test_columns_are_found_by_name_among_others(tmp_path: Path):
    path = write_csv(tmp_path / "more.csv", [("3", "Salut !", "Hi.", ""), ("4", "Va !", "Go.", "x")],
                     header=("id", TARGET_COLUMN, SOURCE_COLUMN, ""))
    pairs, _ = load_pairs(config_for(path), cache_dir=tmp_path / "cache")
    assert rows_of(pairs) == [("Hi.", "Salut !"), ("Go.", "Va !")]


def test_utf8_bom_is_ignored(tmp_path: Path):
    path = tmp_path / "bom.csv"
    path.write_bytes(f"\ufeff{SOURCE_COLUMN},{TARGET_COLUMN}\nHi.,Salut\n".encode("utf-8"))
    pairs, _ = load_pairs(config_for(path), cache_dir=tmp_path / "cache")
    assert rows_of(pairs) == [("Hi.", "Salut")]


def test_non_utf8_names_the_file_and_line(tmp_path: Path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(f"{SOURCE_COLUMN},{TARGET_COLUMN}\nHi.,Salut\nCoffee,Café\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.csv: not UTF-8 text at line 3"):
        load_pairs(config_for(path), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("body", ["Hello, world,Bonjour\nHi.,Salut\n", "Hi.,Salut\nHello, world,Bonjour\n"])
def test_unquoted_separator_is_an_error_not_a_silent_shift(tmp_path: Path, body: str):
    path = tmp_path / "ragged.csv"
    path.write_text(f"{SOURCE_COLUMN},{TARGET_COLUMN}\n{body}", encoding="utf-8")
    with pytest.raises(DataError, match="ragged.csv.*must be quoted"):
        load_pairs(config_for(path), cache_dir=tmp_path / "cache")


def test_header_only_file_is_an_error(tmp_path: Path):
    path = write_csv(tmp_path / "header.csv", [])
    with pytest.raises(DataError, match="no sentence pairs"):
        load_pairs(config_for(path), cache_dir=tmp_path / "cache")


def test_tsv_reads_tabs_and_keeps_quotes(tmp_path: Path):
    path = tmp_path / "pairs.tsv"
    path.write_text('en\tfr\n"Hi," he said.\t« Salut », dit-il.\nI, too.\tMoi aussi.\n', encoding="utf-8")
    config = config_for(path, format="tsv", source_column="en", target_column="fr")
    pairs, _ = load_pairs(config, cache_dir=tmp_path / "cache")
    assert rows_of(pairs) == [('"Hi," he said.', "« Salut », dit-il."), ("I, too.", "Moi aussi.")]


def test_cache_is_reused_and_a_changed_file_is_reread(tmp_path: Path):
    cache = tmp_path / "cache"
    path = write_csv(tmp_path / "pairs.csv", [("Hi.", "Salut !")])
    first, _ = load_pairs(config_for(path), cache_dir=cache)
    files = sorted(cache.rglob("*.arrow"))
    again, _ = load_pairs(config_for(path), cache_dir=cache)
    assert rows_of(again) == rows_of(first) and sorted(cache.rglob("*.arrow")) == files  # nothing rebuilt

    write_csv(path, [("Go.", "Va !"), ("Run!", "Cours !")])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a later edit, even on coarse clocks
    changed, report = load_pairs(config_for(path), cache_dir=cache)
    assert rows_of(changed) == [("Go.", "Va !"), ("Run!", "Cours !")] and report.rows_read == 2


# --------------------------------------------------------------------------- line-aligned text files


def write_lines(path: Path, lines: list[str], ending: str = "\n") -> Path:
    path.write_bytes("".join(line + ending for line in lines).encode("utf-8"))
    return path


def text_config(source: Path, target: Path, **overrides) -> DataConfig:
    return DataConfig(path=str(source), format="text", target_path=str(target), **overrides)


def test_text_files_read_like_the_same_csv(tmp_path: Path, tiny_pairs):
    source = write_lines(tmp_path / "tiny.en", [s for s, _ in tiny_pairs])
    target = write_lines(tmp_path / "tiny.fr", [t for _, t in tiny_pairs])
    csv_path = write_csv(tmp_path / "tiny.csv", tiny_pairs)
    pairs, report = load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")
    as_csv, csv_report = load_pairs(config_for(csv_path), cache_dir=tmp_path / "cache")
    assert pairs.column_names == ["source", "target"] and rows_of(pairs) == rows_of(as_csv)
    assert (report.rows_read, report.rows_kept, report.path, report.target_path) == (
        csv_report.rows_read, csv_report.rows_kept, str(source), str(target))


def test_text_empty_lines_are_dropped_naming_their_lines(tmp_path: Path, caplog):
    source = write_lines(tmp_path / "a.en", ["Hi.", "", "Go.", SOURCE_COLUMN, "Run!"])
    target = write_lines(tmp_path / "a.fr", ["Salut !", "Vide", "\u00a0", TARGET_COLUMN, "Cours !"])
    with caplog.at_level(logging.WARNING, logger="transformer.data"):
        pairs, report = load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")
    # Text has no header line, so a line reading like the CSV header is a pair like any other.
    assert rows_of(pairs) == [("Hi.", "Salut !"), (SOURCE_COLUMN, TARGET_COLUMN), ("Run!", "Cours !")]
    assert (report.rows_read, report.rows_dropped_empty, report.rows_dropped_header) == (5, 2, 0)
    assert (f"{source} and {target}: dropped 2 of 5 rows with an empty English or French side (lines 2, 3)"
            in caplog.text)


def test_text_crlf_byte_order_mark_and_unicode_line_separators(tmp_path: Path):
    source = tmp_path / "a.en"
    source.write_bytes("\ufeffHi.\r\nOne\u2028line.\r\nGo.".encode("utf-8"))  # no final line break
    target = write_lines(tmp_path / "a.fr", ["Salut !", "Une\x85ligne.", "Va !"], ending="\r\n")
    pairs, _ = load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")
    assert rows_of(pairs) == [("Hi.", "Salut !"), ("One line.", "Une ligne."), ("Go.", "Va !")]


def test_text_files_of_different_lengths_name_both_files_and_counts(tmp_path: Path):
    source = write_lines(tmp_path / "a.en", ["Hi.", "Go.", "Run!"])
    target = write_lines(tmp_path / "a.fr", ["Salut !", "Va !"])
    with pytest.raises(DataError) as error:
        load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")
    assert str(error.value) == (f"{source} (data.path) has 3 lines but {target} (data.target_path) has 2: the files "
                                "must be line-aligned, line N of one translating line N of the other")


def test_text_carriage_return_inside_a_line_is_pointed_out(tmp_path: Path):
    source = write_lines(tmp_path / "a.en", ["Hi.", "Go.", "Run!"])
    target = tmp_path / "a.fr"
    target.write_bytes(b"Salut !\nVa\r !\nCours !\n")
    with pytest.raises(DataError, match=rf"has 3 lines but .* has 4: .*; {target} has a carriage return \(\\r\) "
                                        "inside line 2, which counts as a line break"):
        load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("missing, key", [("source", "data.path"), ("target", "data.target_path")])
def test_text_missing_file_names_it_and_its_key(tmp_path: Path, missing: str, key: str):
    files = {"source": tmp_path / "a.en", "target": tmp_path / "a.fr"}
    write_lines(files["target" if missing == "source" else "source"], ["Hi."])
    with pytest.raises(DataError) as error:
        load_pairs(text_config(files["source"], files["target"]), cache_dir=tmp_path / "cache")
    assert str(error.value) == f"data file not found: {files[missing]} ({key})"


def test_text_non_utf8_names_the_file_and_line(tmp_path: Path):
    source = write_lines(tmp_path / "a.en", ["Hi.", "Go.", "Coffee"])
    target = tmp_path / "a.fr"
    target.write_bytes("Salut\nVa !\nCafé\n".encode("latin-1"))
    with pytest.raises(DataError) as error:
        load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")
    assert str(error.value).startswith(f"{target}: not UTF-8 text at line 3 (")


def test_text_empty_file_names_it(tmp_path: Path):
    source = write_lines(tmp_path / "a.en", ["Hi."])
    target = tmp_path / "a.fr"
    target.write_bytes(b"")
    with pytest.raises(DataError, match=rf"^{target}: the file is empty \(data.target_path\)$"):
        load_pairs(text_config(source, target), cache_dir=tmp_path / "cache")


def test_text_cache_is_reused_and_a_changed_file_is_reread(tmp_path: Path):
    cache = tmp_path / "cache"
    source = write_lines(tmp_path / "a.en", ["Hi.", "Go."])
    target = write_lines(tmp_path / "a.fr", ["Salut !", "Va !"])
    first, _ = load_pairs(text_config(source, target), cache_dir=cache)
    files = sorted(cache.rglob("*.arrow"))
    again, _ = load_pairs(text_config(source, target), cache_dir=cache)
    assert rows_of(again) == rows_of(first) and sorted(cache.rglob("*.arrow")) == files  # nothing rebuilt

    write_lines(target, ["Bonjour !", "Bouge !"])
    stat = target.stat()
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    changed, _ = load_pairs(text_config(source, target), cache_dir=cache)
    assert rows_of(changed) == [("Hi.", "Bonjour !"), ("Go.", "Bouge !")]


def test_large_corpora_clean_and_encode_in_worker_processes_alike(monkeypatch, tmp_path: Path, tiny_config,
                                                                  tiny_tokenizers, datasets_cache):
    """Past data.PARALLEL_ROWS rows, map runs one process per CPU; the result must not change."""
    serial_pairs, _ = load_pairs(tiny_config.data, cache_dir=datasets_cache)
    serial = encode_splits(split_pairs(serial_pairs, tiny_config.data), tiny_tokenizers, 128)
    monkeypatch.setattr(data, "PARALLEL_ROWS", 10)
    monkeypatch.setattr(data.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    pairs, _ = load_pairs(tiny_config.data, cache_dir=tmp_path / "cache")
    assert any("_of_00002" in f["filename"] for f in pairs.cache_files)  # really written by two workers
    parallel = encode_splits(split_pairs(pairs, tiny_config.data), tiny_tokenizers, 128)
    for name in ("train", "valid", "test"):
        assert getattr(parallel, name)[:] == getattr(serial, name)[:], name


# --------------------------------------------------------------------------- split_pairs


def make_pairs(rows: list[tuple[str, str]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"source": [s for s, _ in rows], "target": [t for _, t in rows]})


def reference_split(rows: list[tuple[str, str]], config: DataConfig) -> tuple[Counter, Counter]:
    """(valid, test) rows as the first implementation chose them: rank every distinct English sentence
    by (seeded blake2b, sentence) and take whole groups. split_pairs must keep choosing exactly these."""
    counts = Counter(s for s, _ in rows)
    ranked = sorted(counts, key=lambda s: (data._split_rank(config.split_seed, s), s))
    side, groups = {}, iter(ranked)
    for split_id, wanted in ((1, config.valid_pairs), (2, config.test_pairs)):
        taken = 0
        while taken < wanted and (source := next(groups, None)) is not None:
            side[source] = split_id
            taken += counts[source]
    return tuple(Counter(row for row in rows if side.get(row[0]) == split_id) for split_id in (1, 2))


def check_split(rows: list[tuple[str, str]], splits, valid_pairs: int, test_pairs: int) -> None:
    parts = [rows_of(splits.train), rows_of(splits.valid), rows_of(splits.test)]
    assert Counter(rows) == Counter(parts[0]) + Counter(parts[1]) + Counter(parts[2])  # every row exactly once
    sources = [{s for s, _ in part} for part in parts]
    assert not (sources[0] & sources[1] or sources[0] & sources[2] or sources[1] & sources[2])
    assert len(parts[0]) >= 1 and len(parts[1]) >= valid_pairs and len(parts[2]) >= test_pairs


def test_tiny_split_is_by_english_sentence(tiny_config, tiny_splits, tiny_pairs):
    rows = [(clean_text(s), clean_text(t)) for s, t in tiny_pairs]
    check_split(rows, tiny_splits, tiny_config.data.valid_pairs, tiny_config.data.test_pairs)
    assert tiny_splits.train.column_names == ["source", "target"]


def test_split_is_deterministic_and_ignores_row_order(tiny_config, tiny_pairs):
    rows = [(clean_text(s), clean_text(t)) for s, t in tiny_pairs]
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    first = split_pairs(make_pairs(rows), tiny_config.data)
    second = split_pairs(make_pairs(shuffled), tiny_config.data)
    for name in ("train", "valid", "test"):
        assert sorted(rows_of(getattr(first, name))) == sorted(rows_of(getattr(second, name)))
    reseeded = split_pairs(make_pairs(rows), DataConfig(path="x", valid_pairs=4, test_pairs=4, split_seed=7))
    assert sorted(rows_of(reseeded.valid)) != sorted(rows_of(first.valid))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_equals_ranking_every_sentence(seed):
    """Sentences with up to 6 translations, so the search for the leading sentences must widen."""
    generator = random.Random(seed)
    rows = [(f"sentence {i}", f"phrase {i}.{j}") for i in range(3000) for j in range(generator.choice([1, 1, 2, 6]))]
    generator.shuffle(rows)
    config = DataConfig(path="x", valid_pairs=200, test_pairs=150, split_seed=seed)
    splits = split_pairs(make_pairs(rows), config)
    check_split(rows, splits, 200, 150)
    assert (Counter(rows_of(splits.valid)), Counter(rows_of(splits.test))) == reference_split(rows, config)


def test_split_without_test_pairs(tiny_config):
    rows = [(f"s{i % 10}", f"t{i}") for i in range(30)]
    splits = split_pairs(make_pairs(rows), DataConfig(path="x", valid_pairs=5, test_pairs=0))
    assert len(splits.test) == 0
    check_split(rows, splits, 5, 0)


def test_split_too_small_is_an_error():
    rows = [("Go.", "Va !"), ("Go.", "Bouge !"), ("Hi.", "Salut !")]
    with pytest.raises(DataError, match="too few.*data.valid_pairs"):
        split_pairs(make_pairs(rows), DataConfig(path="x", valid_pairs=2, test_pairs=1))


SENTENCES = [f"sentence {i}" for i in range(12)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.tuples(st.sampled_from(SENTENCES), st.sampled_from(["a", "b", "c", "d"])), min_size=1, max_size=60),
    valid_pairs=st.integers(1, 8),
    test_pairs=st.integers(0, 8),
    seed=st.integers(0, 2**32),
    order=st.randoms(use_true_random=False),
)
def test_split_property(rows, valid_pairs, test_pairs, seed, order):
    config = DataConfig(path="x", valid_pairs=valid_pairs, test_pairs=test_pairs, split_seed=seed)
    groups = len({s for s, _ in rows})
    try:
        splits = split_pairs(make_pairs(rows), config)
    except DataError:
        # Each held-out split takes whole groups of >= 1 row, so with more groups than
        # valid_pairs + test_pairs there is always a group left for training.
        assert groups <= valid_pairs + test_pairs
        return
    check_split(rows, splits, valid_pairs, test_pairs)
    assert (Counter(rows_of(splits.valid)), Counter(rows_of(splits.test))) == reference_split(rows, config)
    shuffled = rows[:]
    order.shuffle(shuffled)
    again = split_pairs(make_pairs(shuffled), config)
    for name in ("train", "valid", "test"):
        assert Counter(rows_of(getattr(again, name))) == Counter(rows_of(getattr(splits, name)))


# --------------------------------------------------------------------------- encoding


def test_encoded_columns_and_lengths(tiny_encoded, tiny_tokenizers, tiny_splits):
    for name in ("train", "valid", "test"):
        split = getattr(tiny_encoded, name)
        assert split.column_names == ["source", "target", "src_ids", "tgt_ids", "src_len", "tgt_len"]
        src_len, tgt_len = token_lengths(split)
        assert src_len.dtype == np.int32 and src_len.tolist() == [len(ids) for ids in split["src_ids"][:]]
        assert tgt_len.tolist() == [len(ids) for ids in split["tgt_ids"][:]]
        for ids in split["src_ids"][:] + split["tgt_ids"][:]:
            assert ids and not {PAD_ID, BOS_ID, EOS_ID} & set(ids)  # the batcher adds the specials
    # Held-out sentences may contain characters the tokenizer never saw; training ones may not.
    assert tiny_tokenizers.decode_target(tiny_encoded.train["tgt_ids"][:]) == tiny_encoded.train["target"][:]
    assert len(tiny_encoded.train) == len(tiny_splits.train) and tiny_encoded.train_too_long == 0


def test_long_training_pairs_are_dropped_and_counted(tiny_splits, tiny_tokenizers, caplog):
    max_length = 6  # at most 5 subwords a side
    with caplog.at_level(logging.WARNING, logger="transformer.data"):
        encoded = encode_splits(tiny_splits, tiny_tokenizers, max_length)
    src_len, tgt_len = token_lengths(encoded.train)
    assert src_len.max() <= 5 and tgt_len.max() <= 5
    all_train = encode_splits(tiny_splits, tiny_tokenizers, 128).train
    full_src, full_tgt = token_lengths(all_train)
    expected_drops = int(np.count_nonzero((full_src > 5) | (full_tgt > 5)))
    assert expected_drops > 0 and encoded.train_too_long == expected_drops
    assert len(encoded.train) + expected_drops == len(tiny_splits.train)
    assert f"dropped {expected_drops} of {len(tiny_splits.train)} training pairs" in caplog.text
    assert len(encoded.valid) == len(tiny_splits.valid) and len(encoded.test) == len(tiny_splits.test)


def test_arrow_batches_follow_selections_across_chunks():
    """Rows behind select / shuffle / filter, read by a take per Arrow chunk, come back in the view's order."""
    dataset = datasets.concatenate_datasets(
        [make_pairs([(f"s{i}", f"t{i}") for i in range(k, k + 7)]) for k in range(0, 70, 7)])
    assert dataset.data.table.column("source").num_chunks == 10
    views = [dataset, dataset.select(range(3, 60, 4)), dataset.select(np.array([65, 2, 2, 40, 9])),
             dataset.shuffle(seed=1), dataset.filter(lambda row: row["source"][-1] in "137"),
             dataset.shuffle(seed=2).select(range(20)).filter(lambda row: row["target"] != "t5")]
    for view in views:
        for batch_size in (1, 6, 100):
            batches = list(arrow_batches(view, ["target", "source"], batch_size))
            assert all(batch.column_names == ["target", "source"] for batch in batches)
            assert [row for batch in batches for row in zip(*batch.to_pydict().values())] == list(
                zip(view["target"][:], view["source"][:]))


def test_iter_texts_streams_a_column(tiny_splits):
    assert list(iter_texts(tiny_splits.train, "target", batch_size=3)) == tiny_splits.train["target"][:]


# --------------------------------------------------------------------------- the real file


@pytest.mark.skipif(not REAL_DATA.is_file(), reason="data/eng_-french.csv is not present")
def test_real_data_file(tmp_path: Path):
    start = time.perf_counter()
    config = DataConfig(path=str(REAL_DATA))
    pairs, report = load_pairs(config, cache_dir=tmp_path)
    assert len(pairs) == 164_339 and report.rows_read == 164_339 and report.rows_dropped_empty == 0
    assert pairs[0] == {"source": "Go.", "target": "Va !"}
    splits = split_pairs(pairs, config)
    assert len(splits.valid) >= 1000 and len(splits.test) >= 1000
    assert not set(splits.valid["source"][:]) & set(iter_texts(splits.train, "source"))
    assert time.perf_counter() - start < 60
