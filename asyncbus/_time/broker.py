"""Scheduled envelopes kept by the broker until they are due (the bus over a broker).

A scheduled publish goes to one internal group of the broker, ``_asyncbus.scheduled``
(pattern and group alike), with its real topic and due instant in headers; every bus
over that broker consumes the group (competing consumers), so the envelope survives
its publisher and is published by whichever process holds it when it comes due:

* a delivery more than :data:`HOLD_AHEAD` seconds early (and a second more) goes back
  with the broker's own delayed redelivery (``nack(delay=...)``: Redis's delayed set,
  a JetStream delayed ``NAK``, RabbitMQ's retry queues), to come back
  :data:`HOLD_AHEAD` seconds before it is due: a broker may redeliver late (RabbitMQ
  rounds a delay up by up to 6.25 %; a loaded JetStream server 2.9 was measured
  redelivering a thousand a second over a second late), and a few such hops bring it
  within reach;
* then it is kept in hand on the event loop's timer and, when due, claimed, published
  to its topic as a publish at that moment would be (routed to the groups that exist
  then), marked done, and acked.

Claims keep each envelope published once and make cancelling hold in every process,
in the broker's claim store (the store of ``deduplicate()``: a Redis key, a JetStream KV
entry) under the envelope's id. The process that holds an envelope claims the id when
it is due and marks it done once published; a cancel claims it and marks it done at
once (so a cancel holds until the due instant). Whoever claims first
wins: a cancel that finds the id taken or done returns ``False``, a process that finds
it done drops its copy, one that finds it taken looks again later (its holder may have
died). An id is one message: scheduled twice, it is published once, and an id that was
published or cancelled is not published again while the store remembers it (a week).
A process killed between the publish and the mark leaves its claim to expire and the
envelope to be delivered again: it is published a second time with the same id (the
receivers' ``deduplicate()`` drops it). Over a broker ``cancel_scheduled`` cannot tell
an id nobody scheduled from a pending one: both give ``True`` (and the id is then
spent). Without a shared store (RabbitMQ) the claims are this process's own: a cancel
holds when this process is the one that publishes the envelope.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import anyio

from .._dedup import Claim, DedupStore
from .._envelope import EMPTY_HEADERS, Envelope, replace_headers
from .._failures import describe_error, stray_cancellation
from .._groups import INTERNAL_GROUP_PREFIX
from ..transports.base import BaseDelivery
from .due import (
    DONE_TTL,
    HEADER_DUE,
    BusTime,
    as_datetime,
    concurrently,
    due_header,
    guarded,
    read_due,
)
from .held import Fire, ScheduledEnvelope

__all__ = [
    "HEADER_TOPIC",
    "HOLD_AHEAD",
    "SCHEDULED",
    "BrokerKeeper",
]

logger = logging.getLogger("asyncbus.schedule")

#: The internal topic, pattern and group of scheduled envelopes in a broker.
SCHEDULED = INTERNAL_GROUP_PREFIX + "scheduled"
#: Header of a scheduled envelope held in the broker: the topic it is published to.
HEADER_TOPIC = "asyncbus-scheduled-topic"
#: Seconds before its due time a scheduled envelope is kept in hand (on a local timer).
HOLD_AHEAD = 3.0
#: A delayed redelivery may come this much late (RabbitMQ's buckets: 6.25 %).
ROUNDING = 1.07
#: Longest wait asked of the broker at once (RabbitMQ holds a message at most about
#: 49 days): a longer delay comes back once a day and is handed back again.
LONGEST_HOP = 86_400.0
#: Deliveries of scheduled envelopes one process holds at once (in hand for up to
#: :data:`HOLD_AHEAD` and a second more: room for several thousand a second).
PREFETCH = 10_000
#: Seconds a firing claim lasts (a publish that takes longer may be repeated).
FIRE_LEASE = 60.0
#: The claim store's window (the longest a NATS KV entry is kept).
CLAIMS_WINDOW = DONE_TTL
#: Seconds before a delivery whose id another process holds is looked at again.
BUSY_AGAIN = 5.0
#: Pauses between two subscriptions of the scheduled group after a failure.
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0


def _key(envelope_id: str) -> str:
    return f"_asyncbus.scheduled/{envelope_id}"


class BrokerKeeper:
    """Publishes scheduled envelopes to the broker's scheduled group and fires those
    this process receives when they are due (see the module's docstring)."""

    def __init__(
        self, clock: BusTime, fire: Fire, port: Any, transport: Any, store: DedupStore
    ) -> None:
        self._clock = clock
        self._fire = fire
        self._port = port
        self._transport = transport
        self._store = store
        #: What this process scheduled and has not seen come due: ``bus.scheduled()``.
        self._mine: dict[str, tuple[Envelope, float]] = {}
        #: Deliveries that came early and were handed back to the broker.
        self.handed_back = 0
        self._running: Callable[[], bool] = lambda: True
        #: This process's owner name for the ids it takes to fire.
        self._owner = f"firing-{random.getrandbits(64):x}"

    @property
    def count(self) -> int:
        """Envelopes this process scheduled that are not due yet."""
        self._prune()
        return len(self._mine)

    def abandon(self) -> list[str]:
        """Nothing is abandoned: the broker keeps what is not due."""
        self._mine.clear()
        return []

    def _prune(self) -> None:
        now = self._clock.now() if self._mine else 0.0
        for envelope_id in [i for i, (_, due) in self._mine.items() if due <= now]:
            del self._mine[envelope_id]

    def listed(self) -> list[ScheduledEnvelope]:
        """What this process scheduled that is not due yet, soonest first (the broker
        holds other processes' too)."""
        self._prune()
        items = sorted(self._mine.values(), key=lambda item: item[1])
        return [
            ScheduledEnvelope(envelope.id, envelope.topic, as_datetime(due), envelope)
            for envelope, due in items
        ]

    async def hold(self, envelopes: Sequence[Envelope], due: float) -> None:
        """Hand ``envelopes`` to the broker's scheduled group (each under its due
        instant and topic)."""
        held = [_held(envelope, due) for envelope in envelopes]
        await self._port.publish_to_group(SCHEDULED, SCHEDULED, held)
        for envelope in envelopes:
            self._mine[envelope.id] = (envelope, due)

    async def cancel(self, envelope_id: str) -> bool:
        """Claim the id before a process takes it to publish it; whether it was still
        pending (see the module's docstring)."""
        key, owner = _key(envelope_id), f"cancel-{random.getrandbits(64):x}"
        if await self._store.claim(key, owner, FIRE_LEASE) is not Claim.CLAIMED:
            return False  # published, being published, or cancelled before
        await self._store.done(key, owner, DONE_TTL)
        self._mine.pop(envelope_id, None)
        return True

    async def run(self, running: Callable[[], bool]) -> None:
        """Consume the scheduled group until cancelled, subscribing again after a
        failure (a pause that doubles up to a few seconds); fire only while
        ``running()`` (what is in hand at the close goes back to the broker)."""
        self._running = running
        backoff = BACKOFF_MIN
        while True:
            began = anyio.current_time()
            try:
                async with (
                    self._transport.subscribe(
                        SCHEDULED, group=SCHEDULED, prefetch=PREFETCH
                    ) as deliveries,
                    anyio.create_task_group() as holding,
                ):
                    async for delivery in deliveries:
                        holding.start_soon(guarded, self._take, delivery)
                return
            except BaseException as error:  # deliberate: nothing the broker does ends the bus
                if not _a_broker_failure(error):
                    raise  # the bus's own cancellation, KeyboardInterrupt, SystemExit
                if anyio.current_time() - began > BACKOFF_MAX:
                    backoff = BACKOFF_MIN
                logger.warning(
                    "scheduled envelopes: subscribing to the broker failed, trying again: %s",
                    describe_error(error),
                )
            await anyio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _take(self, delivery: Any) -> None:
        """One delivery of the scheduled group: back to the broker, or in hand until due."""
        try:
            refused = delivery.error if isinstance(delivery, BaseDelivery) else None
            envelope: Envelope = delivery.envelope
            due = read_due(envelope.headers.get(HEADER_DUE))
            topic = envelope.headers.get(HEADER_TOPIC)
            if refused is not None or due is None or not topic:
                why = refused or "no due time or topic: not a scheduled envelope"
                logger.error("a scheduled envelope was unreadable, dead-lettered: %s", why)
                with self._transport.cleanup_scope():
                    await delivery.reject("rejected", error=f"scheduled envelope: {why}")
                return
            remaining = due - self._clock.now()
            if remaining > HOLD_AHEAD + 1.0:
                hop = min((remaining - HOLD_AHEAD) / ROUNDING, LONGEST_HOP)
                with self._transport.cleanup_scope():
                    await delivery.nack(delay=hop)
                self.handed_back += 1
                return
            await self._hold_then_fire(delivery, envelope, topic, due)
        except Exception as error:  # the broker failed us: it delivers it again
            logger.warning("scheduled envelope: %s; it comes back", describe_error(error))

    async def _hold_then_fire(
        self, delivery: Any, envelope: Envelope, topic: str, due: float
    ) -> None:
        """Wait until due, then claim the id (a cancel may still take it until then),
        publish, mark it done and ack."""
        remaining = due - self._clock.now()
        if remaining > 0:
            await anyio.sleep(remaining)
        if not self._running():
            return  # closing: it goes back to the broker with the close
        key, store, owner = _key(envelope.id), self._store, self._owner
        with self._transport.cleanup_scope():  # a close in the middle waits (bounded)
            found = await store.claim(key, owner, FIRE_LEASE)
            if found is Claim.DONE:  # cancelled, or published already
                self._mine.pop(envelope.id, None)
                await delivery.ack()
                return
            if found is Claim.BUSY:  # a cancel under way, or a holder that may have died
                await delivery.nack(delay=BUSY_AGAIN)
                return
            try:
                await self._fire(_released(envelope, topic))
            except Exception as error:
                logger.error(
                    "scheduled envelope %s for %r could not be published, again in 1 s: %s",
                    envelope.id,
                    topic,
                    describe_error(error),
                )
                await store.release(key, owner)
                await delivery.nack(delay=1.0)
                return
            self._mine.pop(envelope.id, None)
            await concurrently(lambda: store.done(key, owner, DONE_TTL), delivery.ack)


def _a_broker_failure(error: BaseException) -> bool:
    """Whether ``error``, out of the scheduled group's subscription, is the broker's
    doing: an exception, or a group of them with a stray cancellation beside (a client
    library cancels what it awaited when its connection drops); never the bus's own
    cancellation (a scope around this task cancelled)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_a_broker_failure(inner) for inner in error.exceptions)
    if isinstance(error, anyio.get_cancelled_exc_class()):
        return stray_cancellation()  # (taken back on the task, if it was asked of it)
    return isinstance(error, Exception) and anyio.current_effective_deadline() != -math.inf


def _held(envelope: Envelope, due: float) -> Envelope:
    """``envelope`` as the broker's scheduled group keeps it."""
    headers = dict(envelope.headers)
    headers[HEADER_DUE] = due_header(due)
    headers[HEADER_TOPIC] = envelope.topic
    return replace_headers(envelope, MappingProxyType(headers), SCHEDULED)


def _released(envelope: Envelope, topic: str) -> Envelope:
    """A held envelope as it is published: its own topic and headers back."""
    headers = {
        name: value
        for name, value in envelope.headers.items()
        if name not in (HEADER_DUE, HEADER_TOPIC)
    }
    return replace_headers(envelope, MappingProxyType(headers) if headers else EMPTY_HEADERS, topic)
