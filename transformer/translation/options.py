"""What a caller may ask of a translation beyond the run's decode config, checked once, here, where it
enters the package: the search's overrides (beam size, length penalty and limits, batch size), the
number of candidates, and sampling, each within what both engines compute. Every refusal is a
DecodeOptionError that names the option generically ("top_k"); translate.py and the API call it by
their own names. The run's config file is config.py's to check; no torch here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from transformer.config import DecodeConfig
from transformer.errors import ConfigError, DecodeOptionError, option

# The widest beam, and the most candidates (n-best, or samples) of one text: memory grows with it, and
# wider beams do not translate better.
MAX_BEAM = 128
# GNMT alpha: ((5 + length) / 6) ** alpha must stay finite in float32 (the torch engine's stopping bound)
# for any output length a model's position table allows; usual values lie between 0.6 and 2.
MAX_LENGTH_PENALTY = 10.0
# logits / temperature must stay finite and nonzero in float32 in both engines; near 0 it is greedy search.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e30
MAX_SEED = 2**32 - 1  # CTranslate2's random generator takes an unsigned 32-bit seed
_INT64_MAX = 2**63 - 1


def _integer(option: str, value: Any, low: int, high: int, expected: str) -> int:
    """`value`, refused unless it is an integer (not a bool) in [low, high]; `expected` ends the
    sentence "... must be <expected>"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise DecodeOptionError(option, f"must be {expected}, got {value!r}")
    return int(value)


def _number(option: str, value: Any, low: float, high: float, expected: str, low_open: bool = False) -> float:
    """`value`, refused unless it is a finite number in [low, high] (or (low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DecodeOptionError(option, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not (low < number if low_open else low <= number) or not number <= high:  # NaN fails both
        raise DecodeOptionError(option, f"must be {expected}, got {value!r}")
    return number


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
        _integer("top_k", self.top_k, 0, _INT64_MAX, "0 (every token) or more")
        object.__setattr__(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0, "above 0 and at most 1",
                                                  low_open=True))
        temperature = _number("temperature", self.temperature, -math.inf, math.inf, "a finite number")
        if temperature <= 0:
            raise DecodeOptionError("temperature", f"must be above 0, got {self.temperature!r} (a temperature near "
                                                   "0 is greedy search)")
        object.__setattr__(self, "temperature", _number("temperature", temperature, MIN_TEMPERATURE,
                                                        MAX_TEMPERATURE,
                                                        f"from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"))
        _integer("seed", self.seed, 0, MAX_SEED, f"from 0 to {MAX_SEED}")


# The overrides a caller may give, each with its check: (low, high, expected) of `_integer` or `_number`.
_OVERRIDES: dict[str, tuple[type, float, float, str]] = {
    "beam_size": (int, 1, MAX_BEAM, f"from 1 to {MAX_BEAM}"),
    "length_penalty": (float, 0.0, MAX_LENGTH_PENALTY, f"from 0 to {MAX_LENGTH_PENALTY:g}"),
    "max_length_a": (float, 0.0, math.inf, "a finite number, 0 or more"),
    "max_length_b": (int, 1, _INT64_MAX, "1 or more"),
    "batch_size": (int, 1, _INT64_MAX, "1 or more"),
}


def _check_override(option: str, value: Any) -> Any:
    kind, low, high, expected = _OVERRIDES[option]
    if kind is int:
        return _integer(option, value, int(low), int(high), expected)
    value = _number(option, value, low, high, expected)
    if not math.isfinite(value):
        raise DecodeOptionError(option, f"must be {expected}, got {value!r}")
    return value


def check_overrides(sampling: Sampling | None = None, **overrides: Any) -> dict[str, Any]:
    """The given `overrides` of a run's decode config (beam_size, length_penalty, max_length_a,
    max_length_b, batch_size; None: not given), each checked, as a dict of those given. Sampling draws
    instead of searching, so it excludes beam_size and length_penalty."""
    unknown = set(overrides) - set(_OVERRIDES)
    if unknown:
        raise TypeError(f"unknown decode overrides: {sorted(unknown)}")  # a caller's bug
    given = {name: _check_override(name, value) for name, value in overrides.items() if value is not None}
    if sampling is not None:
        searching = [name for name in ("beam_size", "length_penalty") if name in given]
        if searching:
            raise DecodeOptionError("sampling", "draws each token at random instead of searching: leave out "
                                                + option(searching[0]))
    return given


def decode_config(base: DecodeConfig, sampling: Sampling | None = None, **overrides: Any) -> DecodeConfig:
    """`base` (a run's decode config) with `overrides` applied (check_overrides). The run's own values
    must be within what the engines compute as well (a ConfigError naming the run's key)."""
    given = check_overrides(sampling, **overrides)
    for name in _OVERRIDES:
        if name not in given:
            try:
                _check_override(name, getattr(base, name))
            except DecodeOptionError as error:
                raise ConfigError(f"the run's decode.{name} {error.reason}") from None
    return dataclasses.replace(base, **given)


def check_n_best(n_best: int, beam_size: int, sampling: Sampling | None) -> None:
    """n-best is at most the beam when searching (a beam of k finishes at most k hypotheses worth
    ranking), and at most MAX_BEAM samples when sampling."""
    _integer("n_best", n_best, 1, MAX_BEAM, f"from 1 to {MAX_BEAM}")
    if sampling is None and n_best > beam_size:
        raise DecodeOptionError("n_best", f"{n_best} needs a beam of at least {n_best} (beam is {beam_size}; "
                                          f"add {option('beam_size')} {n_best})")


__all__ = ["MAX_BEAM", "MAX_LENGTH_PENALTY", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MAX_SEED", "Sampling",
           "check_overrides", "decode_config",
           "check_n_best"]
