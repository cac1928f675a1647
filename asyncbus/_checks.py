"""Checks at the door: a configuration that cannot work fails where it is given.

Every number the bus turns into a wait, a deadline or a size passes through here, so
NaN, infinities, ints too large for a float, negative values, booleans and strings
are refused with a :class:`ConfigurationError` naming the argument, instead of
failing later (or never).
"""

from __future__ import annotations

import decimal
import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from ._exceptions import ConfigurationError

__all__ = [
    "MAX_COUNT",
    "check_count",
    "check_headers",
    "check_number",
    "check_seconds",
    "check_slip",
    "check_wait",
]


def _as_float(value: object) -> float | None:
    """``value`` as a finite float, ``None`` when it is not a real number or not finite.

    Real numbers are ints, floats, fractions and decimals, never bools (``True`` is not
    a duration). An int too large for a float (``10**400``) is not finite here.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError, ArithmeticError):
        return None
    return number if math.isfinite(number) else None


def check_number(value: Any, name: str, *, above: float, inclusive: bool = False) -> float:
    """A finite real number ``> above`` (``>= above`` when ``inclusive``), as a float.

    :raises ConfigurationError: for anything else (NaN, an infinity, an int too large
        for a float, a bool, a string, a complex number).
    """
    number = _as_float(value)
    if number is not None and (number > above or (inclusive and number == above)):
        return number
    bound = f"{'>=' if inclusive else '>'} {above:g}"
    raise ConfigurationError(f"{name} must be a finite number {bound}, got {value!r}")


def check_seconds(value: Any, name: str, *, zero: bool = False, maximum: float = math.inf) -> float:
    """A duration: a finite number ``> 0`` (``>= 0`` when ``zero``), at most ``maximum``,
    as a float.

    :raises ConfigurationError: for anything else (NaN, an infinity, an int too large
        for a float, a bool, a string).
    """
    number = _as_float(value)
    if number is not None and (number > 0 or (zero and number == 0)) and number <= maximum:
        return number
    bound = ">= 0" if zero else "> 0"
    if maximum != math.inf:
        bound += f" and <= {maximum:g}"
    raise ConfigurationError(f"{name} must be a finite number of seconds {bound}, got {value!r}")


def check_wait(value: Any, name: str) -> float | None:
    """A timeout: ``None`` (no deadline) or a finite number of seconds ``>= 0``."""
    if value is None:
        return None
    return check_seconds(value, name, zero=True)


#: The largest count accepted: what the interpreter's own sizes can hold.
MAX_COUNT = sys.maxsize


def check_count(value: Any, name: str, minimum: int, maximum: int = MAX_COUNT) -> int:
    """An int from ``minimum`` to ``maximum`` (:data:`MAX_COUNT` by default; bools
    refused)."""
    if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum:
        return int(value)
    raise ConfigurationError(
        f"{name} must be an int >= {minimum} (at most {maximum}), got {value!r}"
    )


def check_slip(slip: Any, where: str) -> tuple[str, ...]:
    """A routing slip as a tuple of topics; a bare string is one hop.

    (Each hop's topic is validated where the envelope is made.)
    """
    if not slip:
        return ()
    if isinstance(slip, str):
        return (slip,)
    if isinstance(slip, Iterable):
        return tuple(slip)
    raise ConfigurationError(f"{where}: slip must be a sequence of topics, got {slip!r}")


def check_headers(headers: Any, where: str) -> Mapping[str, str]:
    """Headers as given, once every name and value is a string."""
    if not isinstance(headers, Mapping):
        raise ConfigurationError(f"{where}: headers must be a mapping, got {headers!r}")
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError(
                f"{where}: header names and values must be strings, got {name!r}: {value!r}"
            )
    return headers
