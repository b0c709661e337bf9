"""Tests for transformer/data/token_files.py and the PairCorpus encode.corpus_of builds on it: exactly
the ids, batches and tensors of the in-memory corpus and of the per-pair batch loop it replaced, the
files found under the rows' key, the plans stored and read back, files that are only ever complete,
and damaged ones built again."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import column, corpus_from_ids
from transformer.data.batching import BatchPlan, token_batches
from transformer.data.encode import SRC_IDS, TGT_IDS, corpus_of
from transformer.data.rows import Rows
from transformer.data.token_files import TOKEN_DIR, FileArray, load_plan, open_token_files

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def loop_token_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle=True) -> list[np.ndarray]:
    """The batch plan as it was computed before it became arrays: one Python step per pair."""
    src_lengths = np.asarray(src_lengths, dtype=np.int64) + 1
    tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64) + 1
    n = len(src_lengths)
    if n == 0:
        return []
    rng = np.random.default_rng([seed, epoch])
    tie_break = rng.random(n) if shuffle else np.arange(n)
    order = np.lexsort((tie_break, tgt_lengths, src_lengths))
    longest = np.maximum(src_lengths, tgt_lengths)[order]
    batches, start, width = [], 0, 0
    for position in range(n):
        new_width = max(width, int(longest[position]))
        if position > start and new_width * (position - start + 1) > batch_tokens:
            batches.append(order[start:position])
            start, new_width = position, int(longest[position])
        width = new_width
    batches.append(order[start:])
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def assert_same_batches(plan, expected: list[np.ndarray]) -> None:
    assert len(plan) == len(expected)
    for ours, theirs in zip(plan, expected):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


@PROPERTY
@given(pairs=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=300),
       batch_tokens=st.integers(1, 700), seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 100),
       shuffle=st.booleans())
def test_array_plan_equals_the_per_pair_loop(pairs, batch_tokens, seed, epoch, shuffle):
    src_lengths = np.array([s for s, _ in pairs], dtype=np.int64)
    tgt_lengths = np.array([t for _, t in pairs], dtype=np.int64)
    assert_same_batches(token_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle),
                        loop_token_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle))


def test_plan_slices_are_lists_of_batches():
    plan = token_batches(np.arange(40) % 7, np.arange(40) % 5, 24, seed=1, epoch=0)
    assert isinstance(plan, BatchPlan) and len(plan) > 4
    assert [b.tolist() for b in plan[1:4]] == [plan[i].tolist() for i in (1, 2, 3)]
    tail = plan[len(plan) - 1:len(plan) + 5]
    assert len(tail) == 1 and np.array_equal(tail[0], plan[len(plan) - 1])


def in_memory(rows: Rows):
    return corpus_from_ids(column(rows, SRC_IDS), column(rows, TGT_IDS))


def first(rows: Rows, n: int) -> Rows:
    """The first `n` of `rows`: token files of their own."""
    return rows.where(np.arange(len(rows)) < n, f"{rows.key}-first-{n}")


def test_mapped_corpus_gives_the_in_memory_corpus_batches_and_tensors(tiny_encoded):
    """The training corpus read from token files: the same ids, the same batches of two epochs (planned,
    then read back from their files) and the same tensors as the in-memory corpus and the loop."""
    rows = tiny_encoded.train
    mapped = corpus_of(rows)
    in_memory_corpus = in_memory(rows)
    assert mapped.directory is not None and isinstance(mapped.src_tokens, FileArray)
    assert mapped.src_tokens.dtype == np.uint16  # the tiny vocabulary fits
    for name in ("src_tokens", "src_offsets", "tgt_tokens", "tgt_offsets", "src_lengths", "tgt_lengths"):
        assert np.array_equal(getattr(mapped, name), getattr(in_memory_corpus, name)), name
    for epoch in (0, 1):
        expected = loop_token_batches(in_memory_corpus.src_lengths, in_memory_corpus.tgt_lengths, 256, seed=3,
                                      epoch=epoch)
        planned = mapped.batches(256, seed=3, epoch=epoch)
        assert_same_batches(planned, expected)
        assert load_plan(mapped.directory, f"tokens256-seed3-shuffle1-epoch{epoch}") is not None
        again = corpus_of(rows).batches(256, seed=3, epoch=epoch)  # read back, not planned
        assert isinstance(again.order, FileArray)
        assert_same_batches(again, expected)
        for indices in expected:
            ours, theirs = mapped.batch(indices), in_memory_corpus.batch(indices)
            for field in ("src", "tgt_in", "tgt_out"):
                assert torch.equal(getattr(ours, field), getattr(theirs, field))
    # one epoch's plan is kept per setting: the first epoch's went when the second was stored
    assert load_plan(mapped.directory, "tokens256-seed3-shuffle1-epoch0") is None


def test_token_files_sit_beside_the_cache_under_the_rows_key(tiny_encoded):
    train = tiny_encoded.train
    directory = corpus_of(train).directory
    assert directory == train.cache_directory / TOKEN_DIR / train.key
    assert open_token_files(directory) is not None
    assert corpus_of(first(train, 10)).directory == train.cache_directory / TOKEN_DIR / first(train, 10).key
    assert corpus_of(tiny_encoded.valid).directory is None  # held in memory: nothing written


def test_half_written_token_files_are_never_read(tiny_encoded, monkeypatch, tmp_path):
    """A writer killed half-way leaves only its scratch directory: the next run writes the files anew."""
    import transformer.data.cache as cache

    rows = first(tiny_encoded.train, 20)
    directory = rows.cache_directory / TOKEN_DIR / rows.key
    shutil.rmtree(directory, ignore_errors=True)  # as if no run had written them yet
    calls = []

    def failing_rename(source, target):
        calls.append(target)
        raise KeyboardInterrupt

    monkeypatch.setattr(cache.os, "rename", failing_rename)
    try:
        corpus_of(rows)
    except KeyboardInterrupt:
        pass
    assert calls and open_token_files(directory) is None
    assert not list(directory.parent.glob(f".{directory.name}.*"))  # no scratch left behind
    monkeypatch.undo()
    corpus = corpus_of(rows)
    assert corpus.directory == directory and np.array_equal(corpus.tgt_tokens, in_memory(rows).tgt_tokens)


def damage(path: Path, how: str) -> None:
    """What a power cut, a partial copy or a full disk leaves of a file."""
    if how == "empty":
        path.write_bytes(b"")
    elif how == "missing":
        path.unlink()
    elif how == "zeros":  # its size, but none of its bytes (a power cut on some filesystems)
        path.write_bytes(bytes(path.stat().st_size))
    else:
        raise ValueError(how)


def damage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is damaged" in r.getMessage()]


@pytest.mark.parametrize("name, how", [("src.ids", "empty"), ("tgt.offsets", "empty"), ("dtype", "missing"),
                                       ("src.offsets", "zeros"), ("tgt.ids", "zeros"), ("manifest.json", "missing")])
def test_a_damaged_token_file_is_written_again_with_one_warning(tiny_encoded, caplog, name, how):
    rows = first(tiny_encoded.train, 25)
    expected = in_memory(rows)
    directory = corpus_of(rows).directory
    damage(directory / name, how)
    with caplog.at_level(logging.WARNING):
        corpus = corpus_of(rows)
    assert corpus.directory == directory and isinstance(corpus.src_tokens, FileArray)
    for field in ("src_tokens", "src_offsets", "tgt_tokens", "tgt_offsets"):
        assert np.array_equal(getattr(corpus, field), getattr(expected, field)), field
    warnings = damage_warnings(caplog)
    assert len(warnings) == 1 and str(directory) in warnings[0] and "building it again" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert open_token_files(directory) is not None  # whole again: no further note
    assert not damage_warnings(caplog)


@pytest.mark.parametrize("name, how", [("order.npy", "empty"), ("bounds.npy", "empty"), ("order.npy", "zeros"),
                                       ("bounds.npy", "missing")])
def test_a_damaged_batch_plan_is_planned_again_with_one_warning(tiny_encoded, caplog, name, how):
    rows = first(tiny_encoded.train, 30)
    expected = [batch.tolist() for batch in in_memory(rows).batches(64, seed=5, epoch=0)]
    corpus = corpus_of(rows)
    corpus.batches(64, seed=5, epoch=0)  # planned and stored
    damage(corpus.directory / "plans" / "tokens64-seed5-shuffle1-epoch0" / name, how)
    with caplog.at_level(logging.WARNING):
        plan = corpus_of(rows).batches(64, seed=5, epoch=0)
    assert [batch.tolist() for batch in plan] == expected
    assert len(damage_warnings(caplog)) == 1
    assert load_plan(corpus.directory, "tokens64-seed5-shuffle1-epoch0") is not None  # stored whole again


def test_file_array_reads_like_the_array_it_stores(tmp_path):
    values = np.arange(-3, 1000, 7, dtype=np.int64) ** 2
    (tmp_path / "values").write_bytes(b"head" + values.tobytes())  # data after a header, as in a .npy
    stored = FileArray(tmp_path / "values", np.int64, len(values), offset=4)
    assert len(stored) == len(values) and stored.dtype == np.int64
    for index in (0, 5, len(values) - 1, -1, -len(values)):
        assert stored[index] == values[index]
    for part in (slice(3, 9), slice(None, 4), slice(len(values) - 2, None), slice(5, 5), slice(9, 3),
                 slice(-4, None), slice(0, 10 ** 9)):
        assert np.array_equal(stored[part], values[part]), part
    for index in (len(values), -len(values) - 1):
        with pytest.raises(IndexError):
            stored[index]
    with pytest.raises(IndexError):
        stored[::2]
    assert np.array_equal(np.asarray(stored), values)
    assert np.array_equal(stored.diff(chunk=10), np.diff(values))  # across chunk boundaries
    empty = FileArray(tmp_path / "values", np.int64, 0)
    assert len(empty) == 0 and np.asarray(empty).shape == (0,) and empty.diff().shape == (0,)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_reading_batches_maps_no_token_file_into_the_process(tiny_encoded):
    """Token ids and plans are read, never memory-mapped: a mapped file's pages (and the kernel's
    fault-around of 64 KB at each read) stay in the process's RSS, which at 16M pairs grew by the
    whole token files within an epoch."""
    corpus = corpus_of(tiny_encoded.train)
    corpus.batches(256, seed=3, epoch=0)
    plan = corpus_of(tiny_encoded.train).batches(256, seed=3, epoch=0)  # read back from its files
    for indices in plan:
        corpus.batch(indices)
    assert len(corpus.src_lengths) == len(corpus)
    mapped = Path("/proc/self/maps").read_text()
    assert str(corpus.directory) not in mapped
