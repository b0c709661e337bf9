"""Tests for transformer/data/prepare.py, the data stage's one entry: what it hands training, the
tokenizers it trains once and hands to the caller's writer (or reads back), a second call answered
from the cache keyed by content, and the stage's place below training: data/ imports neither
training/ nor checkpoints/."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from conftest import column
from transformer.config import TokenizerConfig
from transformer.data.corpus import SOURCE, TARGET
from transformer.data.prepare import TokenizerSource, prepare
from transformer.data.tokenizer import save_tokenizers, tokenizer_fingerprint, train_tokenizers

DATA = Path(__file__).resolve().parent.parent / "transformer" / "data"


def test_prepare_trains_the_tokenizers_once_then_reads_them_back_from_the_cache(tiny_config, tiny_splits,
                                                                                 tmp_path: Path,
                                                                                 fresh_datasets_cache: Path):
    stored = []

    def store(save) -> None:  # as a run directory's owner would: into a folder of its own, then in place
        stored.append(save)
        save(tmp_path / "tokenizer")

    first = prepare(tiny_config, TokenizerSource.train(tmp_path / "tokenizer", store))
    assert len(stored) == 1 and (tmp_path / "tokenizer" / "joint.json").is_file()
    assert first.fingerprints == {"tokenizer_fingerprint": tokenizer_fingerprint(tmp_path / "tokenizer"),
                                  "data_fingerprint": tiny_splits.fingerprint}
    assert (first.valid.sources, first.valid.targets) == (column(tiny_splits.valid, SOURCE),
                                                          column(tiny_splits.valid, TARGET))
    assert len(first.test) == len(tiny_splits.test) and first.dropout is None
    assert len(first.valid_corpus) == len(first.valid)  # every tiny pair fits the model's positions
    assert first.corpus.directory is not None and first.corpus.directory.is_relative_to(fresh_datasets_cache)
    arrow_files = sorted(fresh_datasets_cache.rglob("*.arrow"))

    again = prepare(tiny_config, TokenizerSource.read(tmp_path / "tokenizer"))
    assert sorted(fresh_datasets_cache.rglob("*.arrow")) == arrow_files  # nothing built again
    assert again.corpus.directory == first.corpus.directory and again.fingerprints == first.fingerprints
    for name in ("src_tokens", "src_offsets", "tgt_tokens", "tgt_offsets"):
        assert np.array_equal(getattr(again.corpus, name), getattr(first.corpus, name)), name
        assert np.array_equal(getattr(again.valid_corpus, name), getattr(first.valid_corpus, name)), name


def test_a_changed_tokenizer_gets_token_files_of_its_own(tiny_config, tiny_tokenizers, tmp_path: Path):
    save_tokenizers(tiny_tokenizers, tmp_path / "a")
    other = TokenizerConfig(vocab_size=120, min_frequency=1)
    save_tokenizers(train_tokenizers(["Go.", "Hi."], ["Va !", "Salut !"], other), tmp_path / "b")
    directories = {prepare(tiny_config, TokenizerSource.read(tmp_path / name)).corpus.directory for name in "ab"}
    assert len(directories) == 2


def test_the_data_stage_imports_no_higher_stage():
    """A lower stage never imports a higher one: data/ is below training/, checkpoints/ and translation/."""
    higher = ("transformer.training", "transformer.checkpoints", "transformer.translation", "transformer.export",
              "transformer.serving")
    for path in sorted(DATA.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [name for name in names if name.startswith(higher)], path.name
