"""Periodic ticks claimed over RabbitMQ: one replica leads each schedule.

RabbitMQ keeps no key-value store to claim a tick in, but it has an atomic lock that
goes with its holder: an exclusive queue. Declaring ``{prefix}._asyncbus.periodic.
{digest}.leader`` (exclusive) succeeds for one connection at a time; every other
connection's declaration is refused while it exists, and it is deleted when its
connection closes (the replica stopped, died, or lost the broker). The replica whose
connection holds a schedule's lock publishes its ticks; the others answer
:attr:`~asyncbus._dedup.Claim.BUSY` and look again shortly (``busy_recheck``) until the
runner's patience runs out: when the leader goes, the next replica to ask takes the
lock, reads which ticks were published, and publishes those left.

What was published is kept in a quorum queue of its own, ``{prefix}._asyncbus.periodic.
{digest}``, holding one message (``x-max-length`` 1: a newer one drops the older):
the newest ticks published (:data:`KEPT`; a tick older than all of them counts as
published) and whether the schedule is known. Only the leader writes it, after each
tick, one write at a time, and only a new leader reads it, before its first claim: AMQP
reads a message by taking it, so a reader hides it from any other reader until it puts
it back, and one lock holder at a time is the only reader there can be.
A tick published by a leader that died before writing it down is published again by
the next leader, under the same id (at least once, as a lease that expires is over a
shared store).

Keys are the periodic runner's: ``_asyncbus.periodic.{name}/{tick ms}`` and
``_asyncbus.periodic.{name}/known``; any other key is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._dedup import TICK_KEY_PREFIX, Claim, MemoryDedupStore
from .._exceptions import DecodeError, TransportError

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection


__all__ = ["HANDOVER", "KEPT", "Link", "TickLeader"]

logger = logging.getLogger("asyncbus.transport.rabbit")

#: Newest published ticks the record keeps per schedule.
KEPT = 64
#: A record whose newest tick is at most this many seconds old was a live leader's:
#: the ticks since are a handover's, published whatever ``catch_up`` says.
HANDOVER = 15.0
#: Seconds between two looks of a follower at the lock.
RECHECK = 0.5
_VERSION = 1
#: Messages a read of a record takes at most (there is one, unless a write raced).
_READ_AT_MOST = 16


class Link(Protocol):
    """What the leader needs of the transport's link: its publishing connection."""

    publisher: AbstractConnection


@dataclass
class _Schedule:
    """One schedule's lead, as this replica sees it."""

    lock: str
    record: str
    #: The link whose connection holds the lock (``None``: another replica leads).
    led_on: Link | None = None
    #: When to look again (anyio time).
    next_look: float = float("-inf")
    known: bool = False
    #: Newest published ticks (ms), ascending, at most KEPT.
    published: list[int] = field(default_factory=list)
    #: The previous leader's newest tick (seconds), when this replica just took over.
    handed_over: float | None = None
    looking: anyio.Lock = field(default_factory=anyio.Lock)
    writing: anyio.Lock = field(default_factory=anyio.Lock)

    def is_done(self, tick: int | None) -> bool:
        if tick is None:
            return self.known
        if tick in self.published:
            return True
        return len(self.published) >= KEPT and tick < self.published[0]

    def mark(self, tick: int | None) -> None:
        if tick is None:
            self.known = True
            return
        if tick not in self.published:
            self.published.append(tick)
            self.published.sort()
            del self.published[:-KEPT]

    def document(self) -> bytes:
        data = {"v": _VERSION, "known": self.known, "published": self.published}
        return json.dumps(data, separators=(",", ":")).encode()

    def read(self, body: bytes) -> None:
        try:
            data = json.loads(body)
            if not isinstance(data, dict) or data.get("v") != _VERSION:
                raise DecodeError(f"version {data.get('v') if isinstance(data, dict) else '?'}")
            ticks = data["published"]
            if not isinstance(ticks, list) or not all(type(t) is int for t in ticks):
                raise DecodeError("published is not a list of integers")
        except (ValueError, KeyError, DecodeError) as error:
            logger.warning("RabbitMQ: the ticks record %s is unreadable: %s", self.record, error)
            return
        self.known = self.known or data.get("known") is True
        for tick in ticks:
            self.mark(tick)


class TickLeader:
    """The claims of periodic ticks over RabbitMQ (a ``DedupStore`` for the periodic
    runner only): a schedule's ticks are the leading replica's; the others are told
    BUSY (another replica has it) until they lead."""

    #: Seconds the runner waits before it asks again about a BUSY tick.
    busy_recheck = RECHECK

    def __init__(
        self,
        prefix: str,
        live_link: Callable[[], Awaitable[Link]],
        current_link: Callable[[], Link | None],
        keep: Callable[[str, bytes], Awaitable[None]],
        declare: Callable[[str], Awaitable[None]],
    ) -> None:
        """
        :param prefix: the transport's prefix (the lock and record queues go under it).
        :param live_link: the transport's live link, waited for (a reconnection).
        :param current_link: the live link now, ``None`` while there is none.
        :param keep: publish a record (queue name, body) with the broker's confirm.
        :param declare: declare a record's queue (durable, holding one message).
        """
        self._prefix = prefix
        self._live_link = live_link
        self._current_link = current_link
        self._keep = keep
        self._declare = declare
        self._schedules: dict[str, _Schedule] = {}
        #: Concurrent claims inside this replica (the leader fires ticks concurrently).
        self._leases = MemoryDedupStore()

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        """CLAIMED when this replica leads the schedule and the tick is not published.

        :raises TransportError: the broker could not be asked (the client's errors).
        """
        schedule, tick = self._parse(key)
        try:
            leading = await self._lead(schedule)
        except TransportError:
            raise
        except Exception as error:  # aiormq's: a channel or connection closed under us
            raise TransportError(
                f"RabbitMQ: looking at the lead of {schedule.record!r} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if schedule.is_done(tick):
            return Claim.DONE
        if not leading:
            return Claim.BUSY
        return await self._leases.claim(key, owner, lease)

    def handed_over(self, key: str) -> float | None:
        """The newest tick the previous leader published, once, when this replica has
        just taken a schedule over from a leader alive a moment before (within
        :data:`HANDOVER` seconds): the runner publishes the ticks due since, which the
        replicas that saw them may not have lived to publish. ``None`` otherwise (ticks
        missed while every replica was down follow ``catch_up``)."""
        schedule, _ = self._parse(key)
        tick, schedule.handed_over = schedule.handed_over, None
        return tick

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        """Keep this replica's lease of ``key`` (among its own concurrent claims)."""
        return await self._leases.extend(key, owner, lease)

    async def done(self, key: str, owner: str, ttl: float) -> None:
        """Record the tick published (written to the broker while this replica leads)."""
        schedule, tick = self._parse(key)
        schedule.mark(tick)
        await self._leases.release(key, owner)
        if self._leads(schedule):
            await self._write(schedule)

    async def release(self, key: str, owner: str) -> None:
        """Forget this replica's lease of ``key``."""
        await self._leases.release(key, owner)

    # -- leading -------------------------------------------------------------------

    def _parse(self, key: str) -> tuple[_Schedule, int | None]:
        if not key.startswith(TICK_KEY_PREFIX) or "/" not in key:
            raise ValueError(f"not a periodic tick's key: {key!r}")
        name, _, tail = key[len(TICK_KEY_PREFIX) :].rpartition("/")
        tick = None if tail == "known" else int(tail)
        schedule = self._schedules.get(name)
        if schedule is None:
            digest = hashlib.sha256(name.encode()).hexdigest()[:32]
            base = f"{self._prefix}._asyncbus.periodic.{digest}"
            schedule = self._schedules[name] = _Schedule(lock=f"{base}.leader", record=base)
        return schedule, tick

    def _leads(self, schedule: _Schedule) -> bool:
        link = schedule.led_on
        return link is not None and link is self._current_link()

    async def _lead(self, schedule: _Schedule) -> bool:
        """Whether this replica leads ``schedule``: it takes the lock when it is free
        (looking at most every :data:`RECHECK` seconds), and reads the record."""
        if self._leads(schedule):
            return True
        async with schedule.looking:
            if self._leads(schedule):
                return True
            if anyio.current_time() < schedule.next_look:
                return False
            schedule.next_look = anyio.current_time() + RECHECK
            link = await self._live_link()
            async with self._channel(link) as channel:
                if not await self._take_lock(channel, schedule):
                    return False
            await self._declare(schedule.record)
            async with self._channel(link) as channel:
                await self._read(channel, schedule)
            newest = schedule.published[-1] if schedule.published else None
            if newest is not None and time.time() * 1000 - newest <= HANDOVER * 1000:
                schedule.handed_over = newest / 1000  # a leader was alive a moment ago
            schedule.led_on = link
            logger.info("RabbitMQ: this process leads the schedule %s", schedule.record)
            return True

    @asynccontextmanager
    async def _channel(self, link: Link) -> AsyncIterator[AbstractChannel]:
        """A channel of the link's publishing connection, closed after use (what it
        got and did not ack goes back to its queue; an exclusive queue stays with the
        connection)."""
        channel = await link.publisher.channel(publisher_confirms=False)
        try:
            yield channel
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                if not channel.is_closed:
                    await channel.close()

    async def _take_lock(self, channel: AbstractChannel, schedule: _Schedule) -> bool:
        import aiormq.exceptions

        try:
            await channel.queue_declare(schedule.lock, exclusive=True)
        except aiormq.exceptions.ChannelLockedResource:
            return False  # (the broker closed the channel)
        return True

    async def _read(self, channel: AbstractChannel, schedule: _Schedule) -> None:
        """Read the record (declared before); the messages go back to their queue when
        the channel closes (every message there is read and merged: records only grow)."""
        for _ in range(_READ_AT_MOST):
            message: Any = await channel.basic_get(schedule.record, no_ack=False)
            if not message.delivery_tag:  # Basic.GetEmpty
                return
            schedule.read(bytes(message.body or b""))

    async def _write(self, schedule: _Schedule) -> None:
        """Publish the record (the newest replaces the older), one write at a time."""
        async with schedule.writing:
            await self._keep(schedule.record, schedule.document())
