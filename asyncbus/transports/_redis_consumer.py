"""The consuming side of :class:`~.redis.RedisTransport`: a subscription's consumer reads
and reclaims the entries of its group, hands them out as deliveries, settles them,
keeps the ones it holds alive, and hands back what it holds when it ends (see the
transport's module docstring: reading, settling, attempts, crash recovery, hand-back).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import time
from collections import deque
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import DecodeError, EncodeError
from ._codec import (
    Codec,
    RawBody,
    dump_meta,
    encode_payload,
    envelope_from_wire,
    envelope_meta,
)
from ._kit import AckWriter, Backoff
from ._kit.cloudevents import event_attributes
from ._kit.options import checked_prefetch
from ._kit.plain import foreign_envelope, plain_envelope
from ._kit.redeliveries import over_max_deliveries
from ._kit.routes import is_inbox
from ._kit.verbatim import Verbatim
from ._redis_bindings import text
from ._redis_dedup import RedisHost
from .base import BaseDelivery, Delivery

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

    from ._redis_bindings import RedisBindings
    from ._redis_dead_letters import RedisDeadLetters
    from ._redis_delayed import DelayedRetries
    from ._redis_groups import RedisGroups
    from ._redis_publish import RedisPublisher

__all__ = ["RELEASE_TIMEOUT", "ConsumerHost", "RedisConsumer", "RedisDelivery"]

logger = logging.getLogger("asyncbus.transport.redis")

#: Seconds the hand-back of a leaving consumer may take before it is left to reclaim.
RELEASE_TIMEOUT = 5.0
#: Why a delivery its subscription gave back cannot be settled.
_RELEASED = "was released when its subscription ended"
#: Consumer that owns handed-back entries until a live consumer claims them.
_SENTINEL = "asyncbus:released"
#: Idle time given to handed-back entries: older than any ack_timeout.
_RELEASED_IDLE_MS = 365 * 24 * 3600 * 1000
#: Claim rounds between two sweeps for dead consumers that hold nothing.
_REAP_EVERY = 20
#: Longest pause between two failed reads.
_BACKOFF_MAX = 2.0


class ConsumerHost(RedisHost, Protocol):
    """What a consumer uses of its transport (:class:`~.redis.RedisTransport`)."""

    codec: Codec
    ack_timeout: float
    claim_interval: float
    block_ms: int
    max_deliveries: int
    #: The registered scripts of :mod:`._redis_scripts`, by name.
    _scripts: dict[str, AsyncScript]
    #: The consumers of the transport's subscriptions.
    _consumers: set[RedisConsumer]
    #: Acks written behind, by (stream, group).
    _acks: AckWriter[tuple[str, str], bytes]

    @property
    def _client(self) -> Redis | None:
        """The client (``None``: not connected, or closed)."""
        ...

    @property
    def _bindings(self) -> RedisBindings:
        """The bindings (to make a vanished stream again, to drop an inbox)."""
        ...

    @property
    def _publisher(self) -> RedisPublisher:
        """The writer (a dead letter on the replicas, with ``wait_replicas``)."""
        ...

    @property
    def _groups(self) -> RedisGroups:
        """The groups (which consumers read)."""
        ...

    @property
    def _shared_dead(self) -> RedisDeadLetters:
        """The dead-letter stream."""
        ...

    @property
    def _delayed(self) -> DelayedRetries:
        """The delayed retries."""
        ...

    def _shown(self) -> str:
        """The URLs given, credentials hidden."""
        ...

    def cleanup_scope(self, timeout: float = ...) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded, bounded scope for clean-up (see ``Transport.cleanup_scope``)."""
        ...


def _vanished(error: BaseException) -> bool:
    """Whether a Redis error says the stream or its group is gone."""
    message = str(error)
    return (
        message.startswith(("NOGROUP", "UNBLOCKED"))
        or "no such key" in message
        or "requires the key to exist" in message
    )


class RedisDelivery(BaseDelivery):
    """A delivery from :class:`~.redis.RedisTransport`; its acks are written behind.

    Acks are written together by the transport's writer (within a moment, before
    the subscription or the transport closes): a process that dies first gets the
    entry redelivered, as at-least-once delivery allows.
    """

    __slots__ = ("_body", "_consumer", "_entry")

    acks_behind = True

    def __init__(
        self,
        consumer: RedisConsumer,
        entry: bytes,
        envelope: Envelope,
        body: bytes,
        error: str | None,
    ) -> None:
        super().__init__(envelope, error)
        self._consumer = consumer
        self._entry = entry
        self._body = body

    def queued_at(self) -> float | None:
        """When Redis added the entry: the milliseconds of its id (Redis's clock)."""
        head = self._entry.split(b"-", 1)[0]
        return int(head) / 1000 if head.isdigit() else None

    def _settled(self) -> None:
        consumer = self._consumer
        # Room is made at once; if the settle fails, the entry stays pending and the
        # group reclaims it after ack_timeout.
        if consumer.held.pop(self._entry, None) is not None:
            consumer.room.set()

    def _retry_meta(self) -> bytes:
        meta = envelope_meta(self.envelope)
        meta["attempt"] = self.envelope.attempt + 1
        return dump_meta(meta)

    def _queue_ack(self) -> None:
        """XACK and XDEL the entry, batched with other acks."""
        consumer = self._consumer
        consumer.transport._acks.queue(
            consumer.ack_key, consumer.stage, self._entry, self.envelope.id
        )

    async def _nack(self, delay: float | None) -> None:
        """Add it again (attempt + 1) to the stream, or to the delayed set."""
        await self._consumer.settle(
            self._entry, retry=(self._retry_meta(), self._body), delay=delay
        )

    async def _reject(self, entry: DeadLetter) -> None:
        """Move it to the dead-letter stream and remove the entry, in one transaction.

        The dead letter keeps the body as it came (byte for byte, also when it did not
        decode).
        """
        await self._consumer.settle(self._entry, dead=(entry, self._body))


class RedisConsumer:
    """One subscription: a named consumer of a binding's group, and what it holds.

    It is what ``subscribe`` yields: an iterator of deliveries whose prefetch can
    change (:class:`~asyncbus.transports.SubscriptionControl`).
    """

    def __init__(
        self, transport: ConsumerHost, pattern: str, group: str, stream: str, prefetch: int
    ) -> None:
        self.transport = transport
        self.pattern = pattern
        self.group = group
        self.stream = stream
        self.prefetch = prefetch
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        #: The stage name, and what its acks are queued under (made once, not per ack).
        self.stage = f"{pattern}@{group}"
        self.ack_key = (stream, group)
        #: Entries delivered to this consumer and not settled (yielded or still ready).
        self.held: dict[bytes, RedisDelivery] = {}
        #: Fetched, not yet yielded.
        self.ready: deque[RedisDelivery] = deque()
        self.room = anyio.Event()
        self.claim_cursor: bytes | str = "0-0"
        self.next_claim = 0.0
        self.claim_rounds = 0
        self.backoff = Backoff(0.05, _BACKOFF_MAX)

    def __aiter__(self) -> RedisConsumer:
        return self

    async def __anext__(self) -> Delivery:
        """The next delivery: what is fetched, then (room permitting) a new fetch."""
        transport = self.transport
        while True:
            if not self.ready:
                while len(self.held) >= self.prefetch:
                    self.room = anyio.Event()
                    await self.room.wait()
                try:
                    await self._fetch()
                except transport._errors.RedisError as error:
                    # Lost connections, a server loading or out of memory, a stream
                    # made again meanwhile: none ends the subscription.
                    pause = self.backoff.next()
                    logger.warning(
                        "Redis at %s: reading %s@%s failed, retrying in %.2f s: %s",
                        transport._shown(),
                        self.pattern,
                        self.group,
                        pause,
                        error,
                    )
                    await anyio.sleep(pause)
                    continue
                self.backoff.reset()
                if not self.ready:
                    continue
            # No yield per delivery: a fetched batch is handed over in one go (the read
            # above is the yield; the stage's room bounds the batch).
            delivery = self.ready.popleft()
            if delivery.settleable:
                return delivery

    async def set_prefetch(self, prefetch: int) -> None:
        """Hold at most ``prefetch`` unsettled entries (see ``SubscriptionControl``);
        give back, uncounted, the entries fetched beyond it that were not handed out
        yet (the newest first)."""
        prefetch = checked_prefetch(prefetch)
        transport = self.transport
        self.prefetch = prefetch
        excess = min(len(self.held) - prefetch, len(self.ready))
        if excess <= 0:
            self.room.set()  # (room to fetch more, perhaps)
            return
        given = [self.ready.pop() for _ in range(excess)]
        for delivery in given:
            delivery.take_back(_RELEASED)
            del self.held[delivery._entry]
        with transport.cleanup_scope(RELEASE_TIMEOUT):
            try:
                await transport._scripts["GIVE_BACK"](
                    keys=[self.stream],
                    args=[
                        self.group,
                        self.name,
                        _SENTINEL,
                        _RELEASED_IDLE_MS,
                        *(delivery._entry for delivery in given),
                    ],
                )
            except transport._errors.RedisError as error:
                logger.warning(
                    "Redis: giving back %d entries of %s@%s failed (they return after "
                    "ack_timeout): %s",
                    len(given),
                    self.pattern,
                    self.group,
                    error,
                )
                return
        self._claim_now()

    async def flush(self) -> None:
        """Write the acks queued for this consumer's entries (see ``SubscriptionControl``)."""
        with self.transport.cleanup_scope(RELEASE_TIMEOUT):
            await self.transport._acks.flush([self.ack_key])

    def _claim_now(self) -> None:
        """Have every consumer of this stream look for entries to claim at its next read
        (entries were handed back)."""
        for other in self.transport._consumers:
            if other.stream == self.stream:
                other.next_claim = 0.0

    async def _fetch(self) -> None:
        """Fill :attr:`ready` with up to its room: reclaimed entries, else new ones."""
        transport = self.transport
        room = self.prefetch - len(self.held)
        now = time.monotonic()
        if now >= self.next_claim:
            self.next_claim = now + transport.claim_interval
            if await self._claim(room):
                return
        client = transport._redis()
        try:
            # The command itself, not ``client.xreadgroup``: its reply is read as it came
            # (see ``open_client``), without a dict per entry nor redis-py's wrapper per read.
            reply: Any = await client.execute_command(  # type: ignore[no-untyped-call]
                "XREADGROUP",
                "GROUP",
                self.group,
                self.name,
                "COUNT",
                room,
                "BLOCK",
                transport.block_ms,
                "STREAMS",
                self.stream,
                ">",
            )
        except transport._errors.ResponseError as error:
            if not _vanished(error):
                raise
            await self._rebind(error)
            return
        if not reply:
            return
        deliver = self._deliver
        for _stream, entries in reply.items() if isinstance(reply, dict) else reply:
            for entry, flat in entries:
                deliver(entry, flat, 1)

    async def _claim(self, room: int) -> int:
        """Take entries of the group idle for ``ack_timeout`` (dead or leaving consumers)."""
        transport = self.transport
        self.claim_rounds += 1
        try:
            if self.claim_rounds % _REAP_EVERY == 0:
                await transport._scripts["REAP"](
                    keys=[self.stream],
                    args=[self.group, int(transport.ack_timeout * 2000)],
                )
            reply: Any = await transport._scripts["CLAIM"](
                keys=[self.stream],
                args=[
                    self.group,
                    self.name,
                    int(transport.ack_timeout * 1000),
                    self.claim_cursor,
                    room,
                ],
            )
        except transport._errors.ResponseError as error:
            if not _vanished(error):
                raise
            await self._rebind(error)
            return 0
        cursor, claimed = reply
        self.claim_cursor = cursor
        delivered = 0
        for entry, flat, count in claimed:
            if entry in self.held:
                # Still held by this consumer (waiting in a local queue past ack_timeout):
                # claiming it only refreshed its idle time; delivering it again would
                # duplicate it. (Another consumer's entries are taken: it may be hung.)
                continue
            self._deliver(entry, flat, int(count))
            delivered += 1
        if claimed and cursor not in (b"0-0", "0-0"):
            self.next_claim = 0.0  # more may wait: look again at once
        return delivered

    async def _rebind(self, error: BaseException) -> None:
        """The stream or group is gone (deleted, flushed, a server restarted empty): make
        both again, and claim whatever the new group may need."""
        logger.warning(
            "Redis: the stream of %s@%s vanished (%s); re-creating it",
            self.pattern,
            self.group,
            error,
        )
        await self.transport._bindings.bind_raw(self.pattern, self.group)
        self.claim_cursor = "0-0"
        self.next_claim = 0.0

    def _deliver(self, entry: bytes, flat: list[bytes] | None, count: int) -> None:
        """Hand over the entry ``entry`` with fields ``flat`` (name, value, ...)."""
        fields: dict[bytes, bytes] | None = None
        if flat and len(flat) == 4 and flat[0] == b"meta" and flat[2] == b"body":
            meta, body = flat[1], flat[3]  # as this transport writes them
        else:  # written by another client, or fields gone: whatever is there
            fields = dict(zip(flat[::2], flat[1::2], strict=False)) if flat else {}
            meta = fields.get(b"meta", b"")
            body = fields.get(b"body", b"")
        error: str | None
        try:
            if fields is not None and b"meta" not in fields and fields:
                envelope, error, body = plain_entry(
                    entry, fields, self.pattern, count, self.transport.codec
                )
            else:
                envelope, error = envelope_from_wire(meta, body, self.transport.codec)
                if count > 1:
                    envelope = envelope.evolve(attempt=envelope.attempt + count - 1)
        except DecodeError as problem:
            # Nothing to rebuild: hand the bus a stand-in carrying the raw entry, with
            # the error set, so it is dead-lettered instead of blocking the group.
            envelope = Envelope(
                id=f"redis:{text(entry)}",
                topic=self.pattern,
                payload=RawBody(body),
                attempt=count,
            )
            error = str(problem)
        if error is None and count > 1:  # a first delivery is never one too many
            error = over_max_deliveries(count, self.transport.max_deliveries)
        delivery = RedisDelivery(self, entry, envelope, body, error)
        delivery.redeliveries = count - 1  # (a hand-back's count was put back)
        self.held[entry] = delivery
        self.ready.append(delivery)

    async def settle(
        self,
        entry: bytes,
        *,
        retry: tuple[bytes, bytes] | None = None,
        delay: float | None = None,
        dead: tuple[DeadLetter, bytes] | None = None,
    ) -> None:
        """XACK and XDEL ``entry``, with its re-add, delayed retry or dead letter, atomically.

        On a cluster whose bindings spread over slots the dead-letter stream is in
        another slot than the entry: the dead letter is written first, then the entry
        settled; cut off between the two, the entry is delivered again (and may be dead
        -lettered twice). A delayed retry stays with its binding, atomic with the ack,
        and is named in the prefix's index of bindings with retries before and after.
        """
        transport = self.transport
        spread = transport.cluster
        delayed = transport._delayed
        due = 0.0
        try:
            if dead is not None and spread:
                # (With wait_replicas, on the replicas of its master too: the ack after
                # it is on another master, which does not fail over with this one.)
                store = transport._shared_dead
                add = functools.partial(store.add_on, entry=dead[0], codec=Verbatim(dead[1]))
                await transport._publisher.replicated(add, key=store.dead_key)
            pipe = transport._redis().pipeline(transaction=True)
            if retry is not None:
                meta, body = retry
                if delay is not None and delay > 0:
                    due = delayed.queue(pipe, self.stream, meta, body, delay)
                    if spread:
                        await delayed.index(self.stream, due)
                else:
                    pipe.xadd(self.stream, {"meta": meta, "body": body})
            if dead is not None and not spread:
                transport._shared_dead.queue(pipe, dead[0], Verbatim(dead[1]))
            pipe.xack(self.stream, self.group, entry)
            pipe.xdel(self.stream, entry)
            await pipe.execute()
            if due and spread:  # (a mover may have written a later time meanwhile)
                await delayed.index_again(self.stream, due)
        except transport._errors.RedisError as error:
            raise transport._failed(f"settling {text(entry)} of {self.stream}", error) from error
        if due and due < delayed.next_due:
            delayed.wake.set()

    async def keep_entries_alive(self) -> None:
        """Reset the idle time of what this consumer holds, until it leaves."""
        transport = self.transport
        while True:
            await anyio.sleep(transport.ack_timeout / 3)
            if self not in transport._consumers:
                return
            held = list(self.held)
            if not held:
                continue
            try:
                await transport._scripts["TOUCH"](
                    keys=[self.stream], args=[self.group, self.name, *held]
                )
            except Exception as error:  # keep trying: a failed round only risks a reclaim
                logger.warning("Redis: keeping %d entries alive failed: %s", len(held), error)

    async def release(self) -> None:
        """Hand back what this consumer holds (see the transport's module docstring), or
        delete it when it is a request inbox; runs shielded."""
        transport = self.transport
        transport._consumers.discard(self)
        for delivery in self.held.values():
            delivery.take_back(_RELEASED)
        self.held.clear()
        self.ready.clear()
        if transport._client is None:
            return  # the transport closed first: the entries are reclaimed after ack_timeout
        if is_inbox(self.group):
            await transport._bindings.drop_inbox(self.stream, within=RELEASE_TIMEOUT)
            return
        with anyio.move_on_after(RELEASE_TIMEOUT):
            await transport._groups.tell_reading([self], ending=True)
        released = 0
        with anyio.move_on_after(RELEASE_TIMEOUT):
            try:
                # Acks first: what was acked must not be handed back.
                await transport._acks.flush()
                released = await transport._scripts["RELEASE"](
                    keys=[self.stream],
                    args=[self.group, self.name, _SENTINEL, _RELEASED_IDLE_MS],
                )
            except transport._errors.RedisError as error:
                logger.warning(
                    "Redis: handing back the entries of %s@%s failed (they return after "
                    "ack_timeout): %s",
                    self.pattern,
                    self.group,
                    error,
                )
        if released:
            self._claim_now()


def plain_entry(
    entry: bytes, fields: dict[bytes, bytes], pattern: str, count: int, codec: Codec
) -> tuple[Envelope, str | None, bytes]:
    """The envelope of an entry another client wrote without the bus's meta, why its
    body did not decode (``None``: it did), and its body as a retry writes it back.

    Its ``body`` field (or its only field) is the payload, decoded by the codec; an entry
    of several fields and no ``body`` is the payload itself, a dict of its fields as
    text. Its id is its ``id`` field, else ``redis:{entry id}``; its timestamp the entry
    id's milliseconds. Fields ``ce-*`` (or a ``content-type``) make it a CloudEvent."""
    entry_id = text(entry)
    stamp, _, _ = entry_id.partition("-")
    timestamp = int(stamp) / 1000 if stamp.isdigit() else None
    given = fields.get(b"id")
    try:
        named = given.decode() if given else None
    except UnicodeDecodeError:
        named = None
    envelope_id = named or f"redis:{entry_id}"
    body = fields.get(b"body")
    if body is None and len(fields) == 1:
        body = next(iter(fields.values()))
    content_type = fields.get(b"content-type")
    if body is None and content_type is None and event_attributes(fields) is None:
        # Several fields, no ``body``, not a CloudEvent: the payload is a dict of them.
        try:
            payload = {name.decode(): value.decode() for name, value in fields.items()}
            body = encode_payload(codec, payload)
        except (UnicodeDecodeError, EncodeError) as error:
            raise DecodeError(f"an entry without meta whose fields are not text: {error}") from None
        found = plain_envelope(
            body,
            codec,
            envelope_id=envelope_id,
            topic=pattern,
            attempt=count,
            timestamp=timestamp,
            payload=payload,
            decoded=True,
        )
        return (*found, body)
    # A plain body, or a CloudEvent (binary: ce-* fields and its data in ``body``;
    # structured: a ``content-type`` field saying so).
    body = body or b""
    found = foreign_envelope(
        body,
        codec,
        headers=fields,
        content_type=content_type.decode("utf-8", "replace") if content_type else None,
        skip=("body", "content-type", "id"),
        envelope_id=envelope_id,
        topic=pattern,
        attempt=count,
        timestamp=timestamp,
    )
    return (*found, body)
