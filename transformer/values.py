"""The one check of a value a user gives, for the config (config.py) and the decode options
(decoding.py) alike: what counts as an integer or a number (a bool is neither; an integer too large
for a float is infinite), whether it lies in a range, and the walk over a frozen dataclass's fields
that keeps each checked value. Each caller words its own refusal (a YAML key, an option's name), so
nothing here raises a user error. Imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

INT64_MAX = 2**63 - 1  # what torch and numpy hold an integer in: every integer must fit it


def integer(value: Any) -> int | None:
    """`value` as an int, or None where it is not an integer (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def number(value: Any) -> float | None:
    """`value` as a float (an integer too large for one is infinite), or None where it is not a real number
    (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def within(value: float, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> bool:
    """Whether `value` lies from `low` to `high` (None: unbounded; each end included unless open). NaN
    never does."""
    if value != value:
        return False
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def check_fields(instance: Any, check: Callable[[dataclasses.Field, Any], Any]) -> None:
    """Replace each field of the frozen dataclass `instance` by `check(field, value)`, in field order: the
    value as checked (an integer given for a number becomes a float)."""
    for item in dataclasses.fields(instance):
        object.__setattr__(instance, item.name, check(item, getattr(instance, item.name)))


__all__ = ["INT64_MAX", "integer", "number", "within", "check_fields"]
