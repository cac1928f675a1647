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
  queue; a name over 200 bytes is cut and ends in a hash of the whole. The queue of
  a bus's reply inbox (group ``_reply.*``, one per process) expires 5 minutes after
  its last consumer left.
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
  that exists while one process reads or edits the dead letters;
  ``{prefix}.deadletters.changes``, a fanout exchange announcing what was taken out,
  so every process's list follows (:class:`~._rabbit_dead_letters.DeadLetterNews`).
* ``{prefix}.catalog``: the names of the queues declared under the prefix, one
  message each (AMQP cannot list queues), for :meth:`RabbitTransport.delete_everything`.
* ``{prefix}.groups``: a fanout exchange each group is announced on when declared,
  and the durable queue (the register) bound to it, read at connect; see
  :mod:`._rabbit_groups`.

How it works:

* **Messages.** Body = the codec's bytes; header ``asyncbus-meta`` = the envelope's
  other fields as JSON; header ``asyncbus-queued`` = when it was published (ms since the
  epoch: a controlled stage's wait counts from then); ``message_id`` = the envelope
  id; persistent. On delivery,
  ``attempt`` = the stored attempt + the quorum queue's ``x-delivery-count`` (every
  return to the queue counts: a consumer that timed out or died). A message
  delivered more than ``max_deliveries`` times that way (plus the count a copy
  carries in ``asyncbus-deliveries``, below) is handed over with ``error`` set and
  dead-lettered ``rejected``; so is one that cannot be read (whatever another client
  wrote into the queue): it is acked, never left unacked.
* **Publishing** returns once the broker confirmed (publisher confirms), within
  ``publish_timeout``. Several envelopes in one call (``Bus.publish_many``) are
  pipelined: all sent, in order, then their confirms awaited together (one round trip
  for the lot); the call raises if any one is not confirmed. It first waits for the
  subscriptions of this process that are still declaring their queue. The bus's
  publishes are ``mandatory``: what no queue (of any process) is bound for comes back,
  and is stored as a ``no_subscribers`` dead letter. A publish interrupted by a lost
  connection is retried on the next one until ``publish_timeout``: one whose confirm
  was lost may arrive twice (at-least-once; ``deduplicate()`` handles it).
* **Consuming.** A channel per subscription with ``basic.qos(prefetch)`` and manual
  acks; consuming starts at the first iteration. The broker keeps a consumer's prefetch
  for its life, so a new prefetch (``set_prefetch``) is a new consumer on the channel,
  begun once fewer than the new size are held (with the room left as its prefetch);
  what the old one received beyond it and did not hand out goes back as copies, as at
  leaving. Acks are written behind by one task,
  within 20 ms, or at once when half the prefetch waits (a busy consumer writes one
  ack per ~half its prefetch, and the broker never stops sending for want of acks):
  one ``multiple`` ack per contiguous run of settled delivery tags, single acks for
  the rest, so a slow delivery never holds back the acks of later ones. AMQP never
  answers an ack, so each write ends with a round trip on its channel: acks count as
  taken once it is answered (a silent broker's are reported lost at close).
* **nack** republishes the envelope with ``attempt + 1`` to the group's queue (or to a
  retry queue when delayed), waits for the confirm, then acks the original. **reject**
  publishes the dead letter, waits for the confirm, then acks. If the publish fails
  the original goes back to the queue (``basic.nack``) and the call raises.
* **Held deliveries.** RabbitMQ gives an unacked delivery to another consumer only
  when its channel or connection closes (a process that dies), so with
  ``keep_alive=True`` (the default) nothing more is needed: a delivery held for a long
  handler, a full stage or a retry delay stays where it is and is never run twice.
  (The broker's ``consumer_timeout``, 30 minutes by default, closes a channel holding
  a delivery longer; keep retry delays below it.)
* **ack_timeout**, with ``keep_alive=False``. AMQP has no visibility timeout, so the
  client keeps one: a delivery handed out and not settled within ``ack_timeout``
  means its consumer is stuck. The consumer is cancelled at the broker, its overdue
  deliveries and those it received but did not hand out yet are nacked back to the
  queue (another consumer gets them at once), and it consumes again at its next
  iteration. Settling an overdue delivery later raises :class:`TransportError`. A
  killed process's deliveries go back to the queue when its connection drops
  (broker-native).
* **Leaving** a subscription cancels its consumer, hands back what it holds, writes
  its pending acks and closes its channel, shielded from cancellation: everything
  unsettled goes back to the queue at once (never stuck on a consumer that is gone).
  A quorum queue would count a message returned that way as a delivery, so a
  service restarted ``max_deliveries`` times would dead-letter what it held as
  poison: each held delivery goes back instead as a copy carrying its count of real
  deliveries (header ``asyncbus-deliveries``; the copy's own count starts at zero)
  and the original is acked once the copy is confirmed. The copies wait behind what
  is already in the queue (order is kept per consumer only between hand-backs); what
  cannot be copied (unreadable, or not confirmed in time) goes back as it is.
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
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import anyio
import anyio.lowlevel

from .._checks import check_count
from .._dead_letters import DeadLetter, dead_letter_key
from .._envelope import Envelope
from .._exceptions import (
    ConfigurationError,
    ConnectError,
    EncodeError,
    TransportError,
)
from .._failures import describe_error
from .._groups import GroupInfo
from .._routing import validate_topic
from . import _rabbit_groups
from ._codec import (
    Codec,
    dead_letter_to_wire,
    dump_meta,
    encode_payload,
    envelope_meta,
)
from ._kit import (
    AckWriter,
    Backoff,
    TaskOwner,
    check_url,
    redact,
    require_asyncio,
    require_extra,
    split_urls,
)
from ._kit.options import (
    DEFAULT_MAX_MESSAGE_SIZE,
    checked_max_message_size,
    checked_prefetch,
    checked_seconds,
    refuse_oversized,
)
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, HEADER_DELIVERIES, checked_max_deliveries
from ._kit.routes import INBOX_GROUP_PREFIX, unrouted_entry
from ._rabbit_channel import ConsumerChannel, retrieve, spurious_cancel
from ._rabbit_consumer import (
    BACKOFF_MIN,
    LOST,
    META_HEADER,
    PREFETCH_MAX,
    QUEUED_HEADER,
    RELEASE_TIMEOUT,
    RabbitDelivery,
    Subscription,
)
from ._rabbit_dead_letters import STALE, DeadLetterNews, DeadLetterScan
from ._rabbit_groups import GroupRegister
from ._rabbit_names import (
    KEY_LIMIT,
    NAME_CHARACTERS,
    binding_key,
    bounded,
    delay_bucket_ms,
    escape,
)
from ._rabbit_ticks import TickLeader
from ._registry import registered
from .base import Capabilities, DeadLetterChange, Delivery, TopicLimits, Transport

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection
    from pamqp.commands import Basic
    from pamqp.common import FieldTable

__all__ = ["META_HEADER", "RabbitTransport", "binding_key", "delay_bucket_ms"]

logger = logging.getLogger("asyncbus.transport.rabbit")

#: The URL schemes aiormq takes, and what a URL looks like (for errors).
_SCHEMES = tuple(registered("rabbit").schemes)
_URL_FORM = "amqp://user:password@host:port/vhost (amqps:// for TLS)"
#: The largest quorum queue group ``replicas`` may ask for.
_MAX_REPLICAS = 99

T = TypeVar("T")

_EXTRA_MISSING = "RabbitTransport needs the 'rabbit' extra: pip install 'asyncbus[rabbit]'"
#: Largest ``asyncbus-meta`` header: the whole content header must fit in one frame.
_META_LIMIT = 64 * 1024
#: Seconds the ack writer waits for more acks before writing (bounds their delay; a
#: channel with half its prefetch waiting is written at once).
_ACK_LINGER = 0.02
#: Unused retry queues are deleted after twice their delay plus this (ms).
_RETRY_EXPIRES_MS = 10 * 60 * 1000
#: Entries the catalog keeps (every process records its queues once: duplicates).
_CATALOG_MAX = 100_000
#: Queues of a bus's reply inbox (group ``_reply.{uuid}``, one per process) expire
#: (``x-expires``) this long after their last consumer left.
_INBOX_EXPIRES_MS = 5 * 60 * 1000
#: The largest x-message-ttl RabbitMQ accepts (about 49 days).
_TTL_MAX_MS = 2**32 - 1
#: Seconds a close whose deadline has passed still runs: enough for the client to
#: begin it and then cut it short (a close never begun leaves its socket open).
_CLOSE_CUT = 0.01


def _failure(outcome: object) -> BaseException | None:
    """What a gathered publish raised (``None``: confirmed); a publish the client
    cancelled (its channel closed) is a lost connection, retried."""
    if isinstance(outcome, asyncio.CancelledError):
        return ConnectionError("the channel closed before the confirm")
    return outcome if isinstance(outcome, BaseException) else None


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
        #: Queues recorded in the catalog, and groups announced, on this link: again on
        #: every new link, since a broker that restarted may have lost both records.
        self.catalogued: set[str] = set()
        self.announced: set[str] = set()
        #: The channel consuming the news of groups (closed with the connection).
        self.news: AbstractChannel | None = None
        self.lost = anyio.Event()
        self._on_lost = on_lost

    def watch(self) -> None:
        for connection in (self.publisher, self.consumer):
            connection.closing.add_done_callback(self._closed)

    def _closed(self, future: asyncio.Future[Any]) -> None:
        retrieve(future)
        if not self.lost.is_set():
            self.lost.set()
            self._on_lost(self)

    async def close(self, timeout: float = RELEASE_TIMEOUT) -> None:
        """Close both connections, together and shielded, within ``timeout`` seconds.

        A broker that does not answer the close in time is not waited for: the client
        cuts its close handshake short and closes the socket itself (which takes a
        moment, not a round trip), so no socket outlives the call.
        """
        # The client's own timeout, not a cancel scope: cancelled from outside before it
        # starts, a close would leave the connection open; timed out, it closes it.
        timeout = max(timeout, _CLOSE_CUT)

        async def close(connection: AbstractConnection) -> None:
            try:
                # (aiormq's Base.close takes the timeout; its abstract class omits it.)
                await connection.close(timeout=timeout)  # type: ignore[call-arg]
            except Exception as error:  # timed out, or closing what is already broken
                logger.debug("RabbitMQ: closing a connection failed: %r", error)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as closing:
                for connection in (self.consumer, self.publisher):
                    closing.start_soon(close, connection)


class RabbitTransport(Transport):
    """Envelopes in RabbitMQ: durable quorum queues shared by every process on the broker.

    Runs on asyncio only (aio-pika and its AMQP layer aiormq are asyncio libraries).

    :param url: the broker, ``amqp://user:password@host:port/vhost`` (query options such
        as ``heartbeat`` are passed to the client); or the nodes of one cluster, as a
        list or one string separated by commas: the transport connects to the first
        that answers, in turn from the one it used last, and after a lost connection
        to the next that does (its queues are the cluster's, so consumers and
        publishes go on there).
    :param replicas: the initial group size of the quorum queues it declares (RabbitMQ
        places that many replicas; ``None``: the broker's default, every node up to
        its ``quorum_queue.initial_group_size``). A queue that exists keeps its own.
    :param prefix: the name of the exchange and the start of every queue name, so
        several buses (or tests) can share a broker.
    :param ack_timeout: with ``keep_alive=False``, seconds a delivery may stay handed
        out and unsettled before it goes back to the queue for another consumer (a hung
        handler). A killed process's deliveries go back at once, when its connection
        drops, whatever the setting.
    :param codec: how payloads become bytes (JSON by default; never pickle).
    :param publish_timeout: longest a publish (or another broker call) waits for the
        broker, reconnecting included, before raising :class:`TransportError`.
    :param connect_timeout: longest one connection attempt may take.
    :param max_backoff: longest pause between two reconnection attempts.
    :param max_message_size: largest envelope (fields + body, in bytes) ``publish``
        accepts; a larger one is refused with :class:`TransportError` before anything
        is sent. (RabbitMQ's own limit, ``max_message_size`` in its configuration, is
        16 MiB by default since 4.0.)
    :param keep_alive: a delivery stays with its consumer however long it is held
        (queued in its stage, handled, waiting for a retry), so a long handler or a
        long retry delay is never run twice: RabbitMQ gives it to another consumer only
        when the connection (or channel) drops, which is what happens when a process
        dies. (RabbitMQ's own ``consumer_timeout``, 30 minutes by default, still closes
        a channel that holds one unacked longer.) Off, ``ack_timeout`` applies.
    :param max_deliveries: deliveries of one message (the quorum queue's
        ``x-delivery-count`` + 1), none settled, after which the next one is handed
        over with ``error`` set (the bus dead-letters it ``rejected``).
    :raises ConfigurationError: for a URL without a scheme, with another broker's or
        the web's (not ``amqp``, ``amqps``) or with a bad port, a timeout, size or cap
        that is not a positive number in range (NaN, infinities, bools, huge values
        included), or an unusable prefix.
    :raises ImportError: (also a ``ConnectError`` and a ``ConfigurationError``) when
        aio-pika is not installed: the message names the extra.
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
    #: Every publish awaits the broker's confirmation (the call's one yield).
    publish_waits: ClassVar[bool] = True
    #: A topic is the routing key, a pattern the binding key: AMQP short strings.
    limits: TopicLimits = TopicLimits(
        max_topic_bytes=KEY_LIMIT,
        max_pattern_bytes=KEY_LIMIT,
        why=f"AMQP's routing and binding keys hold at most {KEY_LIMIT} bytes",
    )

    def __init__(
        self,
        url: str | Sequence[str] = "amqp://guest:guest@127.0.0.1:5672/",
        *,
        prefix: str = "asyncbus",
        ack_timeout: float = 30.0,
        codec: Codec | None = None,
        publish_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        max_backoff: float = 5.0,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        keep_alive: bool = True,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        replicas: int | None = None,
    ) -> None:
        super().__init__(codec=codec)
        require_extra("RabbitTransport", "rabbit", "aio_pika", "aiormq", "pamqp")
        check_url("RabbitTransport", url, _SCHEMES, _URL_FORM)
        if replicas is not None:
            check_count(replicas, "RabbitTransport: replicas", 1, _MAX_REPLICAS)
        ack_timeout, publish_timeout, connect_timeout, max_backoff = (
            checked_seconds(value, f"RabbitTransport: {label}")
            for label, value in (
                ("ack_timeout", ack_timeout),
                ("publish_timeout", publish_timeout),
                ("connect_timeout", connect_timeout),
                ("max_backoff", max_backoff),
            )
        )
        if not isinstance(keep_alive, bool):
            raise ConfigurationError(
                f"RabbitTransport: keep_alive must be a bool, got {keep_alive!r}"
            )
        if (
            not isinstance(prefix, str)
            or not prefix
            or prefix.startswith("amq.")
            or len(prefix) > 100
            or not set(prefix) <= NAME_CHARACTERS
        ):
            raise ConfigurationError(
                "prefix must be 1 to 100 letters, digits or '-_.:#,/ ' and not start "
                f"with 'amq.', got {prefix!r}"
            )
        #: Every URL given, in order (the nodes of one cluster, or one broker).
        self.servers = split_urls(url)
        #: The URL in use: the last one connected to (the first before any).
        self.url = self.servers[0]
        self.replicas = replicas
        self.prefix = prefix
        self.max_message_size = checked_max_message_size(max_message_size)
        self.max_deliveries = checked_max_deliveries(max_deliveries)
        self.keep_alive = keep_alive
        self.ack_timeout = ack_timeout
        self.publish_timeout = publish_timeout
        self.connect_timeout = connect_timeout
        self.max_backoff = max_backoff
        self.dead_letter_exchange = f"{prefix}.deadletters"
        self.dead_letter_queue = f"{prefix}.deadletters"
        self._lock_queue = f"{prefix}.deadletters.lock"
        self._dead_news = DeadLetterNews(
            self.dead_letter_exchange, f"{prefix}.deadletters.changes", self.codec
        )
        self._catalog = f"{prefix}.catalog"
        self._client_id = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self._aiormq: Any = None
        self._properties: type[Basic.Properties] | None = None
        self._fatal: tuple[type[BaseException], ...] = ()
        self._not_found: type[BaseException] = LookupError
        self._returned: type[BaseException] = LookupError
        self._link: _Link | None = None
        self._link_event = anyio.Event()
        self._closing = False
        #: The background tasks: reconnecting, writing acks, the ack timeout.
        self._tasks = TaskOwner("RabbitTransport")
        self._subscriptions: set[Subscription] = set()
        #: Acks written behind, by consumer channel (a channel lost loses its acks: the
        #: broker returns those deliveries to the queue).
        self._acks = AckWriter[ConsumerChannel, int](
            "RabbitTransport",
            self._write_acks,
            self.cleanup_scope,
            linger=_ACK_LINGER,
            timeout=RELEASE_TIMEOUT,
        )
        #: Retry queues used by this process, by work queue, with when they were declared.
        self._retry_queues: dict[str, dict[str, float]] = {}
        self._dead_lock = anyio.Lock()
        #: Subscriptions declaring their queue now, and an event set when none is left.
        self._joining = 0
        self._joins_done = anyio.Event()
        self._dead_args_warned = False
        #: Groups recorded in the broker (read at connect, then as announced).
        self._groups = GroupRegister(prefix)

    # -- names ----------------------------------------------------------------

    def queue_name(self, pattern: str, group: str) -> str:
        """The name of the quorum queue of (``pattern``, ``group``)."""
        return bounded(f"{self.prefix}.{escape(pattern)}@{escape(group)}")

    # -- life cycle -----------------------------------------------------------

    async def __aenter__(self) -> RabbitTransport:
        await self.connect()
        return self

    async def connect(self) -> None:
        """Connect, declare the exchanges and the dead-letter queue, start the helpers.

        :raises ConnectError: when aio-pika is missing or the broker cannot be reached.
        :raises TransportError: when not running on asyncio.
        """
        if self._tasks.running:
            return
        try:
            import aio_pika  # noqa: F401  (the extra; its AMQP layer does the work)
            import aiormq
            import aiormq.exceptions as errors
            from pamqp.commands import Basic
        except ImportError as error:
            raise ConnectError(_EXTRA_MISSING) from error
        require_asyncio("RabbitTransport", "aiormq")
        self._aiormq = aiormq
        self._properties = Basic.Properties
        # The client may fail a call on a closing connection with anything (a future
        # rejected with a bare Exception): all but these (the broker refused, or an
        # argument is wrong) is taken for a lost connection and retried until
        # publish_timeout.
        self._fatal = (
            errors.ChannelAccessRefused,
            errors.ChannelNotFoundEntity,
            errors.ChannelLockedResource,
            errors.ChannelPreconditionFailed,
            errors.DeliveryError,
            errors.AuthenticationError,
            errors.ProbableAuthenticationError,
            errors.IncompatibleProtocolError,
            ValueError,
            TypeError,
        )
        self._not_found = errors.ChannelNotFoundEntity
        self._returned = errors.PublishError
        self._closing = False
        try:
            link = await self._open_link()
        except Exception as error:
            reason = str(error) or type(error).__name__
            raise ConnectError(
                f"cannot connect to RabbitMQ at {redact(self.url)}: {reason}"
            ) from error
        self._link = link
        self._link_event = anyio.Event()
        self._link_event.set()
        await self._tasks.open()
        self._acks.open()
        self._tasks.start_soon(self._supervise)
        self._tasks.start_soon(self._acks.run)
        self._tasks.start_soon(self._expiry_loop)

    async def aclose(self) -> None:
        """Write pending acks, stop the helpers and close the connections (shielded)."""
        if not self._tasks.running and self._link is None:
            return
        self._closing = True
        self._link_event.set()  # waiters wake up and see the transport closed
        with self.cleanup_scope(RELEASE_TIMEOUT):
            await self._acks.flush()
        self._acks.close()  # what the deadline cut short is lost (and redelivered)
        for subscription in list(self._subscriptions):
            subscription.lose(LOST)
        await self._tasks.aclose()
        link, self._link = self._link, None
        if link is not None:
            # By the close deadline, however silent the broker: a close it does not
            # answer in time is cut short, and the client closes the sockets itself.
            left = self.close_deadline - anyio.current_time()
            await link.close(max(0.0, min(RELEASE_TIMEOUT, left)))

    async def _open_link(self) -> _Link:
        """Open a link to the first node that answers, from the one used last.

        :raises Exception: what the last node tried raised (each is logged).
        """
        start = self.servers.index(self.url)
        order = self.servers[start:] + self.servers[:start]
        *others, last = order
        for index, url in enumerate(others):
            try:
                link = await self._open_link_to(url)
            except Exception as error:
                logger.warning(
                    "RabbitMQ: %s does not answer (%s); trying %s",
                    redact(url),
                    describe_error(error),
                    redact(order[index + 1]),
                )
                continue
            self.url = url
            return link
        link = await self._open_link_to(last)
        self.url = last
        return link

    async def _open_link_to(self, url: str) -> _Link:
        """Open both connections and the publishing channel; declare the fixed names."""
        aiormq = self._aiormq
        opened: list[AbstractConnection] = []
        try:
            with anyio.fail_after(self.connect_timeout):
                for role in ("publisher", "consumer"):
                    connection = await aiormq.connect(
                        url,
                        client_properties={"connection_name": f"asyncbus {self.prefix} {role}"},
                    )
                    opened.append(connection)
                channel = await opened[0].channel(publisher_confirms=True)
                link = _Link(opened[0], opened[1], channel, self._link_lost)
                await self._declare_fixed(link)
                # Groups declared by anyone from now on, then those declared before.
                link.news = await self._groups.listen(link.consumer)
                await self._groups.read(
                    link.consumer,
                    lock_timeout=self.publish_timeout,
                    tag=f"asyncbus.{self._client_id}.groups.{secrets.token_hex(4)}",
                )
        except BaseException:  # deliberate: close what was opened on any way out
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                for connection in opened:
                    try:
                        await connection.close()
                    except Exception as error:
                        logger.debug("RabbitMQ: closing a half-open connection failed: %s", error)
            raise
        link.watch()
        if link.lost.is_set():
            await link.close()  # the other connection may still be open
            raise TransportError("the connection closed while it was being set up")
        return link

    def _link_lost(self, link: _Link) -> None:
        self._dead_news.lost(link.consumer)  # its watchers' queues are gone
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
            logger.warning("RabbitMQ: connection to %s lost; reconnecting", redact(self.url))
            for subscription in list(self._subscriptions):
                if subscription.consumer is not None:
                    subscription.lose(LOST)
            await link.close()
            backoff = Backoff(BACKOFF_MIN, self.max_backoff, jitter=True)
            while True:
                try:
                    new = await self._open_link()
                    break
                except Exception as error:
                    pause = backoff.next()
                    logger.warning(
                        "RabbitMQ: reconnecting to %s failed, retrying in %.2f s: %s",
                        redact(self.url),
                        pause,
                        error or type(error).__name__,
                    )
                    await anyio.sleep(pause)
            self._link = new
            self._link_event.set()
            logger.info("RabbitMQ: reconnected to %s", redact(self.url))

    async def _wait_link(self, deadline: float | None) -> _Link:
        """The live link, waiting for a reconnection up to ``deadline`` (anyio time)."""
        while True:
            if self._closing:
                raise TransportError("RabbitTransport is closed")
            link = self._link
            if link is not None and not link.lost.is_set():
                return link
            if not self._tasks.running:
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
                f"RabbitMQ at {redact(self.url)} unreachable for {self.publish_timeout} s"
            )

    def _unconfirmed(self, target: str) -> TransportError:
        return TransportError(
            f"RabbitMQ at {redact(self.url)}: publishing to {target!r} not confirmed within "
            f"publish_timeout={self.publish_timeout:g} s (it may or may not be stored)"
        )

    def _failed(self, what: str, error: BaseException) -> TransportError:
        return TransportError(
            f"RabbitMQ at {redact(self.url)}: {what} failed: {error or type(error).__name__}"
        )

    async def _call(
        self,
        what: str,
        operation: Callable[[_Link], Awaitable[T]],
        deadline: float | None = None,
    ) -> T:
        """Run ``operation`` on the live link; retry it on a lost connection or channel.

        :param deadline: when to give up (anyio time); ``publish_timeout`` from now if unset.
        :raises TransportError: on a broker refusal, or once the deadline passed.
        """
        if deadline is None:
            deadline = anyio.current_time() + self.publish_timeout
        backoff = Backoff(BACKOFF_MIN, self.max_backoff, jitter=True)
        while True:
            link = await self._wait_link(deadline)
            try:
                # Bounded: a broker that stops answering (a confirm that never comes)
                # fails the call at the deadline instead of hanging it.
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    return await operation(link)
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
                problem: BaseException = TransportError("the connection closed")
            except (TransportError, ConfigurationError):
                raise
            except self._fatal as error:
                raise self._failed(what, error) from error
            except Exception as error:
                problem = error
            if self._closing:
                raise TransportError("RabbitTransport is closed")
            if anyio.current_time() >= deadline:
                if isinstance(problem, TimeoutError):
                    problem = TimeoutError(
                        f"no answer within publish_timeout={self.publish_timeout:g} s"
                    )
                raise self._failed(what, problem) from problem
            if not link.lost.is_set():
                pause = backoff.next()
                logger.warning(
                    "RabbitMQ: %s failed, retrying in %.2f s: %s",
                    what,
                    pause,
                    problem or type(problem).__name__,
                )
                await anyio.sleep(pause)

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
            for fanout in (self.dead_letter_exchange, self._dead_news.exchange):
                await channel.exchange_declare(fanout, exchange_type="fanout", durable=True)

        await self._admin(link, declare)
        await self._admin(
            link,
            lambda channel: channel.queue_declare(
                self._catalog, durable=True, arguments={"x-max-length": _CATALOG_MAX}
            ),
        )
        arguments: FieldTable = {
            "x-message-ttl": min(max(1, int(self.settings.dead_letter_ttl * 1000)), _TTL_MAX_MS),
            "x-max-length": max(0, int(self.settings.dead_letter_maxlen)),
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
        await self._admin(link, self._groups.declare)

    async def _declare_queue(self, link: _Link, pattern: str, group: str) -> str:
        """Declare the quorum queue of a group and bind it (once per link)."""
        queue = self.queue_name(pattern, group)
        if queue in link.declared:
            return queue
        key = binding_key(pattern)
        arguments: FieldTable = {"x-queue-type": "quorum"}
        if group.startswith(INBOX_GROUP_PREFIX):
            # A bus's reply inbox: its process's alone, gone once nobody consumes it.
            arguments["x-expires"] = _INBOX_EXPIRES_MS
        elif self.replicas is not None:
            arguments["x-quorum-initial-group-size"] = self.replicas

        async def declare(channel: AbstractChannel) -> None:
            try:
                await channel.queue_declare(queue, durable=True, arguments=arguments)
            except self._aiormq.exceptions.ChannelPreconditionFailed as error:
                # The queue exists with other arguments (another replicas=): a setting
                # to change, not a failure to retry.
                raise ConfigurationError(
                    f"RabbitMQ: the queue {queue} exists with other arguments than this "
                    f"transport's (replicas={self.replicas!r}): {error}; give the setting it "
                    "was declared with, or delete the queue (its messages with it) first"
                ) from error
            await channel.queue_bind(queue, self.prefix, routing_key=key)

        await self._admin(link, declare)
        await self._catalogue(link, queue)
        await self._announce(link, queue, pattern, group)
        link.declared.add(queue)
        return queue

    async def _catalogue(self, link: _Link, queue: str) -> None:
        """Record ``queue`` in the catalog (once per link) for :meth:`delete_everything`."""
        if queue in link.catalogued:
            return
        properties = self._properties_type()(delivery_mode=2, message_id=queue)
        await self._send(link, "", self._catalog, queue.encode(), properties)
        link.catalogued.add(queue)

    async def _announce(self, link: _Link, queue: str, pattern: str, group: str) -> None:
        """Record a group in the broker (once per link) for every process's receipts.

        Once per link, not once for all: a broker that restarted with its state lost
        (then the connections drop) has lost the register too; announced again when
        the subscription declares its queue on the new link, the group is known again
        to every process that connects from then on (readers drop the duplicates).
        """
        if queue in link.announced or group.startswith(INBOX_GROUP_PREFIX):
            return  # (a reply inbox is one process's, and short-lived)
        self._groups.add(pattern, group)
        properties = self._properties_type()(
            content_type="application/json", delivery_mode=2, message_id=queue
        )
        await self._send(
            link, self._groups.exchange, "", self._groups.document(pattern, group), properties
        )
        link.announced.add(queue)

    async def delete_everything(self) -> None:
        """Delete every queue and exchange this prefix has on the broker, messages included.

        For tests and teardown: the group queues come from the catalog queue
        (``{prefix}.catalog``) where each transport records the queues it declares, since
        AMQP cannot list queues. Works on a transport that is not entered (it connects
        for the call). Other processes still using the prefix lose their queues.

        :raises ConnectError: when the broker cannot be reached.
        """
        try:
            import aiormq
            import aiormq.exceptions as errors
        except ImportError as error:
            raise ConnectError(_EXTRA_MISSING) from error
        try:
            connection = await aiormq.connect(self.url)
        except Exception as error:
            raise ConnectError(
                f"cannot connect to RabbitMQ at {redact(self.url)}: {error}"
            ) from error
        try:
            channel = await connection.channel(publisher_confirms=False)
            names: list[str] = []
            try:
                await channel.queue_declare(self._catalog, passive=True)
            except errors.ChannelNotFoundEntity:
                channel = await connection.channel(publisher_confirms=False)
            else:
                while True:
                    message = await channel.basic_get(self._catalog, no_ack=True)
                    if not message.delivery_tag:
                        break  # Basic.GetEmpty
                    # Names this prefix's transports wrote; another client's junk
                    # (not UTF-8, too long for a queue name) is skipped.
                    name = bytes(message.body or b"").decode("utf-8", "replace")
                    if name and len(name.encode()) <= KEY_LIMIT:
                        names.append(name)
            fixed = [
                self.dead_letter_queue,
                self._lock_queue,
                self._catalog,
                self._groups.queue,
                self._groups.lock,
            ]
            for queue in dict.fromkeys([*names, *fixed]):
                try:
                    await channel.queue_delete(queue)
                except errors.ChannelNotFoundEntity:
                    channel = await connection.channel(publisher_confirms=False)
            exchanges = (
                self.prefix,
                self.dead_letter_exchange,
                self._dead_news.exchange,
                self._groups.exchange,
            )
            for exchange in exchanges:
                try:
                    await channel.exchange_delete(exchange)
                except errors.ChannelNotFoundEntity:
                    channel = await connection.channel(publisher_confirms=False)
        finally:
            with anyio.CancelScope(shield=True):
                await connection.close()

    def check_pattern(self, pattern: str) -> None:
        """:attr:`limits`, then what AMQP binds: no ``#`` token (its multi-word
        wildcard), and the binding key (a trailing ``>`` becomes ``*.#``) within 255
        bytes."""
        super().check_pattern(pattern)
        binding_key(pattern)

    def _forget_queue(self, queue: str) -> None:
        link = self._link
        if link is not None:
            link.declared.discard(queue)

    async def _declare_group(self, pattern: str, group: str) -> str:
        binding_key(pattern)  # a bad pattern is a ConfigurationError, raised here
        return await self._call(
            f"declaring the queue of {pattern}@{group}",
            lambda link: self._declare_queue(link, pattern, group),
        )

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
        await self._catalogue(link, name)
        link.declared.add(name)
        known[name] = now
        return name

    # -- publishing -----------------------------------------------------------

    def _outgoing(
        self,
        envelope: Envelope,
        *,
        attempt: int | None = None,
        body: bytes | None = None,
        deliveries: int | None = None,
        queued_at: float | None = None,
    ) -> tuple[bytes, Basic.Properties]:
        """Body and properties of the message carrying ``envelope``; ``deliveries``:
        the deliveries a copy handed back unhandled carries (:data:`HEADER_DELIVERIES`);
        ``queued_at``: when its original was queued (a copy keeps it; else now)."""
        meta = envelope_meta(envelope)
        if attempt is not None:
            meta["attempt"] = attempt
        text = dump_meta(meta).decode()
        if len(text) > _META_LIMIT // 4 and (size := len(text.encode())) > _META_LIMIT:
            raise EncodeError(
                f"envelope {envelope.id}: its headers and fields take {size} bytes, more "
                f"than the {_META_LIMIT} an AMQP header frame can carry here"
            )
        if body is None:  # a publish (a retry re-sends a body that was accepted once)
            body = encode_payload(self.codec, envelope.payload)
            refuse_oversized(envelope, len(body) + len(text.encode()), self.max_message_size)
        headers: FieldTable = {
            META_HEADER: text,
            QUEUED_HEADER: int((time.time() if queued_at is None else queued_at) * 1000),
        }
        if deliveries:
            headers[HEADER_DELIVERIES] = deliveries
        properties = self._properties_type()(
            content_type=self.codec.content_type,
            delivery_mode=2,
            message_id=envelope.id,
            headers=headers,
        )
        return body, properties

    def _properties_type(self) -> type[Basic.Properties]:
        """The client's message properties class; :class:`TransportError` before connect."""
        if self._properties is None or not self._tasks.running:
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
        mandatory: bool = False,
    ) -> bool:
        channel = link.channel
        if channel.is_closed:
            async with link.channel_lock:
                if link.channel.is_closed:
                    link.channel = await link.publisher.channel(publisher_confirms=True)
            channel = link.channel
        try:
            await channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=mandatory,
            )
        except self._returned:
            return False  # mandatory, and no queue is bound for it
        return True

    async def _publish_one(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Basic.Properties,
        mandatory: bool = False,
    ) -> bool:
        """Publish one message and wait for the broker's confirm (retried on a lost link).

        :param mandatory: have the broker return it when no queue takes it.
        :returns: whether a queue took it (always, unless ``mandatory``).
        :raises TransportError: when no confirm came within ``publish_timeout``.
        """
        deadline = anyio.current_time() + self.publish_timeout
        link = self._link
        if link is not None and not link.lost.is_set() and not link.channel.is_closed:
            # The common case, without the retry loop's set-up; a failure goes to it.
            try:
                # The client's own timeout (it sets one anyway: cheaper than a cancel
                # scope per publish). ``wait=False``: the channel's lock is not held
                # until the frames reach the socket (the confirm implies they did), so
                # concurrent publishes are written back to back.
                await link.channel.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=mandatory,
                    timeout=self.publish_timeout,
                    wait=False,  # type: ignore[call-arg]  # (aiormq's abc omits it)
                )
                return True
            except self._returned:
                return False
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
            except TimeoutError as error:
                raise self._unconfirmed(exchange or routing_key) from error
            except TransportError:
                raise
            except self._fatal as error:
                raise self._failed(f"publishing to {exchange or routing_key!r}", error) from error
            except Exception as error:
                logger.debug("RabbitMQ: publishing failed, retrying: %s", error)
        return await self._call(
            f"publishing to {exchange or routing_key!r}",
            lambda link: self._send(link, exchange, routing_key, body, properties, mandatory),
            deadline,
        )

    async def _publish_all(
        self,
        exchange: str,
        routing_key: str,
        messages: list[tuple[bytes, Basic.Properties]],
        mandatory: bool = False,
    ) -> list[bool]:
        """Publish ``messages`` pipelined; whether a queue took each (see :meth:`_publish_one`).

        Every message is sent, in order, before any confirm is awaited, then the confirms
        are awaited together: one round trip for the lot, not one per message. What a
        lost connection left unconfirmed is sent again (in order) on the next one, until
        ``publish_timeout``; what the broker returned (``mandatory``) is not.

        :raises TransportError: when a message was not confirmed within
            ``publish_timeout`` or the broker refused one (once every publish ended).
        """
        if len(messages) == 1:
            body, properties = messages[0]
            return [await self._publish_one(exchange, routing_key, body, properties, mandatory)]
        taken = [True] * len(messages)
        #: Positions not confirmed yet, in order.
        left = list(range(len(messages)))

        async def send(link: _Link) -> None:
            nonlocal left
            outcomes = await self._send_pipelined(
                link, exchange, routing_key, [messages[index] for index in left], mandatory
            )
            unconfirmed: list[int] = []
            problem: BaseException | None = None
            for index, outcome in zip(left, outcomes, strict=True):
                if outcome is None:
                    continue
                if isinstance(outcome, self._returned):
                    taken[index] = False  # mandatory, and no queue is bound for it
                    continue
                unconfirmed.append(index)
                if problem is None or (
                    isinstance(outcome, self._fatal) and not isinstance(problem, self._fatal)
                ):
                    problem = outcome
            left = unconfirmed
            if problem is not None:
                # A refusal ends the publish; anything else is retried by ``_call``.
                raise problem

        await self._call(f"publishing to {exchange or routing_key!r}", send)
        return taken

    async def _send_pipelined(
        self,
        link: _Link,
        exchange: str,
        routing_key: str,
        messages: list[tuple[bytes, Basic.Properties]],
        mandatory: bool,
    ) -> list[BaseException | None]:
        """Send every message on the link's channel, then await their confirms together.

        :returns: per message, ``None`` once confirmed, else what its publish raised.
        """
        channel = link.channel
        if channel.is_closed:
            async with link.channel_lock:
                if link.channel.is_closed:
                    link.channel = await link.publisher.channel(publisher_confirms=True)
            channel = link.channel
        publishes = [
            # One task each, started in order: the channel's lock (first come, first
            # served) writes them in that order. ``wait=False``: a publish does not hold
            # the lock until its frames reach the socket (its confirm implies they did).
            asyncio.ensure_future(
                channel.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=mandatory,
                    wait=False,  # type: ignore[call-arg]  # (aiormq's abc omits it)
                )
            )
            for body, properties in messages
        ]
        # Cancelled, the gathering cancels them all and ends once they all ended.
        outcomes = await asyncio.gather(*publishes, return_exceptions=True)
        return [_failure(outcome) for outcome in outcomes]

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Publish each envelope to the topic exchange; return once the broker confirmed all.

        :raises EncodeError: when a payload cannot be encoded (nothing is published).
        :raises TransportError: when the broker refused them or stayed unreachable.
        """
        validate_topic(topic)
        self.check_topic(topic)
        self._properties_type()
        messages = [self._outgoing(e) for e in envelopes]
        await self._wait_joins()
        if messages:
            await self._publish_all(self.prefix, topic, messages)

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`publish`, ``mandatory``: what no queue takes is dead-lettered instead.

        The broker returns a message no group's queue is bound for (in any process);
        each such envelope is stored as a ``no_subscribers`` dead letter. The groups
        named are those recorded in the broker's group register (see the module
        docstring), read at connect and kept current by its news.

        :returns: the stage names of the known groups reached (``()``: none; ``None``
            when a queue took it but no recorded group matches the topic).
        """
        validate_topic(topic)
        self.check_topic(topic)
        self._properties_type()
        messages = [self._outgoing(e) for e in envelopes]
        await self._wait_joins()
        if not messages:
            return self._groups.known(topic)
        taken = await self._publish_all(self.prefix, topic, messages, mandatory=True)
        unrouted = [envelope for envelope, took in zip(envelopes, taken, strict=True) if not took]
        if unrouted:
            await self._add_dead_letters([unrouted_entry(envelope) for envelope in unrouted])
        if not any(taken):
            return ()
        return self._groups.known(topic) or None

    async def _wait_joins(self) -> None:
        """Wait for the subscriptions of this process that are declaring their queue.

        A bus yields before a publish while a pump it started (a ``subscribe`` on a
        running bus) has not run yet, so such a pump has begun to declare its queue by
        now.
        """
        while self._joining:
            await self._joins_done.wait()

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Publish straight to the group's queue (default exchange), and no other."""
        self._properties_type()
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
        checked_prefetch(prefetch)
        # AMQP's prefetch count is 16 bits; a bus stage still holds no more than its
        # capacity.
        prefetch = min(prefetch, PREFETCH_MAX)
        self._properties_type()
        # Counted before the first await: a publish made by this process right after
        # a subscription started (a bus's pump, started in the background) waits for
        # its queue to be bound, rather than being dropped as unroutable.
        self._joining += 1
        try:
            await self._declare_group(pattern, group)
        finally:
            self._joining -= 1
            if not self._joining:
                self._joins_done.set()
                self._joins_done = anyio.Event()
        subscription = Subscription(self, pattern, group, prefetch)
        self._subscriptions.add(subscription)
        try:
            yield subscription
        finally:
            with self.cleanup_scope():
                await subscription.release()

    # -- settling -------------------------------------------------------------

    def _ack(
        self, consumer: ConsumerChannel, tag: int, stage: str, envelope_id: str | None
    ) -> None:
        """Queue the ack of ``tag`` (``envelope_id``: the bus's ack, reported if lost)."""
        self._acks.queue(consumer, stage, tag, envelope_id, consumer.ack_batch)

    async def _write_acks(
        self, batch: dict[ConsumerChannel, list[tuple[int, str | None]]]
    ) -> list[ConsumerChannel]:
        """Write each channel's acks; the channels that are gone (their acks lost)."""
        lost: list[ConsumerChannel] = []
        for consumer, acks in batch.items():
            if not await consumer.flush([tag for tag, _id in acks]):
                lost.append(consumer)
        return lost

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the bus's acks that were lost with their channel."""
        return self._acks.take_lost()

    async def _retry(self, delivery: RabbitDelivery, delay: float | None) -> None:
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
        except BaseException:  # deliberate: not re-sent, so the broker keeps it; re-raise
            with self.cleanup_scope(RELEASE_TIMEOUT):
                await delivery._consumer.give_back([delivery._tag])
            raise
        self._ack(delivery._consumer, delivery._tag, subscription.name, None)

    async def _hand_back(
        self, consumer: ConsumerChannel, queue: str, deliveries: list[RabbitDelivery]
    ) -> list[RabbitDelivery]:
        """Put each delivery back in ``queue`` as a copy carrying its deliveries so far,
        and ack the original once the copy is confirmed (see ``Subscription.release``).

        The quorum queue counts a message returned by a leaving consumer as a
        delivery (``x-delivery-count``); a copy starts from zero and carries the count
        of real deliveries instead, so ``max_deliveries`` counts only those.

        :returns: the deliveries not copied (unreadable, or the copy was not
            confirmed): they go back as they are (counted), when the channel closes or
            the caller gives them back.
        """
        kept = [delivery for delivery in deliveries if delivery.error is not None]

        async def copy(delivery: RabbitDelivery) -> None:
            try:
                body, properties = self._outgoing(
                    delivery.envelope,
                    body=delivery._body,
                    deliveries=delivery._before,
                    queued_at=delivery.queued_at(),
                )
                await self._publish_one("", queue, body, properties)
            except Exception as error:  # deliberate: it goes back as it is instead
                logger.warning(
                    "RabbitMQ: handing back %s as a copy failed (it goes back counted): %s",
                    delivery.envelope.id,
                    error or type(error).__name__,
                )
                kept.append(delivery)
                return
            self._ack(consumer, delivery._tag, delivery._subscription.name, None)

        async with anyio.create_task_group() as task_group:
            for delivery in deliveries:
                if delivery.error is None:
                    task_group.start_soon(copy, delivery)
        return kept

    async def _bury(self, delivery: RabbitDelivery, entry: DeadLetter) -> None:
        """Publish ``entry`` (with the delivery's raw body) to the dead letters, then ack."""
        try:
            document = dead_letter_to_wire(entry, _Verbatim(delivery._body))
            await self._publish_dead(entry.envelope.id, document)
        except BaseException:  # deliberate: not buried, so the broker keeps it; re-raise
            with self.cleanup_scope(RELEASE_TIMEOUT):
                await delivery._consumer.give_back([delivery._tag])
            raise
        self._ack(delivery._consumer, delivery._tag, delivery._subscription.name, None)

    # -- the ack timeout ------------------------------------------------------

    async def _expiry_loop(self) -> None:
        """Give back what stuck consumers hold (see the module docstring)."""
        interval = min(self.ack_timeout / 4, 1.0)
        while True:
            now = time.monotonic()
            wait = interval
            for subscription in list(self._subscriptions):
                if not subscription.handed or subscription.keep_alive:
                    continue
                first = next(iter(subscription.handed.values()))
                if first._deadline <= now:
                    with self.cleanup_scope():
                        await subscription.expire(now)
                else:
                    wait = min(wait, first._deadline - now)
            await anyio.sleep(max(wait, 0.001))

    # -- periodic ticks -------------------------------------------------------

    def tick_claims(self) -> TickLeader:
        """Periodic ticks claimed by leading (:mod:`._rabbit_ticks`): one replica per
        schedule holds its lock queue and publishes its ticks."""
        return TickLeader(self.prefix, self._live_link, self._current_link, self._keep_record)

    async def _live_link(self) -> _Link:
        return await self._wait_link(anyio.current_time() + self.publish_timeout)

    def _current_link(self) -> _Link | None:
        link = self._link
        return link if link is not None and not link.lost.is_set() else None

    async def _keep_record(self, queue: str, body: bytes) -> None:
        """Publish a record to its one-message queue (catalogued for delete_everything)."""
        await self._catalogue(await self._live_link(), queue)
        properties = self._properties_type()(content_type="application/json", delivery_mode=2)
        await self._publish_one("", queue, body, properties)

    # -- groups ---------------------------------------------------------------

    async def groups(self) -> list[GroupInfo]:
        """The groups recorded in the broker's register whose queue exists (request
        inboxes aside), with the messages ready in it and its consumers."""
        return await _rabbit_groups.list_groups(self)

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the group's queue (binding and messages), tell every process, and
        drop it from the register (see :mod:`._rabbit_groups`)."""
        return await _rabbit_groups.delete_group(self, pattern, group)

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
        """Ready messages of the group (and its retries here) + what this process holds
        (its acks written first)."""
        self._properties_type()
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
        # The queue's count leaves out what is delivered and unacked. A round trip first:
        # what the broker sent before it has arrived (held here, or handled with its ack
        # queued). Then the queued acks are written (after any write already going on)
        # and a second round trip means the broker has them: a drain that returns leaves
        # nothing handled here for the broker to deliver again. What is held, or acked
        # and not yet written, after that is counted, and the drain looks again.
        for subscription in mine:
            await subscription.sync()
        consumers = [s.consumer for s in mine if s.consumer is not None]
        if consumers:
            try:
                await self._acks.flush(consumers)
            except Exception as error:  # kept queued: the writer tries again
                logger.debug("RabbitMQ: writing acks for a backlog count failed: %s", error)
            for subscription in mine:
                await subscription.sync()
        total += sum(1 for consumer in consumers if self._acks.queued(consumer))
        return total + sum(subscription.unsettled() for subscription in mine)

    # -- dead letters ---------------------------------------------------------

    async def _publish_dead(self, id: str, document: bytes) -> None:
        properties = self._properties_type()(
            content_type="application/json", delivery_mode=2, message_id=id
        )
        await self._publish_one(self.dead_letter_exchange, "", document, properties)

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter queue."""
        self._properties_type()
        await self._publish_dead(entry.envelope.id, dead_letter_to_wire(entry, self.codec))

    async def _add_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Publish ``entries`` to the dead-letter queue, pipelined (confirms gathered)."""
        properties = self._properties_type()
        documents = [
            (
                dead_letter_to_wire(entry, self.codec),
                properties(
                    content_type="application/json", delivery_mode=2, message_id=entry.envelope.id
                ),
            )
            for entry in entries
        ]
        await self._publish_all(self.dead_letter_exchange, "", documents)

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        kept, _ = await self._edit_dead_letters(frozenset())
        return kept

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Delete the dead letters of these envelope ids."""
        await self.take_dead_letters(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the dead letters of these envelope ids, under the lock (the claim);
        return those this call deleted, telling every watcher."""
        self._properties_type()
        if not ids:
            return []
        _, taken = await self._edit_dead_letters(frozenset(ids))
        if taken:
            await self._announce_dead(DeadLetterNews.removal(list(map(dead_letter_key, taken))))
        return taken

    async def clear_dead_letters(self) -> None:
        """Delete every dead letter, under the lock (every watcher reads them again)."""
        await self._edit_dead_letters(None)
        await self._announce_dead(STALE)

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Publish ``entries`` again (taken for a replay that failed); every watcher
        reads the dead letters again."""
        self._properties_type()
        await self._add_dead_letters(entries)
        await self._announce_dead(STALE)

    @asynccontextmanager
    async def watch_dead_letters(self) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """Every dead letter added or removed from now on, by any process; the changes
        end when the connection is lost (watch again: what was missed is unknown)."""
        self._properties_type()
        link = await self._wait_link(anyio.current_time() + self.publish_timeout)
        self._dead_news.codec = self.codec
        try:
            cleanup = partial(self.cleanup_scope, RELEASE_TIMEOUT)
            async with self._dead_news.watch(link.consumer, cleanup) as changes:
                yield changes
        except (self._aiormq.exceptions.AMQPError, OSError) as error:
            raise self._failed("watching the dead letters", error) from error

    async def _announce_dead(self, body: bytes) -> None:
        properties = self._properties_type()(content_type="application/json", delivery_mode=1)
        await self._publish_one(self._dead_news.exchange, "", body, properties)

    async def _edit_dead_letters(
        self, drop: frozenset[str] | None
    ) -> tuple[list[DeadLetter], list[DeadLetter]]:
        self._properties_type()
        async with self._dead_lock:
            return await self._call("reading the dead letters", partial(self._scan_dead, drop))

    async def _scan_dead(
        self, drop: frozenset[str] | None, link: _Link
    ) -> tuple[list[DeadLetter], list[DeadLetter]]:
        scan = DeadLetterScan(
            link.consumer,
            queue=self.dead_letter_queue,
            lock=self._lock_queue,
            codec=self.codec,
            ttl=self.settings.dead_letter_ttl,
            maxlen=self.settings.dead_letter_maxlen,
            lock_timeout=self.publish_timeout,
            consumer_tag=f"asyncbus.{self._client_id}.dead.{secrets.token_hex(4)}",
        )
        return await scan.run(drop)
