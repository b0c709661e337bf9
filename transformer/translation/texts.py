"""The one road from text to text that every engine shares: clean once, warn about characters the
tokenizer never saw, encode, truncate to the position table, search length-sorted batches with the
engine's `search`, detokenize. Also the output-length rule and the GNMT length penalty, which both
engines' searches follow. No torch here, so that the CTranslate2 engine starts without it; the
searches themselves live with their engines (search.py, torch_engine.py, ct2_engine.py).
"""

from __future__ import annotations

import logging
import math
from typing import Protocol, TypeVar

from transformer.config import DecodeConfig
from transformer.data.text import clean_text
from transformer.data.tokenizer import UNK, UNK_ID, Tokenizers

log = logging.getLogger(__name__)

_UNKNOWN_SHOWN = 10  # unknown characters named in the warning

Length = TypeVar("Length")  # a float or a tensor of lengths


class Engine(Protocol):
    """What the text path needs of an engine: its tokenizers, decode settings, position table size,
    and a search over one batch of source id lists."""

    tokenizers: Tokenizers
    decode: DecodeConfig

    @property
    def max_len(self) -> int: ...

    def search(self, sources: list[list[int]], n_best: int) -> list[list[list[int]]]:
        """Source id lists (no EOS) -> for each, up to `n_best` output id lists best first (no BOS/EOS)."""
        ...


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


def source_ids(texts: list[str], tokenizers: Tokenizers, hard_cap: int, warn_unknown: bool = True
               ) -> list[list[int]]:
    """The source ids (without EOS) each text is read as.

    Each text is cleaned exactly as training cleaned its pairs (text.clean_text), here and nowhere
    else on the way, so that what a user pastes (non-breaking spaces, tabs, zero-width characters)
    reads as in training. Sources longer than `hard_cap` subwords are truncated to it with a logged
    warning (not refused: one odd line should not stop a whole file). A blank text has no ids.
    """
    texts = [clean_text(text) for text in texts]
    if warn_unknown:
        warn_unknown_characters(texts, tokenizers)
    ids = truncate_sources(tokenizers.encode_source(texts), hard_cap)
    # A blank line stays blank: BPE would turn spaces into "▁" tokens and the model would invent text.
    return [row if text else [] for text, row in zip(texts, ids)]


def search_in_batches(engine: Engine, sources: list[list[int]], n_best: int) -> list[list[list[int]]]:
    """For each source, up to `n_best` output id lists best first, found by `engine.search` on
    decode.batch_size sources at a time, sorted by length; the result is in input order. A source
    without ids gets n_best empty outputs, without a search."""
    results: list[list[list[int]]] = [[[]] * n_best for _ in sources]
    # Longest first: peak memory shows up in the first batch, not after minutes of work.
    order = sorted((i for i, row in enumerate(sources) if row), key=lambda i: -len(sources[i]))
    batch_size = engine.decode.batch_size
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        for i, output in zip(chunk, engine.search([sources[i] for i in chunk], n_best)):
            results[i] = output[:n_best]
    return results


def search_texts(engine: Engine, texts: list[str], n_best: int = 1, warn_unknown: bool = True
                 ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """`translate_texts` before detokenization: the source ids each text was read as (without EOS),
    and for each text its `n_best` output id lists best first (without BOS/EOS)."""
    if not 1 <= n_best <= engine.decode.beam_size:
        raise ValueError(f"n_best must be between 1 and the beam size {engine.decode.beam_size}, got {n_best}")
    sources = source_ids(texts, engine.tokenizers, engine.max_len - 1, warn_unknown)
    return sources, search_in_batches(engine, sources, n_best)


def decode_outputs(tokenizers: Tokenizers, results: list[list[list[int]]]) -> list[list[str]]:
    """The text of each output id list, nested as given (per text, its candidates)."""
    flat = iter(tokenizers.decode_target([tokens for sentence in results for tokens in sentence]))
    # Not a fixed stride: with a vocabulary smaller than the beam a search can finish fewer than n_best.
    return [[next(flat) for _ in sentence] for sentence in results]


def translate_texts(engine: Engine, texts: list[str], n_best: int = 1, warn_unknown: bool = True
                    ) -> list[list[str]]:
    """For each text, its `n_best` translations best first (n_best <= the beam size), in input order;
    the result does not depend on the batching. Blank texts translate to ""."""
    return decode_outputs(engine.tokenizers, search_texts(engine, texts, n_best, warn_unknown)[1])


__all__ = ["Engine", "gnmt_length_penalty", "max_output_length", "truncate_sources", "warn_unknown_characters",
           "source_ids", "search_in_batches", "search_texts", "decode_outputs", "translate_texts"]
