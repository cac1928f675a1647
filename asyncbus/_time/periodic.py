"""Periodic schedules: each tick published once per deployment, however many replicas run.

Every bus runs the schedules made on it (``bus.schedule``, ``@bus.periodic``); at a
tick each replica claims the tick in the claim store (the broker's, as for scheduled
envelopes: a Redis key, a JetStream KV entry; in memory, this process's), and the one
that claims it publishes the tick's envelope, then marks the tick done. The envelope's
id is the schedule's name and the tick (``"{name}@{epoch ms}"``): should a replica die
between its publish and its mark, the next claims the tick once the lease ends and
publishes it again under the same id, which ``deduplicate()`` drops. A replica that
finds the tick claimed looks again when the claim's lease ends, so a replica killed
mid-tick never makes a tick disappear.

Missed ticks (the loop was blocked, or every replica was down) follow the schedule's
``catch_up``: ``"skip"`` them, publish the latest ``"one"``, or ``"all"`` of them (at
most :data:`MAX_CATCH_UP`). Over a shared store a starting bus finds the
ticks missed while it was down by claiming back from now to the last one marked done.
"""

from __future__ import annotations

import datetime as dt
import heapq
import inspect
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import anyio

from .._checks import check_seconds
from .._dedup import TICK_KEY_PREFIX, Claim, DedupStore
from .._exceptions import ConfigurationError
from .._failures import describe_error
from .._stats import ScheduleStatistics
from .due import DONE_TTL, BusTime, as_datetime, guarded, seconds_of
from .ticks import Ticks, ticks_of

__all__ = ["CATCH_UP", "CatchUp", "Schedule", "Schedules"]

logger = logging.getLogger("asyncbus.schedule")

CatchUp = Literal["skip", "one", "all"]
CATCH_UP = ("skip", "one", "all")
#: Missed ticks published at most by ``catch_up="all"`` (the latest ones).
MAX_CATCH_UP = 1_000
#: Seconds a replica's claim of a tick lasts: another publishes it after a crash.
TICK_LEASE = 5.0
#: Seconds after its tick a replica stops asking about a tick another one keeps
#: claimed (a dead replica's lease has run out long before).
BUSY_PATIENCE = 3 * TICK_LEASE
#: A tick more than this late (seconds) counts as missed.
LATE = 1.0
#: Header of a tick's envelope: the tick, as ISO 8601 in the schedule's time zone.
HEADER_TICK = "asyncbus-tick"

#: Publishes a tick: (schedule, tick instant) -> what happened, for the statistics.
Publish = Callable[["Schedule", float], Awaitable[None]]


class Schedule:
    """A periodic schedule (``bus.schedule(...)``): what it publishes and when.

    :ivar name: its name, the same in every replica (it identifies its ticks).
    :ivar topic: where each tick's envelope is published.
    :ivar payload: each tick's payload.
    :ivar ticks: when it fires.
    :ivar jitter: each replica waits up to this many seconds past a tick (spread load).
    :ivar catch_up: what becomes of missed ticks.
    :ivar next_fire: the next tick (aware UTC datetime), once the bus runs.
    :ivar last_fire: the last tick this process published or saw published.
    :ivar last_outcome: ``"published"``, ``"published elsewhere"``, ``"skipped"`` or
        ``"failed: ..."``.
    :ivar fired: ticks this process published.
    """

    def __init__(
        self,
        name: str,
        topic: str,
        payload: Any,
        ticks: Ticks,
        jitter: float,
        catch_up: CatchUp,
        headers: Mapping[str, str],
    ) -> None:
        self.name = name
        self.topic = topic
        self.payload = payload
        self.ticks = ticks
        self.jitter = jitter
        self.catch_up = catch_up
        self.headers = headers
        self.next_fire: dt.datetime | None = None
        self.last_fire: dt.datetime | None = None
        self.last_outcome: str | None = None
        self.fired = 0

    def statistics(self) -> ScheduleStatistics:
        """What this schedule did so far."""
        return ScheduleStatistics(
            name=self.name,
            topic=self.topic,
            when=self.ticks.describe(),
            next_fire=self.next_fire,
            last_fire=self.last_fire,
            last_outcome=self.last_outcome,
            fired=self.fired,
        )

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, {self.topic!r}, {self.ticks.describe()})"


class _Called:
    """A sync function that takes nothing, as a handler (the tick's payload left out);
    picklable by reference like the function, for ``offload="process"``."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function = function
        _named_as(self, function)

    def __call__(self, payload: Any) -> Any:
        return self.function()

    def __repr__(self) -> str:
        return repr(self.function)


def tick_handler(function: Any) -> Any:
    """``function`` as a handler of its schedule's ticks: as it is when it takes the
    payload (or the envelope), wrapped when it takes no argument (a periodic job)."""
    try:
        signature = inspect.signature(function)
        signature.bind()
    except (TypeError, ValueError):
        return function  # it takes an argument (or cannot be told): subscribe checks it
    if inspect.iscoroutinefunction(function):

        async def handle(payload: Any) -> Any:
            return await function()

        _named_as(handle, function)
        return handle
    return _Called(function)


def _named_as(wrapper: Any, function: Any) -> None:
    """Give ``wrapper`` ``function``'s names, so the default group stays the function's
    (not ``functools.wraps``: its ``__wrapped__`` would give back the signature that
    takes no argument)."""
    wrapper.__module__ = function.__module__
    wrapper.__qualname__ = function.__qualname__
    wrapper.__name__ = function.__name__


def make_schedule(
    topic: str,
    *,
    every: Any,
    cron: Any,
    payload: Any,
    name: Any,
    timezone: Any,
    jitter: Any,
    catch_up: Any,
    headers: Mapping[str, str],
) -> Schedule:
    """A checked :class:`Schedule` (``bus.schedule``'s arguments).

    :raises ConfigurationError: for anything it cannot run.
    """
    where = f"schedule({topic!r})"
    ticks = ticks_of(every, cron, timezone, where)
    if name is None:
        name = f"{topic} {ticks.describe()}"
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ConfigurationError(f"{where}: name must be a non-empty string, got {name!r}")
    spread = (
        0.0 if jitter is None else check_seconds(seconds_of(jitter), f"{where}: jitter", zero=True)
    )
    if catch_up not in CATCH_UP:
        raise ConfigurationError(f"{where}: catch_up must be one of {CATCH_UP}, got {catch_up!r}")
    return Schedule(name, topic, payload, ticks, spread, catch_up, headers)


class Schedules:
    """Runs a bus's schedules: one task, sleeping until the soonest tick."""

    def __init__(self, clock: BusTime, publish: Publish) -> None:
        self._clock = clock
        self._publish = publish
        self.by_name: dict[str, Schedule] = {}
        #: The transport's name when it keeps no claims every replica shares (neither a
        #: dedup store nor tick claims): each replica then publishes every tick (said
        #: once per schedule).
        self.unshared: str | None = None
        #: Set when a schedule is added or a tick queued (made when the schedules run).
        self._wake: anyio.Event | None = None
        self._owner = f"{random.getrandbits(64):x}"
        self._turns = itertools.count()

    def add(self, schedule: Schedule) -> None:
        """Run ``schedule`` too (from now on, if the bus runs).

        :raises ConfigurationError: another schedule has its name.
        """
        if schedule.name in self.by_name:
            raise ConfigurationError(f"a schedule named {schedule.name!r} exists already")
        self.by_name[schedule.name] = schedule
        if self._wake is not None:
            self._wake.set()

    async def run(self, running: Callable[[], bool], shared: bool, store: DedupStore) -> None:
        """Fire every schedule's ticks until cancelled, claiming them in ``store``
        (``shared``: every replica's, so ticks missed while all were down are found)."""
        #: (loop deadline, turn, schedule, tick, try): ticks to look at, soonest first.
        queue: list[tuple[float, int, Schedule, float, int]] = []
        started: set[str] = set()
        self._wake = anyio.Event()
        async with anyio.create_task_group() as firing:
            while True:
                for schedule in list(self.by_name.values()):
                    if schedule.name not in started:
                        started.add(schedule.name)
                        await self._begin(schedule, store, shared, queue, firing)
                deadline = queue[0][0] if queue else float("inf")
                with anyio.CancelScope(deadline=deadline):
                    await self._wake.wait()
                self._wake = anyio.Event()
                now = anyio.current_time()
                while queue and queue[0][0] <= now:
                    _, _, schedule, tick, tries = heapq.heappop(queue)
                    if not running():
                        continue
                    firing.start_soon(guarded, self._tick, schedule, tick, tries, store, queue)

    def _enqueue(
        self, queue: list[Any], schedule: Schedule, tick: float, tries: int, at: float
    ) -> None:
        turn = (self._clock.loop_deadline(at), next(self._turns), schedule, tick, tries)
        heapq.heappush(queue, turn)
        if self._wake is not None:
            self._wake.set()

    def _plan_next(self, schedule: Schedule, after: float, queue: list[Any]) -> None:
        tick = schedule.ticks.after(after)
        schedule.next_fire = as_datetime(tick)
        spread = random.uniform(0.0, schedule.jitter) if schedule.jitter else 0.0
        self._enqueue(queue, schedule, tick, 0, tick + spread)

    async def _begin(
        self, schedule: Schedule, store: DedupStore, shared: bool, queue: list[Any], firing: Any
    ) -> None:
        """Plan ``schedule``'s first tick, and the ticks missed while every replica was
        down (over a shared store, unless ``catch_up="skip"``)."""
        now = self._clock.now()
        self._plan_next(schedule, now, queue)
        if self.unshared is not None:
            logger.warning(
                "schedule %r: %s keeps no claims the replicas share, so every replica "
                "running it publishes each tick (under the same id: deduplicate() on the "
                "consumers drops the copies); run it in one replica",
                schedule.name,
                self.unshared,
            )
        if not shared or schedule.catch_up == "skip":
            return
        try:
            missed = await self._find_missed(schedule, store, now)
        except Exception as error:
            logger.warning(
                "schedule %r: could not look for missed ticks: %s",
                schedule.name,
                describe_error(error),
            )
            return
        if schedule.catch_up == "one":
            for tick in missed[:-1]:
                await store.done(_tick_key(schedule, tick), self._owner, DONE_TTL)
            missed = missed[-1:]
        for tick in missed:
            logger.info(
                "schedule %r: publishing the missed tick %s", schedule.name, as_datetime(tick)
            )
            await self._fire_claimed(schedule, tick, store)

    async def _find_missed(self, schedule: Schedule, store: DedupStore, now: float) -> list[float]:
        """The ticks before now that no replica published, oldest first, each claimed."""
        known = _known_key(schedule)
        if await store.claim(known, self._owner, DONE_TTL) is Claim.CLAIMED:
            await store.done(known, self._owner, DONE_TTL)  # a new schedule: none missed
            return []
        missed: list[float] = []
        tick = schedule.ticks.before(schedule.ticks.after(now))  # the last tick so far
        for _ in range(MAX_CATCH_UP):
            found = await store.claim(_tick_key(schedule, tick), self._owner, TICK_LEASE * 12)
            if found is not Claim.CLAIMED:
                break
            missed.append(tick)
            tick = schedule.ticks.before(tick)
        missed.reverse()
        return missed

    async def _tick(
        self, schedule: Schedule, tick: float, tries: int, store: DedupStore, queue: list[Any]
    ) -> None:
        """One tick's turn in this replica: claim it and publish, or look again later."""
        if tries == 0 and not self._plan_after(schedule, tick, queue):
            schedule.last_outcome = "skipped"
            return
        key = _tick_key(schedule, tick)
        try:
            found = await store.claim(key, self._owner, TICK_LEASE)
        except Exception as error:
            self._failed(schedule, tick, tries, queue, error)
            return
        if found is Claim.DONE:
            schedule.last_fire, schedule.last_outcome = as_datetime(tick), "published elsewhere"
            return
        if found is Claim.BUSY:  # another replica publishes it: look again after its lease
            now = self._clock.now()
            if now - tick > BUSY_PATIENCE:  # it keeps it: trust it (it retries, or fails)
                schedule.last_fire, schedule.last_outcome = as_datetime(tick), "published elsewhere"
                return
            recheck = getattr(store, "busy_recheck", TICK_LEASE)
            self._enqueue(queue, schedule, tick, tries + 1, now + recheck)
            return
        handed_over = getattr(store, "handed_over", None)  # (a store of leaders)
        previous = handed_over(key) if handed_over is not None else None
        if previous is not None:
            self._take_over(schedule, previous, tick, queue)
        await self._fire_claimed(schedule, tick, store, tries, queue)

    def _take_over(
        self, schedule: Schedule, previous: float, tick: float, queue: list[Any]
    ) -> None:
        """This replica just took ``schedule`` over from a leader whose newest tick was
        ``previous``: the ticks due between it and ``tick`` are looked at now."""
        between = schedule.ticks.after(previous)
        for _ in range(MAX_CATCH_UP):
            if between >= tick:
                return
            logger.info(
                "schedule %r: taken over; the tick %s is published if it was not",
                schedule.name,
                as_datetime(between),
            )
            self._enqueue(queue, schedule, between, 1, self._clock.now())
            between = schedule.ticks.after(between)

    def _plan_after(self, schedule: Schedule, tick: float, queue: list[Any]) -> bool:
        """Plan the regular tick after ``tick``; the ticks passed meanwhile (the loop
        was late) follow the schedule's ``catch_up``. Whether ``tick`` is published."""
        now = self._clock.now()
        passed = [tick]
        following = schedule.ticks.after(tick)
        while following <= now and len(passed) <= MAX_CATCH_UP:
            passed.append(following)
            following = schedule.ticks.after(following)
        self._plan_next(schedule, max(passed[-1], now) if following <= now else passed[-1], queue)
        late = LATE + schedule.jitter
        missed = [t for t in passed if now - t > late]
        due = [t for t in passed if now - t <= late]
        if schedule.catch_up == "skip":
            missed = []
        elif schedule.catch_up == "one":
            missed = missed[-1:]
        for other in missed + due:
            if other != tick:
                self._enqueue(queue, schedule, other, 1, now)
        return tick in missed or tick in due

    async def _fire_claimed(
        self,
        schedule: Schedule,
        tick: float,
        store: DedupStore,
        tries: int = 0,
        queue: list[Any] | None = None,
    ) -> None:
        key = _tick_key(schedule, tick)
        try:
            await self._publish(schedule, tick)
        except Exception as error:
            await _quietly(store.release(key, self._owner))
            if queue is not None:
                self._failed(schedule, tick, tries, queue, error)
            else:
                schedule.last_outcome = f"failed: {describe_error(error)}"
            return
        schedule.fired += 1
        schedule.last_fire, schedule.last_outcome = as_datetime(tick), "published"
        await _quietly(store.done(key, self._owner, DONE_TTL))
        await _quietly(store.done(_known_key(schedule), self._owner, DONE_TTL))

    def _failed(
        self, schedule: Schedule, tick: float, tries: int, queue: list[Any], error: Exception
    ) -> None:
        schedule.last_outcome = f"failed: {describe_error(error)}"
        if tries >= 5:
            logger.error(
                "schedule %r: tick %s not published: %s",
                schedule.name,
                as_datetime(tick),
                describe_error(error),
            )
            return
        logger.warning(
            "schedule %r: tick %s failed, trying again: %s",
            schedule.name,
            as_datetime(tick),
            describe_error(error),
        )
        self._enqueue(queue, schedule, tick, tries + 1, self._clock.now() + 2.0**tries)


async def _quietly(call: Awaitable[None]) -> None:
    """A mark in the claim store: lost is logged (its lease ends by itself)."""
    try:
        await call
    except Exception as error:
        logger.warning("a schedule's mark was lost: %s", describe_error(error))


def _tick_key(schedule: Schedule, tick: float) -> str:
    return f"{TICK_KEY_PREFIX}{schedule.name}/{round(tick * 1000)}"


def _known_key(schedule: Schedule) -> str:
    return f"{TICK_KEY_PREFIX}{schedule.name}/known"


def periodic_topic(name: str) -> str:
    """The topic of ``@bus.periodic``'s schedule ``name``: ``periodic.{name}``, each
    character a topic cannot hold replaced by ``_``."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in name)
    return "periodic." + ".".join(part or "_" for part in safe.split("."))


def tick_id(schedule: Schedule, tick: float) -> str:
    """The envelope id of ``schedule``'s tick at ``tick`` (the same in every replica)."""
    return f"{schedule.name}@{round(tick * 1000)}"
