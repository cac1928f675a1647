"""When a periodic schedule fires: fixed intervals, or a cron expression in a time zone.

A tick is an instant in epoch seconds, the same in every replica: intervals are
counted from the epoch (``every=timedelta(minutes=5)`` fires at :00, :05, ...), a cron
expression is read in its schedule's time zone, daylight-saving changes included (as
cron does: a time skipped by the change fires when the clocks jump over it, a repeated
hour fires once). Cron expressions need the ``cron`` extra (cronsim).
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Protocol

from .._checks import check_seconds
from .._exceptions import ConfigurationError
from .due import seconds_of

__all__ = ["Cron", "Every", "Ticks", "check_timezone", "ticks_of"]


class Ticks(Protocol):
    """The instants a schedule fires at."""

    def after(self, instant: float) -> float:
        """The first tick strictly after epoch ``instant``."""

    def before(self, instant: float) -> float:
        """The last tick strictly before epoch ``instant``."""

    def describe(self) -> str:
        """``every 300 s`` or ``cron */5 * * * * (Europe/Paris)``."""


class Every:
    """A tick every ``period`` seconds, counted from the epoch."""

    def __init__(self, period: float) -> None:
        self.period = period

    def after(self, instant: float) -> float:
        """The first multiple of the period past ``instant``."""
        return (math.floor(instant / self.period) + 1) * self.period

    def before(self, instant: float) -> float:
        """The last multiple of the period before ``instant``."""
        return (math.ceil(instant / self.period) - 1) * self.period

    def describe(self) -> str:
        """``every <period> s``."""
        return f"every {self.period:g} s"


class Cron:
    """The ticks of a cron expression in time zone ``zone`` (cronsim reads it)."""

    def __init__(self, expression: str, zone: dt.tzinfo) -> None:
        try:
            from cronsim import CronSim
        except ImportError:
            raise ConfigurationError(
                "cron schedules need cronsim: pip install 'asyncbus[cron]'"
            ) from None
        self._cronsim = CronSim
        self.expression = expression
        self.zone = zone
        try:
            CronSim(expression, dt.datetime.now(zone))
        except Exception as error:  # cronsim's CronSimError, or what a bad field raises
            raise ConfigurationError(f"cron={expression!r}: {error}") from None

    def _next(self, instant: float, reverse: bool) -> float:
        start = dt.datetime.fromtimestamp(instant, self.zone)
        tick: dt.datetime = next(iter(self._cronsim(self.expression, start, reverse=reverse)))
        return tick.timestamp()

    def after(self, instant: float) -> float:
        """The expression's first tick after ``instant``."""
        return self._next(instant, reverse=False)

    def before(self, instant: float) -> float:
        """The expression's last tick before ``instant``."""
        return self._next(instant, reverse=True)

    def describe(self) -> str:
        """``cron <expression> (<zone>)``."""
        return f"cron {self.expression} ({self.zone})"


def check_timezone(zone: Any, where: str) -> dt.tzinfo:
    """``zone`` (a :class:`datetime.tzinfo`, an IANA name, or ``None`` for UTC) as a tzinfo."""
    if zone is None:
        return dt.UTC
    if isinstance(zone, dt.tzinfo):
        return zone
    if isinstance(zone, str):
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            return ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigurationError(f"{where}: unknown time zone {zone!r}") from None
    raise ConfigurationError(f"{where}: timezone must be a tzinfo or a name, got {zone!r}")


def ticks_of(every: Any, cron: Any, zone: Any, where: str) -> Ticks:
    """The ticks of ``every=`` (a timedelta or seconds) or ``cron=`` (exactly one)."""
    if (every is None) == (cron is None):
        raise ConfigurationError(f"{where}: give every= or cron=, exactly one")
    if every is not None:
        if zone is not None:
            check_timezone(zone, where)  # (checked all the same; intervals ignore it)
        seconds = seconds_of(every)
        return Every(check_seconds(seconds, f"{where}: every", maximum=1e9))
    if not isinstance(cron, str):
        raise ConfigurationError(f"{where}: cron must be a string, got {cron!r}")
    return Cron(cron, check_timezone(zone, where))
