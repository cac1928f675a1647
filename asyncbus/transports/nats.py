"""The NATS JetStream transport: a stream per prefix, a durable pull consumer per group.

What it keeps on the server, for ``prefix="asyncbus"``:

* stream ``ASYNCBUS`` (interest retention, file storage) captures ``asyncbus.>``.
  Topic ``orders.created`` is published as ``asyncbus.orders.created`` with the
  envelope id as ``Nats-Msg-Id`` (the stream's duplicate window drops a second
  publish of the same id), the envelope's fields as JSON in the ``asyncbus-meta``
  header and the codec's bytes as the body. A message stays until every group whose
  pattern matches it has settled it.
* every (pattern, group) is a durable pull consumer named from both (sanitised, plus
  a hash, so the name is deterministic and unique), described as
  ``asyncbus group ["pattern", "group"]`` (so any process knows the groups a publish
  reaches: :mod:`._nats_groups`), filtering ``asyncbus.{pattern}``,
  with explicit acks, ``ack_wait = ack_timeout``, ``deliver_policy = new`` and no
  delivery limit (the bus's retry policy decides). Every process subscribing with the
  same (pattern, group) pulls from it: competing consumers. Each subscription asks
  for no more than ``prefetch`` minus what it holds, so ``prefetch`` bounds each
  subscription alone (the consumer's own ``max_ack_pending`` is unlimited); the
  pulling side is :mod:`._nats_consumer`.
* stream ``ASYNCBUS_DLQ`` (limits retention, ``max_age = dead_letter_ttl``,
  ``max_msgs = dead_letter_maxlen``, both updated at every start) keeps dead letters,
  one subject per envelope id (``asyncbus_dlq.{id}``). A shorter TTL shrinks its
  duplicate window with it (JetStream refuses a window longer than the age); a TTL
  under JetStream's shortest age (0.1 s) is kept 0.1 s, and the listing drops what is
  past the TTL. Taking one out deletes it by its sequence, the claim that makes a
  replay happen once, and every process hears of what went on
  ``asyncbus_dlq_changes`` (:mod:`._nats_dead_letters`).

Replaying to one group: a server before 2.10 gives a consumer a single filter
subject, so a replay cannot go to a subject only its group sees. It is published
to its topic like any envelope, with the header ``asyncbus-replay-group`` naming
the target consumer; consumers of other groups ack it silently without delivering
it. (It costs them a skip each; it never reaches their handlers.) Its
``Nats-Msg-Id`` is the envelope id plus the replay's timestamp, so the duplicate
window never drops a replay as a copy of the original.

Vanished state: a server restarted with its JetStream store lost, or a stream or
consumer deleted by another client, is made whole again. A publish answered "no
responders" (no stream captures its subject) asks whether the stream exists: when the
server says it does not, the streams are made again, and this process's consumers, then
the publish is sent once more; when it does not say (a cluster electing the stream's
leader answers nothing for a second or two), the publish is sent again every 0.25 s
until ``publish_timeout``, then raises :class:`TransportError`. A pull answered
"consumer deleted" makes the stream and the consumer again, a moment later (a stream
still being deleted would take the new one's files with it), and pulls again. A pull
answered "no responders", or never answered, asks first whether the consumer exists:
only when the server says it does not is it made again; otherwise (a cluster electing
the consumer's leader answers "no responders" too) the pull is asked again after a
pause. Publishes of this process wait while streams and consumers are made again, at
most ``publish_timeout`` (then :class:`TransportError`): one stored before its
consumers exist would reach none of them (retention is by interest). Another process's
groups are made again by that process, on its next pull.

Request inboxes (groups ``_reply.*``, one per bus process) are durable consumers
with ``inactive_threshold = inbox_ttl``: deleted when their subscription ends, and
by the server once their process died and stopped pulling.

Worth knowing:

* A subject travels in the protocol line, which the server holds to 4 KiB (its
  ``max_control_line``) and closes the connection of a longer one: :attr:`limits`
  keeps topics and patterns (which nats-py sends in the subject of the request that
  creates a consumer) within it, and out of whitespace and control characters, and
  the bus refuses the rest at its door. Should the server close the connection for a
  command it refused anyway, the client reconnects as after any lost connection
  (nats-py alone would close for good: :func:`~._nats_client.client_class`).
* ``attempt`` is JetStream's ``num_delivered``: every delivery counts, including
  one a consumer gave back unhandled when it left (the reference transport does not
  count those) and one that timed out at a crashed consumer. A message delivered
  more than ``max_deliveries`` times is handed over with ``error`` set, and the bus
  dead-letters it ``rejected`` instead of running it again; there the deliveries
  given back unhandled (a bus shutting down) do not count: each one is recorded
  in the KV bucket ``{STREAM}_HANDBACKS`` before its ``nak`` (:mod:`._nats_handbacks`).
* After a reconnect every subscription asks again at once: the server may have
  dropped the open pull request (it found no interest while the client was away)
  without answering it. If it did not, the old request may still bring up to one
  more batch, which waits in the subscription (kept in progress) until taken.
* A ``publish`` of many envelopes is one pipelined write: every message is written
  (each with its own reply subject on one shared inbox, :mod:`._nats_publisher`)
  before any stream ack is awaited, and the call returns once the stream acked
  them all. Acks of deliveries are written behind (``ack_nowait``): queued, and
  written together within a moment by one task (:class:`~._kit.AckWriter`), before
  the subscription or the transport closes; a process that dies first gets those
  messages again after ``ack_timeout``. A write of acks (and every nak and term)
  counts once the server answered a ``PING`` sent after it: nats-py buffers what it
  cannot send, so acks written while the server is down or silent are not taken
  for written, and are reported lost when the transport closes without them.
* Order: one subscription receives a topic's envelopes in stream (publish) order;
  ``nack`` and redeliveries after ``ack_timeout`` come back later, out of order.
* Retention is by interest and new groups start with what is published after they
  were created (``deliver_policy = new``), as in the reference transport.
* ``keep_alive=True`` (the default) sends ``+WPI`` (in progress) for held
  deliveries every ``ack_timeout / 3``, so a long handler, a full stage or a retry
  delay never makes the group run a delivery twice; only a dead process loses
  them (a hung one keeps them until it leaves). Without it, a delivery held
  unsettled longer than ``ack_timeout`` goes to the group again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, ClassVar

import anyio

from .._checks import check_count
from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import ConfigurationError, TransportError
from .._groups import GroupInfo
from .._routing import validate_topic
from ._codec import Codec
from ._kit import AckWriter, TaskOwner, check_url, redact, require_extra, split_urls
from ._kit.options import checked_seconds
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, checked_max_deliveries
from ._kit.routes import INBOX_TTL, unrouted_entry
from ._nats_connection import NatsConnection
from ._nats_consumer import PullConsumer
from ._nats_dead_letters import NatsDeadLetters
from ._nats_dedup import NatsDedupStore
from ._nats_groups import GroupDirectory, group_backlog, list_groups, remove_group
from ._nats_handbacks import HandBacks
from ._nats_heartbeats import NatsHeartbeats
from ._nats_leases import NatsLeaseStore
from ._nats_messages import HEADER_META, HEADER_REPLAY_GROUP
from ._nats_rates import NatsRateStore
from ._nats_restore import Restorer
from ._nats_sending import EnvelopeSender
from ._nats_streams import MIN_MAX_AGE, JetStreamSetup
from ._nats_subjects import check_subject_text, consumer_name, stream_name, subject_limits
from ._nats_subscriptions import Subscriptions
from ._registry import registered
from .base import Capabilities, DeadLetterChange, Delivery, Transport

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

    from ._nats_publisher import JetStreamPublisher

__all__ = ["HEADER_META", "HEADER_REPLAY_GROUP", "NatsTransport", "consumer_name"]

logger = logging.getLogger("asyncbus.transport.nats")

#: The URL schemes nats-py takes, and what a URL looks like (for errors).
_SCHEMES = tuple(registered("nats").schemes)
#: The most copies JetStream keeps of a stream.
_MAX_REPLICAS = 5
_URL_FORM = "nats://[user:password@]host:port (tls://, ws:// or wss:// also)"

#: A pull request lives this long on the server (then it answers 408 and we ask again),
#: or less with a short ack_timeout (see :meth:`NatsTransport.pull_expires`).
_PULL_EXPIRES = 5.0
#: Seconds the ack writer waits for more acks before writing them together.
_ACK_LINGER = 0.002


class NatsTransport(Transport):
    """Envelopes in a NATS JetStream stream; groups are durable pull consumers.

    Runs on asyncio only (nats-py is asyncio-only). The server needs JetStream; a
    2.9 server is enough. See the module docstring for what is kept on the server.

    :param url: the server, ``nats://[user:password@]host:port``; or the nodes of one
        cluster, as a list or one string separated by commas: the client connects to
        any that answers and, after a lost connection, to any listed or discovered
        (the servers announce their peers).
    :param replicas: copies JetStream keeps of the bus's streams and key-value buckets
        (1 to 5; a cluster needs at least as many nodes). An existing stream with
        another count is an error at connect, never reused with other guarantees.
    :param prefix: subject prefix and (upper-cased, sanitised) stream name; one bus
        deployment per prefix.
    :param ack_timeout: seconds a delivery may stay unsettled by a consumer that
        stopped answering (crashed) before the group gets it again (``ack_wait``).
    :param codec: how payloads become bytes.
    :param connect_timeout: seconds to wait for the first connection.
    :param request_timeout: seconds to wait for the server to answer an API request.
    :param publish_timeout: longest a ``publish`` waits for the stream's ack before
        raising :class:`TransportError` (default: ``request_timeout``); a publish that
        timed out may or may not be stored.
    :param dedup_window: seconds the stream remembers envelope ids to drop duplicates
        (capped at ``max_age``: JetStream refuses a longer window).
    :param max_age: seconds after which the stream discards envelopes still unsettled
        (``None``: keep them until every group settled them; at least 0.1 s).
    :param keep_alive: while a delivery is held (queued in its stage, handled,
        waiting for a retry), tell the server every ``ack_timeout / 3`` that it is in
        progress, so a long handler or retry delay is never run twice; off, a delivery
        held longer than ``ack_timeout`` also goes to another consumer.
    :param reconnect_wait: seconds between reconnection attempts after a connection
        broke (reconnection is nats-py's and never gives up).
    :param max_deliveries: deliveries of one message (``num_delivered``), none
        settled, after which the next one is handed over with ``error`` set (the bus
        dead-letters it ``rejected``).
    :raises ConfigurationError: for a URL without a scheme, with another broker's or
        the web's (not ``nats``, ``tls``, ``ws``, ``wss``) or with a bad port, a bad
        prefix, or a timeout, window or cap that is not a positive number in range
        (NaN, infinities, bools, huge values included).
    :raises ImportError: (also a ``ConnectError`` and a ``ConfigurationError``) when
        nats-py is not installed: the message names the extra.
    """

    #: Seconds without a pull after which the server deletes a request inbox's
    #: consumer (its process died; one that leaves deletes it at once).
    inbox_ttl: float = INBOX_TTL

    capabilities: ClassVar[Capabilities] = Capabilities(
        delayed_nack=True,
        dedup=True,
        per_message_ttl=False,
        replay=True,
        durable=True,
        ordered=True,
    )
    name: ClassVar[str] = "nats"
    #: Every publish awaits the broker's confirmation (the call's one yield).
    publish_waits: ClassVar[bool] = True

    def __init__(
        self,
        url: str | Sequence[str] = "nats://127.0.0.1:4222",
        *,
        prefix: str = "asyncbus",
        ack_timeout: float = 30.0,
        codec: Codec | None = None,
        connect_timeout: float = 2.0,
        request_timeout: float = 5.0,
        dedup_window: float = 120.0,
        max_age: float | None = None,
        keep_alive: bool = True,
        reconnect_wait: float = 0.5,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        publish_timeout: float | None = None,
        replicas: int = 1,
    ) -> None:
        super().__init__(codec=codec)
        require_extra("NatsTransport", "nats", "nats")
        check_url("NatsTransport", url, _SCHEMES, _URL_FORM)
        check_count(replicas, "NatsTransport: replicas", 1, _MAX_REPLICAS)
        if publish_timeout is None:
            publish_timeout = request_timeout
        validate_topic(prefix)
        check_subject_text("prefix", prefix)
        seconds = {
            label: checked_seconds(value, f"NatsTransport: {label}")
            for label, value in (
                ("ack_timeout", ack_timeout),
                ("connect_timeout", connect_timeout),
                ("request_timeout", request_timeout),
                ("dedup_window", dedup_window),
                ("reconnect_wait", reconnect_wait),
                ("publish_timeout", publish_timeout),
            )
        }
        if max_age is not None:
            max_age = checked_seconds(max_age, "NatsTransport: max_age")
            if max_age < MIN_MAX_AGE:
                raise ConfigurationError(
                    f"NatsTransport: max_age must be at least {MIN_MAX_AGE:g} s "
                    f"(JetStream's shortest), got {max_age!r}"
                )
        if not isinstance(keep_alive, bool):
            raise ConfigurationError(
                f"NatsTransport: keep_alive must be a bool, got {keep_alive!r}"
            )
        #: Every URL given, in order (the nodes of one cluster, or one server).
        self.servers = split_urls(url)
        #: The URLs given, comma-separated.
        self.url = ",".join(self.servers)
        self.replicas = replicas
        self.prefix = prefix
        self.ack_timeout = seconds["ack_timeout"]
        self.connect_timeout = seconds["connect_timeout"]
        self.request_timeout = seconds["request_timeout"]
        self.publish_timeout = seconds["publish_timeout"]
        self.dedup_window = seconds["dedup_window"]
        self.max_age = max_age
        self.keep_alive = keep_alive
        self.reconnect_wait = seconds["reconnect_wait"]
        self.max_deliveries = checked_max_deliveries(max_deliveries)
        #: Name of the stream of envelopes, and of the stream of dead letters.
        self.stream = stream_name(prefix)
        self.dead_letter_stream = f"{self.stream}_DLQ"
        self.limits = subject_limits(prefix, self.stream)
        if (self.limits.max_pattern_bytes or 0) < 1:
            raise ConfigurationError(
                f"NatsTransport: prefix of {len(prefix.encode())} bytes leaves no room for "
                "a topic in a NATS subject"
            )
        self._dead_prefix = f"{prefix}_dlq"
        self._shared_dead = NatsDeadLetters(self, self._dead_prefix)
        #: The background tasks: publish expiry, keep-alives, and what outlives a
        #: subscription (an inbox kept until its open pull request ends).
        self._tasks = TaskOwner("NatsTransport")
        #: The client, its JetStream context and publisher, while connected.
        self._connection = NatsConnection(self)
        self._groups = GroupDirectory(self.stream)
        #: What makes the streams and consumers, and makes them again when they vanish.
        self._setup = JetStreamSetup(self)
        self._subscriptions = Subscriptions(self)
        self._restorer = Restorer(self, self._setup, self._connection)
        self._sender = EnvelopeSender(self, self._connection, self._restorer, self._setup)
        self._handbacks = HandBacks(self)
        self._heartbeats = NatsHeartbeats(self)
        #: Acks written behind, by consumer name: the reply subjects to ``+ACK``.
        self._acks = AckWriter[str, str](
            "NatsTransport",
            self._connection.write_acks,
            self.cleanup_scope,
            linger=_ACK_LINGER,
            timeout=self.request_timeout,
        )

    def __repr__(self) -> str:
        return f"NatsTransport({self._shown()!r}, prefix={self.prefix!r})"

    def _shown(self) -> str:
        """The URLs given, credentials hidden."""
        return ",".join(redact(one) for one in self.servers)

    @property
    def pull_expires(self) -> float:
        """Seconds each pull request lives on the server: 5, or ``ack_timeout / 2``.

        A process that dies leaves its open pull request behind until it expires, and
        the server goes on sending into it: a redelivery sent there is lost, yet
        counted in ``num_delivered``, so a message that kills its consumer would
        reach ``max_deliveries`` early (and miss its next consumer until one more
        ``ack_timeout``). A request that expires within half an ``ack_timeout`` is
        gone before a redelivery of what its process held comes due (``+WPI`` keeps
        them at least two thirds of an ``ack_timeout`` away).
        """
        return min(_PULL_EXPIRES, self.ack_timeout / 2)

    # -- connection ---------------------------------------------------------------

    async def __aenter__(self) -> NatsTransport:
        await self.connect()
        return self

    async def connect(self) -> None:
        """Connect, and create the two streams unless they exist.

        :raises ConnectError: when nats-py is missing, the server is unreachable or
            JetStream is not enabled on it.
        """
        if self._connection.nc is not None:
            return
        self._groups.forget()
        await self._connection.open()
        self._acks.open()
        self._tasks.start_soon(self._acks.run, name="asyncbus NATS ack writer")

    async def _set_up(
        self, nc: Client, js: JetStreamContext, publisher: JetStreamPublisher
    ) -> None:
        """Once connected (the tasks open): the streams, the publisher's inbox and the
        watch of the groups (:class:`NatsConnection` calls it)."""
        await self._setup.ensure_streams(js)
        await publisher.start(self._tasks)
        await self._groups.watch(nc)

    async def aclose(self) -> None:
        """Write the acks queued, flush what is buffered (acks, naks) and close the
        connection, shielded."""
        if self._connection.nc is None:
            return
        with self.cleanup_scope(self.request_timeout):
            try:
                await self._acks.flush()
            except Exception as error:
                logger.warning("NATS: acks lost at close (redelivered later): %s", error)
        detached = self._connection.detach()
        if detached is None:
            return
        self._subscriptions.stop_lingering()
        # Keep-alives stop; lingering inboxes unsubscribe (shielded, by the deadline).
        # Whatever interrupts that (a cancellation of the closing task), the connection
        # is closed below all the same: never a socket left open.
        try:
            await self._tasks.aclose()
        finally:
            # What is still queued (a write cut short puts its acks back) is lost.
            self._acks.close()
            await self._connection.close(*detached)
            self._subscriptions.wake()

    def _reconnected(self) -> None:
        """The connection came back (:class:`NatsConnection` tells)."""
        self._groups.forget()  # announcements may have been missed meanwhile
        self._shared_dead.reconnected()  # so may changes of the dead letters
        self._subscriptions.pull_again()  # the open pull requests may be gone

    def _closed(self) -> None:
        """The connection is closed for good (:class:`NatsConnection` tells)."""
        self._subscriptions.wake()

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the acks the transport closed without writing."""
        return self._acks.take_lost()

    def _client(self) -> tuple[Client, JetStreamContext]:
        """The connected client and its JetStream context (:class:`TransportError`
        when not connected)."""
        return self._connection.client()

    # -- publishing ---------------------------------------------------------------

    def check_topic(self, topic: str) -> None:
        """:class:`ConfigurationError` unless ``topic`` makes a subject the server takes
        (:attr:`limits`; checked once per topic)."""
        self._sender.subject(topic)

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Publish each envelope to ``{prefix}.{topic}`` and wait for the stream's ack.

        :raises ConfigurationError: when ``topic`` is not a valid NATS subject.
        :raises TransportError: when the server refuses or does not confirm in time,
            or an envelope is larger than the server's ``max_payload``.
        """
        sender = self._sender
        await sender.send_all(sender.subject(topic), sender.messages(envelopes))

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`publish` to the groups the stream's consumers are; none: dead-letter.

        The groups are the stream's durable consumers (every process's), read from the
        server and read again when it announces a change. When none matches ``topic``
        they are read once more (one created a moment ago counts), and if still none
        does, each envelope is stored as a ``no_subscribers`` dead letter, unpublished.

        :returns: the stage names of the groups reached (``()``: none).
        """
        subject = self._sender.subject(topic)  # (checks the topic)
        # One deadline for the whole call: reading the groups, a restore, the publish.
        deadline = anyio.current_time() + self.publish_timeout
        restorer = self._restorer
        await restorer.wait(subject, deadline)
        names = self._groups.known(topic)
        if not names:
            await restorer.read_groups()
            names = self._groups.known(topic)
        if not names and self._subscriptions.reach(topic):
            # This process subscribes to it, yet the server has no such consumer: it
            # lost them (a restart with an empty store). Make them again, then look.
            await restorer.restore()
            await restorer.read_groups()
            names = self._groups.known(topic)
        if not names:
            for envelope in envelopes:
                await self._shared_dead.add(unrouted_entry(envelope))
            return ()
        changes = self._groups.changes
        with anyio.move_on_after(deadline - anyio.current_time()) as late:
            await self.publish(topic, envelopes)
        if late.cancelled_caught:
            raise TransportError(
                f"publish of {len(envelopes)} envelope(s) to {subject} was not confirmed "
                f"within {self.publish_timeout:g} s"
            )
        if self._groups.changes != changes:
            # The server announced a consumer created or deleted while the publish was on
            # its way: the announcement of one made before the publish was stored comes
            # before its acknowledgement, so the groups known now are those it reached.
            # (None found now: it went to those that were there, it is not a dead letter.)
            if self._groups.known(topic) is None:
                await restorer.read_groups()
            names = self._groups.known(topic) or names
        return names

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Deliver the envelopes to one (pattern, group) only (see the module docstring)."""
        await self._sender.send_to_group(pattern, group, envelopes)

    # -- consuming ----------------------------------------------------------------

    def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[Delivery]]:
        """Pull from the group's durable consumer; unsettled deliveries go back at the end."""
        return self._subscriptions.subscribe(pattern, group, prefetch)

    async def _restore(self, consumer: PullConsumer | None = None) -> None:
        """Make the streams and this transport's consumers again (``consumer`` first):
        what a pull consumer (or the dead letters) that found them gone asks for."""
        await self._restorer.restore(consumer)

    async def _consumer_exists(self, name: str) -> bool:
        """Whether the durable consumer ``name`` is on the server (a pull consumer asks)."""
        return await self._setup.consumer_exists(name)

    def dedup_store(self, window: float) -> NatsDedupStore:
        """``deduplicate()``'s store in NATS: a JetStream KV bucket aged by ``window``.

        (The stream's ``Nats-Msg-Id`` window drops duplicate publishes, not a second
        handling of a redelivery: see :mod:`._nats_dedup`.)
        """
        return NatsDedupStore(self, window)

    def rate_store(self) -> NatsRateStore:
        """``RateLimit``'s shared turns in NATS: a JetStream KV bucket, one key per
        bucket, written at the revision read."""
        return NatsRateStore(self)

    def lease_store(self) -> NatsLeaseStore:
        """``max_in_flight``'s slots in NATS: a JetStream KV bucket, one key of leases per
        stage, written at the revision read."""
        return NatsLeaseStore(self)

    async def backlog(self, pattern: str, group: str) -> int:
        """Messages of the group's consumer not yet delivered plus delivered, unsettled."""
        _, js = self._client()
        return await group_backlog(js, self.stream, consumer_name(pattern, group))

    async def groups(self) -> list[GroupInfo]:
        """The groups (the stream's durable consumers, request inboxes aside), with their
        backlog, the pull requests waiting on them and their last delivery."""
        _, js = self._client()
        return await list_groups(js, self.stream, self.prefix)

    async def beat(self, instance: str, record: bytes) -> None:
        """Write process ``instance``'s heartbeat record (``Bus.cluster_statistics``)."""
        await self._heartbeats.beat(instance, record)

    async def beats(self) -> list[bytes]:
        """Every process's latest heartbeat record."""
        return await self._heartbeats.beats()

    async def forget(self, instance: str) -> None:
        """Delete process ``instance``'s heartbeat record."""
        await self._heartbeats.forget(instance)

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the group's durable consumer; the stream drops what only it needed
        (interest retention), and every process's next publish reads the groups again."""
        _, js = self._client()
        return await remove_group(js, self._groups, consumer_name(pattern, group))

    # -- dead letters -------------------------------------------------------------

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter stream and wait for the ack (its payload
        as the body: see :meth:`NatsDeadLetters.add`)."""
        await self._shared_dead.add(entry)

    async def dead_letters(self) -> list[DeadLetter]:
        """Every dead letter in the stream, oldest first, without expired ones."""
        return await self._shared_dead.read()

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Delete the dead letters of these envelope ids (every entry of each id)."""
        await self._shared_dead.take(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the dead letters of these envelope ids, each by its sequence (the
        claim); return those this call deleted, telling every watcher."""
        return await self._shared_dead.take(ids)

    async def clear_dead_letters(self) -> None:
        """Purge the dead-letter stream (every watcher reads it again)."""
        await self._shared_dead.clear()

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Store ``entries`` again (taken for a replay that failed); every watcher reads
        the dead letters again."""
        await self._shared_dead.put_back(entries)

    def watch_dead_letters(self) -> AbstractAsyncContextManager[AsyncIterator[DeadLetterChange]]:
        """Every dead letter added or removed from now on, by any process."""
        return self._shared_dead.watch()
