"""Terminology as target ids: the phrases a sentence's outputs must contain or must not, read from text
the way they appear inside a sentence, checked against each other, the sentence's prefix and its output
length, and the progress a hypothesis makes through them, which constrained search (constrained.py) and
these checks share. No torch here: the text path (texts.py) builds a sentence's `Phrases` before any
search.

Phrases are whole words: a constraint (a phrase every output contains) is met by any of its forms (`gare`,
`▁gare.`, `Gare`) that no subword glued onto it makes a longer word, and an avoided phrase is kept out where
it stands as whole words (`gare`, `gare.`), not where it begins a longer word (`gares`). Constraints are
deduplicated by their ids, and one standing as whole words inside another is dropped: writing the longer one
meets both.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformer.data.text import clean_text, whole_words
from transformer.data.tokenizer import EOS_ID, UNK_ID, Tokenizers
from transformer.decoding import DecodeOptions, PhraseError, check_not_avoided
from transformer.errors import option

Ids = tuple[int, ...]


@dataclass(frozen=True)
class Forms:
    """Every way an output may write one phrase as subwords. BPE splits text only at spaces, so a word
    and the punctuation or elision attached to it are one piece, tokenized together: `gare.` is `▁gare.`,
    not `▁gare` + `.`, and `l'hôpital` holds no `▁hôpital`. A form is the phrase (its first letter in
    either case) with nothing, or with an elision the vocabulary holds (`l'`, `qu'`), before it, and
    nothing, or punctuation the vocabulary holds after a word (`.`, `?`), after it: each tokenized as the
    whole piece. `ending` finds the forms by their last subword; `closed` ones end at a word end (with
    their punctuation), the others end where the next subword decides (one that glues on makes a longer
    word). `closed_after` finds the closed forms by the subword before their last (None: one-subword forms),
    so that a search can rule out the last subword of each form a hypothesis is one subword from."""

    ending: dict[int, tuple[tuple[Ids, bool], ...]] = field(default_factory=dict)
    closed_after: dict[int | None, tuple[Ids, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Phrases:
    """The phrases of one sentence, as target ids: each output must contain every one of `constraints` and
    none of `avoid` (as whole words). Both hold each phrase as written alone (what a search writes to meet
    a constraint); their `Forms` are what meets or breaks them."""

    constraints: tuple[Ids, ...] = ()
    avoid: tuple[Ids, ...] = ()
    # Subwords that would glue onto the word before them (no word start, a letter or digit first): never
    # right after a constraint, which would else end inside a longer word ("voulais" + "ais"); and
    # the only ones allowed right after an avoided phrase, which is then no longer a whole word.
    glued: frozenset[int] = frozenset()
    constraint_forms: tuple[Forms, ...] = field(default=(), compare=False)
    avoid_forms: tuple[Forms, ...] = field(default=(), compare=False)
    # The avoided phrases as whole words in any case (data.text.whole_words), and each target id's text: the
    # last check of a hypothesis, which no spelling in subwords escapes (Forms are the spellings BPE gives a
    # piece; a model may still write `▁chan` + `ter.`).
    avoid_text: re.Pattern | None = field(default=None, compare=False)
    pieces: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def writes_avoided(self, text: str) -> bool:
        """Whether `text` (an output's text so far, with what follows it: a space for EOS, else a word
        character, since the next subword may still continue the last word) holds an avoided phrase as whole
        words."""
        return self.avoid_text is not None and self.avoid_text.search(text) is not None

    def __post_init__(self) -> None:  # a phrase with no forms given has its own ids as its one form
        if len(self.constraint_forms) != len(self.constraints):
            object.__setattr__(self, "constraint_forms", tuple(_own_form(ids) for ids in self.constraints))
        if len(self.avoid_forms) != len(self.avoid):
            object.__setattr__(self, "avoid_forms", tuple(_own_form(ids) for ids in self.avoid))

    @property
    def tokens(self) -> int:
        return sum(len(phrase) for phrase in self.constraints)

    @property
    def empty(self) -> bool:
        return not self.constraints and not self.avoid


@dataclass(frozen=True)
class Progress:
    """How far one hypothesis is through its sentence's constraints: a bit per phrase met, the phrase
    it is in the middle of (-1: none) with the tokens of it written so far, and the phrase its last token
    completed (-1: none)."""

    met: int = 0
    current: int = -1
    position: int = 0
    just_met: int = -1

    @property
    def completed(self) -> bool:
        """The last token ended a constraint: a glued subword now would end it inside a longer word."""
        return self.just_met >= 0

    def advance(self, token: int, phrases: Phrases, history: Sequence[int]) -> "Progress":
        """The progress after writing `token` after `history` (the tokens so far). A phrase begun and then
        left loses its progress (Post & Vilar, Section 3): it must be written whole, in one piece. A phrase
        is also met by any of its forms (Forms: `gare.` as one subword). A glued subword right after an
        open form takes the phrase back (it was not a whole word): the search never writes one there, but a
        forced prefix may."""
        constraints = phrases.constraints
        if self.completed and token in phrases.glued:
            return Progress(self.met & ~(1 << self.just_met))
        for j, forms in enumerate(phrases.constraint_forms):
            if self.met >> j & 1:
                continue
            for form, closed in forms.ending.get(token, ()):
                if ends_with(history, form[:-1]):
                    return Progress(self.met | 1 << j, just_met=-1 if closed else j)
        if self.current >= 0:
            phrase = constraints[self.current]
            if phrase[self.position] == token:
                if self.position + 1 == len(phrase):
                    return Progress(self.met | 1 << self.current, just_met=self.current)
                return Progress(self.met, self.current, self.position + 1)
        for j, phrase in enumerate(constraints):
            if not self.met >> j & 1 and phrase[0] == token:
                return (Progress(self.met | 1 << j, just_met=j) if len(phrase) == 1 else
                        Progress(self.met, j, 1))
        return Progress(self.met) if self.current >= 0 or self.completed else self

    def met_tokens(self, constraints: tuple[Ids, ...]) -> int:
        """The bank: tokens of constraints written (whole phrases met, and the one under way)."""
        return sum(len(p) for j, p in enumerate(constraints) if self.met >> j & 1) + self.position

    def met_count(self) -> int:
        """Whole constraints met."""
        return bin(self.met).count("1")

    def all_met(self, constraints: tuple[Ids, ...]) -> bool:
        return self.met == (1 << len(constraints)) - 1

    def next_tokens(self, constraints: tuple[Ids, ...]) -> list[int]:
        """The tokens that advance a constraint: the next of the one under way, or the first of each
        phrase not yet met."""
        if self.current >= 0:
            return [constraints[self.current][self.position]]
        return list(dict.fromkeys(p[0] for j, p in enumerate(constraints) if not self.met >> j & 1))


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
    if not _has_vocabulary(tokenizers):  # a stand-in without a subword vocabulary
        return frozenset()
    return frozenset(i for token, i in tokenizers.target.get_vocab().items() if token and not token.startswith("\u2581")
                     and token[0].isalnum())


def ends_with(tokens: Sequence[int], phrase: Sequence[int]) -> bool:
    n = len(phrase)
    return len(tokens) >= n and (n == 0 or tuple(tokens[len(tokens) - n:]) == tuple(phrase))


def _own_form(ids: Ids) -> Forms:
    """A phrase whose only form is its own ids, open (a stand-in tokenizer's, or a test's)."""
    return Forms({ids[-1]: ((ids, False),)}, {})


@dataclass(frozen=True)
class Affixes:
    """What the target vocabulary attaches to words: elisions before (`l'`, `qu'`: a few letters and an
    apostrophe, then a letter), each with the letters it is seen before, and punctuation after (`.`, `?`:
    a letter, then non-word characters), read from its subwords, so that no language's list is written
    here and a phrase gets only the elisions its first letter is seen after (`l'hôpital`, not `l'gare`)."""

    before: dict[str, frozenset[str]] = field(default_factory=dict)
    after: tuple[str, ...] = ()


_ELISION = re.compile(r"^\u2581?(\w{1,4}['’])(\w)")
_TRAILING = re.compile(r"\w(\W+)$")


def _has_vocabulary(tokenizers: Tokenizers) -> bool:
    return getattr(getattr(tokenizers, "target", None), "get_vocab", None) is not None


def vocabulary_affixes(tokenizers: Tokenizers) -> Affixes:
    if not _has_vocabulary(tokenizers):  # a stand-in without a subword vocabulary
        return Affixes()
    before: dict[str, set[str]] = {}
    after = set()
    for token in tokenizers.target.get_vocab():
        if match := _ELISION.match(token):
            before.setdefault(match[1], set()).add(match[2].lower())
        if match := _TRAILING.search(token.replace("\u2581", " ")):
            if " " not in match[1]:
                after.add(match[1])
    return Affixes({lead: frozenset(letters) for lead, letters in sorted(before.items())}, tuple(sorted(after)))


def phrase_forms(tokenizers: Tokenizers, text: str, canonical: Ids, affixes: Affixes) -> Forms:
    """The Forms of `text` (cleaned), whose ids alone are `canonical`."""
    text = clean_text(text)
    firsts = dict.fromkeys([text, text[:1].swapcase() + text[1:]])
    leads = [lead for lead, letters in affixes.before.items() if text[:1].lower() in letters]
    pieces = [(before + word + after, bool(after)) for word in firsts for before in ("", *leads)
              for after in ("", *affixes.after)]
    encoded = tokenizers.encode_target([piece for piece, _ in pieces])
    ending: dict[int, dict[Ids, bool]] = {canonical[-1]: {canonical: False}}
    closed_after: dict[int | None, dict[Ids, None]] = {}
    for ids, (_, closed) in zip(encoded, pieces):
        ids = tuple(ids)
        if not ids or UNK_ID in ids:
            continue
        ending.setdefault(ids[-1], {}).setdefault(ids, closed)
        if closed:
            closed_after.setdefault(ids[-2] if len(ids) > 1 else None, {})[ids] = None
    return Forms({token: tuple(forms.items()) for token, forms in ending.items()},
                 {token: tuple(forms) for token, forms in closed_after.items()})


def target_pieces(tokenizers: Tokenizers) -> tuple[str, ...]:
    """Each target id's text as it reads inside an output (its word-start mark a space; specials empty)."""
    vocab = tokenizers.target.get_vocab()
    pieces = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        if i > EOS_ID:
            pieces[i] = token.replace("\u2581", " ")
    return tuple(pieces)


@dataclass(frozen=True)
class TargetVocabulary:
    """What phrases read of the target vocabulary: its glued subwords, its affixes and each id's text."""

    glued: frozenset[int] = frozenset()
    affixes: Affixes = Affixes()
    pieces: tuple[str, ...] = ()


# Read once per tokenizer (a vocabulary scan costs tens of milliseconds, a request's whole budget on the
# server); weak keys, so an unloaded tokenizer takes its entry with it.
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def target_vocabulary(tokenizers: Tokenizers) -> TargetVocabulary:
    if not _has_vocabulary(tokenizers):  # a stand-in without a subword vocabulary
        return TargetVocabulary()
    found = _VOCABULARIES.get(tokenizers.target)
    if found is None:
        found = TargetVocabulary(glued_subwords(tokenizers), vocabulary_affixes(tokenizers), target_pieces(tokenizers))
        _VOCABULARIES[tokenizers.target] = found
    return found


def whole_word_at(ids: Sequence[int], phrase: Ids, glued: frozenset[int]) -> int | None:
    """Where in `ids` `phrase` first stands as whole words (not followed by a glued subword), or None."""
    n = len(phrase)
    for start in range(len(ids) - n + 1):
        if tuple(ids[start: start + n]) == phrase and (start + n == len(ids) or ids[start + n] not in glued):
            return start
    return None


def constraints_once(constraints: Sequence[Ids], glued: frozenset[int]) -> tuple[Ids, ...]:
    """The constraints without repeats, and without a phrase that stands as whole words inside another
    (writing the longer one meets it; `gare` in `gares du Nord` does not), in their first order. Without
    this, `gare` required twice (a flag and a glossary) or beside `la gare` made the search write it twice."""
    unique = list(dict.fromkeys(constraints))
    return tuple(p for p in unique
                 if not any(q != p and len(q) > len(p) and whole_word_at(q, p, glued) is not None for q in unique))


@dataclass(frozen=True)
class Named:
    """A phrase as the user gave it, with its ids."""

    text: str
    ids: Ids


def sentence_phrases(tokenizers: Tokenizers, decode: DecodeOptions, count: int, limits: Sequence[int | None],
                     text_constraints: Sequence[Sequence[str]] | None, prefixes: Sequence[Sequence[int]] | None,
                     prefix_texts: Sequence[str] | None = None, hard_cap: int | None = None) -> list[Phrases]:
    """For each of `count` texts, its Phrases: the options' constraints and avoided phrases with the text's
    own `text_constraints` (None: none), as target ids. `limits`: each text's output length (None: a blank text,
    not searched); `prefixes`: each text's forced target ids (None: none). A PhraseError, naming the text's
    index where the text is to blame, when no output could hold to them: an avoided phrase inside a
    constraint or inside the prefix, or constraints that with the prefix need more subwords than the
    output may have. `hard_cap`: the most subwords the model writes at all (its max_len - 1), which no
    option raises (None: the `limits` alone)."""
    vocabulary = target_vocabulary(tokenizers)
    glued, affixes = vocabulary.glued, vocabulary.affixes
    shared = [Named(p, phrase_ids(tokenizers, p, "constraints")) for p in decode.constraints]
    avoid = [Named(p, phrase_ids(tokenizers, p, "avoid")) for p in decode.avoid]
    forms: dict[Ids, Forms] = {}  # by a phrase's ids: each phrase's forms are tokenized once

    subwords = _has_vocabulary(tokenizers)  # else a stand-in (the tests' word-level tokenizers): no forms

    def forms_of(named: Sequence[Named], ids: Ids) -> Forms:
        if ids not in forms:
            forms[ids] = phrase_forms(tokenizers, next(n.text for n in named if n.ids == ids), ids, affixes) \
                if subwords else _own_form(ids)
        return forms[ids]

    avoid_forms = tuple(forms_of(avoid, n.ids) for n in avoid)
    avoid_text, pieces = None, ()
    if avoid and subwords:
        avoid_text = whole_words([n.text for n in avoid])
        pieces = vocabulary.pieces
    result = []
    for i in range(count):
        own = [] if text_constraints is None else [Named(p, phrase_ids(tokenizers, p, "text_constraints", i))
                                                   for p in text_constraints[i]]
        # The options' own constraints were checked against the avoided phrases as the options were made.
        check_not_avoided([n.text for n in own], decode.avoid, "text_constraints", index=i)
        prefix = () if prefixes is None else tuple(prefixes[i])
        if prefix and prefix_texts and limits[i] is not None:  # a blank text is not searched: nor its prefix
            _refuse_avoided_in_prefix(prefix_texts[i], avoid, i)
        constraints = constraints_once([n.ids for n in shared + own], glued)
        phrases = Phrases(constraints, tuple(n.ids for n in avoid), glued,
                          tuple(forms_of(shared + own, ids) for ids in constraints), avoid_forms, avoid_text, pieces)
        if limits[i] is not None and phrases.constraints:
            _refuse_what_cannot_fit(phrases, prefix, limits[i], hard_cap, "text_constraints" if own else "constraints",
                                    i)
        result.append(phrases)
    return result


def _refuse_avoided_in_prefix(text: str, avoid: list[Named], i: int) -> None:
    """A prefix's last word may still grow into a longer one: only an avoided phrase followed by more of the
    prefix is refused."""
    for avoided in avoid:
        match = whole_words([avoided.text]).search(clean_text(text))
        if match and match.end() < len(clean_text(text)):
            raise PhraseError("avoid", f"{avoided.text!r} is in the target prefix {text!r}, which every output "
                                       "starts with", i)


def _refuse_what_cannot_fit(phrases: Phrases, prefix: Ids, limit: int, hard_cap: int | None, option_name: str,
                            i: int) -> None:
    """The prefix's tokens count towards the phrases, as in the search: what the prefix leaves unwritten
    must fit after it. Raising max_length_b is advised only where it can help: up to `hard_cap`, the model's
    own limit, which nothing raises."""
    progress = Progress()
    for at, token in enumerate(prefix):
        progress = progress.advance(token, phrases, prefix[:at])
    unwritten = phrases.tokens - progress.met_tokens(phrases.constraints)
    need = len(prefix) + unwritten
    if need <= limit:
        return
    after = f" after the {len(prefix)} of the target prefix" if prefix else ""
    if hard_cap is not None and need > hard_cap:
        raise PhraseError(option_name, f"need {unwritten} subwords{after}, more than the {hard_cap} the model "
                                       f"writes in any output (its max_len, {hard_cap + 1}, counts the start token)", i)
    raise PhraseError(option_name, f"need {unwritten} subwords{after}, more than the {limit} an output of this "
                                   "source may have", i, remedy=f"({option('max_length_b')} raises it)")


def met_phrases(output: str, phrases: Sequence[str]) -> list[bool]:
    """Whether each phrase (as given: repeats and phrases inside others included) stands as whole words in
    the `output` text, its first letter in either case: the rule the search holds to (Forms)."""
    text = clean_text(output)
    return [whole_words([phrase], any_case=False).search(text) is not None for phrase in phrases]


__all__ = ["PhraseError", "Forms", "Phrases", "Progress", "Affixes", "vocabulary_affixes", "phrase_forms", "ends_with",
           "target_pieces", "TargetVocabulary", "target_vocabulary", "phrase_ids", "glued_subwords", "whole_word_at",
           "constraints_once", "sentence_phrases", "met_phrases"]
