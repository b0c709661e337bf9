"""A phrase as BPE may write it: its forms (every way an output may write one phrase as subwords, with the
elisions and punctuation the target vocabulary attaches to words) and what phrases read of the target
vocabulary once (its glued subwords, its affixes, each id's text). No torch here; what a search holds to and
how far a hypothesis is through it are phrases.py's.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformer.data.text import clean_text
from transformer.data.tokenizer import EOS_ID, UNK_ID, Tokenizers

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


def glued_subwords(tokenizers: Tokenizers) -> frozenset[int]:
    """The target subwords that continue the word before them: no word-start mark, a letter or digit first
    (punctuation, which Metaspace also leaves unmarked, ends a word rather than continuing it)."""
    if not has_vocabulary(tokenizers):  # a stand-in without a subword vocabulary
        return frozenset()
    return frozenset(i for token, i in tokenizers.target.get_vocab().items() if token and not token.startswith("\u2581")
                     and token[0].isalnum())


def own_form(ids: Ids) -> Forms:
    """A phrase whose only form is its own ids, open (a stand-in tokenizer's, or a test's)."""
    return Forms({ids[-1]: ((ids, False),)}, {})


def merged_forms(forms: Sequence[Forms]) -> Forms:
    """The forms of a constraint's alternatives as the constraint's: any one of them meets it."""
    if len(forms) == 1:
        return forms[0]
    ending: dict[int, dict[Ids, bool]] = {}
    closed_after: dict[int | None, dict[Ids, None]] = {}
    for each in forms:
        for token, found in each.ending.items():
            for ids, closed in found:
                ending.setdefault(token, {}).setdefault(ids, closed)
        for token, closed_forms in each.closed_after.items():
            closed_after.setdefault(token, {}).update(dict.fromkeys(closed_forms))
    return Forms({token: tuple(found.items()) for token, found in ending.items()},
                 {token: tuple(found) for token, found in closed_after.items()})


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


def has_vocabulary(tokenizers: Tokenizers) -> bool:
    return getattr(getattr(tokenizers, "target", None), "get_vocab", None) is not None


def vocabulary_affixes(tokenizers: Tokenizers) -> Affixes:
    if not has_vocabulary(tokenizers):  # a stand-in without a subword vocabulary
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
    if not has_vocabulary(tokenizers):  # a stand-in without a subword vocabulary
        return TargetVocabulary()
    found = _VOCABULARIES.get(tokenizers.target)
    if found is None:
        found = TargetVocabulary(glued_subwords(tokenizers), vocabulary_affixes(tokenizers), target_pieces(tokenizers))
        _VOCABULARIES[tokenizers.target] = found
    return found


__all__ = ["Ids", "Forms", "glued_subwords", "own_form", "merged_forms", "has_vocabulary", "Affixes",
           "vocabulary_affixes",
           "phrase_forms", "target_pieces", "TargetVocabulary", "target_vocabulary"]
