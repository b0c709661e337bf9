"""BPE-dropout (tokenizer.dropout, transformer/data/dropout.py): without dropout its merges give exactly
the tokenizer's ids; training batches are split afresh each epoch, seeded by (seed, epoch, pair); a
stopped and resumed run trains bit for bit as one left alone; validation, the held-out files and the
tokenizer files translation loads never see dropout.

What the `tokenizers` library does (0.23), checked while writing this and the reason for a seeded
re-implementation: `model.dropout` set on a tokenizer loaded from its JSON does take effect, the BPE
cache does not turn it off, and 0.0 behaves as None; but its random draws cannot be seeded, so a
resumed run could not redo an epoch. The run's tokenizer files are saved without dropout.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_settings
from test_resume import assert_same_training
from test_tokenizer import SPELLED, SPELLED_TEXTS, SPELLING_CORPUS
from transformer.checkpoints import layout
from transformer.config import TokenizerConfig, load_config
from transformer.data.corpus import SOURCE, TARGET
from transformer.data.dropout import BpeDropout, DropoutBatches
from transformer.data.encode import corpus_of
from transformer.data.rows import iter_texts
from transformer.data.tokenizer import load_tokenizers, train_tokenizers
from transformer.training import run, trainer


def test_without_dropout_the_merges_give_the_tokenizer_s_ids(tiny_splits, tiny_tokenizers):
    texts = list(iter_texts(tiny_splits.train, SOURCE)) + list(iter_texts(tiny_splits.train, TARGET)) + [
        "Où êtes-vous, « Zoë » ? 😀 ☃ unseen-words_and_UNK: ж"]
    plain = BpeDropout(tiny_tokenizers.source, 0.0)
    assert [plain.encode(text, random.Random(0)) for text in texts] == tiny_tokenizers.encode_source(texts)


def test_without_dropout_a_text_that_spells_a_special_token_reads_as_the_tokenizer_reads_it():
    """Training batches with BPE-dropout and every other encoding make the same decision on "<s>" in a
    text: its characters, even where the corpus taught merges that build the spelling."""
    tokenizers = train_tokenizers(SPELLING_CORPUS, SPELLING_CORPUS, TokenizerConfig(vocab_size=300, min_frequency=1))
    plain = BpeDropout(tokenizers.source, 0.0)
    texts = SPELLED + SPELLED_TEXTS
    assert [plain.encode(text, random.Random(0)) for text in texts] == tokenizers.encode_source(texts)


def test_dropout_splits_words_differently_but_always_into_the_same_text(tiny_tokenizers):
    text = "The heart has its reasons. Où est la gare ?"
    dropped = BpeDropout(tiny_tokenizers.source, 0.3)
    splits = {tuple(dropped.encode(text, random.Random(seed))) for seed in range(20)}
    assert len(splits) > 5
    decoded = {tiny_tokenizers.source.decode(list(ids)) for ids in splits}
    assert decoded == {tiny_tokenizers.source.decode(tiny_tokenizers.encode_source([text])[0])}
    assert all(len(ids) >= len(tiny_tokenizers.encode_source([text])[0]) for ids in splits)


def test_training_batches_differ_between_epochs_and_repeat_for_the_same_seed_and_epoch(tiny_encoded,
                                                                                       tiny_tokenizers):
    corpus = corpus_of(tiny_encoded.train)
    indices = np.arange(len(corpus))

    def batches(seed: int, epoch: int) -> torch.Tensor:
        return DropoutBatches(tiny_encoded.train_texts, corpus, tiny_tokenizers, 0.3, seed, 127).batch(indices,
                                                                                                      epoch).src

    assert torch.equal(batches(1, 0), batches(1, 0)) and torch.equal(batches(1, 4), batches(1, 4))
    assert not torch.equal(batches(1, 0), batches(1, 1))
    assert not torch.equal(batches(1, 0), batches(2, 0))
    # a pair's split depends on its index, not on the batch it is in (so data-parallel shards agree)
    alone = DropoutBatches(tiny_encoded.train_texts, corpus, tiny_tokenizers, 0.3, 1, 127).batch(indices[5:6], 3).src
    together = batches(1, 3)[5]
    assert torch.equal(alone[0], together[: alone.shape[1]])


def test_without_dropout_training_batches_are_the_corpus_batches(tiny_encoded, tiny_tokenizers):
    """The training texts BPE-dropout reads are the corpus's pairs, row for row: with p = 0 every batch is
    the corpus's own."""
    corpus = corpus_of(tiny_encoded.train)
    plain = DropoutBatches(tiny_encoded.train_texts, corpus, tiny_tokenizers, 0.0, 1, 127)
    for indices in corpus.batches(64, seed=2, epoch=0):
        ours, theirs = plain.batch(indices, 0), corpus.batch(indices)
        assert torch.equal(ours.src, theirs.src) and torch.equal(ours.tgt_out, theirs.tgt_out)


def test_a_side_that_dropout_makes_too_long_keeps_its_plain_ids(tiny_encoded, tiny_tokenizers):
    corpus = corpus_of(tiny_encoded.train)
    longest = int(np.argmax(corpus.src_lengths))
    limit = int(corpus.src_lengths[longest])
    dropout = DropoutBatches(tiny_encoded.train_texts, corpus, tiny_tokenizers, 0.9, 0, limit)
    texts = tiny_encoded.train_texts.take([longest], [SOURCE, TARGET])
    src, _ = dropout.encode(longest, 0, texts[SOURCE][0], texts[TARGET][0])
    assert src == corpus.source(longest).tolist()


# --------------------------------------------------------------------------- in a run


def write_config(path: Path, csv_path: Path, dropout: float) -> Path:
    settings = tiny_settings(csv_path, tokenizer={"dropout": dropout}, model={"dropout": 0.1},
                             train={"max_steps": 16, "batch_tokens": 104, "accumulate_batches": 2, "warmup_steps": 5,
                                    "log_every": 4, "valid_every": 8, "checkpoint_every": 8})
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def left_alone(tmp_path_factory: pytest.TempPathFactory, tiny_csv: Path) -> tuple[Path, Path]:
    """(config, run directory) of a run with BPE-dropout 0.5, trained without interruption."""
    base = tmp_path_factory.mktemp("dropout")
    config = write_config(base / "c.yaml", tiny_csv, 0.5)
    run.train(load_config(config), base / "run", show_progress=False)
    return config, base / "run"


def test_a_stopped_and_resumed_run_with_dropout_trains_bit_for_bit_as_one_left_alone(left_alone, tmp_path: Path):
    config_path, expected = left_alone
    config, run_dir = load_config(config_path), tmp_path / "run"
    steps = iter(range(1, 100))
    first = run.train(config, run_dir, should_stop=lambda: next(steps) >= 5, show_progress=False)
    assert first.state.step == 5 and first.state.epoch >= 1  # stopped in the middle of a later epoch
    second = run.train(config, run_dir, show_progress=False)
    assert second.resumed_from.name == "step_00000005" and second.state.step == 16
    last = layout.step_dir_name(16)
    assert_same_training(expected / layout.CHECKPOINTS / last, run_dir / layout.CHECKPOINTS / last)


def test_dropout_changes_what_is_trained_on(left_alone, tmp_path: Path, tiny_csv: Path):
    _, with_dropout = left_alone
    without = tmp_path / "run"
    run.train(load_config(write_config(tmp_path / "c.yaml", tiny_csv, 0.0)), without, show_progress=False)
    name = layout.step_dir_name(16)
    a, b = (torch.load(run_dir / layout.CHECKPOINTS / name / "training.pt", weights_only=True)["optimizer"]
            for run_dir in (with_dropout, without))
    assert not torch.equal(a["state"][0]["exp_avg"], b["state"][0]["exp_avg"])
    assert (with_dropout / "tokenizer" / "joint.json").read_bytes() == (without / "tokenizer" / "joint.json").read_bytes()


def test_validation_held_out_files_and_translation_never_see_dropout(left_alone, tmp_path: Path, monkeypatch):
    config_path, original = left_alone
    # The tokenizer files a translation loads are saved without dropout, and encode one way only.
    assert json.loads((original / "tokenizer" / "joint.json").read_text(encoding="utf-8"))["model"]["dropout"] is None
    tokenizers = load_tokenizers(original / "tokenizer")
    sentence = "The heart has its reasons; où est la gare ?"
    assert len({tuple(tokenizers.encode_source([sentence])[0]) for _ in range(50)}) == 1
    # Validation in a run with dropout: the valid pairs are the held-out sentences' plain ids.
    seen = []
    real_evaluate = trainer.evaluate

    def evaluate(model, valid, tokenizers, config, device):
        seen.append((valid, tokenizers))
        return real_evaluate(model, valid, tokenizers, config, device)

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    run_dir = tmp_path / "run"
    run.train(load_config(config_path), run_dir, show_progress=False)
    assert len(seen) == 2
    held_out = (run_dir / "heldout" / "valid.en").read_text(encoding="utf-8").splitlines()
    plain = load_tokenizers(run_dir / "tokenizer")
    for valid, tokenizers in seen:
        assert tokenizers.source.model.dropout is None
        corpus_sources = {tuple(valid.corpus.source(i).tolist()) for i in range(len(valid.corpus))}
        assert corpus_sources == {tuple(ids) for ids in plain.encode_source(held_out)}
    assert (run_dir / "heldout" / "valid.en").read_bytes() == (original / "heldout" / "valid.en").read_bytes()
