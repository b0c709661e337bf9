"""What a translation may ask of its search, checked once, here: `DecodeOptions`, the one typed object
(beam size, n-best, length penalty, output length, batch size, `Sampling`'s settings and the phrases a
search holds to) with every range the engines compute in `RANGES`, the one check of phrases
(`check_phrases`, `check_not_avoided`), the output-length rule every engine applies
(`RunDecodeSettings.max_output_length`), and `STRATEGIES`, the decoding methods (greedy, beam, sampling,
constrained): when each is chosen, what it reads and excludes, and which engines run it. A run's decode
settings (`RunDecodeSettings`; config.DecodeConfig is them read from YAML), translate.py's flags and the
API's requests all build these objects, and a refusal is a DecodeOptionError that marks the option's
generic name (errors.option) for each face to call by its own: a YAML key, a flag, a JSON field. What
counts as an integer or a number in range is values.py's, as for the config; what a whole word is,
data/text.py's. No torch here; it imports only errors.py, values.py and data/text.py, so that config/
can build on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformer.data.text import clean_text, whole_words
from transformer.errors import DecodeOptionError, UserError, marked_options, name_options, option
from transformer.values import INT64_MAX, check_fields, integer, number, within

# The widest beam, and the most candidates (n-best, or samples) of one text: memory grows with it, and
# wider beams do not translate better.
MAX_BEAM = 128
# GNMT alpha: ((5 + length) / 6) ** alpha must stay finite in float32 (the torch engine's stopping bound)
# for any output length a model's position table allows; usual values lie between 0.6 and 2.
MAX_LENGTH_PENALTY = 10.0
# logits / temperature must stay finite and nonzero in float32 in both engines; near 0 it is greedy search.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e30
MAX_SEED = 2**32 - 1  # CTranslate2's random generator takes an unsigned 32-bit seed
# The most constraints, and the most avoided phrases, one text may have: every constraint adds a bank
# of beams per step, and the search keeps one state per beam and phrase (translation/constrained.py).
MAX_PHRASES = 16
# The most alternatives one phrase may accept (`nez qui coule|nez coule-t-il`): each is tokenized with its forms
# and proposed to every beam each step.
MAX_ALTERNATIVES = 8


@dataclass(frozen=True)
class Range:
    """The values an option may take: integers (not bools) or finite numbers from `low` to `high`
    (`low` excluded when `low_open`); `expected` ends the refusal "... must be <expected>, got X"."""

    kind: type  # int or float
    low: float
    high: float
    expected: str
    low_open: bool = False
    not_above_zero: str = ""  # said after a value <= 0, for a range that starts just above it


# The one statement of each decode option's range.
RANGES: dict[str, Range] = {
    "beam_size": Range(int, 1, MAX_BEAM, f"from 1 to {MAX_BEAM}"),
    "length_penalty": Range(float, 0.0, MAX_LENGTH_PENALTY, f"from 0 to {MAX_LENGTH_PENALTY:g}"),
    "max_length_a": Range(float, 0.0, math.inf, "a finite number, 0 or more"),
    "max_length_b": Range(int, 1, INT64_MAX, "1 or more"),
    "batch_size": Range(int, 1, INT64_MAX, "1 or more"),
    "n_best": Range(int, 1, MAX_BEAM, f"from 1 to {MAX_BEAM}"),
    "top_k": Range(int, 0, INT64_MAX, "0 (every token) or more"),
    "top_p": Range(float, 0.0, 1.0, "above 0 and at most 1", low_open=True),
    "temperature": Range(float, MIN_TEMPERATURE, MAX_TEMPERATURE, f"from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}",
                         not_above_zero="a temperature near 0 is greedy search"),
    "seed": Range(int, 0, MAX_SEED, f"from 0 to {MAX_SEED}"),
}


def check_option(name: str, value: Any) -> int | float:
    """`value` of option `name` as its kind (an integer given for a number becomes a float), or a
    DecodeOptionError naming the option: the one check of every decode value (values.py's, worded here)."""
    rule = RANGES[name]
    if rule.kind is int:
        checked = integer(value)
        if checked is None or not within(checked, rule.low, rule.high):
            raise DecodeOptionError(name, f"must be {rule.expected}, got {value!r}")
        return checked
    checked = number(value)
    if checked is None:
        raise DecodeOptionError(name, f"must be a number, got {value!r}")
    if rule.not_above_zero and checked <= 0:
        raise DecodeOptionError(name, f"must be above 0, got {value!r} ({rule.not_above_zero})")
    if not (within(checked, rule.low, rule.high, rule.low_open) and math.isfinite(checked)):
        raise DecodeOptionError(name, f"must be {rule.expected}, got {value!r}")
    return checked


def _check_fields(options: Any) -> None:
    """Check every field of `options` that RANGES names, in field order, keeping the checked value."""
    check_fields(options, lambda item, value: check_option(item.name, value) if item.name in RANGES else value)


@dataclass(frozen=True)
class Sampling:
    """Random sampling instead of search: each next token drawn from softmax(logits / temperature),
    among the `top_k` most probable (0 = all), then the fewest most probable whose probabilities sum
    to at least `top_p`; `seed` makes the draws reproducible. n-best means that many independent samples."""

    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class RunDecodeSettings:
    """How a run translates by default: what its config's decode section holds (config.DecodeConfig is these
    settings read from YAML), and what each translation's DecodeOptions start from."""

    beam_size: int = 5  # 1 = greedy search
    length_penalty: float = 1.0  # GNMT alpha: score / ((5 + length) / 6) ** alpha; 0 = none
    max_length_a: float = 1.5  # longest output = a * source_length + b tokens
    max_length_b: int = 10
    batch_size: int = 64  # sentences decoded together

    def __post_init__(self) -> None:
        _check_fields(self)

    def max_output_length(self, source_length: int, max_len: int) -> int:
        """The output-length rule every engine and check applies: the most subwords (EOS not counted) an
        output of a source of `source_length` subwords (without EOS) may have, by a model whose position
        table holds `max_len` positions (max_output_length with these settings' a and b)."""
        return max_output_length(source_length, self.max_length_a, self.max_length_b, max_len - 1)


SETTINGS = tuple(item.name for item in dataclasses.fields(RunDecodeSettings))


def max_output_length(source_length: int, a: float, b: int, hard_cap: int) -> int:
    """Longest output, in subwords without EOS, of a source of `source_length` subwords (without EOS):
    floor(a * length) + b, between 1 and `hard_cap` (model max_len - 1: the start token + that many tokens
    fill the position table)."""
    # A tiny epsilon, so that e.g. 1.1 * 10 floors to 11 and not to 10.
    length = source_length * a + 1e-9
    if not length < hard_cap:  # also a product too large for a float, which no floor takes
        return hard_cap
    return min(max(math.floor(length) + b, 1), hard_cap)


@dataclass(frozen=True)
class DecodeOptions(RunDecodeSettings):
    """Everything one translation asks of its search: a run's settings, the candidates per text, and
    sampling (None: search). Each value is checked as the object is made, then the chosen method's
    own rule (`Strategy.n_best_in_beam`); `strategy` is the method that runs."""

    n_best: int = 1  # candidates per text, best first
    sampling: Sampling | None = None  # draw at random instead of searching
    constraints: tuple[str, ...] = ()  # target phrases every output of every text must contain
    avoid: tuple[str, ...] = ()  # target phrases no output may contain
    per_text_constraints: bool = False  # each text brings its own phrases too (a column, a glossary, an API field)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sampling is not None and not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling or None, got {self.sampling!r}")  # a caller's bug
        object.__setattr__(self, "constraints", check_phrases(self.constraints, "constraints"))
        object.__setattr__(self, "avoid", check_phrases(self.avoid, "avoid"))
        check_not_avoided(self.constraints, self.avoid)
        if self.sampling is not None and self.constrained:
            raise DecodeOptionError("sampling", "draws each token at random and cannot be held to phrases: leave "
                                                f"out {option(self._phrases_option())}")
        if self.strategy.n_best_in_beam and self.n_best > self.beam_size:
            raise DecodeOptionError("n_best", f"{self.n_best} needs a beam of at least {self.n_best} (beam is "
                                              f"{self.beam_size}; add {option('beam_size')} {self.n_best})")

    @property
    def strategy(self) -> "Strategy":
        return strategy_of(self)

    def _phrases_option(self) -> str:
        """The option that gave phrases, for a refusal to name."""
        return "constraints" if self.constraints else "avoid" if self.avoid else "text_constraints"

    def without_phrases(self) -> "DecodeOptions":
        """These options held to no phrases: how a text with none (a glossary that matches nothing in it) is
        translated, by the method they choose then (`strategy`: greedy search at beam 1, else beam search)."""
        return dataclasses.replace(self, constraints=(), avoid=(), per_text_constraints=False)

    @property
    def constrained(self) -> bool:
        """Whether the search is held to phrases: constraints or avoided ones."""
        return bool(self.constraints or self.avoid or self.per_text_constraints)

    @classmethod
    def over(cls, base: RunDecodeSettings, sampling: Sampling | None = None, n_best: int = 1,
             constraints: tuple[str, ...] = (), avoid: tuple[str, ...] = (), per_text_constraints: bool = False,
             **given: Any) -> "DecodeOptions":
        """`base` (a run's decode settings) with the `given` ones (beam_size, length_penalty,
        max_length_a, max_length_b, batch_size; None: not given), `n_best`, `sampling` and the phrases.
        Each value is checked by the object; a given setting the chosen method excludes is refused, not ignored."""
        unknown = set(given) - set(SETTINGS)
        if unknown:
            raise TypeError(f"unknown decode settings: {sorted(unknown)}")  # a caller's bug
        given = {name: value for name, value in given.items() if value is not None}
        options = cls(**{**{name: getattr(base, name) for name in SETTINGS}, **given}, n_best=n_best,
                      sampling=sampling, constraints=tuple(constraints), avoid=tuple(avoid),
                      per_text_constraints=per_text_constraints)
        strategy = options.strategy
        excluded = [name for name in strategy.excludes if name in given]
        if excluded:
            raise DecodeOptionError(strategy.chosen_by, f"{strategy.unlike}: leave out {option(excluded[0])}")
        return options


class PhraseError(DecodeOptionError):
    """A constraint or avoided phrase (option `option_name`) no output can hold to; `index`: the text it
    belongs to (None: the options' phrases, shared by every text), for a face to name its line. `remedy`:
    advice that marks an option (e.g. "(⟨max_length_b⟩ raises it)"), said only by a face that names every
    option it marks: one that does not take the option (the API) never suggests it. `at` says where first."""

    def __init__(self, option_name: str, reason: str, index: int | None = None, remedy: str = "") -> None:
        super().__init__(option_name, reason)
        self.index, self.remedy, self.where = index, remedy, ""

    def naming(self, names: dict[str, str]) -> str:
        said = self.where + super().naming(names)
        if self.remedy and all(name in names for name in marked_options(self.remedy)):
            said += " " + name_options(self.remedy, names)
        return said

    def at(self, where: str) -> "PhraseError":
        """This refusal said after `where` (e.g. "line 3: ", "texts[2]: "), its text no longer to be located."""
        located = PhraseError(self.option, self.reason, None, self.remedy)
        located.where = where
        return located


def _refuse(name: str, reason: str, where: str, index: int | None) -> None:
    """A PhraseError naming option `name`, or, with `where` (e.g. "line 3: "), a UserError that says it first."""
    if where:
        raise UserError(f"{where}{option(name)} {reason}")
    raise PhraseError(name, reason, index)


def check_phrases(phrases: Any, name: str, where: str = "") -> tuple[str, ...]:
    """`phrases` (target phrases, constraints or avoided ones: option `name`) as a tuple of strings, refused
    when one is blank, when there are more than MAX_PHRASES, or when one has a blank alternative or too many
    (`check_alternatives`). The one check of a phrase's text, for the
    options and for each text's own phrases (`where`: e.g. "line 3: ", said first); whether a phrase has
    subwords, and fits its output, is the text path's (texts.py)."""
    if isinstance(phrases, str) or not all(isinstance(phrase, str) for phrase in phrases):
        raise TypeError(f"{name} must be a sequence of strings, got {phrases!r}")  # a caller's bug
    phrases = tuple(phrases)
    if any(not phrase.strip() for phrase in phrases):
        _refuse(name, f"has an empty or blank phrase: nothing to {'avoid' if name == 'avoid' else 'require'}",
                where, None)
    if len(phrases) > MAX_PHRASES:
        _refuse(name, f"has {len(phrases)} phrases, more than the {MAX_PHRASES} a text may have", where, None)
    for phrase in phrases:
        check_alternatives(phrase, name, where)
    return phrases


ALTERNATIVE = "|"  # separates the alternatives a phrase accepts; `\\|` is a literal bar, `\\\\` a backslash


def alternatives_of(phrase: str) -> tuple[str, ...]:
    """The alternatives `phrase` accepts (`nez qui coule|nez coule-t-il`), any one of which meets it, split at
    each bar: a backslash before a bar or a backslash makes that character literal (`\\|` is a bar, `\\\\` a
    backslash, so `a\\\\|b` is `a\\` or `b`); any other backslash is itself."""
    if ALTERNATIVE not in phrase and "\\" not in phrase:  # the common case, read as it is
        return (phrase,)
    found, current, at = [], [], 0
    while at < len(phrase):
        character = phrase[at]
        if character == "\\" and phrase[at + 1: at + 2] in (ALTERNATIVE, "\\"):
            current.append(phrase[at + 1])
            at += 2
            continue
        if character == ALTERNATIVE:
            found.append("".join(current))
            current = []
        else:
            current.append(character)
        at += 1
    return (*found, "".join(current))


def phrase_of(alternatives: Sequence[str]) -> str:
    """The phrase that accepts `alternatives`, written as `alternatives_of` reads it."""
    return ALTERNATIVE.join(alternative.replace("\\", "\\\\").replace(ALTERNATIVE, "\\" + ALTERNATIVE)
                            for alternative in alternatives)


def check_alternatives(phrase: str, name: str, where: str = "", index: int | None = None) -> None:
    """Refuse a phrase (of option `name`) with a blank alternative (`a|`, `a||b`) or more than MAX_ALTERNATIVES;
    `where` and `index` say which text, as check_phrases and PhraseError say."""
    alternatives = alternatives_of(phrase)
    if len(alternatives) == 1:
        return
    if any(not alternative.strip() for alternative in alternatives):
        _refuse(name, f"{phrase!r} has an empty alternative: nothing to {'avoid' if name == 'avoid' else 'require'} "
                      f"(a literal {ALTERNATIVE} is written \\{ALTERNATIVE})", where, index)
    if len(alternatives) > MAX_ALTERNATIVES:
        _refuse(name, f"{phrase!r} has {len(alternatives)} alternatives, more than the {MAX_ALTERNATIVES} a phrase "
                      "may have", where, index)


def check_not_avoided(constraints: Sequence[str], avoid: Sequence[str], name: str = "constraints", where: str = "",
                      index: int | None = None) -> None:
    """The one check that no constraint (option `name`, which the refusal blames), nor any of its alternatives,
    is an avoided phrase (or one of its alternatives) or holds one as whole words: no output could contain the
    one without the other. Compared as cleaned text by the whole-word rule (data.text.whole_words): `l'hôtel`
    and `l’hôtel` are one phrase, `gare` is in `la gare du Nord` but not in `gares`. For the options
    (DecodeOptions) and for each text's own constraints (`where` or `index`: which text, as check_phrases and
    PhraseError say)."""
    avoided_alternatives = [avoided for phrase in avoid for avoided in alternatives_of(phrase)]
    for phrase in constraints:
        alternatives = alternatives_of(phrase)
        for alternative in alternatives:
            named = f"{phrase!r}" if len(alternatives) == 1 else f"{phrase!r}: its alternative {alternative!r}"
            for avoided in avoided_alternatives:
                if not clean_text(avoided):  # nothing left of it: phrases.phrase_ids refuses it by its own name
                    continue
                pattern = whole_words([avoided])
                if pattern.search(clean_text(alternative)):
                    said = f"{option('avoid')} {avoided!r}"
                    _refuse(name, f"{named} is also avoided ({said}); a phrase is required or avoided, not both"
                            if pattern.fullmatch(clean_text(alternative)) else
                            f"{named} holds an avoided phrase ({said}); no output can contain one without the other",
                            where, index)


ENGINES = ("torch", "ctranslate2")


@dataclass(frozen=True)
class Strategy:
    """A decoding method: one row of STRATEGIES, read by the engines (which implementation runs it),
    by the engine policy (which engine can) and by the option checks (what it excludes). Every method
    reads max_length_a, max_length_b and batch_size; `reads` names what else."""

    name: str
    chosen: Callable[[DecodeOptions], bool]  # whether options ask for this method (the first row that does wins)
    reads: tuple[str, ...]  # the options it uses beyond the output length and batch size
    engines: tuple[str, ...]  # the engines that run it (each has its implementation keyed by `name`)
    chosen_by: str = "beam_size"  # the option that asks for it, named in its refusals
    excludes: tuple[str, ...] = ()  # settings a caller may not give with it: it would ignore them
    unlike: str = ""  # why it excludes them
    n_best_in_beam: bool = False  # its n-best are finished beam hypotheses: at most beam_size of them
    ends_with_eos: bool = False  # every output ends in EOS, at the length limit too (else one cut there has none)
    traced: bool = False  # its steps can be watched (translation/trace.py, translate.py --explain)
    beam_steps: bool = False  # traced, its steps are beam steps (candidates, finished hypotheses), else one token each
    exports_beam: bool = False  # an export runs it with its beam settings (Hugging Face num_beams, length penalty)
    seeded: bool = False  # it draws random numbers from sampling.seed
    described: str = ""  # its name in messages, where `name` alone would not say it


# In order: the first row whose `chosen` holds is the method. To add one, see docs/decoding.md.
STRATEGIES: dict[str, Strategy] = {strategy.name: strategy for strategy in (
    # Before sampling, whose options refuse phrases, and before greedy: beam 1 with phrases is this search.
    Strategy("constrained", lambda options: options.constrained,
             reads=("beam_size", "length_penalty", "n_best", "constraints", "avoid"), engines=("torch",),
             chosen_by="constraints", n_best_in_beam=True, ends_with_eos=True, traced=True, beam_steps=True,
             described="constrained beam search (required or avoided phrases)"),
    Strategy("sampling", lambda options: options.sampling is not None,
             reads=("n_best", "top_k", "top_p", "temperature", "seed"), engines=ENGINES, chosen_by="sampling",
             excludes=("beam_size", "length_penalty"), unlike="draws each token at random instead of searching",
             seeded=True),
    Strategy("greedy", lambda options: options.beam_size == 1, reads=(), engines=ENGINES, n_best_in_beam=True,
             traced=True),
    Strategy("beam", lambda options: True, reads=("beam_size", "length_penalty", "n_best"), engines=ENGINES,
             n_best_in_beam=True, ends_with_eos=True, traced=True, beam_steps=True, exports_beam=True),
)}


def strategy_of(options: DecodeOptions) -> Strategy:
    """The decoding method `options` ask for."""
    return next(strategy for strategy in STRATEGIES.values() if strategy.chosen(options))


def traced_strategy(options: DecodeOptions) -> Strategy:
    """The method `options` ask for, refused unless its steps can be watched (trace.py, --explain)."""
    strategy = strategy_of(options)
    if not strategy.traced:
        shown = " or ".join(name for name, method in STRATEGIES.items() if method.traced)
        raise UserError(f"{option('explain')} shows {shown} search, not {strategy.name}: leave out "
                        f"{option(strategy.chosen_by)}")
    return strategy


__all__ = ["MAX_PHRASES", "MAX_ALTERNATIVES", "PhraseError", "check_phrases", "ALTERNATIVE", "alternatives_of",
           "phrase_of", "check_alternatives", "check_not_avoided",
           "MAX_BEAM", "MAX_LENGTH_PENALTY", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MAX_SEED", "Range", "RANGES",
           "check_option", "Sampling", "RunDecodeSettings", "SETTINGS", "max_output_length", "DecodeOptions",
           "ENGINES", "Strategy", "STRATEGIES", "strategy_of", "traced_strategy"]
