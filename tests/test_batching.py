"""Tests for transformer/data/batching.py: every pair once per epoch, the token budget, reproducible
orders, teacher-forcing layout (BOS/EOS, shifted targets, right padding, masks), PairCorpus over flat
arrays and built from encoded rows (encode.corpus_of), and little padding on sorted batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import column, corpus_from_ids, in_memory_rows
from transformer.data.batching import Batch, PairCorpus, make_batch, pad_rows, source_tensor, token_batches
from transformer.data.encode import SRC_IDS, TGT_IDS, corpus_of, token_lengths
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None)

lengths = st.integers(0, 60)
length_pairs = st.lists(st.tuples(lengths, lengths), max_size=200)
id_rows = st.lists(st.lists(st.integers(4, 999), max_size=20), min_size=1, max_size=12)


def cost(batch: np.ndarray, src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> int:
    """Padded tokens of a batch on its longer side: n * longest sequence with its EOS/BOS."""
    return len(batch) * int(max(src_lengths[batch].max() + 1, tgt_lengths[batch].max() + 1))


# --------------------------------------------------------------------------- token_batches


@PROPERTY
@given(pairs=length_pairs, batch_tokens=st.integers(1, 600), seed=st.integers(0, 2**32 - 1),
       epoch=st.integers(0, 1000), shuffle=st.booleans())
def test_every_pair_once_per_epoch_within_the_budget(pairs, batch_tokens, seed, epoch, shuffle):
    src_lengths = np.array([s for s, _ in pairs], dtype=np.int64)
    tgt_lengths = np.array([t for _, t in pairs], dtype=np.int64)
    batches = token_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle)
    if not pairs:
        assert len(batches) == 0
        return
    assert all(len(b) >= 1 for b in batches)
    everything = np.concatenate(batches)
    assert sorted(everything.tolist()) == list(range(len(pairs)))  # each exactly once
    for batch in batches:
        # Over budget only as a lone pair that is itself longer than the budget.
        assert cost(batch, src_lengths, tgt_lengths) <= batch_tokens or len(batch) == 1
    again = token_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch, shuffle)
    assert len(again) == len(batches) and all(np.array_equal(a, b) for a, b in zip(again, batches))


@PROPERTY
@given(pairs=length_pairs, batch_tokens=st.integers(1, 600), seeds=st.lists(st.integers(0, 2**32 - 1), min_size=2,
                                                                           max_size=2), epochs=st.lists(
       st.integers(0, 10**6), min_size=2, max_size=2))
def test_every_epoch_has_batches_of_the_same_sizes(pairs, batch_tokens, seeds, epochs):
    """What budgets count on to plan no epoch but the one at hand: the seed and the epoch only
    choose among pairs of equal lengths and the order of the batches, never their number or sizes."""
    src_lengths = np.array([s for s, _ in pairs], dtype=np.int64)
    tgt_lengths = np.array([t for _, t in pairs], dtype=np.int64)
    sizes = [sorted(len(b) for b in token_batches(src_lengths, tgt_lengths, batch_tokens, seed, epoch))
             for seed, epoch in zip(seeds, epochs)]
    assert sizes[0] == sizes[1]


@PROPERTY
@given(pairs=length_pairs.filter(lambda p: len(p) > 0), batch_tokens=st.integers(1, 600))
def test_batches_are_full_sorted_runs(pairs, batch_tokens):
    """Unshuffled, batches are consecutive runs of the length-sorted pairs, and each is full:
    taking the next pair too would break the budget. So the budget is used, not just respected."""
    src_lengths = np.array([s for s, _ in pairs])
    tgt_lengths = np.array([t for _, t in pairs])
    batches = token_batches(src_lengths, tgt_lengths, batch_tokens, seed=0, epoch=0, shuffle=False)
    order = np.concatenate(batches)
    keys = list(zip(src_lengths[order], tgt_lengths[order]))
    assert keys == sorted(keys)
    for batch, following in zip(batches, batches[1:]):
        assert cost(np.append(batch, following[0]), src_lengths, tgt_lengths) > batch_tokens


def test_epochs_differ_but_each_is_a_permutation_and_seeds_reproduce():
    rng = np.random.default_rng(0)
    src_lengths, tgt_lengths = rng.integers(1, 40, 2000), rng.integers(1, 40, 2000)
    orders = []
    for epoch in range(4):
        batches = token_batches(src_lengths, tgt_lengths, 512, seed=7, epoch=epoch)
        order = np.concatenate(batches)
        assert np.array_equal(np.sort(order), np.arange(2000))
        orders.append(order)
        # Resuming rebuilds exactly the same batches from (seed, epoch).
        rebuilt = token_batches(src_lengths, tgt_lengths, 512, seed=7, epoch=epoch)
        assert all(np.array_equal(a, b) for a, b in zip(batches, rebuilt))
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.array_equal(orders[i], orders[j]), (i, j)
    other_seed = np.concatenate(token_batches(src_lengths, tgt_lengths, 512, seed=8, epoch=0))
    assert not np.array_equal(other_seed, orders[0])


@pytest.mark.parametrize("side", ["source", "target"])
def test_budget_counts_the_eos_or_bos_of_the_longer_side(side):
    """9 subwords + EOS (or BOS) = 10 tokens: a budget of 100 holds exactly 10 such pairs, 99 only 9."""
    long, short = np.full(100, 9), np.full(100, 3)
    src_lengths, tgt_lengths = (long, short) if side == "source" else (short, long)
    assert {len(b) for b in token_batches(src_lengths, tgt_lengths, 100, seed=0, epoch=0)} == {10}
    assert {len(b) for b in token_batches(src_lengths, tgt_lengths, 99, seed=0, epoch=0)} == {9, 1}


def test_batch_order_is_shuffled_not_sorted_by_length():
    """Batches are built from length-sorted pairs, but must not be trained short-to-long."""
    rng = np.random.default_rng(0)
    src_lengths = rng.integers(1, 50, 3000)
    batches = token_batches(src_lengths, src_lengths, 500, seed=0, epoch=0)
    first_lengths = [int(src_lengths[b].min()) for b in batches]
    assert first_lengths != sorted(first_lengths) and first_lengths != sorted(first_lengths, reverse=True)
    unshuffled = token_batches(src_lengths, src_lengths, 500, seed=0, epoch=0, shuffle=False)
    assert [int(src_lengths[b].min()) for b in unshuffled] == sorted(first_lengths)


def test_equal_lengths_are_shuffled_within_batches_across_epochs():
    """Ties in length are broken at random per epoch: with all pairs the same length, the
    batches' contents (not only their order) change between epochs."""
    ones = np.full(100, 5)
    first = {tuple(sorted(b.tolist())) for b in token_batches(ones, ones, 60, seed=1, epoch=0)}
    second = {tuple(sorted(b.tolist())) for b in token_batches(ones, ones, 60, seed=1, epoch=1)}
    assert first != second


def test_mismatched_length_arrays_are_refused():
    with pytest.raises(ValueError, match="differ"):
        token_batches(np.array([1, 2]), np.array([1]), 100, seed=0, epoch=0)


def padding_fraction(batches: list[np.ndarray], src_lengths: np.ndarray, tgt_lengths: np.ndarray) -> float:
    """Share of padding in the (B, S) and (B, T) tensors the batches become."""
    real = padded = 0
    for batch in batches:
        for side in (src_lengths[batch] + 1, tgt_lengths[batch] + 1):
            real += int(side.sum())
            padded += len(batch) * int(side.max())
    return 1 - real / padded


def test_sorted_batches_carry_little_padding():
    rng = np.random.default_rng(0)
    src_lengths = rng.integers(2, 30, 5000)
    tgt_lengths = np.maximum(1, (src_lengths * 1.2 + rng.normal(0, 3, 5000)).astype(int))
    batches = token_batches(src_lengths, tgt_lengths, 2048, seed=1, epoch=0)
    fraction = padding_fraction(batches, src_lengths, tgt_lengths)
    permutation = rng.permutation(5000)
    size = int(np.mean([len(b) for b in batches]))
    unsorted = padding_fraction([permutation[i: i + size] for i in range(0, 5000, size)], src_lengths, tgt_lengths)
    assert fraction < 0.2
    assert fraction < unsorted / 2


def test_tiny_corpus_padding_is_low(tiny_encoded):
    src_lengths, tgt_lengths = token_lengths(tiny_encoded.train)
    batches = token_batches(src_lengths, tgt_lengths, 64, seed=0, epoch=0)
    assert len(batches) > 1
    assert padding_fraction(batches, src_lengths, tgt_lengths) < 0.25


# --------------------------------------------------------------------------- make_batch


@PROPERTY
@given(rows=st.lists(st.tuples(st.lists(st.integers(4, 999), max_size=20),
                               st.lists(st.integers(4, 999), max_size=20)), min_size=1, max_size=12))
def test_make_batch_layout(rows):
    sources, targets = [s for s, _ in rows], [t for _, t in rows]
    batch = make_batch(sources, targets)
    widest_src, widest_tgt = max(map(len, sources)) + 1, max(map(len, targets)) + 1
    assert batch.src.shape == (len(rows), widest_src)  # padded per batch, not to a global length
    assert batch.tgt_in.shape == batch.tgt_out.shape == (len(rows), widest_tgt)
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.int64
    for i, (source, target) in enumerate(rows):
        s, t = len(source), len(target)
        assert batch.src[i].tolist() == source + [EOS_ID] + [PAD_ID] * (widest_src - s - 1)
        assert batch.tgt_in[i].tolist() == [BOS_ID] + target + [PAD_ID] * (widest_tgt - t - 1)
        assert batch.tgt_out[i].tolist() == target + [EOS_ID] + [PAD_ID] * (widest_tgt - t - 1)
        # The decoder predicts at position j the token it reads at position j + 1.
        assert batch.tgt_in[i, 1: t + 1].tolist() == batch.tgt_out[i, :t].tolist()
        assert batch.src_pad_mask[i].tolist() == [False] * (s + 1) + [True] * (widest_src - s - 1)
        assert batch.tgt_pad_mask[i].tolist() == [False] * (t + 1) + [True] * (widest_tgt - t - 1)
    # tgt_in pads exactly where tgt_out does: the two are one shift apart.
    assert torch.equal(batch.tgt_in == PAD_ID, batch.tgt_pad_mask)
    assert batch.n_sentences == len(rows)
    assert batch.n_src_tokens == sum(len(s) + 1 for s in sources)
    assert batch.n_tgt_tokens == sum(len(t) + 1 for t in targets)


@PROPERTY
@given(rows=id_rows)
def test_source_tensor_matches_the_training_source(rows):
    """translate() builds sources with source_tensor; it must equal what training saw."""
    src, src_pad_mask = source_tensor(rows)
    batch = make_batch(rows, [[5]] * len(rows))
    assert torch.equal(src, batch.src)
    assert torch.equal(src_pad_mask, batch.src_pad_mask)


def test_pad_rows_accepts_numpy_rows_and_empty_input():
    rows = [np.array([7, 8, 9], dtype=np.int32), np.array([], dtype=np.int32)]
    assert pad_rows(rows, prefix=BOS_ID).tolist() == [[BOS_ID, 7, 8, 9], [BOS_ID, PAD_ID, PAD_ID, PAD_ID]]
    assert pad_rows([]).shape == (0, 1)


def test_batch_to_keeps_the_tensors():
    batch = make_batch([[5, 6]], [[7]])
    moved = batch.to("cpu")
    assert isinstance(moved, Batch)
    assert all(torch.equal(a, b) for a, b in zip((moved.src, moved.tgt_in, moved.tgt_out),
                                                  (batch.src, batch.tgt_in, batch.tgt_out)))


# --------------------------------------------------------------------------- PairCorpus


@PROPERTY
@given(rows=st.lists(st.tuples(st.lists(st.integers(4, 999), max_size=20),
                               st.lists(st.integers(4, 999), max_size=20)), min_size=1, max_size=30),
       data=st.data())
def test_pair_corpus_keeps_every_pair(rows, data):
    sources, targets = [s for s, _ in rows], [t for _, t in rows]
    corpus = corpus_from_ids(sources, targets)
    assert len(corpus) == len(rows)
    assert corpus.src_lengths.tolist() == [len(s) for s in sources]
    assert corpus.tgt_lengths.tolist() == [len(t) for t in targets]
    for i, (source, target) in enumerate(rows):
        assert corpus.source(i).tolist() == source
        assert corpus.target(i).tolist() == target
    indices = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=8), label="indices")
    batch, expected = corpus.batch(indices), make_batch([sources[i] for i in indices], [targets[i] for i in indices])
    assert torch.equal(batch.src, expected.src)
    assert torch.equal(batch.tgt_in, expected.tgt_in)
    assert torch.equal(batch.tgt_out, expected.tgt_out)


def assert_same_corpus(corpus: PairCorpus, expected: PairCorpus) -> None:
    assert len(corpus) == len(expected)
    for name in ("src_tokens", "src_offsets", "tgt_tokens", "tgt_offsets", "src_lengths", "tgt_lengths"):
        assert np.array_equal(getattr(corpus, name), getattr(expected, name)), name


def expected_corpus(rows) -> PairCorpus:
    return corpus_from_ids(column(rows, SRC_IDS), column(rows, TGT_IDS))


def test_corpus_of_encoded_rows_holds_their_ids(tiny_encoded):
    expected = expected_corpus(tiny_encoded.train)
    assert len(expected) == len(tiny_encoded.train) > 10
    assert_same_corpus(corpus_of(tiny_encoded.train), expected)


def test_corpus_of_follows_the_rows_mask(tiny_encoded):
    """A mask over the encoded table chooses the rows: the corpus holds those, not the table's others."""
    train = tiny_encoded.train
    median = sorted(len(ids) for ids in column(train, TGT_IDS))[len(train) // 2]
    every_third = train.where(np.arange(len(train)) % 3 == 1, "every third")
    long_only = train.where(np.array([len(ids) > median for ids in column(train, TGT_IDS)]), "long only")
    for view in (every_third, long_only):
        assert 0 < len(view) < len(train)
        assert_same_corpus(corpus_of(view), expected_corpus(view))


@pytest.mark.parametrize("largest, dtype", [(65_535, np.uint16), (65_536, np.int32)])
def test_corpus_of_stores_ids_in_the_smallest_type_that_holds_them(largest, dtype):
    rows = in_memory_rows({SRC_IDS: [[4, largest], [], [7]], TGT_IDS: [[5], [largest, 0, 9], [8, 8]]})
    corpus = corpus_of(rows)
    assert corpus.src_tokens.dtype == corpus.tgt_tokens.dtype == dtype
    assert_same_corpus(corpus, expected_corpus(rows))


def test_pair_corpus_batches_are_token_batches(tiny_encoded):
    corpus = corpus_of(tiny_encoded.train)
    src_lengths, tgt_lengths = token_lengths(tiny_encoded.train)
    assert np.array_equal(corpus.src_lengths, src_lengths) and np.array_equal(corpus.tgt_lengths, tgt_lengths)
    ours, theirs = corpus.batches(64, seed=5, epoch=2), token_batches(src_lengths, tgt_lengths, 64, seed=5, epoch=2)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)) and len(ours) == len(theirs)
