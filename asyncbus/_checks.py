"""Checks at the door: a configuration that cannot work fails where it is given.

Every number the bus turns into a wait, a deadline or a size passes through here, so
NaN, infinities, negative values, booleans and strings are refused with a
:class:`ConfigurationError` naming the argument, instead of failing later (or never).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ._exceptions import ConfigurationError

__all__ = ["check_count", "check_headers", "check_seconds", "check_slip", "check_wait"]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_seconds(value: Any, name: str, *, zero: bool = False) -> float:
    """A duration: a finite number ``> 0`` (``>= 0`` when ``zero``), as a float.

    :raises ConfigurationError: for anything else (NaN, an infinity, a bool, a string).
    """
    if _is_number(value) and math.isfinite(value) and (value > 0 or (zero and value == 0)):
        return float(value)
    bound = ">= 0" if zero else "> 0"
    raise ConfigurationError(f"{name} must be a finite number of seconds {bound}, got {value!r}")


def check_wait(value: Any, name: str) -> float | None:
    """A timeout: ``None`` (no deadline) or a finite number of seconds ``>= 0``."""
    if value is None:
        return None
    return check_seconds(value, name, zero=True)


def check_count(value: Any, name: str, minimum: int) -> int:
    """An int ``>= minimum`` (bools refused)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")


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
