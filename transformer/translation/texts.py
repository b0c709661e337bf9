"""The one road from text to text that every engine shares: clean once, warn about characters the
tokenizer never saw, encode, truncate to the position table, search length-sorted batches with the
engine's `search` (optionally from target prefixes, or sampling), detokenize; and the one road from
(source, target) texts to scores through the engine's `score`. Also the GNMT length penalty, which
both engines' searches follow (the output-length rule is the decode settings', decoding.py). No torch
here, so that the CTranslate2 engine starts without it; the searches themselves live with their
engines (search.py, torch_engine.py, ct2_engine.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from transformer.data.text import clean_text
from transformer.data.tokenizer import UNK, UNK_ID, Tokenizers
from transformer.decoding import DecodeOptions
from transformer.errors import UserError
from transformer.translation.phrases import met_phrases, sentence_phrases

log = logging.getLogger(__name__)

_UNKNOWN_SHOWN = 10  # unknown characters named in the warning

Length = TypeVar("Length")  # a float or a tensor of lengths


class Engine(Protocol):
    """What the text path needs of an engine: its tokenizers, decode options, position table size,
    a search over one batch of source id lists, and the teacher-forced log-probabilities of targets."""

    tokenizers: Tokenizers
    decode: DecodeOptions  # its method (decode.strategy), settings, and candidates per text by default

    @property
    def max_len(self) -> int: ...

    def search(self, sources: list[list[int]], n_best: int, prefixes: list[list[int]] | None = None
               ) -> list[list[list[int]]]:
        """Source id lists (no EOS) -> for each, up to `n_best` output id lists best first (no start id or
        EOS), each starting with its target prefix (ids) when `prefixes` are given. An engine whose decoding
        method holds to phrases (decoding.Strategy "constrained") also takes `phrases`: one
        phrases.Phrases per source."""
        ...

    def score(self, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
        """Source and target id lists (no start id or EOS) -> for each pair, the log-probability of every
        target token and of the EOS after them, normalised over the whole vocabulary."""
        ...


def gnmt_length_penalty(length: Length, alpha: float) -> Length:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016, Section 7); `length`
    counts the EOS. alpha = 0 gives 1, so scores are raw log-probability sums."""
    return ((5.0 + length) / 6.0) ** alpha


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


def length_sorted_batches(sources: list[list[int]], batch_size: int) -> Iterator[list[int]]:
    """Indices of the non-empty `sources`, longest first, `batch_size` at a time: peak memory shows up
    in the first batch, not after minutes of work, and a batch holds similar lengths."""
    order = sorted((i for i, row in enumerate(sources) if row), key=lambda i: -len(sources[i]))
    for start in range(0, len(order), batch_size):
        yield order[start: start + batch_size]


def search_in_batches(engine: Engine, sources: list[list[int]], n_best: int,
                      prefixes: list[list[int]] | None = None, phrases: list | None = None) -> list[list[list[int]]]:
    """For each source, up to `n_best` output id lists best first, found by `engine.search` on
    decode.batch_size sources at a time, sorted by length; the result is in input order. A source
    without ids gets n_best empty outputs, without a search. Every source gets at least one output:
    one whose search finished nothing gets an empty one, with a logged warning."""
    results: list[list[list[int]]] = [[[]] * n_best for _ in sources]
    unfinished = 0
    for chunk in length_sorted_batches(sources, engine.decode.batch_size):
        chunk_prefixes = None if prefixes is None else [prefixes[i] for i in chunk]
        # Phrases only to an engine whose method holds to them.
        chunk_phrases = {} if phrases is None else {"phrases": [phrases[i] for i in chunk]}
        searched = engine.search([sources[i] for i in chunk], n_best, chunk_prefixes, **chunk_phrases)
        for i, output in zip(chunk, searched):
            # A beam whose every hypothesis the model rules out (a forced prefix token it gives no
            # probability) finishes nothing; every reader of these results takes a first output.
            unfinished += not output
            results[i] = output[:n_best] or [[]]
    if unfinished:
        log.warning("the search finished no translation of %d sentence(s): every hypothesis was ruled out; "
                    "each is left blank", unfinished)
    return results


def target_prefix_ids(prefixes: list[str], sources: list[list[int]], engine: Engine) -> list[list[int]]:
    """The target ids each prefix is read as (cleaned as every text is), checked to fit the output
    length of its source (decoding.RunDecodeSettings.max_output_length); a blank prefix has none, which is
    plain translation."""
    texts = [clean_text(prefix) for prefix in prefixes]
    ids = [row if text else [] for text, row in zip(texts, engine.tokenizers.encode_target(texts))]
    decode = engine.decode
    for source, prefix, text in zip(sources, ids, texts):
        if source and prefix:
            limit = decode.max_output_length(len(source), engine.max_len)
            if len(prefix) > limit:
                raise UserError(f"the target prefix {text!r} has {len(prefix)} subwords, more than the {limit} "
                                "an output of its source may have")
    return ids


def text_phrases(engine: Engine, sources: list[list[int]], text_constraints: list[list[str]] | None,
                 prefix_ids: list[list[int]] | None = None, prefixes: list[str] | None = None) -> list:
    """For each source, its phrases.Phrases under the engine's options, with the text's own
    `text_constraints` (None: none), checked against its output length and its prefix (`prefix_ids`, read
    from the `prefixes` texts); a PhraseError names the text's index (phrases.sentence_phrases)."""
    decode = engine.decode
    limits = [decode.max_output_length(len(source), engine.max_len) if source else None for source in sources]
    return sentence_phrases(engine.tokenizers, decode, len(sources), limits, text_constraints, prefix_ids, prefixes,
                            hard_cap=engine.max_len - 1)


def candidates_per_text(engine: Engine, n_best: int | None) -> int:
    """`n_best`, checked with the engine's other options (decoding.DecodeOptions: at most the beam when
    searching); None: the engine's own decode.n_best."""
    return engine.decode.n_best if n_best is None else dataclasses.replace(engine.decode, n_best=n_best).n_best


def search_texts(engine: Engine, texts: list[str], n_best: int | None = None, warn_unknown: bool = True,
                 prefixes: list[str] | None = None, text_constraints: list[list[str]] | None = None
                 ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """`translate_texts` before detokenization: the source ids each text was read as (without EOS),
    and for each text its `n_best` output id lists best first (without the start id and EOS)."""
    return search_texts_and_phrases(engine, texts, n_best, warn_unknown, prefixes, text_constraints)[:2]


def search_texts_and_phrases(engine: Engine, texts: list[str], n_best: int | None = None, warn_unknown: bool = True,
                             prefixes: list[str] | None = None, text_constraints: list[list[str]] | None = None
                             ) -> tuple[list[list[int]], list[list[list[int]]], list | None]:
    """`search_texts`, and each text's phrases.Phrases (None: the search holds to none)."""
    n_best = candidates_per_text(engine, n_best)
    if prefixes is not None and len(prefixes) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(prefixes)} prefixes")
    if text_constraints is not None and len(text_constraints) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(text_constraints)} constraint lists")
    if text_constraints is not None and not engine.decode.per_text_constraints:
        raise ValueError("texts bring their own constraints, but the decode options say they do not")  # a caller's bug
    sources = source_ids(texts, engine.tokenizers, engine.max_len - 1, warn_unknown)
    prefix_ids = None if prefixes is None else target_prefix_ids(prefixes, sources, engine)
    phrases = (text_phrases(engine, sources, text_constraints, prefix_ids, prefixes) if engine.decode.constrained
               else None)
    return sources, search_in_batches(engine, sources, n_best, prefix_ids, phrases), phrases


def decode_outputs(tokenizers: Tokenizers, results: list[list[list[int]]]) -> list[list[str]]:
    """The text of each output id list, nested as given (per text, its candidates)."""
    flat = iter(tokenizers.decode_target([tokens for sentence in results for tokens in sentence]))
    # Not a fixed stride: with a vocabulary smaller than the beam a search can finish fewer than n_best.
    return [[next(flat) for _ in sentence] for sentence in results]


def translate_texts(engine: Engine, texts: list[str], n_best: int | None = None, warn_unknown: bool = True,
                    prefixes: list[str] | None = None, text_constraints: list[list[str]] | None = None
                    ) -> list[list[str]]:
    """For each text, its `n_best` translations best first (None: the engine's decode.n_best; at most the
    beam size unless sampling), in input order; the result does not depend on the batching. Blank texts translate to "".
    `prefixes`: one per text, a text its translation must start with ("" for none). `text_constraints`: one
    list per text, the constraints of that text besides the options' (decode.per_text_constraints)."""
    return decode_outputs(engine.tokenizers, search_texts(engine, texts, n_best, warn_unknown, prefixes,
                                                          text_constraints)[1])


@dataclass(frozen=True)
class PairScore:
    """How likely the model finds a target given its source."""

    log_prob: float  # natural-log probability of the target's subwords and the EOS after them
    tokens: int  # the subwords scored: the target's and the EOS

    @property
    def normalized(self) -> float:
        """log_prob per token."""
        return self.log_prob / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(-self.normalized)


def score_ids(engine: Engine, sources: list[list[int]], targets: list[list[int]]) -> list[PairScore]:
    """The score of each (source ids, target ids) pair by `engine.score`, decode.batch_size pairs at a
    time sorted by source length, in input order. Every source needs ids."""
    if not all(sources):
        raise ValueError("every source needs at least one id")
    scores: list[PairScore | None] = [None] * len(sources)
    for chunk in length_sorted_batches(sources, engine.decode.batch_size):
        for i, log_probs in zip(chunk, engine.score([sources[i] for i in chunk], [targets[i] for i in chunk])):
            scores[i] = PairScore(float(sum(log_probs)), len(log_probs))
    return scores  # type: ignore[return-value]


def score_texts(engine: Engine, sources: list[str], targets: list[str]) -> list[PairScore]:
    """The score of each (source, target) text pair, in input order: both cleaned as translation
    cleans its input, the source truncated as translation truncates it. A blank source, or a target
    too long for the model's position table, is a UserError naming the pair (1-based)."""
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    source_list = source_ids(sources, engine.tokenizers, engine.max_len - 1)
    texts = [clean_text(target) for target in targets]
    target_list = [row if text else [] for text, row in zip(texts, engine.tokenizers.encode_target(texts))]
    for number, (source, target) in enumerate(zip(source_list, target_list), start=1):
        if not source:
            raise UserError(f"pair {number}: the source is blank; there is nothing to score the target against")
        if len(target) + 1 > engine.max_len:  # the decoder reads the start token (BOS) + target
            raise UserError(f"pair {number}: the target has {len(target)} subwords, more than the model's "
                            f"{engine.max_len - 1} (max_len with the start token)")
    return score_ids(engine, source_list, target_list)


def translate_scored(engine: Engine, texts: list[str], n_best: int | None = None, prefixes: list[str] | None = None
                     ) -> list[list[tuple[str, float | None]]]:
    """`translate_texts`, each translation with the log-probability of its subwords and an EOS after
    them (`score_ids`: the same measure as `score_texts`, whichever search found it). A blank text
    translates to "" with score None."""
    sources, results = search_texts(engine, texts, n_best, True, prefixes)
    translations = decode_outputs(engine.tokenizers, results)
    return [list(zip(candidates, log_probs)) for candidates, log_probs in
            zip(translations, output_log_probs(engine, sources, results))]


@dataclass(frozen=True)
class ConstraintsMet:
    """What a text's best translation holds of the constraints it was searched with, as given (the options',
    then the text's own; repeats and phrases inside others included), each met as phrases.met_phrases says.
    `held`: the text was searched held to phrases (not blank, and with constraints or avoided phrases)."""

    constraints: tuple[str, ...]
    met: tuple[bool, ...]
    held: bool

    @property
    def all_met(self) -> bool:
        """Every constraint met: false only where the search found no translation holding them all and gave the
        one that met the most (constrained.ConstrainedBeamSearch.run)."""
        return all(self.met)

    @property
    def unmet(self) -> list[str]:
        return [phrase for phrase, met in zip(self.constraints, self.met) if not met]


def translate_held(engine: Engine, texts: list[str], n_best: int | None = None, prefixes: list[str] | None = None,
                   text_constraints: list[list[str]] | None = None, with_scores: bool = False
                   ) -> tuple[list[list[tuple[str, float | None]]], list[ConstraintsMet]]:
    """`translate_texts` for an engine whose options hold to phrases (decode.constrained): each text's
    translations best first, each with its log-probability (`output_log_probs`) when `with_scores` (else None),
    and what its best translation holds of its constraints."""
    sources, results, phrases = search_texts_and_phrases(engine, texts, n_best, True, prefixes, text_constraints)
    translations = decode_outputs(engine.tokenizers, results)
    scores = (output_log_probs(engine, sources, results) if with_scores else
              [[None] * len(candidates) for candidates in translations])
    reports = []
    for i, candidates in enumerate(translations):
        constraints = (*engine.decode.constraints, *(text_constraints[i] if text_constraints else ()))
        met = met_phrases(candidates[0], constraints) if sources[i] else [False] * len(constraints)
        reports.append(ConstraintsMet(constraints, tuple(met), bool(sources[i]) and not phrases[i].empty))
    return [list(zip(c, s)) for c, s in zip(translations, scores)], reports


def output_log_probs(engine: Engine, sources: list[list[int]], results: list[list[list[int]]]
                     ) -> list[list[float | None]]:
    """For each source's outputs (as search_texts gives them), the log-probability of each with an EOS
    after it; None for the outputs of a source without ids."""
    pairs = [(i, output) for i, outputs in enumerate(results) if sources[i] for output in outputs]
    scores = iter(score_ids(engine, [sources[i] for i, _ in pairs], [output for _, output in pairs]))
    return [[next(scores).log_prob if sources[i] else None for _ in outputs] for i, outputs in enumerate(results)]


__all__ = ["search_texts_and_phrases", "text_phrases",
           "Engine", "PairScore", "gnmt_length_penalty", "truncate_sources",
           "warn_unknown_characters", "source_ids", "length_sorted_batches", "search_in_batches", "target_prefix_ids",
           "candidates_per_text", "search_texts", "decode_outputs", "translate_texts", "score_ids", "score_texts",
           "translate_scored", "ConstraintsMet", "translate_held", "output_log_probs"]
