"""Terminology as target ids: the phrases a sentence's outputs must contain or must not, read from text
the way they appear inside a sentence, checked against each other, the sentence's prefix and its output
length, and the progress a hypothesis makes through them, which constrained search (constrained.py) and
these checks share. No torch here: the text path (texts.py) builds a sentence's `Phrases` before any
search.

Phrases are whole words: a constraint (a phrase every output contains) is met by any of its forms (`gare`,
`▁gare.`, `Gare`) that no subword glued onto it makes a longer word, and an avoided phrase is kept out where
it stands as whole words (`gare`, `gare.`), not where it begins a longer word (`gares`). A constraint may
accept alternatives (`nez qui coule|nez coule-t-il`, decoding.alternatives_of): any one of them, written whole,
meets it, and it counts once. Constraints are deduplicated by their alternatives, and one that another implies
is dropped (`gare` beside `la gare`: writing the longer one meets both).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformer.data.text import clean_text, whole_words
from transformer.data.tokenizer import UNK_ID, Tokenizers
from transformer.decoding import DecodeOptions, PhraseError, alternatives_of, check_alternatives, check_not_avoided
from transformer.errors import option
from transformer.translation.forms import (Forms, Ids, has_vocabulary, merged_forms, own_form, phrase_forms,
                                           target_vocabulary)

Alternatives = tuple[Ids, ...]  # the subword sequences any one of which, written whole, meets one constraint


@dataclass(frozen=True)
class Phrases:
    """The phrases of one sentence, as target ids: each output must contain every one of `constraints` (one
    of its `alternatives`) and none of `avoid` (as whole words). Both hold each phrase as written alone (what
    a search writes to meet a constraint); their `Forms` are what meets or breaks them."""

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
    # Each constraint's accepted alternatives as written alone, `constraints[j]` first (constraints[j] names
    # constraint j); each constraint alone by default. `shortest`: the subwords of each one's shortest, the
    # fewest that meet it, which the bank and the length checks count.
    alternatives: tuple[Alternatives, ...] = ()
    shortest: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)

    def writes_avoided(self, text: str) -> bool:
        """Whether `text` (an output's text so far, with what follows it: a space for EOS, else a word
        character, since the next subword may still continue the last word) holds an avoided phrase as whole
        words."""
        return self.avoid_text is not None and self.avoid_text.search(text) is not None

    def __post_init__(self) -> None:  # a phrase with no forms given has its own ids as its one form
        if not self.alternatives:
            object.__setattr__(self, "alternatives", tuple((ids,) for ids in self.constraints))
        if [alternatives[0] for alternatives in self.alternatives] != list(self.constraints):
            raise ValueError("each constraint's alternatives start with the constraint")  # a caller's bug
        object.__setattr__(self, "shortest", tuple(min(map(len, options)) for options in self.alternatives))
        if len(self.constraint_forms) != len(self.constraints):
            object.__setattr__(self, "constraint_forms", tuple(merged_forms([own_form(ids) for ids in options])
                                                               for options in self.alternatives))
        if len(self.avoid_forms) != len(self.avoid):
            object.__setattr__(self, "avoid_forms", tuple(own_form(ids) for ids in self.avoid))

    @property
    def tokens(self) -> int:
        """The fewest subwords that meet every constraint: each one's shortest alternative."""
        return sum(self.shortest)

    @property
    def empty(self) -> bool:
        return not self.constraints and not self.avoid


@dataclass(frozen=True)
class Progress:
    """How far one hypothesis is through its sentence's constraints: a bit per phrase met, the phrase it is
    in the middle of (-1: none) with the tokens of it written so far and, as a bit per alternative, those of
    its alternatives they begin (all begun at one subword), and the phrase its last token completed (-1:
    none). A phrase completed by one alternative may stay `current` while a longer one that continues its
    last word (`symptôme|symptômes`) may still be written."""

    met: int = 0
    current: int = -1
    position: int = 0
    just_met: int = -1
    alive: int = 0

    @property
    def completed(self) -> bool:
        """The last token ended a constraint: a glued subword now would end it inside a longer word."""
        return self.just_met >= 0

    def advance(self, token: int, phrases: Phrases, history: Sequence[int]) -> "Progress":
        """The progress after writing `token` after `history` (the tokens so far). A phrase begun and then
        left loses its progress (Post & Vilar, Section 3): it must be written whole, in one piece. A phrase
        is also met by any of its forms (Forms: `gare.` as one subword). A glued subword right after an
        open form takes the phrase back (it was not a whole word), unless it goes on with a longer
        alternative: the search writes one there only so, but a forced prefix may."""
        met = self.met
        if self.completed and token in phrases.glued:
            met &= ~(1 << self.just_met)
        alive, complete = self._continued(token, phrases)
        for j, forms in enumerate(phrases.constraint_forms):
            if met >> j & 1:
                continue
            for form, closed in forms.ending.get(token, ()):
                if ends_with(history, form[:-1]):
                    if closed:
                        return Progress(met | 1 << j)
                    # Met; a longer alternative that goes on from here stays under way (`symptôme|symptômes`).
                    going, at = (alive, self.position + 1) if j == self.current else (_started(phrases, j, token)[0], 1)
                    return Progress(met | 1 << j, j if going else -1, at if going else 0, j, going)
        if alive or complete:
            j = self.current
            return Progress(met | (1 << j if complete else 0), j if alive else -1, self.position + 1 if alive else 0,
                            j if complete else -1, alive)
        for j in range(len(phrases.alternatives)):
            if met >> j & 1:
                continue
            started, complete = _started(phrases, j, token)
            if started or complete:
                return Progress(met | (1 << j if complete else 0), j if started else -1, 1 if started else 0,
                                j if complete else -1, started)
        return Progress(met) if self.current >= 0 or self.completed else self

    def _continued(self, token: int, phrases: Phrases) -> tuple[int, bool]:
        """The alternatives of the phrase under way that `token` continues beyond it (bits), and whether it
        completes one."""
        if self.current < 0:
            return 0, False
        alive, complete = 0, False
        for a, alternative in enumerate(phrases.alternatives[self.current]):
            if self.alive >> a & 1 and alternative[self.position] == token:
                if len(alternative) == self.position + 1:
                    complete = True
                else:
                    alive |= 1 << a
        return alive, complete

    def _under_way(self, phrases: Phrases) -> list[Ids]:
        """The alternatives of the unmet phrase under way that the tokens so far begin ([] for none)."""
        if self.current < 0 or self.met >> self.current & 1:
            return []
        return [options for a, options in enumerate(phrases.alternatives[self.current]) if self.alive >> a & 1]

    def met_tokens(self, phrases: Phrases) -> int:
        """The bank: the subwords of the constraints met (each its shortest alternative's, whichever was
        written: a constraint counts once) and of the one under way (fewer than its shortest's)."""
        written = sum(n for j, n in enumerate(phrases.shortest) if self.met >> j & 1)
        if self._under_way(phrases):
            written += min(self.position, phrases.shortest[self.current] - 1)
        return written

    def unwritten(self, phrases: Phrases) -> int:
        """The fewest subwords still to write to meet every constraint."""
        left = sum(n for j, n in enumerate(phrases.shortest) if not self.met >> j & 1)
        under_way = self._under_way(phrases)
        if under_way:
            left += min(map(len, under_way)) - self.position - phrases.shortest[self.current]
        return left

    def met_count(self) -> int:
        """Whole constraints met."""
        return bin(self.met).count("1")

    def all_met(self, phrases: Phrases) -> bool:
        return self.met == (1 << len(phrases.alternatives)) - 1

    def next_tokens(self, phrases: Phrases, fewest: bool = False) -> list[int]:
        """The tokens that advance a constraint: the next of the alternatives under way, or the first of each
        alternative of each phrase not yet met. `fewest`: only those that keep to `unwritten`, the fewest
        subwords that meet every constraint (an alternative no longer than its phrase's shortest)."""
        under_way = self._under_way(phrases)
        if under_way:
            least = min(map(len, under_way))
            return list(dict.fromkeys(ids[self.position] for ids in under_way if not fewest or len(ids) == least))
        return list(dict.fromkeys(ids[0] for j, options in enumerate(phrases.alternatives) if not self.met >> j & 1
                                  for ids in options if not fewest or len(ids) == phrases.shortest[j]))

    def continuing(self, phrases: Phrases) -> list[int]:
        """Where the last token completed a phrase whose longer alternative may go on with a glued subword
        (`symptôme` + `s` of `symptôme|symptômes`), those subwords, which the rule against gluing onto a
        phrase just completed lets through."""
        if not self.completed or self.current != self.just_met:
            return []
        return list(dict.fromkeys(ids[self.position] for a, ids in enumerate(phrases.alternatives[self.current])
                                  if self.alive >> a & 1))


def _started(phrases: Phrases, j: int, token: int) -> tuple[int, bool]:
    """The alternatives of constraint `j` that `token` begins and that go on beyond it (bits), and whether it
    is one of them whole."""
    started, complete = 0, False
    for a, alternative in enumerate(phrases.alternatives[j]):
        if alternative[0] == token:
            if len(alternative) == 1:
                complete = True
            else:
                started |= 1 << a
    return started, complete


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


def ends_with(tokens: Sequence[int], phrase: Sequence[int]) -> bool:
    n = len(phrase)
    return len(tokens) >= n and (n == 0 or tuple(tokens[len(tokens) - n:]) == tuple(phrase))


def whole_word_at(ids: Sequence[int], phrase: Ids, glued: frozenset[int]) -> int | None:
    """Where in `ids` `phrase` first stands as whole words (not followed by a glued subword), or None."""
    n = len(phrase)
    for start in range(len(ids) - n + 1):
        if tuple(ids[start: start + n]) == phrase and (start + n == len(ids) or ids[start + n] not in glued):
            return start
    return None


def constraints_once(constraints: Sequence[Alternatives], glued: frozenset[int]) -> tuple[Alternatives, ...]:
    """The constraints (each its alternatives) without repeats, and without one that another implies, in their
    first order. One implies another when each of its alternatives writes one of the other's as whole words
    (`la gare` implies `gare`; `gares du Nord` does not): writing it meets both. Without this, `gare` required
    twice (a flag and a glossary) or beside `la gare` made the search write it twice. Within a constraint, an
    alternative that writes another as whole words accepts nothing more (`nez|nez qui coule` is `nez`)."""
    def writes(longer: Ids, shorter: Ids) -> bool:
        return longer == shorter or whole_word_at(longer, shorter, glued) is not None

    reduced: dict[frozenset[Ids], Alternatives] = {}  # by their alternatives: a repeat in another order is one
    for options in constraints:
        unique = list(dict.fromkeys(options))
        kept = tuple(a for a in unique if not any(b != a and writes(a, b) for b in unique))
        reduced.setdefault(frozenset(kept), kept)
    found = list(reduced.values())
    return tuple(p for p in found if not any(q is not p and all(any(writes(a, b) for b in p) for a in q)
                                             for q in found))


@dataclass(frozen=True)
class Named:
    """A phrase (or one alternative of one) as the user gave it, with its ids."""

    text: str
    ids: Ids


def _alternatives(tokenizers: Tokenizers, phrase: str, name: str, index: int | None = None) -> tuple[Named, ...]:
    return tuple(Named(text, phrase_ids(tokenizers, text, name, index)) for text in alternatives_of(phrase))


def sentence_phrases(tokenizers: Tokenizers, decode: DecodeOptions, count: int, limits: Sequence[int | None],
                     text_constraints: Sequence[Sequence[str]] | None, prefixes: Sequence[Sequence[int]] | None,
                     prefix_texts: Sequence[str] | None = None, hard_cap: int | None = None) -> list[Phrases]:
    """For each of `count` texts, its Phrases: the options' constraints and avoided phrases with the text's
    own `text_constraints` (None: none), as target ids; a phrase's alternatives (decoding.alternatives_of) are
    one constraint, and an avoided phrase's are each avoided. `limits`: each text's output length (None: a
    blank text, not searched); `prefixes`: each text's forced target ids (None: none). A PhraseError, naming
    the text's index where the text is to blame, when no output could hold to them: a blank alternative, an
    avoided phrase inside a constraint or inside the prefix, or constraints that with the prefix need more
    subwords than the output may have (each its shortest alternative). `hard_cap`: the most subwords the model
    writes at all (its max_len - 1), which no option raises (None: the `limits` alone)."""
    vocabulary = target_vocabulary(tokenizers)
    glued, affixes = vocabulary.glued, vocabulary.affixes
    shared = [_alternatives(tokenizers, p, "constraints") for p in decode.constraints]
    avoid = [n for p in decode.avoid for n in _alternatives(tokenizers, p, "avoid")]
    texts = {n.ids: n.text for n in [*avoid, *(n for options in shared for n in options)]}
    forms: dict[Ids, Forms] = {}  # by a phrase's ids: each phrase's forms are tokenized once

    subwords = has_vocabulary(tokenizers)  # else a stand-in (the tests' word-level tokenizers): no forms

    def forms_of(ids: Ids) -> Forms:
        if ids not in forms:
            forms[ids] = phrase_forms(tokenizers, texts[ids], ids, affixes) if subwords else own_form(ids)
        return forms[ids]

    avoid_forms = tuple(forms_of(n.ids) for n in avoid)
    avoid_text, pieces = None, ()
    if avoid and subwords:
        avoid_text = whole_words([n.text for n in avoid])
        pieces = vocabulary.pieces
    result = []
    for i in range(count):
        given = [] if text_constraints is None else list(text_constraints[i])
        # The options' own constraints were checked as the options were made.
        for phrase in given:
            check_alternatives(phrase, "text_constraints", index=i)
        check_not_avoided(given, decode.avoid, "text_constraints", index=i)
        own = [_alternatives(tokenizers, p, "text_constraints", i) for p in given]
        for options in own:
            for n in options:
                texts.setdefault(n.ids, n.text)
        prefix = () if prefixes is None else tuple(prefixes[i])
        if prefix and prefix_texts and limits[i] is not None:  # a blank text is not searched: nor its prefix
            _refuse_avoided_in_prefix(prefix_texts[i], avoid, i)
        constraints = constraints_once([tuple(n.ids for n in options) for options in shared + own], glued)
        phrases = Phrases(tuple(options[0] for options in constraints), tuple(n.ids for n in avoid), glued,
                          tuple(merged_forms([forms_of(ids) for ids in options]) for options in constraints),
                          avoid_forms, avoid_text, pieces, constraints)
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
    unwritten = progress.unwritten(phrases)
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
    """Whether each phrase (as given: repeats and phrases inside others included), one of its alternatives,
    stands as whole words in the `output` text, its first letter in either case: the rule the search holds
    to (Forms)."""
    text = clean_text(output)
    return [whole_words([a for a in alternatives_of(phrase) if clean_text(a)], any_case=False).search(text)
            is not None for phrase in phrases]


__all__ = ["PhraseError", "Phrases", "Progress", "Alternatives", "ends_with", "phrase_ids", "whole_word_at",
           "constraints_once", "sentence_phrases", "met_phrases"]
