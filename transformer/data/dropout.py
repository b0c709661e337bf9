"""BPE-dropout (Provilkov, Emelianenko & Voita, "BPE-Dropout", ACL 2020) for training batches only:
the tokenizer's own merges, each left out with probability p, so that a word is split differently
from one epoch to the next. Validation, test, the held-out files and translation encode through
tokenizer.py, whose tokenizers never drop a merge.

Why not the `tokenizers` BPE model's own `dropout`: it draws from an unseeded generator, so a resumed
run could not redo an epoch's batches exactly. Here a pair's split depends only on (seed, epoch,
pair index), and with p = 0 the merges give exactly the tokenizer's ids (tests/test_bpe_dropout.py).
"""

from __future__ import annotations

import json
import random
from typing import Sequence

from transformer.data.batching import Batch, PairCorpus, make_batch
from transformer.data.corpus import SOURCE, TARGET
from transformer.data.rows import Rows
from transformer.data.tokenizer import BOS_ID, UNK_ID, Tokenizers
from transformer.errors import UserError
from tokenizers import Tokenizer


class BpeDropout:
    """One BPE tokenizer's normalizer, pre-tokenizer and merges, the merges applied with dropout."""

    def __init__(self, tokenizer: Tokenizer, p: float) -> None:
        model = json.loads(tokenizer.to_str())["model"]
        plain = model.get("type") == "BPE" and not any(
            model.get(key) for key in ("continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                                       "byte_fallback", "ignore_merges"))
        if model.get("type") != "BPE":  # an imported model's tokenizer (a SentencePiece unigram, say)
            raise UserError(f"tokenizer.dropout is BPE-dropout, and this run's tokenizer is a {model.get('type')} "
                            "model, which has no merges to drop; set tokenizer.dropout: 0")
        if not plain:  # tokenizer.py trains none of these: a bug, not the user's
            raise ValueError("BPE-dropout supports the plain BPE models tokenizer.py trains")
        self.vocab: dict[str, int] = model["vocab"]
        merges = [pair.split(" ", 1) if isinstance(pair, str) else pair for pair in model["merges"]]
        self.ranks: dict[tuple[str, str], int] = {(a, b): rank for rank, (a, b) in enumerate(merges)}
        self.normalizer, self.pre_tokenizer = tokenizer.normalizer, tokenizer.pre_tokenizer
        self.p = p

    def encode(self, text: str, rng: random.Random) -> list[int]:
        """Subword ids of `text` (no BOS/EOS); a character the vocabulary lacks is UNK, as in tokenizer.py."""
        normalized = self.normalizer.normalize_str(text) if self.normalizer else text
        return [self.vocab.get(piece, UNK_ID)
                for word, _ in self.pre_tokenizer.pre_tokenize_str(normalized)
                for piece in self._merge(list(word), rng)]

    def _merge(self, symbols: list[str], rng: random.Random) -> list[str]:
        """Apply the best-ranked merge among the adjacent pairs (the leftmost of equals) until none is
        left; each candidate is dropped with probability p at every round. Candidates ranked below
        the best so far need no draw: dropping them changes nothing."""
        ranks, p = self.ranks, self.p
        while len(symbols) > 1:
            best_rank, best = len(ranks), -1
            for i in range(len(symbols) - 1):
                rank = ranks.get((symbols[i], symbols[i + 1]))
                if rank is not None and rank < best_rank and not (p and rng.random() < p):
                    best_rank, best = rank, i
            if best < 0:
                break
            symbols[best: best + 2] = [symbols[best] + symbols[best + 1]]
        return symbols


class DropoutBatches:
    """Training batches whose pairs are encoded afresh with BPE-dropout for each epoch, from their text,
    when the batch is built: nothing per epoch is held in memory, and a resumed run rebuilds any batch
    exactly. Which pairs form a batch follows the lengths without dropout (`corpus`), so a batch may
    hold somewhat more tokens than the budget. A side that dropout makes longer than `max_tokens`
    keeps its ids without dropout, as training never sees a side longer than that."""

    def __init__(self, texts: Rows, corpus: PairCorpus, tokenizers: Tokenizers, p: float, seed: int,
                 max_tokens: int) -> None:
        """`texts`: the training pairs' SOURCE and TARGET columns, row i being pair i of `corpus`."""
        self.texts = texts
        self.corpus, self.seed, self.max_tokens = corpus, seed, max_tokens
        self.source = BpeDropout(tokenizers.source, p)
        self.target = self.source if tokenizers.joint else BpeDropout(tokenizers.target, p)

    def encode(self, index: int, epoch: int, source: str, target: str) -> tuple[list[int], list[int]]:
        rng = random.Random(f"bpe-dropout:{self.seed}:{epoch}:{index}")  # a str seed hashes the same everywhere
        src, tgt = self.source.encode(source, rng), self.target.encode(target, rng)
        if len(src) > self.max_tokens:
            src = self.corpus.source(index).tolist()
        if len(tgt) > self.max_tokens:
            tgt = self.corpus.target(index).tolist()
        return src, tgt

    def batch(self, indices: Sequence[int], epoch: int, start_id: int = BOS_ID) -> Batch:
        """The pairs `indices` split afresh for `epoch`, decoder inputs beginning with `start_id`."""
        indices = [int(i) for i in indices]
        rows = self.texts.take(indices, [SOURCE, TARGET])
        pairs = [self.encode(i, epoch, s, t) for i, s, t in zip(indices, rows[SOURCE], rows[TARGET])]
        return make_batch([src for src, _ in pairs], [tgt for _, tgt in pairs], start_id)


__all__ = ["BpeDropout", "DropoutBatches"]
