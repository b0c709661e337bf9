"""What every translation engine shares, around its search: cleaning, subword ids, truncation to the
position table, blank lines, length-sorted batches, the output-length rule and the GNMT length
penalty. No torch here: decode.py's searches and the CTranslate2 engine (ct2_engine.py) both use it,
so the two engines read and write text in exactly the same way.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, TypeVar

from transformer.data.text import clean_text
from transformer.data.tokenizer import UNK, UNK_ID, Tokenizers

log = logging.getLogger(__name__)

_UNKNOWN_SHOWN = 10  # unknown characters named in the warning

# One batch of source id lists (no EOS) -> for each sentence its hypotheses' target ids, best first.
Search = Callable[[list[list[int]]], list[list[list[int]]]]
Length = TypeVar("Length")  # a float or a tensor of lengths


def gnmt_length_penalty(length: Length, alpha: float) -> Length:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016, Section 7); `length`
    counts the EOS. alpha = 0 gives 1, so scores are raw log-probability sums."""
    return ((5.0 + length) / 6.0) ** alpha


def max_output_length(source_length: int, a: float, b: int, hard_cap: int) -> int:
    """Longest output, in subwords without EOS, of a source of `source_length` subwords (without EOS):
    floor(a * length) + b, between 1 and `hard_cap` (model max_len - 1: BOS + that many tokens fill the
    position table)."""
    # A tiny epsilon, so that e.g. 1.1 * 10 floors to 11 and not to 10.
    return min(max(math.floor(source_length * a + 1e-9) + b, 1), hard_cap)


def truncate_sources(ids: list[list[int]], limit: int) -> list[list[int]]:
    """Cut sources to `limit` subwords (so that with EOS they fit the position table), warning once."""
    too_long = [i for i, row in enumerate(ids) if len(row) > limit]
    if too_long:
        log.warning("%d source sentence(s) longer than %d subwords were truncated (the model's max_len "
                    "is %d including EOS); first at input index %d",
                    len(too_long), limit, limit + 1, too_long[0])
        ids = [row[:limit] if len(row) > limit else row for row in ids]
    return ids


def warn_unknown_characters(texts: list[str], tokenizers: Tokenizers) -> None:
    """Characters the tokenizer never saw reach the model as <unk>: say which, or a poor translation
    goes unexplained. `texts` are cleaned already."""
    unknown: dict[str, None] = {}  # ordered set
    sentences = 0
    for text, encoding in zip(texts, tokenizers.source.encode_batch(texts, add_special_tokens=False)):
        spans = [text[start:end] for token_id, (start, end) in zip(encoding.ids, encoding.offsets)
                 if token_id == UNK_ID]
        sentences += bool(spans)
        unknown.update(dict.fromkeys(spans))
    if unknown:
        shown = list(unknown)[:_UNKNOWN_SHOWN]
        log.warning("%d sentence(s) contain characters never seen in training, which the model reads as %s: %s%s",
                    sentences, UNK, ", ".join(map(repr, shown)), ", ..." if len(unknown) > len(shown) else "")


def search_texts(texts: list[str], tokenizers: Tokenizers, search: Search, batch_size: int, n_best: int,
                 hard_cap: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """For each text, the source ids it was read as (without EOS) and up to `n_best` output id lists
    found by `search`, best first (without BOS/EOS).

    Each text is first cleaned exactly as training cleaned its pairs (text.clean_text), so what a user
    pastes (non-breaking spaces, tabs, zero-width characters) reads as in training. Sentences are
    sorted by source length and handed to `search` `batch_size` at a time; the result is in input
    order. An empty or blank text (or one with no subwords) has no source ids and n_best empty
    outputs, without a search. Sources longer than `hard_cap` subwords are truncated to it with a
    logged warning (not refused: one odd line should not stop a whole file).
    """
    texts = [clean_text(text) for text in texts]  # as the training pairs were cleaned
    ids = truncate_sources(tokenizers.encode_source(texts), hard_cap)
    # A blank line stays blank: BPE would turn spaces into "▁" tokens and the model would invent text.
    ids = [row if text else [] for text, row in zip(texts, ids)]
    results: list[list[list[int]]] = [[[]] * n_best for _ in ids]
    # Longest first: peak memory shows up in the first batch, not after minutes of work.
    order = sorted((i for i, row in enumerate(ids) if row), key=lambda i: -len(ids[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        for i, output in zip(chunk, search([ids[i] for i in chunk])):
            results[i] = output[:n_best]
    return ids, results


def decode_outputs(tokenizers: Tokenizers, results: list[list[list[int]]]) -> list[list[str]]:
    """The text of each output id list, nested as given (per text, its candidates)."""
    flat = iter(tokenizers.decode_target([tokens for sentence in results for tokens in sentence]))
    # Not a fixed stride: with a vocabulary smaller than the beam a search can finish fewer than n_best.
    return [[next(flat) for _ in sentence] for sentence in results]


def translate_texts(texts: list[str], tokenizers: Tokenizers, search: Search, batch_size: int, n_best: int,
                    hard_cap: int) -> list[list[str]]:
    """For each text, up to `n_best` translations best first, found by `search` (see `search_texts`)."""
    return decode_outputs(tokenizers, search_texts(texts, tokenizers, search, batch_size, n_best, hard_cap)[1])


__all__ = ["Search", "gnmt_length_penalty", "max_output_length", "truncate_sources", "warn_unknown_characters",
           "search_texts", "decode_outputs", "translate_texts"]
