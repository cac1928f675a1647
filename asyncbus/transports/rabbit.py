"""The RabbitMQ transport: a topic exchange, one quorum queue per group, confirmed publishes.

Broker names (all under ``prefix``, ``asyncbus`` by default):

* ``{prefix}``: the durable topic exchange every envelope is published to, with its
  topic as the routing key.
* ``{prefix}.{pattern}@{group}``: one durable quorum queue per (pattern, group), bound
  to the exchange with the pattern as an AMQP binding key: ``*`` stays ``*`` and a
  trailing ``>`` becomes ``*.#`` (AMQP's ``#`` also matches zero words, NATS's ``>``
  needs one or more, so ``orders.>`` must not match ``orders``). In pattern and group,
  characters AMQP names do not take (``*``, ``>``, ``<``...) and ``+`` and ``@``
  themselves become ``+XX`` (UTF-8 bytes in hex), so two bindings never share a
  queue; a name over 200 bytes is cut and ends in a hash of the whole.
* ``{queue}.retry.{ms}``: classic queues where delayed retries wait ``ms``
  milliseconds (``x-message-ttl``) and are then dead-lettered back to ``{queue}``
  through the default exchange. A delay is rounded up to one of 16 buckets per
  doubling (at most 6.25 % later), so each queue holds one delay and no retry waits
  behind a longer one (per-message TTLs only expire at the head of a queue). Unused
  retry queues expire (``x-expires``).
* ``{prefix}.deadletters``: a fanout exchange and a classic queue of dead-letter
  documents (``x-message-ttl`` = ``dead_letter_ttl``, ``x-max-length`` =
  ``dead_letter_maxlen``, as they were when the queue was first declared; listing
  applies the current values), and ``{prefix}.deadletters.lock``, an exclusive queue
  that exists while one process reads or edits the dead letters.

How it works:

* **Messages.** Body = the codec's bytes; header ``asyncbus-meta`` = the envelope's
  other fields as JSON; ``message_id`` = the envelope id; persistent. On delivery,
  ``attempt`` = the stored attempt + the quorum queue's ``x-delivery-count`` (every
  return to the queue counts: a consumer that left, timed out or died).
* **Publishing** returns once the broker confirmed (publisher confirms). A publish
  interrupted by a lost connection is retried on the next one until
  ``publish_timeout``: one whose confirm was lost may arrive twice (at-least-once;
  ``deduplicate()`` handles it).
* **Consuming.** A channel per subscription with ``basic.qos(prefetch)`` and manual
  acks; consuming starts at the first iteration. Acks are written behind by one task
  within a turn of the event loop: one ``multiple`` ack per contiguous run of settled
  delivery tags, single acks for the rest, so a slow delivery never holds back the
  acks of later ones.
* **nack** republishes the envelope with ``attempt + 1`` to the group's queue (or to a
  retry queue when delayed), waits for the confirm, then acks the original. **reject**
  publishes the dead letter, waits for the confirm, then acks. If the publish fails
  the original goes back to the queue (``basic.nack``) and the call raises.
* **ack_timeout.** AMQP has no visibility timeout, so the client keeps one: a
  delivery handed out and not settled within ``ack_timeout`` means its consumer is
  stuck. The consumer is cancelled at the broker, its overdue deliveries and those
  it received but did not hand out yet are nacked back to the queue (another
  consumer gets them at once), and it consumes again at its next iteration. Settling
  an overdue delivery later raises :class:`TransportError`. A killed process's
  deliveries go back to the queue when its connection drops (broker-native).
* **Leaving** a subscription cancels its consumer, writes its pending acks and closes
  its channel, shielded from cancellation: everything unsettled goes back to the
  queue at once (never stuck on a consumer that is gone).
* **Reconnecting.** Publishing and consuming use two connections. When either
  drops, both are closed and reopened with exponential, jittered backoff (up to
  ``max_backoff``); publishes wait for it (up to ``publish_timeout``) and
  subscriptions consume again. The broker returns the deliveries of the lost
  connection to their queues; settling one of them raises :class:`TransportError`.
* **Dead letters** are read under the lock by consuming the whole dead-letter queue
  on a fresh channel, acking the entries to drop (past the TTL, beyond the maximum
  length, or removed) and closing the channel, which puts every other entry back in
  its place, in order.
* **backlog** = the ready messages of the group's queue and of the retry queues this
  process used, plus the deliveries this process's consumers hold (after a round trip
  on each consumer channel, so none is in flight uncounted). Deliveries held by
  other processes are not counted (AMQP does not tell).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import random
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from .._dead_letters import DeadLetter, DeadLetterReason
from .._envelope import Envelope
from .._exceptions import (
    ConfigurationError,
    ConnectError,
    DecodeError,
    EncodeError,
    TransportError,
)
from .._routing import compile_pattern, validate_topic
from ._codec import (
    Codec,
    dead_letter_from_wire,
    dead_letter_to_wire,
    envelope_from_wire,
    envelope_meta,
)
from .base import Capabilities, Delivery, Transport

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage
    from pamqp.commands import Basic
    from pamqp.common import FieldTable

__all__ = ["RabbitTransport"]

logger = logging.getLogger("asyncbus")

T = TypeVar("T")

_EXTRA_MISSING = "RabbitTransport needs the 'rabbit' extra: pip install 'asyncbus[rabbit]'"
#: Header carrying the envelope's fields (all but the payload) as JSON.
META_HEADER = "asyncbus-meta"
#: Quorum queues count the returns of a message in this header.
_DELIVERY_COUNT = "x-delivery-count"
#: AMQP limits names, routing and binding keys to 255 bytes; retry queues add a suffix.
_NAME_LIMIT = 200
_KEY_LIMIT = 255
#: Largest ``asyncbus-meta`` header: the whole content header must fit in one frame.
_META_LIMIT = 64 * 1024
_BACKOFF_MIN = 0.05
#: Seconds a leaving consumer, or one found stuck, may take to give its deliveries back.
_RELEASE_TIMEOUT = 5.0
#: Idle seconds after which a dead-letter read asks whether it has everything.
_DEAD_IDLE = 0.05
#: Unused retry queues are deleted after twice their delay plus this (ms).
_RETRY_EXPIRES_MS = 10 * 60 * 1000
#: The largest x-message-ttl RabbitMQ accepts (about 49 days).
_TTL_MAX_MS = 2**32 - 1

# Delivery states (``None``: handed out or waiting, not settled).
_SETTLED = "settled"
_EXPIRED = "expired"
_LOST = "lost"
_RELEASED = "released"
_RETURNED = "returned"

_STATE_MESSAGES = {
    _SETTLED: "was already settled",
    _EXPIRED: "was not settled within ack_timeout and went back to the queue",
    _LOST: "came over a connection that was lost: the broker delivers it again",
    _RELEASED: "was released when its subscription ended",
    _RETURNED: "went back to the queue",
}


def _redact(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


#: What AMQP clients accept in queue and exchange names (pamqp checks it).
_NAME_CHARACTERS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:#,/ "
)


def _escape(name: str) -> str:
    # Injective: every byte outside the safe set, and the escape ``+`` and the
    # separator ``@`` themselves, become ``+XX``.
    if all(character in _NAME_CHARACTERS for character in name):
        return name
    return "".join(
        character
        if character in _NAME_CHARACTERS
        else "".join(f"+{byte:02X}" for byte in character.encode())
        for character in name
    )


def _bounded(name: str) -> str:
    """``name``, or its first bytes and a hash of it when it is too long for AMQP."""
    data = name.encode()
    if len(data) <= _NAME_LIMIT:
        return name
    digest = hashlib.sha256(data).hexdigest()[:16]
    return data[: _NAME_LIMIT - 17].decode(errors="ignore") + "#" + digest


def binding_key(pattern: str) -> str:
    """The AMQP binding key of a NATS-style ``pattern``.

    ``*`` is one word in both; NATS's trailing ``>`` (one or more tokens) becomes
    ``*.#`` (one word, then zero or more).

    :raises ConfigurationError: for an invalid pattern, a token AMQP reads as a
        wildcard (``#``), or a key over 255 bytes.
    """
    compile_pattern(pattern)
    words: list[str] = []
    for token in pattern.split("."):
        if token == "#":
            raise ConfigurationError(
                f"pattern {pattern!r}: a '#' token cannot be bound in RabbitMQ "
                "(it is AMQP's multi-word wildcard)"
            )
        words.append("*.#" if token == ">" else token)
    key = ".".join(words)
    if len(key.encode()) > _KEY_LIMIT:
        raise ConfigurationError(f"pattern {pattern!r} is longer than AMQP's 255-byte keys")
    return key


def delay_bucket_ms(delay: float) -> int:
    """Milliseconds a retry delayed by ``delay`` seconds waits: rounded up, 16 per doubling."""
    ms = max(1, math.ceil(delay * 1000))
    if ms <= 16:
        return ms
    step = 1 << (ms.bit_length() - 5)
    return -(-ms // step) * step


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Marks the exception as retrieved (asyncio logs unretrieved ones).
    if not future.cancelled():
        future.exception()


def _spurious_cancel() -> bool:
    """Whether a ``CancelledError`` came from the client library, not a cancel request."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class _Verbatim:
    """A codec that always encodes to one body: a delivery's raw body, kept as it came."""

    content_type = "application/octet-stream"

    def __init__(self, body: bytes) -> None:
        self.body = body

    def encode(self, value: Any) -> bytes:
        return self.body

    def decode(self, data: bytes) -> Any:
        return data


class _Link:
    """One generation of connections (publishing, consuming) and the shared channels."""

    def __init__(
        self,
        publisher: AbstractConnection,
        consumer: AbstractConnection,
        channel: AbstractChannel,
        on_lost: Callable[[_Link], None],
    ) -> None:
        self.publisher = publisher
        self.consumer = consumer
        #: Publishes, with confirms (reopened when the broker closed it).
        self.channel = channel
        self.channel_lock = anyio.Lock()
        #: Declarations and counts, one at a time (a failed one closes the channel).
        self.admin: AbstractChannel | None = None
        self.admin_lock = anyio.Lock()
        #: Queues declared and bound on this link.
        self.declared: set[str] = set()
        self.lost = anyio.Event()
        self._on_lost = on_lost

    def watch(self) -> None:
        for connection in (self.publisher, self.consumer):
            connection.closing.add_done_callback(self._closed)

    def _closed(self, future: asyncio.Future[Any]) -> None:
        _retrieve(future)
        if not self.lost.is_set():
            self.lost.set()
            self._on_lost(self)

    async def close(self) -> None:
        """Close both connections (shielded, bounded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
            for connection in (self.consumer, self.publisher):
                try:
                    await connection.close()
                except Exception as error:  # closing what is already broken
                    logger.debug("RabbitMQ: closing a connection failed: %s", error)


class _Consumer:
    """One channel of a subscription, and the acks it owes the broker."""

    __slots__ = ("acks", "channel", "consuming", "done", "lock", "next_tag", "tag")

    def __init__(self, channel: AbstractChannel) -> None:
        self.channel = channel
        self.tag = ""
        self.consuming = False
        #: Every delivery tag below this one is settled and written.
        self.next_tag = 1
        #: Settled tags from ``next_tag`` on (acked, or nacked one by one).
        self.done: set[int] = set()
        #: Tags settled by ``ack`` and not written yet.
        self.acks: list[int] = []
        self.lock = anyio.Lock()


class _RabbitDelivery:
    """A delivery from :class:`RabbitTransport`; settled exactly once."""

    __slots__ = (
        "_body",
        "_consumer",
        "_deadline",
        "_state",
        "_subscription",
        "_tag",
        "envelope",
        "error",
    )

    def __init__(
        self,
        subscription: _Subscription,
        consumer: _Consumer,
        tag: int,
        envelope: Envelope,
        body: bytes,
        error: str | None,
    ) -> None:
        self.envelope = envelope
        self.error = error
        self._subscription = subscription
        self._consumer = consumer
        self._tag = tag
        self._body = body
        self._state: str | None = None
        self._deadline = 0.0

    def _settle(self) -> _Subscription:
        state = self._state
        if state is not None:
            raise TransportError(
                f"delivery of {self.envelope.id} {_STATE_MESSAGES.get(state, state)}"
            )
        self._state = _SETTLED
        subscription = self._subscription
        subscription.handed.pop(self._tag, None)
        return subscription

    async def ack(self) -> None:
        """Done: acked at the broker, written behind with other acks (within a loop turn).

        A process that dies before the ack is written gets the message redelivered,
        as at-least-once delivery allows.
        """
        subscription = self._settle()
        subscription.transport._ack(self._consumer, self._tag)

    async def nack(self, *, delay: float | None = None) -> None:
        """Deliver it again (attempt + 1) to the group, after ``delay`` seconds.

        :raises TransportError: when it could not be republished (it then goes back
            to the queue as it is).
        """
        subscription = self._settle()
        await subscription.transport._retry(self, delay)

    async def reject(
        self, reason: str, *, error: str | None = None, stage: str | None = None
    ) -> None:
        """Store it as a dead letter (the body byte for byte), then ack it."""
        entry = DeadLetter(
            self.envelope,
            DeadLetterReason(reason),
            error,
            stage,
            self.envelope.attempt,
            time.time(),
        )
        subscription = self._settle()
        await subscription.transport._bury(self, entry)


class _Subscription:
    """One ``subscribe``: its consumer channel, what it received, and what it handed out."""

    def __init__(self, transport: RabbitTransport, pattern: str, group: str, prefetch: int):
        self.transport = transport
        self.pattern = pattern
        self.group = group
        self.prefetch = prefetch
        self.queue = transport.queue_name(pattern, group)
        self.consumer: _Consumer | None = None
        #: Received, not handed out yet (unsettled at the broker).
        self.ready: deque[_RabbitDelivery] = deque()
        #: Handed out and not settled, by delivery tag, oldest first.
        self.handed: dict[int, _RabbitDelivery] = {}
        self.wake = anyio.Event()
        #: Cancelled at the broker after a timeout; consumes again at the next iteration.
        self.suspended = False
        self.closed = False
        #: A channel whose consumer the broker cancelled, to be closed.
        self.stale: AbstractChannel | None = None

    def unsettled(self) -> int:
        return len(self.ready) + len(self.handed)

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> Delivery:
        while True:
            if self.closed:
                raise StopAsyncIteration
            if self.consumer is None or self.suspended:
                await self._consume()
                continue
            if self.ready:
                await anyio.lowlevel.checkpoint()
                if not self.ready or self.consumer is None:
                    continue
                delivery = self.ready.popleft()
                if delivery._state is not None:
                    continue
                delivery._deadline = time.monotonic() + self.transport.ack_timeout
                self.handed[delivery._tag] = delivery
                return delivery
            wake = self.wake = anyio.Event()
            await wake.wait()

    async def _consume(self) -> None:
        """Open a consumer channel if there is none, and (re)start consuming on it."""
        transport = self.transport
        backoff = _BACKOFF_MIN
        while True:
            if self.closed:
                return
            try:
                await self._close_stale()
                consumer = self.consumer
                if consumer is None:
                    link = await transport._wait_link(None)
                    await transport._declare_queue(link, self.queue, binding_key(self.pattern))
                    channel = await link.consumer.channel(publisher_confirms=False)
                    consumer = self.consumer = _Consumer(channel)
                    channel.closing.add_done_callback(partial(self._channel_closed, consumer))
                    cancelled = getattr(channel, "on_consumer_cancel_callbacks", None)
                    if cancelled is not None:
                        cancelled.add(partial(self._cancelled_by_broker, consumer))
                    await channel.basic_qos(prefetch_count=self.prefetch)
                consumer.tag = f"asyncbus.{transport._client_id}.{secrets.token_hex(4)}"
                await consumer.channel.basic_consume(
                    self.queue, partial(self._on_message, consumer), consumer_tag=consumer.tag
                )
                consumer.consuming = True
                self.suspended = False
                return
            except asyncio.CancelledError:
                if not _spurious_cancel():
                    raise
                problem: BaseException = TransportError("the connection closed")
            except TransportError:
                raise
            except transport._not_found as error:
                # The queue was deleted under us: declare it again.
                transport._forget_queue(self.queue)
                problem = error
            except transport._fatal as error:
                raise transport._failed(f"consuming {self.queue!r}", error) from error
            except Exception as error:
                problem = error
            if transport._closing:
                raise TransportError("RabbitTransport is closed")
            logger.warning(
                "RabbitMQ: consuming %s failed, retrying in %.2f s: %s",
                self.queue,
                backoff,
                problem,
            )
            await anyio.sleep(backoff * (0.5 + random.random() / 2))
            backoff = min(backoff * 2, transport.max_backoff)

    async def _close_stale(self) -> None:
        stale, self.stale = self.stale, None
        if stale is not None and not stale.is_closed:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
                try:
                    await stale.close()
                except Exception as error:
                    logger.debug("RabbitMQ: closing a stale channel failed: %s", error)

    async def _on_message(self, consumer: _Consumer, message: DeliveredMessage) -> None:
        if consumer is not self.consumer or self.closed:
            return  # a late delivery on a channel being closed: the broker requeues it
        self.ready.append(self.transport._incoming(self, consumer, message))
        if not self.wake.is_set():
            self.wake.set()

    def _channel_closed(self, consumer: _Consumer, future: asyncio.Future[Any]) -> None:
        _retrieve(future)
        if consumer is self.consumer:
            if not (self.closed or self.transport._closing):
                logger.warning(
                    "RabbitMQ: the channel consuming %s closed; consuming again", self.queue
                )
            self.lose(_LOST)

    async def _cancelled_by_broker(self, consumer: _Consumer, frame: Any) -> None:
        # The queue was deleted (or the broker cancelled us otherwise): declare it and
        # consume again on a new channel.
        if consumer is self.consumer and getattr(frame, "consumer_tag", None) == consumer.tag:
            logger.warning("RabbitMQ: the broker cancelled the consumer of %s", self.queue)
            self.stale = consumer.channel
            self.lose(_LOST)
            self.transport._forget_queue(self.queue)

    def lose(self, state: str) -> None:
        """Forget the current channel and every delivery received on it."""
        self.consumer = None
        self.suspended = False
        for delivery in self.ready:
            delivery._state = state
        for delivery in self.handed.values():
            delivery._state = state
        self.ready.clear()
        self.handed.clear()
        if not self.wake.is_set():
            self.wake.set()

    async def sync(self) -> None:
        """A round trip on the consumer channel: deliveries sent before it have arrived."""
        consumer = self.consumer
        if consumer is None or consumer.channel.is_closed:
            return
        try:
            await consumer.channel.basic_qos(prefetch_count=self.prefetch)
            await anyio.lowlevel.checkpoint()
        except asyncio.CancelledError:
            if not _spurious_cancel():
                raise
        except Exception:  # the channel is going: nothing in flight to wait for
            pass

    async def release(self) -> None:
        """Give back everything unsettled at once (shielded): cancel, write acks, close."""
        self.closed = True
        transport = self.transport
        transport._subscriptions.discard(self)
        consumer = self.consumer
        self.lose(_RELEASED)
        await self._close_stale()
        if consumer is None or consumer.channel.is_closed:
            return
        channel = consumer.channel
        with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT) as scope:
            try:
                if consumer.consuming:
                    consumer.consuming = False
                    await channel.basic_cancel(consumer.tag)
                # Acks before the close: what was acked must not come back.
                await transport._flush(consumer)
                await channel.close()
            except Exception as error:
                logger.warning(
                    "RabbitMQ: releasing the deliveries of %s failed (the broker returns "
                    "them when the connection closes): %s",
                    self.queue,
                    error,
                )
        if scope.cancelled_caught:
            logger.warning("RabbitMQ: releasing the deliveries of %s timed out", self.queue)


class RabbitTransport(Transport):
    """Envelopes in RabbitMQ: durable quorum queues shared by every process on the broker.

    Runs on asyncio only (aio-pika and its AMQP layer aiormq are asyncio libraries).

    :param url: the broker, ``amqp://user:password@host:port/vhost`` (query options such
        as ``heartbeat`` are passed to the client).
    :param prefix: the name of the exchange and the start of every queue name, so
        several buses (or tests) can share a broker.
    :param ack_timeout: seconds a delivery may stay handed out and unsettled before it
        goes back to the queue for another consumer (a hung handler); a killed
        process's deliveries go back at once, when its connection drops.
    :param codec: how payloads become bytes (JSON by default; never pickle).
    :param publish_timeout: longest a publish (or another broker call) waits for the
        broker, reconnecting included, before raising :class:`TransportError`.
    :param connect_timeout: longest one connection attempt may take.
    :param max_backoff: longest pause between two reconnection attempts.
    :raises ConfigurationError: for a non-positive timeout or an unusable prefix.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        delayed_nack=True,
        dedup=False,
        per_message_ttl=False,
        replay=True,
        durable=True,
        ordered=True,
    )
    name: ClassVar[str] = "rabbit"

    def __init__(
        self,
        url: str = "amqp://guest:guest@127.0.0.1:5672/",
        *,
        prefix: str = "asyncbus",
        ack_timeout: float = 30.0,
        codec: Codec | None = None,
        publish_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        max_backoff: float = 5.0,
    ) -> None:
        super().__init__(codec=codec)
        for label, value in (
            ("ack_timeout", ack_timeout),
            ("publish_timeout", publish_timeout),
            ("connect_timeout", connect_timeout),
            ("max_backoff", max_backoff),
        ):
            if not value > 0:
                raise ConfigurationError(f"{label} must be > 0, got {value}")
        if (
            not prefix
            or prefix.startswith("amq.")
            or len(prefix) > 100
            or not set(prefix) <= _NAME_CHARACTERS
        ):
            raise ConfigurationError(
                "prefix must be 1 to 100 letters, digits or '-_.:#,/ ' and not start "
                f"with 'amq.', got {prefix!r}"
            )
        self.url = url
        self.prefix = prefix
        self.ack_timeout = float(ack_timeout)
        self.publish_timeout = float(publish_timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_backoff = float(max_backoff)
        self.dead_letter_exchange = f"{prefix}.deadletters"
        self.dead_letter_queue = f"{prefix}.deadletters"
        self._lock_queue = f"{prefix}.deadletters.lock"
        self._client_id = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self._aiormq: Any = None
        self._properties: type[Basic.Properties] | None = None
        self._fatal: tuple[type[BaseException], ...] = ()
        self._not_found: type[BaseException] = LookupError
        self._link: _Link | None = None
        self._link_event = anyio.Event()
        self._closing = False
        self._task_group: TaskGroup | None = None
        self._subscriptions: set[_Subscription] = set()
        self._dirty: set[_Consumer] = set()
        self._ack_wake = anyio.Event()
        #: Retry queues used by this process, by work queue, with when they were declared.
        self._retry_queues: dict[str, dict[str, float]] = {}
        self._dead_lock = anyio.Lock()
        self._dead_args_warned = False
        self._queues_declared: set[str] = {self.dead_letter_queue}

    # -- names ----------------------------------------------------------------

    def queue_name(self, pattern: str, group: str) -> str:
        """The name of the quorum queue of (``pattern``, ``group``)."""
        return _bounded(f"{self.prefix}.{_escape(pattern)}@{_escape(group)}")

    def declared_names(self) -> tuple[list[str], list[str]]:
        """``(queues, exchanges)`` this transport declared since it was made (for clean-up)."""
        return sorted(self._queues_declared), [self.prefix, self.dead_letter_exchange]

    # -- life cycle -----------------------------------------------------------

    async def connect(self) -> None:
        """Connect, declare the exchanges and the dead-letter queue, start the helpers.

        :raises ConnectError: when aio-pika is missing or the broker cannot be reached.
        :raises TransportError: when not running on asyncio.
        """
        if self._task_group is not None:
            return
        try:
            import aio_pika  # noqa: F401  (the extra; its AMQP layer does the work)
            import aiormq
            import aiormq.exceptions as errors
            from pamqp.commands import Basic
        except ImportError as error:
            raise ConnectError(_EXTRA_MISSING) from error
        import sniffio

        library = sniffio.current_async_library()
        if library != "asyncio":
            raise TransportError(f"RabbitTransport runs on asyncio only (aiormq), not {library}")
        self._aiormq = aiormq
        self._properties = Basic.Properties
        self._fatal = (
            errors.ChannelAccessRefused,
            errors.ChannelNotFoundEntity,
            errors.ChannelLockedResource,
            errors.ChannelPreconditionFailed,
            errors.DeliveryError,
            errors.AuthenticationError,
            errors.ProbableAuthenticationError,
            errors.IncompatibleProtocolError,
        )
        # The client may fail a call on a closing connection with anything (a future
        # rejected with a bare Exception): all but a refusal or a bad argument is
        # taken for a lost connection and retried until publish_timeout.
        self._fatal = (*self._fatal, ValueError, TypeError)
        self._not_found = errors.ChannelNotFoundEntity
        self._closing = False
        try:
            link = await self._open_link()
        except Exception as error:
            reason = str(error) or type(error).__name__
            raise ConnectError(
                f"cannot connect to RabbitMQ at {_redact(self.url)}: {reason}"
            ) from error
        self._link = link
        self._link_event = anyio.Event()
        self._link_event.set()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        task_group.start_soon(self._supervise)
        task_group.start_soon(self._ack_loop)
        task_group.start_soon(self._expiry_loop)

    async def aclose(self) -> None:
        """Write pending acks, stop the helpers and close the connections (shielded)."""
        if self._task_group is None and self._link is None:
            return
        self._closing = True
        self._link_event.set()  # waiters wake up and see the transport closed
        with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
            for consumer in list(self._dirty):
                await self._flush(consumer)
        for subscription in list(self._subscriptions):
            subscription.lose(_LOST)
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        link, self._link = self._link, None
        if link is not None:
            await link.close()

    async def _open_link(self) -> _Link:
        """Open both connections and the publishing channel; declare the fixed names."""
        aiormq = self._aiormq
        opened: list[AbstractConnection] = []
        try:
            with anyio.fail_after(self.connect_timeout):
                for role in ("publisher", "consumer"):
                    connection = await aiormq.connect(
                        self.url,
                        client_properties={"connection_name": f"asyncbus {self.prefix} {role}"},
                    )
                    opened.append(connection)
                channel = await opened[0].channel(publisher_confirms=True)
                link = _Link(opened[0], opened[1], channel, self._link_lost)
                await self._declare_fixed(link)
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
                for connection in opened:
                    try:
                        await connection.close()
                    except Exception as error:
                        logger.debug("RabbitMQ: closing a half-open connection failed: %s", error)
            raise
        link.watch()
        if link.lost.is_set():
            raise TransportError("the connection closed while it was being set up")
        return link

    def _link_lost(self, link: _Link) -> None:
        if self._link is link and not self._closing:
            self._link_event = anyio.Event()

    async def _supervise(self) -> None:
        """Reconnect with exponential, jittered backoff whenever the connections drop."""
        while True:
            link = self._link
            assert link is not None
            await link.lost.wait()
            if self._closing:
                return
            logger.warning("RabbitMQ: connection to %s lost; reconnecting", _redact(self.url))
            for subscription in list(self._subscriptions):
                if subscription.consumer is not None:
                    subscription.lose(_LOST)
            await link.close()
            backoff = _BACKOFF_MIN
            while True:
                try:
                    new = await self._open_link()
                    break
                except Exception as error:
                    pause = backoff * (0.5 + random.random() / 2)
                    logger.warning(
                        "RabbitMQ: reconnecting to %s failed, retrying in %.2f s: %s",
                        _redact(self.url),
                        pause,
                        error or type(error).__name__,
                    )
                    await anyio.sleep(pause)
                    backoff = min(backoff * 2, self.max_backoff)
            self._link = new
            self._link_event.set()
            logger.warning("RabbitMQ: reconnected to %s", _redact(self.url))

    async def _wait_link(self, deadline: float | None) -> _Link:
        """The live link, waiting for a reconnection up to ``deadline`` (anyio time)."""
        while True:
            if self._closing:
                raise TransportError("RabbitTransport is closed")
            link = self._link
            if link is not None and not link.lost.is_set():
                return link
            if self._task_group is None:
                raise TransportError(
                    "RabbitTransport is not connected: use `async with transport` first"
                )
            event = self._link_event
            if deadline is None:
                await event.wait()
                continue
            with anyio.move_on_after(deadline - anyio.current_time()):
                await event.wait()
                continue
            raise TransportError(
                f"RabbitMQ at {_redact(self.url)} unreachable for {self.publish_timeout} s"
            )

    def _failed(self, what: str, error: BaseException) -> TransportError:
        return TransportError(f"RabbitMQ: {what} failed: {error or type(error).__name__}")

    async def _call(self, what: str, operation: Callable[[_Link], Awaitable[T]]) -> T:
        """Run ``operation`` on the live link; retry it on a lost connection or channel.

        :raises TransportError: on a broker refusal, or once ``publish_timeout`` passed.
        """
        deadline = anyio.current_time() + self.publish_timeout
        backoff = _BACKOFF_MIN
        while True:
            link = await self._wait_link(deadline)
            try:
                return await operation(link)
            except asyncio.CancelledError:
                if not _spurious_cancel():
                    raise
                problem: BaseException = TransportError("the connection closed")
            except TransportError:
                raise
            except self._fatal as error:
                raise self._failed(what, error) from error
            except Exception as error:
                problem = error
            if self._closing:
                raise TransportError("RabbitTransport is closed")
            if anyio.current_time() >= deadline:
                raise self._failed(what, problem) from problem
            if not link.lost.is_set():
                logger.warning(
                    "RabbitMQ: %s failed, retrying in %.2f s: %s",
                    what,
                    backoff,
                    problem or type(problem).__name__,
                )
                await anyio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self.max_backoff)

    async def _admin(self, link: _Link, operation: Callable[[AbstractChannel], Awaitable[T]]) -> T:
        """Run ``operation`` on the link's admin channel (opened again if closed)."""
        async with link.admin_lock:
            admin = link.admin
            if admin is None or admin.is_closed:
                admin = link.admin = await link.publisher.channel(publisher_confirms=False)
            return await operation(admin)

    # -- declarations ---------------------------------------------------------

    async def _declare_fixed(self, link: _Link) -> None:
        """The topic exchange, and the dead-letter exchange and queue."""
        aiormq = self._aiormq

        async def declare(channel: AbstractChannel) -> None:
            await channel.exchange_declare(self.prefix, exchange_type="topic", durable=True)
            await channel.exchange_declare(
                self.dead_letter_exchange, exchange_type="fanout", durable=True
            )

        await self._admin(link, declare)
        arguments: FieldTable = {
            "x-message-ttl": min(max(1, int(self.dead_letter_ttl * 1000)), _TTL_MAX_MS),
            "x-max-length": max(0, int(self.dead_letter_maxlen)),
        }
        try:
            await self._admin(
                link,
                lambda channel: channel.queue_declare(
                    self.dead_letter_queue, durable=True, arguments=arguments
                ),
            )
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            # Declared earlier with other limits: keep it (listing applies the current
            # dead_letter_ttl and dead_letter_maxlen anyway).
            if not self._dead_args_warned:
                self._dead_args_warned = True
                logger.warning(
                    "RabbitMQ: %s exists with other limits, kept as it is: %s",
                    self.dead_letter_queue,
                    error,
                )
            await self._admin(
                link,
                lambda channel: channel.queue_declare(self.dead_letter_queue, passive=True),
            )

        async def bind(channel: AbstractChannel) -> None:
            await channel.queue_bind(
                self.dead_letter_queue, self.dead_letter_exchange, routing_key=""
            )

        await self._admin(link, bind)

    async def _declare_queue(self, link: _Link, queue: str, key: str) -> None:
        """Declare the quorum queue of a group and bind it (once per link)."""
        if queue in link.declared:
            return

        async def declare(channel: AbstractChannel) -> None:
            await channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
            await channel.queue_bind(queue, self.prefix, routing_key=key)

        await self._admin(link, declare)
        link.declared.add(queue)
        self._queues_declared.add(queue)

    def _forget_queue(self, queue: str) -> None:
        link = self._link
        if link is not None:
            link.declared.discard(queue)

    async def _declare_group(self, pattern: str, group: str) -> str:
        queue = self.queue_name(pattern, group)
        key = binding_key(pattern)
        await self._call(f"declaring {queue!r}", lambda link: self._declare_queue(link, queue, key))
        return queue

    async def _retry_queue(self, link: _Link, queue: str, delay: float) -> str:
        """The retry queue for ``delay`` of work queue ``queue``, declared if need be."""
        ms = delay_bucket_ms(delay)
        name = f"{queue}.retry.{ms}"
        known = self._retry_queues.setdefault(queue, {})
        expires = 2 * ms + _RETRY_EXPIRES_MS
        now = time.monotonic()
        # Declaring again resets x-expires: a queue in use never expires under a retry.
        if name in link.declared and now - known.get(name, -math.inf) < expires / 2000:
            return name

        async def declare(channel: AbstractChannel) -> None:
            await channel.queue_declare(
                name,
                durable=True,
                arguments={
                    "x-message-ttl": ms,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": queue,
                    "x-expires": expires,
                },
            )

        await self._admin(link, declare)
        link.declared.add(name)
        self._queues_declared.add(name)
        known[name] = now
        return name

    # -- publishing -----------------------------------------------------------

    def _outgoing(
        self, envelope: Envelope, *, attempt: int | None = None, body: bytes | None = None
    ) -> tuple[bytes, Basic.Properties]:
        """Body and properties of the message carrying ``envelope``."""
        meta = envelope_meta(envelope)
        if attempt is not None:
            meta["attempt"] = attempt
        text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False)
        if len(text) > _META_LIMIT:
            raise EncodeError(
                f"envelope {envelope.id}: headers and fields take {len(text)} characters, "
                f"more than the {_META_LIMIT} an AMQP header frame can carry here"
            )
        if body is None:
            body = self.codec.encode(envelope.payload)
        properties = self._require_properties()(
            content_type=self.codec.content_type,
            delivery_mode=2,
            message_id=envelope.id,
            headers={META_HEADER: text},
        )
        return body, properties

    def _require_properties(self) -> type[Basic.Properties]:
        if self._properties is None or self._task_group is None:
            raise TransportError(
                "RabbitTransport is not connected: use `async with transport` first"
            )
        return self._properties

    async def _send(
        self,
        link: _Link,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Basic.Properties,
    ) -> None:
        channel = link.channel
        if channel.is_closed:
            async with link.channel_lock:
                if link.channel.is_closed:
                    link.channel = await link.publisher.channel(publisher_confirms=True)
            channel = link.channel
        await channel.basic_publish(
            body, exchange=exchange, routing_key=routing_key, properties=properties
        )

    async def _publish_one(
        self, exchange: str, routing_key: str, body: bytes, properties: Basic.Properties
    ) -> None:
        """Publish one message and wait for the broker's confirm (retried on a lost link)."""
        await self._call(
            f"publishing to {exchange or routing_key!r}",
            lambda link: self._send(link, exchange, routing_key, body, properties),
        )

    async def _publish_all(
        self, exchange: str, routing_key: str, messages: list[tuple[bytes, Basic.Properties]]
    ) -> None:
        if len(messages) == 1:
            body, properties = messages[0]
            await self._publish_one(exchange, routing_key, body, properties)
            return
        # Pipelined: sent in order (the channel writes them in call order), confirmed
        # together; the first failure is raised once every publish has ended.
        failures: list[BaseException] = []

        async def one(body: bytes, properties: Basic.Properties) -> None:
            try:
                await self._publish_one(exchange, routing_key, body, properties)
            except Exception as error:
                failures.append(error)

        async with anyio.create_task_group() as task_group:
            for body, properties in messages:
                task_group.start_soon(one, body, properties)
        if failures:
            raise failures[0]

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Publish each envelope to the topic exchange; return once the broker confirmed all.

        :raises EncodeError: when a payload cannot be encoded (nothing is published).
        :raises TransportError: when the broker refused them or stayed unreachable.
        """
        validate_topic(topic)
        if len(topic.encode()) > _KEY_LIMIT:
            raise ConfigurationError(f"topic {topic[:50]!r}... is longer than 255 bytes")
        self._require_properties()
        if envelopes:
            await self._publish_all(self.prefix, topic, [self._outgoing(e) for e in envelopes])

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Publish straight to the group's queue (default exchange), and no other."""
        self._require_properties()
        messages = [self._outgoing(e) for e in envelopes]
        queue = await self._declare_group(pattern, group)
        if messages:
            await self._publish_all("", queue, messages)

    # -- consuming ------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AsyncIterator[AsyncIterator[Delivery]]:
        """Join ``group`` on ``pattern``: its queue is declared and bound on entering.

        Consuming starts at the first iteration; leaving gives back every delivery
        not settled (shielded from cancellation).
        """
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if prefetch > 65535:
            raise ConfigurationError(f"prefetch must be <= 65535 in AMQP, got {prefetch}")
        self._require_properties()
        await self._declare_group(pattern, group)
        subscription = _Subscription(self, pattern, group, prefetch)
        self._subscriptions.add(subscription)
        try:
            yield subscription
        finally:
            with anyio.CancelScope(shield=True):
                await subscription.release()

    def _incoming(
        self, subscription: _Subscription, consumer: _Consumer, message: DeliveredMessage
    ) -> _RabbitDelivery:
        """The delivery of a received message; an unreadable one carries ``error``."""
        properties = message.header.properties
        headers = properties.headers or {}
        count = headers.get(_DELIVERY_COUNT) or 0
        if not isinstance(count, int):
            count = 0
        body = message.body
        tag = message.delivery_tag or 0
        error: str | None
        try:
            meta = headers.get(META_HEADER)
            if isinstance(meta, str):
                meta = meta.encode()
            if not isinstance(meta, bytes):
                raise DecodeError(f"the message has no {META_HEADER} header")
            envelope, error = envelope_from_wire(meta, body, self.codec)
            if count:
                envelope = envelope.evolve(attempt=envelope.attempt + count)
        except DecodeError as problem:
            # Nothing to rebuild: hand over a stand-in carrying the raw body, with the
            # error set, so it is dead-lettered instead of blocking the queue.
            topic = message.routing_key if message.exchange == self.prefix else None
            envelope = Envelope(
                id=properties.message_id or f"rabbit:{secrets.token_hex(8)}",
                topic=topic or subscription.pattern,
                payload=body,
                attempt=1 + count,
            )
            error = str(problem)
        return _RabbitDelivery(subscription, consumer, tag, envelope, body, error)

    # -- settling -------------------------------------------------------------

    def _ack(self, consumer: _Consumer, tag: int) -> None:
        consumer.done.add(tag)
        consumer.acks.append(tag)
        self._dirty.add(consumer)
        if not self._ack_wake.is_set():
            self._ack_wake.set()

    async def _flush(self, consumer: _Consumer) -> None:
        """Write the acks ``consumer`` owes: ``multiple`` for the contiguous run, single after."""
        self._dirty.discard(consumer)
        async with consumer.lock:
            acks, consumer.acks = consumer.acks, []
            if not acks:
                return
            fresh = set(acks)
            done = consumer.done
            tag = consumer.next_tag
            last = 0
            while tag in done:
                done.remove(tag)
                if tag in fresh:
                    last = tag
                tag += 1
            consumer.next_tag = tag
            channel = consumer.channel
            try:
                if last:
                    await channel.basic_ack(last, multiple=True)
                for single in acks:
                    if single >= tag:
                        await channel.basic_ack(single)
            except asyncio.CancelledError:
                if not _spurious_cancel():
                    raise
            except Exception as error:
                # The channel is gone; so are its deliveries (the broker returns them).
                logger.debug("RabbitMQ: acks lost with their channel: %s", error)

    async def _ack_loop(self) -> None:
        """Write acks as they come, in batches (what comes during a write goes next)."""
        while True:
            await self._ack_wake.wait()
            self._ack_wake = anyio.Event()
            for consumer in list(self._dirty):
                with anyio.CancelScope(shield=True):
                    await self._flush(consumer)

    async def _give_back(self, consumer: _Consumer, tags: Sequence[int]) -> None:
        """``basic.nack`` with requeue: the broker gives them to a consumer again."""
        async with consumer.lock:
            for tag in tags:
                consumer.done.add(tag)
            try:
                for tag in tags:
                    await consumer.channel.basic_nack(tag, requeue=True)
            except asyncio.CancelledError:
                if not _spurious_cancel():
                    raise
            except Exception as error:
                logger.debug("RabbitMQ: nack lost with its channel: %s", error)

    async def _retry(self, delivery: _RabbitDelivery, delay: float | None) -> None:
        """Republish ``delivery`` (attempt + 1), delayed or not, then ack it."""
        subscription = delivery._subscription
        queue = subscription.queue
        try:
            body, properties = self._outgoing(
                delivery.envelope, attempt=delivery.envelope.attempt + 1, body=delivery._body
            )
            if delay is not None and delay > 0:

                async def send(link: _Link) -> None:
                    name = await self._retry_queue(link, queue, delay)
                    await self._send(link, "", name, body, properties)

                await self._call(f"delaying a retry of {queue!r}", send)
            else:
                await self._publish_one("", queue, body, properties)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._give_back(delivery._consumer, [delivery._tag])
            raise
        self._ack(delivery._consumer, delivery._tag)

    async def _bury(self, delivery: _RabbitDelivery, entry: DeadLetter) -> None:
        """Publish ``entry`` (with the delivery's raw body) to the dead letters, then ack."""
        try:
            document = dead_letter_to_wire(entry, _Verbatim(delivery._body))
            await self._publish_dead(entry.envelope.id, document)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._give_back(delivery._consumer, [delivery._tag])
            raise
        self._ack(delivery._consumer, delivery._tag)

    # -- the ack timeout ------------------------------------------------------

    async def _expiry_loop(self) -> None:
        """Give back what stuck consumers hold (see the module docstring)."""
        interval = min(self.ack_timeout / 4, 1.0)
        while True:
            now = time.monotonic()
            wait = interval
            for subscription in list(self._subscriptions):
                if not subscription.handed:
                    continue
                first = next(iter(subscription.handed.values()))
                if first._deadline <= now:
                    with anyio.CancelScope(shield=True):
                        await self._expire(subscription, now)
                else:
                    wait = min(wait, first._deadline - now)
            await anyio.sleep(max(wait, 0.001))

    async def _expire(self, subscription: _Subscription, now: float) -> None:
        consumer = subscription.consumer
        overdue: list[_RabbitDelivery] = []
        for delivery in subscription.handed.values():
            if delivery._deadline > now:
                break
            overdue.append(delivery)
        for delivery in overdue:
            delivery._state = _EXPIRED
            del subscription.handed[delivery._tag]
        logger.warning(
            "RabbitMQ: %d deliveries of %s@%s not settled within ack_timeout=%s s; "
            "giving them (and what the consumer has not taken yet) back to the queue: %s",
            len(overdue),
            subscription.pattern,
            subscription.group,
            self.ack_timeout,
            ", ".join(delivery.envelope.id for delivery in overdue[:5]),
        )
        if consumer is None or consumer.channel.is_closed:
            return
        with anyio.move_on_after(_RELEASE_TIMEOUT):
            try:
                if consumer.consuming:
                    consumer.consuming = False
                    await consumer.channel.basic_cancel(consumer.tag)
            except asyncio.CancelledError:
                if not _spurious_cancel():
                    raise
            except Exception as error:
                logger.debug("RabbitMQ: cancelling a stuck consumer failed: %s", error)
            await anyio.lowlevel.checkpoint()  # deliveries sent before the cancel land
            waiting = [d for d in subscription.ready if d._state is None]
            if consumer is subscription.consumer:
                subscription.ready.clear()
                subscription.suspended = True
            for delivery in waiting:
                delivery._state = _RETURNED
            await self._give_back(consumer, [delivery._tag for delivery in overdue + waiting])
        if not subscription.wake.is_set():
            subscription.wake.set()

    # -- backlog --------------------------------------------------------------

    async def _ready_count(self, name: str) -> int | None:
        """Ready messages in queue ``name``; ``None`` when it does not exist."""
        aiormq = self._aiormq

        async def count(link: _Link) -> int | None:
            try:
                declared = await self._admin(
                    link, lambda channel: channel.queue_declare(name, passive=True)
                )
            except aiormq.exceptions.ChannelNotFoundEntity:
                return None
            return int(declared.message_count or 0)

        return await self._call(f"counting {name!r}", count)

    async def backlog(self, pattern: str, group: str) -> int:
        """Ready messages of the group (and its retries here) + what this process holds."""
        self._require_properties()
        queue = self.queue_name(pattern, group)
        total = 0
        if (count := await self._ready_count(queue)) is not None:
            total += count
        retries = self._retry_queues.get(queue, {})
        for name in list(retries):
            count = await self._ready_count(name)
            if count is None:
                retries.pop(name, None)  # expired
            else:
                total += count
        mine = [s for s in self._subscriptions if s.queue == queue]
        for subscription in mine:
            await subscription.sync()
        return total + sum(subscription.unsettled() for subscription in mine)

    # -- dead letters ---------------------------------------------------------

    async def _publish_dead(self, id: str, document: bytes) -> None:
        properties = self._require_properties()(
            content_type="application/json", delivery_mode=2, message_id=id
        )
        await self._publish_one(self.dead_letter_exchange, "", document, properties)

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter queue."""
        self._require_properties()
        await self._publish_dead(entry.envelope.id, dead_letter_to_wire(entry, self.codec))

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        return await self._edit_dead_letters(frozenset())

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Delete the dead letters of these envelope ids."""
        self._require_properties()
        if ids:
            await self._edit_dead_letters(frozenset(ids))

    async def _edit_dead_letters(self, drop: frozenset[str]) -> list[DeadLetter]:
        self._require_properties()
        async with self._dead_lock:
            return await self._call("reading the dead letters", partial(self._scan_dead, drop))

    async def _scan_dead(self, drop: frozenset[str], link: _Link) -> list[DeadLetter]:
        """Under the lock: read every dead letter, ack those to drop, put back the rest."""
        lock = await self._lock_dead(link)
        try:
            reader = await link.consumer.channel(publisher_confirms=False)
            try:
                messages = await self._read_dead(reader)
                return await self._sift_dead(reader, messages, drop)
            finally:
                # Closing returns every entry not acked, each to its place.
                with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
                    if not reader.is_closed:
                        await reader.close()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
                try:
                    if not lock.is_closed:
                        await lock.queue_delete(self._lock_queue)
                        await lock.close()
                except Exception as error:  # the lock goes with the connection anyway
                    logger.debug("RabbitMQ: releasing the dead-letter lock failed: %s", error)

    async def _lock_dead(self, link: _Link) -> AbstractChannel:
        """Hold the exclusive lock queue (another connection's declare is refused)."""
        aiormq = self._aiormq
        deadline = anyio.current_time() + self.publish_timeout
        backoff = _BACKOFF_MIN
        while True:
            channel = await link.consumer.channel(publisher_confirms=False)
            try:
                await channel.queue_declare(self._lock_queue, exclusive=True)
                return channel
            except aiormq.exceptions.ChannelLockedResource:
                pass  # the broker closed the channel
            except BaseException:
                with anyio.CancelScope(shield=True), anyio.move_on_after(_RELEASE_TIMEOUT):
                    if not channel.is_closed:
                        await channel.close()
                raise
            if anyio.current_time() >= deadline:
                raise TransportError(
                    f"RabbitMQ: the dead letters stayed locked by another process "
                    f"({self._lock_queue!r}) for {self.publish_timeout} s"
                )
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _read_dead(self, reader: AbstractChannel) -> list[DeliveredMessage]:
        """Consume the whole dead-letter queue (unacked) on ``reader``."""
        aiormq = self._aiormq
        try:
            declared = await reader.queue_declare(self.dead_letter_queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return []
        expected = int(declared.message_count or 0)
        if not expected:
            return []
        received: list[DeliveredMessage] = []
        arrived = [anyio.Event()]

        async def on_message(message: DeliveredMessage) -> None:
            received.append(message)
            arrived[0].set()

        await reader.basic_qos(prefetch_count=0)
        tag = f"asyncbus.{self._client_id}.dead.{secrets.token_hex(4)}"
        await reader.basic_consume(self.dead_letter_queue, on_message, consumer_tag=tag)
        while len(received) < expected:
            arrived[0] = anyio.Event()
            with anyio.move_on_after(_DEAD_IDLE):
                await arrived[0].wait()
                continue
            # Quiet: everything handed to us has arrived once the queue shows none ready
            # and a round trip on this channel came back after them.
            left = await reader.queue_declare(self.dead_letter_queue, passive=True)
            await reader.basic_qos(prefetch_count=0)
            await anyio.lowlevel.checkpoint()
            if not left.message_count:
                break
        await reader.basic_cancel(tag)
        await anyio.lowlevel.checkpoint()
        return list(received)

    async def _sift_dead(
        self, reader: AbstractChannel, messages: list[DeliveredMessage], drop: frozenset[str]
    ) -> list[DeadLetter]:
        horizon = time.time() - self.dead_letter_ttl
        kept: list[tuple[DeliveredMessage, DeadLetter]] = []
        gone: list[DeliveredMessage] = []
        for message in messages:
            try:
                entry = dead_letter_from_wire(message.body, self.codec)
            except DecodeError as error:
                logger.warning("RabbitMQ: skipping an unreadable dead letter: %s", error)
                continue
            if entry.dead_at <= horizon or entry.envelope.id in drop:
                gone.append(message)
            else:
                kept.append((message, entry))
        excess = len(kept) - max(self.dead_letter_maxlen, 0)
        if excess > 0:
            gone += [message for message, _ in kept[:excess]]
            kept = kept[excess:]
        for message in gone:
            await reader.basic_ack(message.delivery_tag or 0)
        return [entry for _, entry in kept]
