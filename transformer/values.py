"""The one check of a value a user gives, for the config (config/sections.py) and the decode options
(decoding.py) alike: what counts as an integer or a number (a bool is neither; an integer too large
for a float is infinite), whether it lies in a range, a typed field's whole check (`check_value`: its
type, a finite number, its `Bounds`, no NUL in a string) and the walk over a frozen dataclass's fields
that keeps each checked value. Each caller words its own refusal (a YAML key, an option's name): a
value refused here is an `Unexpected`, never a user error. Imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

INT64_MAX = 2**63 - 1  # what torch and numpy hold an integer in: every integer must fit it
_INT64_MIN = -INT64_MAX - 1
BOUNDS = "bounds"  # the metadata key of a field's Bounds (`bounded`)


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


# --------------------------------------------------------------------------- a typed field's check


@dataclass(frozen=True)
class Bounds:
    """The values a number field may take: from `low` to `high` (None: unbounded; each end included
    unless open). An integer field is always kept within int64 as well."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def hold(self, value: float, annotation: Any) -> bool:
        if annotation is int and not within(value, _INT64_MIN, INT64_MAX):
            return False
        return within(value, self.low, self.high, self.low_open, self.high_open)

    def describe(self, annotation: Any, value: float) -> str:
        """What a value of the field must be, as a refusal ends "expected <this>, got <value>"."""
        low, high, low_open, high_open = self.low, self.high, self.low_open, self.high_open
        noun = "an integer" if annotation is int else "a number"
        if annotation is int:
            low = _INT64_MIN if low is None else low
            high = INT64_MAX if high is None else high
            if high == INT64_MAX and low > _INT64_MIN:  # the int64 limit is named where it was passed
                return f"{noun} {'>' if low_open else '>='} {low}" if value <= high else f"{noun} of at most {high}"
            return f"{noun} from {low} to {high}"
        if low is not None and high is not None:
            return f"{noun} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        if low is not None:
            return f"{noun} {'>' if low_open else '>='} {low:g}"
        return f"{noun} {'<' if high_open else '<='} {high:g}"


def bounded(default: Any, low: float | None = None, high: float | None = None, *, low_open: bool = False,
            high_open: bool = False) -> Any:
    """A dataclass field whose every value (each item of a tuple) must lie between `low` and `high`
    (included unless `*_open`); integers are always kept within int64 as well."""
    return dataclasses.field(default=default, metadata={BOUNDS: Bounds(low, high, low_open, high_open)})


class Unexpected(Exception):
    """A value its field does not take: the caller's refusal reads "<its key><index>: expected
    <expected>, got <value!r>", where `index` ("[1]") names the item of a tuple that was refused."""

    def __init__(self, expected: str, value: Any, index: str = "") -> None:
        super().__init__(f"expected {expected}, got {value!r}")
        self.expected, self.value, self.index = expected, value, index


def check_value(value: Any, annotation: Any, bounds: Bounds | None = None) -> Any:
    """The one check of a typed field's value: its type (a bool is not an integer; a Literal's
    choices; a tuple of typed items, or of any number of one type), a finite number, `bounds`, no NUL
    in a string. Returns the value, an integer given for a number as a float; raises Unexpected."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if isinstance(value, bool) or value not in choices:
            raise Unexpected(f"one of {', '.join(map(str, choices))}", value)
        return value
    if origin is tuple:
        item_types = typing.get_args(annotation)
        if len(item_types) == 2 and item_types[1] is Ellipsis:  # tuple[int, ...]: any number of items of one type
            if not isinstance(value, tuple):
                raise Unexpected("a list of values", value)
            item_types = (item_types[0],) * len(value)
        elif not isinstance(value, tuple) or len(value) != len(item_types):
            raise Unexpected(f"a list of {len(item_types)} values", value)
        checked = []
        for index, (item, item_type) in enumerate(zip(value, item_types)):
            try:
                checked.append(check_value(item, item_type, bounds))
            except Unexpected as refusal:
                raise Unexpected(refusal.expected, refusal.value, f"[{index}]{refusal.index}") from None
        return tuple(checked)
    if annotation is bool:
        if not isinstance(value, bool):
            raise Unexpected("true or false", value)
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise Unexpected("a string", value)
        if "\0" in value:
            raise Unexpected("a string without NUL characters", value)
        return value
    if annotation is int:
        checked_number = integer(value)
        if checked_number is None:
            raise Unexpected("an integer", value)
    elif annotation is float:
        checked_number = number(value)
        if checked_number is None:
            raise Unexpected("a number", value)
        if not math.isfinite(checked_number):
            raise Unexpected("a finite number", value)
    else:
        raise TypeError(f"unsupported field type {annotation!r}")  # a bug, not user error
    bounds = bounds or Bounds()
    if not bounds.hold(checked_number, annotation):
        raise Unexpected(bounds.describe(annotation, checked_number), checked_number)
    return checked_number


__all__ = ["INT64_MAX", "BOUNDS", "integer", "number", "within", "check_fields", "Bounds", "bounded", "Unexpected",
           "check_value"]
