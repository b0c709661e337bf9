"""Terminology as target ids: the phrases a sentence's outputs must contain or must not, read from text
the way they appear inside a sentence, checked against each other, the sentence's prefix and its output
length, and the progress a hypothesis makes through them, which constrained search (constrained.py) and
these checks share. No torch here: the text path (texts.py) builds a sentence's `Phrases` before any
search.

Phrases are whole words: a required phrase must not be followed by a subword that glues onto its last
word, and an avoided phrase is banned where it stands as whole words (`gare`, `gare.`), not where it
begins a longer word (`gares`). Required phrases are deduplicated by their ids, and one whose ids lie
inside another's is dropped: writing the longer one meets both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformer.data.text import clean_text
from transformer.data.tokenizer import UNK_ID, Tokenizers
from transformer.decoding import DecodeOptions
from transformer.errors import DecodeOptionError, option

Ids = tuple[int, ...]


class PhraseError(DecodeOptionError):
    """A required or banned phrase (option `option_name`) no output can hold to; `index`: the text it
    belongs to (None: the options' phrases, shared by every text), for a face to name its line."""

    def __init__(self, option_name: str, reason: str, index: int | None) -> None:
        super().__init__(option_name, reason)
        self.index = index


@dataclass(frozen=True)
class Phrases:
    """The phrases of one sentence, as target ids: each output must contain every `required` one and
    none of the `banned` ones (as whole words)."""

    required: tuple[Ids, ...] = ()
    banned: tuple[Ids, ...] = ()
    # Subwords that would glue onto the word before them (no word start, a letter or digit first): never
    # right after a required phrase, which would else end inside a longer word ("voulais" + "ais"); and
    # the only ones allowed right after a banned phrase, which is then no longer a whole word.
    glued: frozenset[int] = frozenset()

    @property
    def tokens(self) -> int:
        return sum(len(phrase) for phrase in self.required)

    @property
    def empty(self) -> bool:
        return not self.required and not self.banned


@dataclass(frozen=True)
class Progress:
    """How far one hypothesis is through its sentence's required phrases: a bit per phrase met, the phrase
    it is in the middle of (-1: none) with the tokens of it written so far, and the phrase its last token
    completed (-1: none)."""

    met: int = 0
    current: int = -1
    position: int = 0
    just_met: int = -1

    @property
    def completed(self) -> bool:
        """The last token ended a required phrase: a glued subword now would end it inside a longer word."""
        return self.just_met >= 0

    def advance(self, token: int, phrases: Phrases) -> "Progress":
        """The progress after writing `token`. A phrase begun and then left loses its progress (Post &
        Vilar, Section 3): it must be written whole, in one piece. A glued subword right after a phrase
        takes the phrase back (it was not a whole word): the search never writes one there, but a forced
        prefix may."""
        required = phrases.required
        if self.completed and token in phrases.glued:
            return Progress(self.met & ~(1 << self.just_met))
        if self.current >= 0:
            phrase = required[self.current]
            if phrase[self.position] == token:
                if self.position + 1 == len(phrase):
                    return Progress(self.met | 1 << self.current, just_met=self.current)
                return Progress(self.met, self.current, self.position + 1)
        for j, phrase in enumerate(required):
            if not self.met >> j & 1 and phrase[0] == token:
                return (Progress(self.met | 1 << j, just_met=j) if len(phrase) == 1 else
                        Progress(self.met, j, 1))
        return Progress(self.met) if self.current >= 0 or self.completed else self

    def met_tokens(self, required: tuple[Ids, ...]) -> int:
        """The bank: tokens of required phrases written (whole phrases met, and the one under way)."""
        return sum(len(p) for j, p in enumerate(required) if self.met >> j & 1) + self.position

    def met_count(self) -> int:
        """Whole required phrases met."""
        return bin(self.met).count("1")

    def all_met(self, required: tuple[Ids, ...]) -> bool:
        return self.met == (1 << len(required)) - 1

    def next_tokens(self, required: tuple[Ids, ...]) -> list[int]:
        """The tokens that advance a required phrase: the next of the one under way, or the first of each
        phrase not yet met."""
        if self.current >= 0:
            return [required[self.current][self.position]]
        return list(dict.fromkeys(p[0] for j, p in enumerate(required) if not self.met >> j & 1))


def phrase_ids(tokenizers: Tokenizers, phrase: str, name: str, index: int | None = None) -> Ids:
    """The target ids of `phrase` (option `name`: constraints or avoid) as it is written inside a
    sentence. The tokenizer's Metaspace marks every word start, the first one's too, and BPE never merges
    across words, so a phrase alone reads as it does after a space mid-sentence ("gare" is "▁gare" in
    both); it is cleaned as every text is. Special tokens are text here, as everywhere. Refused (a
    PhraseError) when nothing of it is left, or when it holds characters the target vocabulary lacks."""
    text = clean_text(phrase)
    ids = tokenizers.encode_target([text])[0] if text else []
    if not ids:
        raise PhraseError(name, f"{phrase!r} has no subwords: nothing of it is left after the input cleaning",
                          index)
    if UNK_ID in ids:
        raise PhraseError(name, f"{phrase!r} holds characters the target vocabulary lacks: no output can "
                                f"{'hold' if name == 'avoid' else 'contain'} it", index)
    return tuple(ids)


def glued_subwords(tokenizers: Tokenizers) -> frozenset[int]:
    """The target subwords that continue the word before them: no word-start mark, a letter or digit first
    (punctuation, which Metaspace also leaves unmarked, ends a word rather than continuing it)."""
    vocab = getattr(getattr(tokenizers, "target", None), "get_vocab", None)
    if vocab is None:  # a stand-in without a subword vocabulary (the tests' word-level tokenizers)
        return frozenset()
    return frozenset(i for token, i in vocab().items() if token and not token.startswith("\u2581")
                     and token[0].isalnum())


def whole_word_at(ids: Sequence[int], phrase: Ids, glued: frozenset[int], open_end: bool = False) -> int | None:
    """Where in `ids` `phrase` first stands as whole words (not followed by a glued subword), or None.
    `open_end`: `ids` go on (a prefix), so a phrase at their very end is not yet a whole word."""
    n = len(phrase)
    for start in range(len(ids) - n + 1):
        if tuple(ids[start: start + n]) == phrase:
            end = start + n
            if end < len(ids) and ids[end] not in glued or end == len(ids) and not open_end:
                return start
    return None


def required_once(required: Sequence[Ids], glued: frozenset[int]) -> tuple[Ids, ...]:
    """The required phrases without repeats, and without a phrase that stands as whole words inside another
    (writing the longer one meets it; `gare` in `gares du Nord` does not), in their first order. Without
    this, `gare` required twice (a flag and a glossary) or beside `la gare` made the search write it twice."""
    unique = list(dict.fromkeys(required))
    return tuple(p for p in unique
                 if not any(q != p and len(q) > len(p) and whole_word_at(q, p, glued) is not None for q in unique))


@dataclass(frozen=True)
class Named:
    """A phrase as the user gave it, with its ids and where it came from (for messages)."""

    text: str
    ids: Ids
    option_name: str  # constraints, line_constraints or avoid
    index: int | None  # the text it belongs to (None: the options', shared)


def sentence_phrases(tokenizers: Tokenizers, decode: DecodeOptions, count: int, limits: Sequence[int | None],
                     required: Sequence[Sequence[str]] | None, prefixes: Sequence[Sequence[int]] | None,
                     prefix_texts: Sequence[str] | None = None) -> list[Phrases]:
    """For each of `count` texts, its Phrases: the options' required and banned phrases with the text's own
    `required` ones (None: none), as target ids. `limits`: each text's output length (None: a blank text,
    not searched); `prefixes`: each text's forced target ids (None: none). A PhraseError, naming the text's
    index where the text is to blame, when no output could hold to them: an avoided phrase inside a
    required one or inside the prefix, or required phrases that with the prefix need more subwords than the
    output may have."""
    glued = glued_subwords(tokenizers)
    shared = [Named(p, phrase_ids(tokenizers, p, "constraints"), "constraints", None) for p in decode.constraints]
    banned = [Named(p, phrase_ids(tokenizers, p, "avoid"), "avoid", None) for p in decode.avoid]
    _refuse_avoided_inside_required(shared, banned, glued)
    result = []
    for i in range(count):
        own = [] if required is None else [Named(p, phrase_ids(tokenizers, p, "line_constraints", i),
                                                 "line_constraints", i) for p in required[i]]
        _refuse_avoided_inside_required(own, banned, glued)
        prefix = () if prefixes is None else tuple(prefixes[i])
        if prefix and limits[i] is not None:  # a blank text is not searched: its prefix is never written
            _refuse_avoided_in_prefix(prefix, prefix_texts[i] if prefix_texts else "", banned, glued, i)
        phrases = Phrases(required_once([n.ids for n in shared + own], glued), tuple(n.ids for n in banned), glued)
        if limits[i] is not None and phrases.required:
            _refuse_what_cannot_fit(phrases, prefix, limits[i], "line_constraints" if own else "constraints", i)
        result.append(phrases)
    return result


def _refuse_avoided_inside_required(required: list[Named], banned: list[Named], glued: frozenset[int]) -> None:
    """Compared as ids, after the input cleaning: `l'hôtel` and `l’hôtel` are one phrase."""
    for phrase in required:
        for avoided in banned:
            if whole_word_at(phrase.ids, avoided.ids, glued) is not None:
                avoid = f"{option('avoid')} {avoided.text!r}"
                raise PhraseError(phrase.option_name, f"{phrase.text!r} is also avoided ({avoid}); a phrase is "
                                  "required or avoided, not both" if phrase.ids == avoided.ids else
                                  f"{phrase.text!r} holds an avoided phrase ({avoid}); no output can contain one "
                                  "without the other", phrase.index)


def _refuse_avoided_in_prefix(prefix: Ids, text: str, banned: list[Named], glued: frozenset[int], i: int) -> None:
    for avoided in banned:
        if whole_word_at(prefix, avoided.ids, glued, open_end=True) is not None:
            raise PhraseError("avoid", f"{avoided.text!r} is in the target prefix{f' {text!r}' if text else ''}, "
                                       "which every output starts with", i)


def _refuse_what_cannot_fit(phrases: Phrases, prefix: Ids, limit: int, option_name: str, i: int) -> None:
    """The prefix's tokens count towards the phrases, as in the search: what the prefix leaves unwritten
    must fit after it."""
    progress = Progress()
    for token in prefix:
        progress = progress.advance(token, phrases)
    unwritten = phrases.tokens - progress.met_tokens(phrases.required)
    need = len(prefix) + unwritten
    if need > limit:
        after = f" after the {len(prefix)} of the target prefix" if prefix else ""
        raise PhraseError(option_name, f"need {unwritten} subwords{after}, more than the {limit} an output of this "
                                       f"source may have ({option('max_length_b')} raises it)", i)


def met_phrases(tokenizers: Tokenizers, output: Sequence[int], phrases: Sequence[str],
                glued: frozenset[int]) -> list[bool]:
    """Whether each phrase (as given: repeats and phrases inside others included) stands as whole words in
    `output` ids, the rule the search holds to; `glued`: glued_subwords(tokenizers), read once by the caller."""
    return [whole_word_at(output, phrase_ids(tokenizers, phrase, "constraints"), glued) is not None
            for phrase in phrases]


__all__ = ["PhraseError", "Phrases", "Progress", "phrase_ids", "glued_subwords", "whole_word_at", "required_once",
           "sentence_phrases", "met_phrases"]
