"""The data stage in one call: `prepare(config, tokenizer_source)` reads and cleans the corpus
(corpus.py), splits it leak-free (split.py), trains BPE on the training split or reads the run's
tokenizers, encodes every pair (encode.py) and hands back what training needs: the training corpus as
token files, the valid set, the held-out texts and the fingerprints checkpoints record.

Training calls it once. Which tokenizer files to reuse and writing into the run directory stay the
run's business: `TokenizerSource` says where the files are and, when they are to be trained, hands
them to a writer the caller owns. Nothing here imports training/ or checkpoints/.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transformer.config import Config
from transformer.data.batching import Mix, PairCorpus
from transformer.data.cache import content_key
from transformer.data.corpus import SOURCE, TARGET, LoadReport, load_pairs
from transformer.data.dropout import DropoutBatches
from transformer.data.encode import corpus_of, encode_splits, token_lengths
from transformer.data.rows import Rows, iter_texts, sample_rows
from transformer.data.split import Splits, split_pairs
from transformer.data.tokenizer import (Tokenizers, load_tokenizers, save_tokenizers, tokenizer_fingerprint,
                                        train_tokenizers)
from transformer.errors import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenizers come from. `directory` holds the files `save_tokenizers` writes, or will.

    Without `store` they are read from there. With it, BPE is trained on the training split and
    `store(save)` is called once: it must run `save(folder)`, which writes the files into `folder`,
    so that they end up in `directory` (a run directory's owner writes them its own way)."""

    directory: Path
    store: Callable[[Callable[[Path], None]], None] | None = None

    @classmethod
    def read(cls, directory: Path) -> "TokenizerSource":
        return cls(Path(directory))

    @classmethod
    def train(cls, directory: Path, store: Callable[[Callable[[Path], None]], None]) -> "TokenizerSource":
        return cls(Path(directory), store)


@dataclass(frozen=True)
class HeldOutTexts:
    """The cleaned texts of a held-out split's pairs, in corpus order (a source repeats once per translation)."""

    sources: list[str]
    targets: list[str]

    def __len__(self) -> int:
        return len(self.sources)


@dataclass(frozen=True)
class PreparedData:
    """What training needs from the data stage."""

    corpus: PairCorpus  # the training pairs' ids, read a batch at a time from token files
    valid_corpus: PairCorpus  # the valid pairs short enough for the model's positions: the valid loss
    valid: HeldOutTexts  # every valid pair: BLEU, chrF and the held-out files
    test: HeldOutTexts  # every test pair, never trained on nor scored during training
    tokenizers: Tokenizers
    fingerprints: dict[str, str]  # tokenizer_fingerprint (of the files), data_fingerprint (of the set of pairs)
    dropout: DropoutBatches | None  # with tokenizer.dropout: the training pairs encoded afresh every epoch


def prepare(config: Config, tokenizer_source: TokenizerSource) -> PreparedData:
    """Read, clean, split and encode the corpus `config.data` names, with the tokenizers `tokenizer_source`
    gives (trained on the training split when it asks for that). datasets keeps its tables in its cache
    (HF_DATASETS_CACHE), and this package its split, token files and batch plans beside them, all keyed
    by content: a second run with the same data and settings reads them back. A DataError names the
    file or key at fault."""
    pairs, reports = load_pairs(config.data, config.filter)
    splits = split_pairs(pairs, config.data, _held_out(pairs, reports))
    tokenizers = _tokenizers(splits, config, tokenizer_source)
    fingerprints = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer_source.directory),
                    "data_fingerprint": splits.fingerprint}
    logger.info("encoding %d pairs into subword ids", len(splits.train) + len(splits.valid) + len(splits.test))
    encoded = encode_splits(splits, tokenizers, config.data.max_length)
    if not len(encoded.train):
        raise DataError(f"{', '.join(report.path for report in reports)}: nothing to train on: all {encoded.train_too_long} "
                        f"training pairs are longer than data.max_length={config.data.max_length} allows (more "
                        f"than {config.data.max_length - 1} subword tokens on a side); raise data.max_length")
    corpus = corpus_of(encoded.train, _mix(encoded.train, reports))
    # BPE-dropout splits training pairs afresh each epoch; valid, test and held-out files never see it.
    dropout = DropoutBatches(encoded.train_texts, corpus, tokenizers, config.tokenizer.dropout, config.train.seed,
                             config.data.max_length - 1) if config.tokenizer.dropout else None
    return PreparedData(corpus=corpus, valid_corpus=_valid_corpus(encoded.valid, config.model.max_len),
                        valid=_texts(splits.valid), test=_texts(splits.test), tokenizers=tokenizers,
                        fingerprints=fingerprints, dropout=dropout)


def _held_out(pairs: Rows, reports: tuple[LoadReport, ...]) -> np.ndarray | None:
    """(len(pairs),) whether each pair is of a corpus valid and test are drawn from; None: all are."""
    if all(report.held_out for report in reports) or not any(report.held_out for report in reports):
        return None
    held = np.zeros(len(pairs.table), dtype=bool)
    for report in reports:
        held[report.rows[0]: report.rows[1]] = report.held_out
    return held if pairs.mask is None else held[pairs.mask]


def _mix(train: Rows, reports: tuple[LoadReport, ...]) -> Mix | None:
    """The weights of several corpora over the training pairs (PairCorpus indices), or None for one."""
    if len(reports) == 1:
        return None
    chosen = np.ones(len(train.table), dtype=bool) if train.mask is None else train.mask
    bounds = [0] + [int(np.count_nonzero(chosen[: report.rows[1]])) for report in reports]
    logger.info("training pairs by corpus: %s", ", ".join(
        f"{report.section} {end - start} (weight {report.weight:g})"
        for report, start, end in zip(reports, bounds, bounds[1:])))
    return Mix(tuple(bounds), tuple(report.weight for report in reports),
               tuple(f"{report.section} ({report.path})" for report in reports))


def _tokenizers(splits: Splits, config: Config, source: TokenizerSource) -> Tokenizers:
    if source.store is None:  # a run's own files (a resume, a fine-tuned run's copy, another rank)
        tokenizers = load_tokenizers(source.directory)
        logger.info("tokenizers: reusing %s", source.directory)
        return tokenizers
    sample = sample_rows(len(splits.train), config.tokenizer.sample_pairs, config.train.seed)
    sampled = len(splits.train) if sample is None else config.tokenizer.sample_pairs
    logger.info("training BPE tokenizers (vocabulary %d, %s) on %d training pairs%s", config.tokenizer.vocab_size,
                "joint" if config.tokenizer.joint else "separate", sampled,
                f", a seeded sample of the {len(splits.train)} (tokenizer.sample_pairs)" if sample is not None else "")
    tokenizers = train_tokenizers(iter_texts(splits.train, SOURCE, rows=sample),
                                  iter_texts(splits.train, TARGET, rows=sample), config.tokenizer)
    source.store(functools.partial(save_tokenizers, tokenizers))
    return tokenizers


def _valid_corpus(valid: Rows, max_len: int) -> PairCorpus:
    """The encoded valid pairs whose sides (+ BOS/EOS) fit the model's position table: the valid loss
    feeds whole pairs to the model. A longer pair still counts in BLEU, where translation truncates
    its source."""
    src_len, tgt_len = token_lengths(valid)
    fits = (src_len < max_len) & (tgt_len < max_len)
    if not fits.all():
        logger.warning("valid: %d of %d pairs are longer than model.max_len=%d tokens; they count in BLEU but not "
                       "in the valid loss", int(np.count_nonzero(~fits)), len(valid), max_len)
    return corpus_of(valid.where(fits, content_key(valid.key, "fits", max_len)))


def _texts(held_out: Rows) -> HeldOutTexts:
    return HeldOutTexts(list(iter_texts(held_out, SOURCE)), list(iter_texts(held_out, TARGET)))


__all__ = ["TokenizerSource", "HeldOutTexts", "PreparedData", "prepare"]
