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
* ``{queue}.retry.{ms}``: quorum queues where delayed retries wait ``ms``
  milliseconds (``x-message-ttl``) and are then dead-lettered back to ``{queue}``
  through the default exchange, at least once (``x-dead-letter-strategy``
  ``at-least-once``, with ``x-overflow`` ``reject-publish`` as it requires: the
  message leaves the retry queue once the group's queue confirmed it). A delay is
  rounded up to one of 16 buckets per doubling (at most 6.25 % later), so each queue
  holds one delay and no retry waits behind a longer one (per-message TTLs only expire
  at the head of a queue). Unused retry queues expire (``x-expires``).
* ``{prefix}.deadletters``: a fanout exchange and a quorum queue of dead-letter
  documents (``x-message-ttl`` = ``dead_letter_ttl``, ``x-max-length`` =
  ``dead_letter_maxlen``, as they were when the queue was first declared; listing
  applies the current values), and ``{prefix}.deadletters.lock``, an exclusive queue
  that exists while one process reads or edits the dead letters;
  ``{prefix}.deadletters.changes``, a fanout exchange announcing what was taken out,
  so every process's list follows (:class:`~._rabbit_dead_letters.DeadLetterNews`).
* ``{prefix}.catalog``: a quorum queue of the names of the queues declared under the
  prefix, one message each (AMQP cannot list queues), for
  :meth:`RabbitTransport.delete_everything`.
* ``{prefix}.groups``: a fanout exchange each group is announced on when declared,
  and the quorum queue (the register) bound to it, read at connect; see
  :mod:`._rabbit_groups`. ``{prefix}._asyncbus.periodic.{digest}``: a quorum queue
  holding a periodic schedule's record (:mod:`._rabbit_ticks`).

Queue kinds. Every durable queue is a quorum queue (``replicas`` sets its initial group
size too), so it lives on the cluster, not on one node: any one node of a cluster of
three can die and every queue goes on, led by another node (a classic queue lives on the
node that declared it, and while that node is down declaring it again fails with
``NOT_FOUND``, which no reconnection gets past). The rest are exclusive or server-named
queues that go with their connection (locks, leases, the news of groups and dead
letters): they need no replicas. A durable queue that exists with other arguments (a
classic queue of an older version, other limits) is used as it is, said once per
transport (declaring it with others is the broker's ``PRECONDITION_FAILED``). While the
node of such a classic queue is down, the queues declared at connect (dead letters,
catalog, group register) are left out, said at each connect, and whatever needs one of
them (a retry queue too) fails with :class:`TransportError` until its node is back: the
bus still connects and runs. Unused retry queues expire, so those become quorum queues
by themselves.

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
  on a fresh channel (the largest prefetch AMQP takes, and one more consumer each time
  it is full: a quorum queue gives a consumer without one 2,000), acking the entries to
  drop (past the TTL, beyond the maximum length, or removed) and closing the channel,
  which puts every other entry back, in order, ahead of anything newer. The quorum
  queue counts each return in ``x-delivery-count``; no delivery limit is declared on
  it, so reading never drops or dead-letters an entry. The broker sends a quorum queue
  a few dozen settlements at a time from one channel and loses those it still holds
  when the channel closes, so a read acks the run of entries to drop that begins it in
  one ``multiple`` ack and at most 16 others one by one, and reads again for the rest;
  and a read first waits (up to 2 s) until no consumer is left on the queue: the
  previous reader's entries are back only once its consumer is gone.
* **A nack of a publish** (the message is not stored: a quorum queue without a leader
  for a moment after its node died) is sent again on a fresh channel until
  ``publish_timeout``: a channel whose first publish to a quorum queue found its leader
  gone keeps refusing publishes to it, however soon a new one is elected.
* **backlog** = the ready messages of the group's queue and of the retry queues this
  process used, plus the deliveries this process's consumers hold (after a round trip
  on each consumer channel, so none is in flight uncounted). Deliveries held by
  other processes are not counted (AMQP does not tell).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

import anyio

from .._checks import check_count
from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import ConfigurationError, TransportError
from .._groups import GroupInfo
from .._routing import validate_topic
from . import _rabbit_groups
from ._codec import Codec
from ._kit import AckWriter, TaskOwner, check_url, require_extra, split_urls
from ._kit.options import (
    DEFAULT_MAX_MESSAGE_SIZE,
    checked_max_message_size,
    checked_prefetch,
    checked_seconds,
)
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, checked_max_deliveries
from ._kit.routes import unrouted_entry
from ._rabbit_channel import ConsumerChannel, write_acks
from ._rabbit_consumer import LOST, META_HEADER, PREFETCH_MAX, RELEASE_TIMEOUT, Subscription
from ._rabbit_dead_letters import RabbitDeadLetters
from ._rabbit_groups import GroupRegister
from ._rabbit_leases import RabbitPartitionLeases
from ._rabbit_link import Connections, Link
from ._rabbit_names import (
    KEY_LIMIT,
    NAME_CHARACTERS,
    binding_key,
    bounded,
    delay_bucket_ms,
    escape,
)
from ._rabbit_publisher import Publisher
from ._rabbit_ticks import TickLeader
from ._rabbit_topology import Topology
from ._registry import registered
from .base import Capabilities, DeadLetterChange, Delivery, TopicLimits, Transport

if TYPE_CHECKING:
    from pamqp.commands import Basic

__all__ = ["META_HEADER", "RabbitTransport", "binding_key", "delay_bucket_ms"]

#: The URL schemes aiormq takes, and what a URL looks like (for errors).
_SCHEMES = tuple(registered("rabbit").schemes)
_URL_FORM = "amqp://user:password@host:port/vhost (amqps:// for TLS)"
#: The largest quorum queue group ``replicas`` may ask for.
_MAX_REPLICAS = 99
#: Seconds the ack writer waits for more acks before writing (bounds their delay; a
#: channel with half its prefetch waiting is written at once).
_ACK_LINGER = 0.02


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
        self._client_id = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self._properties: type[Basic.Properties] | None = None
        #: The background tasks: reconnecting, writing acks, the ack timeout.
        self._tasks = TaskOwner("RabbitTransport")
        self._subscriptions: set[Subscription] = set()
        #: Acks written behind, by consumer channel (a channel lost loses its acks: the
        #: broker returns those deliveries to the queue).
        self._acks = AckWriter[ConsumerChannel, int](
            "RabbitTransport",
            write_acks,
            self.cleanup_scope,
            linger=_ACK_LINGER,
            timeout=RELEASE_TIMEOUT,
        )
        #: Subscriptions declaring their queue now, and an event set when none is left.
        self._joining = 0
        self._joins_done = anyio.Event()
        #: Groups recorded in the broker (read at connect, then as announced).
        self._groups = GroupRegister(prefix)
        #: The link to the broker, what is declared on it, publishing, the dead letters.
        self._links = Connections(self)
        self._topology = Topology(self, self._links)
        self._publisher = Publisher(self, self._links, self._topology.retry_queue)
        self._dead = RabbitDeadLetters(self, self._links, self._publisher)

    # -- names ----------------------------------------------------------------

    def queue_name(self, pattern: str, group: str) -> str:
        """The name of the quorum queue of (``pattern``, ``group``)."""
        return bounded(f"{self.prefix}.{escape(pattern)}@{escape(group)}")

    # -- life cycle -----------------------------------------------------------

    async def connect(self) -> None:
        """Connect, declare the exchanges and the dead-letter queue, start the helpers.

        :raises ConnectError: when aio-pika is missing or the broker cannot be reached.
        :raises TransportError: when not running on asyncio.
        """
        if self._tasks.running:
            return
        self._properties = self._links.load()
        await self._links.open()
        await self._tasks.open()
        self._acks.open()
        self._tasks.start_soon(self._links.supervise)
        self._tasks.start_soon(self._acks.run)
        self._tasks.start_soon(self._expiry_loop)

    async def aclose(self) -> None:
        """Write pending acks, stop the helpers and close the connections (shielded)."""
        if not self._tasks.running and self._links.link is None:
            return
        self._links.stop()  # waiters wake up and see the transport closed
        with self.cleanup_scope(RELEASE_TIMEOUT):
            await self._acks.flush()
        self._acks.close()  # what the deadline cut short is lost (and redelivered)
        for subscription in list(self._subscriptions):
            subscription.lose(LOST)
        await self._tasks.aclose()
        # By the close deadline, however silent the broker: a close it does not answer
        # in time is cut short, and the client closes the sockets itself.
        left = self.close_deadline - anyio.current_time()
        await self._links.close(max(0.0, min(RELEASE_TIMEOUT, left)))

    async def _set_up(self, link: Link) -> None:
        """Declare the fixed names on a new link, then follow the groups declared by
        anyone from now on, and read those declared before."""
        await self._topology.declare_fixed(link)
        link.news = await self._groups.listen(link.consumer)
        await self._groups.read(
            link.consumer,
            lock_timeout=self.publish_timeout,
            tag=f"asyncbus.{self._client_id}.groups.{secrets.token_hex(4)}",
        )

    def _link_lost(self, link: Link) -> None:
        """The connections of ``link`` closed: the dead letters watched on it end."""
        self._dead.news.lost(link.consumer)  # its watchers' queues are gone

    def _properties_type(self) -> type[Basic.Properties]:
        """The client's message properties class; :class:`TransportError` before connect."""
        if self._properties is None or not self._tasks.running:
            raise TransportError(
                "RabbitTransport is not connected: use `async with transport` first"
            )
        return self._properties

    async def delete_everything(self) -> None:
        """Delete every queue and exchange this prefix has on the broker, messages included.

        For tests and teardown: the group queues come from the catalog queue
        (``{prefix}.catalog``) where each transport records the queues it declares, since
        AMQP cannot list queues. Works on a transport that is not entered (it connects
        for the call). Other processes still using the prefix lose their queues.

        :raises ConnectError: when the broker cannot be reached.
        """
        await self._topology.delete_everything()

    def check_pattern(self, pattern: str) -> None:
        """:attr:`limits`, then what AMQP binds: no ``#`` token (its multi-word
        wildcard), and the binding key (a trailing ``>`` becomes ``*.#``) within 255
        bytes."""
        super().check_pattern(pattern)
        binding_key(pattern)

    # -- publishing -----------------------------------------------------------

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Publish each envelope to the topic exchange; return once the broker confirmed all.

        :raises EncodeError: when a payload cannot be encoded (nothing is published).
        :raises TransportError: when the broker refused them or stayed unreachable.
        """
        validate_topic(topic)
        self.check_topic(topic)
        self._properties_type()
        publisher = self._publisher
        messages = [publisher.outgoing(e) for e in envelopes]
        await self._wait_joins()
        if messages:
            await publisher.publish_all(self.prefix, topic, messages)

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
        publisher = self._publisher
        messages = [publisher.outgoing(e) for e in envelopes]
        await self._wait_joins()
        if not messages:
            return self._groups.known(topic)
        taken = await publisher.publish_all(self.prefix, topic, messages, mandatory=True)
        unrouted = [envelope for envelope, took in zip(envelopes, taken, strict=True) if not took]
        if unrouted:
            await publisher.publish_dead_letters(
                [unrouted_entry(envelope) for envelope in unrouted]
            )
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
        messages = [self._publisher.outgoing(e) for e in envelopes]
        queue = await self._topology.declare_group(pattern, group)
        if messages:
            await self._publisher.publish_all("", queue, messages)

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
            await self._topology.declare_group(pattern, group)
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

    # -- acks and the ack timeout ---------------------------------------------

    def _ack(
        self, consumer: ConsumerChannel, tag: int, stage: str, envelope_id: str | None
    ) -> None:
        """Queue the ack of ``tag`` (``envelope_id``: the bus's ack, reported if lost)."""
        self._acks.queue(consumer, stage, tag, envelope_id, consumer.ack_batch)

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the bus's acks that were lost with their channel."""
        return self._acks.take_lost()

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

    def partition_leases(self) -> RabbitPartitionLeases:
        """The partitions of ordered groups leased to replicas as exclusive queues
        (:mod:`._rabbit_leases`)."""
        return RabbitPartitionLeases(self.prefix, self._links.current, self.publish_timeout)

    def tick_claims(self) -> TickLeader:
        """Periodic ticks claimed by leading (:mod:`._rabbit_ticks`): one replica per
        schedule holds its lock queue and publishes its ticks."""
        return TickLeader(
            self.prefix,
            self._links.live,
            self._links.current,
            self._keep_record,
            self._declare_record,
        )

    async def _declare_record(self, queue: str) -> None:
        """Declare a record's queue: a quorum queue holding the newest message only."""
        topology = self._topology
        arguments = topology.durable_arguments({"x-max-length": 1})
        await self._links.call(
            f"declaring {queue!r}",
            lambda link: topology.declare_durable(link, queue, arguments),
        )

    async def _keep_record(self, queue: str, body: bytes) -> None:
        """Publish a record to its one-message queue (catalogued for delete_everything)."""
        await self._topology.catalogue(await self._links.live(), queue)
        properties = self._properties_type()(content_type="application/json", delivery_mode=2)
        await self._publisher.publish_one("", queue, body, properties)

    # -- groups and backlog ---------------------------------------------------

    async def groups(self) -> list[GroupInfo]:
        """The groups recorded in the broker's register whose queue exists (request
        inboxes aside), with the messages ready in it and its consumers."""
        return await _rabbit_groups.list_groups(self)

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the group's queue (binding and messages), tell every process, and
        drop it from the register (see :mod:`._rabbit_groups`)."""
        return await _rabbit_groups.delete_group(self, pattern, group)

    async def backlog(self, pattern: str, group: str) -> int:
        """Ready messages of the group (and its retries here) + what this process holds
        (its acks written first)."""
        return await _rabbit_groups.backlog(self, pattern, group)

    # -- dead letters (see :mod:`._rabbit_dead_letters`) ----------------------

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter queue."""
        await self._dead.add(entry)

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        return await self._dead.listed()

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Delete the dead letters of these envelope ids."""
        await self._dead.take(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the dead letters of these envelope ids, under the lock (the claim);
        return those this call deleted, telling every watcher."""
        return await self._dead.take(ids)

    async def clear_dead_letters(self) -> None:
        """Delete every dead letter, under the lock (every watcher reads them again)."""
        await self._dead.clear()

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Publish ``entries`` again (taken for a replay that failed); every watcher
        reads the dead letters again."""
        await self._dead.restore(entries)

    def watch_dead_letters(self) -> AbstractAsyncContextManager[AsyncIterator[DeadLetterChange]]:
        """Every dead letter added or removed from now on, by any process; the changes
        end when the connection is lost (watch again: what was missed is unknown)."""
        return self._dead.watch()
