"""The checks every config and file reader shares: numbers, integer ranges, thresholds, JSON shapes.

Each check returns the value in its normal form (a ``float``, an ``int``, a tuple) or raises
``error(field, problem)``: :class:`~entmtp_hf.errors.ConfigError` for a config field (the
default), :class:`~entmtp_hf.errors.FieldError` for a field of a file's data, whose reader
adds the file's name. The rules are the same everywhere: a bool is not a number, NaN and
infinities are refused, every integer has a maximum (so no value overflows a tensor, a deque
or a C long later), and a value of the wrong type is refused with the project's error, never
a raw ``TypeError``.

This module imports nothing of the project but :mod:`entmtp_hf.errors`: every layer may use it.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
from typing import Any, Callable, Iterable, Mapping, Sequence

from .errors import ConfigError, EntMTPError

#: builds the error a check raises from the field's name and what is wrong with it
Refusal = Callable[[str, str], EntMTPError]
_LISTED = 12  # items shown in an error message before eliding
#: the bound of a count read from JSON (tokens, prompts, steps): exact in a JSON number, far
#: beyond any run
MAX_COUNT = 2**53


# ------------------------------------------------------------------ short values in messages
class _BriefRepr(reprlib.Repr):
    """``reprlib`` limits, plus ints too long to print in full (``repr`` would raise on them)."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_BRIEF = _BriefRepr()
_BRIEF.maxstring = _BRIEF.maxother = 80


def brief_repr(value: object) -> str:
    """A short ``repr`` for error messages about values read from files (any size, any depth)."""
    return _BRIEF.repr(value)


def brief_list(items: Iterable[object], limit: int = _LISTED) -> str:
    """``a, b, c, ... (N more)``: error messages stay short however many items are wrong."""
    items = [str(i) for i in items]
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# ------------------------------------------------------------------ numbers
def _span(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """`` in [0, 1]``, `` > 0``, ... (empty when unbounded), to follow "must be a finite number"."""
    if low == -math.inf and high == math.inf:
        return ""
    if high == math.inf:
        return f" {'>' if low_open else '>='} {low:g}"
    if low == -math.inf:
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    left = "(" if low_open or low == -math.inf else "["
    right = ")" if high_open or high == math.inf else "]"
    return f"{left}{low:g}, {high:g}{right}"


def number(
    value: Any,
    field: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    error: Refusal = ConfigError,
) -> float:
    """A finite real number in the range (``low``/``high`` included unless open), as a float.

    Real numbers of any type (``numpy.float32``, ``fractions.Fraction``) are accepted; bools,
    strings, tensors and ints beyond the float range are not.
    """
    finite = False
    if type(value) is float:  # the common case first: this runs for every number a bank holds
        result, finite = value, math.isfinite(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            result = float(value)
            finite = math.isfinite(result)
        except (OverflowError, ValueError, TypeError):  # an int beyond the float range, an odd Real
            pass
    if not finite:
        raise error(field, f"must be a finite number{_span(low, high, low_open, high_open)}, got {brief_repr(value)}")
    above = result > low if low_open else result >= low
    below = result < high if high_open else result <= high
    if not (above and below):
        raise error(field, f"{brief_repr(value)} is outside {_interval(low, high, low_open, high_open)}")
    return result


def integer(value: Any, field: str, *, low: int, high: int, error: Refusal = ConfigError) -> int:
    """An integer in ``[low, high]``, as an int: ``high`` is required, so that no field takes a
    value that overflows later. Integer types of any kind (``numpy.int64``) are accepted; bools,
    floats and strings are not."""
    result = None
    if type(value) is int:  # the common case first
        result = value
    elif not isinstance(value, bool):
        try:
            result = operator.index(value)
        except (TypeError, ValueError, OverflowError, RuntimeError):  # RuntimeError: a tensor of several values
            pass
    if result is None or not low <= result <= high:
        raise error(field, f"must be an integer in [{low}, {high}], got {brief_repr(value)}")
    return result


def flag(value: Any, field: str, *, error: Refusal = ConfigError) -> bool:
    """``True`` or ``False`` (not 0, 1 or a string: ``"no"`` would be true)."""
    if not isinstance(value, bool):
        raise error(field, f"must be True or False, got {brief_repr(value)}")
    return value


def choice(value: Any, field: str, choices: Sequence[str], *, error: Refusal = ConfigError) -> str:
    """One of ``choices`` (strings only: an unhashable value is refused like any other)."""
    if not isinstance(value, str) or value not in choices:
        raise error(field, f"must be one of {list(choices)}, got {brief_repr(value)}")
    return value


# ------------------------------------------------------------------ lists and objects
def sequence(value: Any, field: str, *, of: str, max_len: int | None = None, error: Refusal = ConfigError) -> tuple:
    """A list or tuple (not a string, a dict or a tensor), as a tuple of at most ``max_len`` items."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise error(field, f"must be a list of {of}, got {brief_repr(value)}")
    if max_len is not None and len(value) > max_len:
        raise error(field, f"must be a list of at most {max_len} {of}, got {len(value)}")
    return tuple(value)


def numbers_in(
    value: Any,
    field: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    max_len: int | None = None,
    error: Refusal = ConfigError,
) -> tuple[float, ...]:
    """A list of finite numbers in the range, each one named ``field[i]`` when refused."""
    items = sequence(value, field, of="numbers", max_len=max_len, error=error)
    return tuple(
        number(x, f"{field}[{i}]", low=low, high=high, low_open=low_open, error=error) for i, x in enumerate(items)
    )


def increasing(values: Sequence[float], field: str, *, error: Refusal = ConfigError) -> tuple:
    """``values`` when each is larger than the one before it."""
    if any(b <= a for a, b in zip(values, values[1:])):
        raise error(field, f"must be strictly increasing, got {brief_repr(list(values))}")
    return tuple(values)


def thresholds(
    value: Any,
    field: str,
    *,
    low: float = 0.0,
    high: float = math.inf,
    count: int | None = None,
    error: Refusal = ConfigError,
) -> tuple[float, ...]:
    """A ladder's thresholds: strictly increasing finite numbers in ``[low, high]``; with ``count``,
    exactly that many (one fewer than the trees they bin the feature into)."""
    values = numbers_in(value, field, low=low, high=high, error=error)
    if count is not None and len(values) != count:
        raise error(field, f"a ladder of {count + 1} trees needs {count} thresholds, got {len(values)}")
    return increasing(values, field, error=error)


def taus(
    tau_on: Any,
    tau_off: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    prefix: str = "",
    error: Refusal = ConfigError,
) -> tuple[float | None, float | None]:
    """The hysteresis pair: each a finite number in ``[low, high]`` (or None, left unset), and
    ``tau_off <= tau_on`` when both are set (switching down never needs more confidence than
    switching up). ``prefix`` names their owner (``"EntMTPConfig."``)."""
    on = None if tau_on is None else number(tau_on, f"{prefix}tau_on", low=low, high=high, error=error)
    off = None if tau_off is None else number(tau_off, f"{prefix}tau_off", low=low, high=high, error=error)
    if on is not None and off is not None and off > on:
        raise error(f"{prefix}tau_off", f"must be <= tau_on ({on:g}), got {off:g}")
    return on, off


def mapping(value: Any, field: str, *, optional: bool = False, error: Refusal = ConfigError) -> dict:
    """A JSON object (a dict), as a shallow copy; ``optional``: None stands for an empty one."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        what = "a JSON object or null" if optional else "a JSON object"
        raise error(field, f"must be {what}, got {brief_repr(value)}")
    return dict(value)
