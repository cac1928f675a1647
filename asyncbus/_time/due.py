"""When a delayed or scheduled publish is due, and the clock every timer of time reads.

A publish given ``delay=`` or ``at=`` is due at an instant in epoch seconds (what a
broker keeps and another process reads). Every wait for that instant, and every tick of
a periodic schedule, reads :class:`BusTime`: the wall clock as the bus saw it when it
started, moved on by the event loop's clock. So a test's trio ``MockClock`` drives hours
of schedules without a real sleep, and a clock jump on this machine after the start
(NTP stepping the clock, a suspended laptop) neither fires everything at once nor holds
anything back: only the loop's monotonic clock moves time on.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._checks import check_seconds
from .._exceptions import ConfigurationError
from .._failures import stray_cancellation

_logger = logging.getLogger("asyncbus.schedule")

__all__ = [
    "DONE_TTL",
    "HEADER_DUE",
    "BusTime",
    "as_datetime",
    "check_due",
    "concurrently",
    "due_header",
    "guarded",
    "read_due",
    "seconds_of",
]

#: Header of an envelope held until it is due: the instant, in epoch seconds.
HEADER_DUE = "asyncbus-due"
#: Seconds a claim marked done is remembered: a scheduled id published or cancelled, a
#: tick published, a schedule known.
DONE_TTL = 7 * 24 * 3600.0

#: The longest delay accepted (about 30 years): beyond it a typo, not a plan.
MAX_DELAY = 1e9


class BusTime:
    """Epoch seconds as this bus reckons them: the wall clock read once, at the start,
    then moved on by the event loop's clock (see the module's docstring)."""

    __slots__ = ("_origin_loop", "_origin_wall")

    def __init__(self) -> None:
        self._origin_wall = time.time()
        self._origin_loop = 0.0

    def start(self) -> None:
        """Read both clocks now (called on the event loop, when the bus starts)."""
        self._origin_wall = time.time()
        self._origin_loop = anyio.current_time()

    def now(self) -> float:
        """Epoch seconds now (the wall clock itself off the event loop's thread)."""
        try:
            loop_now = anyio.current_time()
        except RuntimeError:  # no event loop here: a statistics call from another thread
            return time.time()
        return self._origin_wall + (loop_now - self._origin_loop)

    def loop_deadline(self, due: float) -> float:
        """The event loop's clock reading at which epoch instant ``due`` comes."""
        return self._origin_loop + (due - self._origin_wall)


def seconds_of(value: Any) -> Any:
    """A :class:`datetime.timedelta` as its seconds; anything else as it is (to check)."""
    return value.total_seconds() if isinstance(value, dt.timedelta) else value


def check_due(delay: Any, at: Any, now: float, where: str) -> float | None:
    """The epoch instant a publish given ``delay`` or ``at`` is due (``None``: neither).

    :param now: epoch seconds now (:meth:`BusTime.now`).
    :raises ConfigurationError: both given; ``delay`` not a finite number of seconds
        (or a timedelta) ``>= 0``; ``at`` not a timezone-aware :class:`datetime.datetime`.
    """
    if at is None:
        if delay is None:
            return None
        delay = seconds_of(delay)
        return now + check_seconds(delay, f"{where}: delay", zero=True, maximum=MAX_DELAY)
    if delay is not None:
        raise ConfigurationError(f"{where}: give delay= or at=, not both")
    if not isinstance(at, dt.datetime):
        raise ConfigurationError(
            f"{where}: at must be a timezone-aware datetime, got {type(at).__name__}"
        )
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigurationError(
            f"{where}: at={at.isoformat()} is a naive datetime: give it a timezone "
            "(datetime.now(timezone.utc) + ..., or tzinfo=ZoneInfo(...))"
        )
    due = at.timestamp()
    if not math.isfinite(due) or due - now > MAX_DELAY:
        raise ConfigurationError(f"{where}: at={at.isoformat()} is too far away")
    return due


def as_datetime(due: float) -> dt.datetime:
    """Epoch seconds as an aware UTC datetime."""
    return dt.datetime.fromtimestamp(due, dt.UTC)


def due_header(due: float) -> str:
    """The :data:`HEADER_DUE` value of epoch instant ``due``."""
    return f"{due:.6f}"


def read_due(value: str | None) -> float | None:
    """The instant a :data:`HEADER_DUE` value names (``None`` when it names none)."""
    if value is None or len(value) > 32:
        return None
    try:
        due = float(value)
    except ValueError:
        return None
    return due if math.isfinite(due) and due >= 0 else None


async def guarded(run: Callable[..., Awaitable[None]], *args: Any) -> None:
    """``run(*args)``, run again after a cancellation that is not the bus's own (a
    ``task.cancel()`` from outside the bus: see :func:`stray_cancellation`)."""
    while True:
        try:
            await run(*args)
            return
        except anyio.get_cancelled_exc_class():
            if not stray_cancellation():
                raise
            _logger.warning("a task of the bus's timers was cancelled from outside; it goes on")


async def concurrently(*calls: Callable[[], Awaitable[object]]) -> None:
    """Await every call at once; the first failure is raised as it is (no group), once
    all have ended."""
    failures: list[BaseException] = []

    async def run(call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
        except Exception as error:
            failures.append(error)

    async with anyio.create_task_group() as tasks:
        for call in calls:
            tasks.start_soon(run, call)
    if failures:
        raise failures[0]
