"""The Redis Streams transport: consumer groups, delayed retries and dead letters in Redis.

Layout of the keys (all under ``prefix``; with ``cluster=True`` under ``{prefix}``, one
hash tag, so that every script and transaction stays in one slot of a Redis Cluster):

* ``{prefix}:stage:{pattern}@{group}``: one stream per (pattern, group) binding, with
  one consumer group (``group``) on it. Pattern and group are percent-escaped (``@``,
  ``%``, spaces, braces...), so two bindings never share a key.
* ``{prefix}:bindings``: hash of binding stream key to ``[pattern, group]``, written by
  ``subscribe``; ``{prefix}:bindings:version`` changes on every registration and
  deletion (listing and deleting groups: :mod:`._redis_groups`).
* ``{prefix}:readers``: hash of ``{stream} {consumer}`` to ``{seen ms}:{until ms}``,
  which consumers read each binding (written every ``claim_interval``), for listings.
* ``{prefix}:delayed``: sorted set of delayed retries by due time (ms), each one a hash
  ``{prefix}:delayed:{token}`` (stream, meta, body, id); ``{prefix}:delayed:counts``
  counts them per stream (for :meth:`RedisTransport.backlog`).
* ``{prefix}:deadletters``: the dead-letter stream (``id``, ``entry`` fields), and
  ``{prefix}:deadletters:removed`` / ``:removals``, what was taken out of it, so every
  process's list follows (:mod:`._redis_dead_letters`).
* ``{prefix}:inboxes``: sorted set of the streams of request inboxes (groups
  ``_reply.*``, one per process) by the time they expire (ms). A live process pushes
  its inbox's expiry (and the stream's own ``PEXPIRE``) forward every
  ``inbox_ttl / 3``; any process deletes the expired ones with their bindings, so a
  process that dies leaves nothing behind for more than ``inbox_ttl``, and one that
  leaves deletes its inbox at once. Replies are written with ``NOMKSTREAM``: a reply
  to an inbox that is gone is dropped instead of making the stream again.

How it works:

* **Routing.** ``publish`` matches the topic against the cached bindings and XADDs each
  envelope to every matching binding stream with one script call (``PUBLISH``: one
  round trip, atomic), which also reads the version key; a publish of many envelopes
  is that one call. Publishes from concurrent tasks share it (a group commit,
  :mod:`._coalesce`): one writer task writes all that arrived during its last write,
  and each publish returns once the write holding it succeeded (``publish_timeout``
  bounds each batch, queued time included). The script writes only if the version is
  the one the routes were made from; when it moved (a binding was added or deleted
  anywhere), the bindings are read again and the batch routed anew, so a binding
  registered before a publish always receives it and one deleted never does. A
  publish through :meth:`RedisTransport.publish_routed` (the bus's) that no binding
  matched is stored as a ``no_subscribers`` dead letter instead.
* **Reading.** A consumer reads with ``XREADGROUP COUNT <room>`` (its free prefetch),
  the reply taken as it came (no dict per entry); commands are packed by hiredis
  when it is installed (redis-py packs in Python, an argument at a time).
* **Settling.** Every settle removes the entry from the stream together with its XACK
  (MULTI), so a stream holds exactly what its group has not settled: ``backlog`` is its
  XLEN plus the retries waiting in the sorted set. Acks are written behind, in batches
  (a writer task gathers what arrives within ~2 ms; leaving a subscription or closing
  the transport writes them first); nack and reject are written before they return.
* **Attempts.** ``attempt`` = the attempt stored in the entry's meta (incremented on
  every re-add) + the entry's delivery count - 1 (reclaimed entries count up). An
  entry delivered more than ``max_deliveries`` times (``XPENDING``'s count: reclaimed
  from consumers that died or hung on it, never settled) is handed over with
  ``error`` set, so the bus dead-letters it ``rejected`` instead of running it again.
* **Delayed nack** moves the entry into the sorted set (and acks it) atomically; a task
  of every transport moves due entries back with a Lua script, so any live process
  does it. ``nack()`` without delay re-adds at once.
* **Crash recovery.** Consumers claim (XAUTOCLAIM) entries idle for ``ack_timeout``
  every ``claim_interval`` (between reads of at most ``block_ms``): an entry not
  settled within ``ack_timeout`` of its delivery (its consumer was killed, or hangs)
  goes to another consumer as the next attempt. ``ack_timeout`` therefore bounds the
  time from delivery to settling, waiting in a local queue included, unless
  ``keep_alive=True`` (the default): then a task resets the idle time of every held
  entry every ``ack_timeout / 3`` (a Lua script that touches only entries the
  consumer still owns), so a long handler or a long retry delay is never run twice.
* **Vanished streams.** A stream deleted under a waiting consumer (``DEL``,
  ``FLUSHDB``, a restart without persistence: ``NOGROUP``, ``UNBLOCKED``) is made
  again with its group and binding, and consuming goes on. A binding gone from the
  hash is registered again within ``claim_interval`` by its process, also while its
  consumers do not read (a full stage, long handlers), so publishers find the group.
* **Hand-back.** Leaving ``subscribe`` gives every entry the consumer holds to a
  sentinel consumer, idle enough to be claimed at once and with its delivery count put
  back, then deletes the consumer (one Lua script, shielded). The group's next claim
  round takes them, oldest first, before new entries. A subscription whose prefetch
  comes down (``set_prefetch``) gives back the same way the entries it fetched beyond
  it and did not hand out yet.
* **Suspects and waits.** A reclaimed entry's delivery count less one is its
  ``redeliveries`` (deliveries to consumers that died or hung with it); its id's
  milliseconds are when it was queued (``queued_at``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote, unquote, urlsplit

import anyio
import anyio.lowlevel

from .._checks import check_count
from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import ConfigurationError, ConnectError, DecodeError, TransportError
from .._groups import GroupInfo
from .._routing import compile_pattern, validate_topic
from . import _redis_scripts
from ._coalesce import Coalescer
from ._codec import (
    Codec,
    RawBody,
    dead_letter_from_wire,
    dead_letter_to_wire,
    dump_meta,
    envelope_from_wire,
    envelope_meta,
    envelope_to_wire,
)
from ._kit import (
    AckWriter,
    Backoff,
    TaskOwner,
    TopicMatches,
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
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, checked_max_deliveries, over_max_deliveries
from ._kit.routes import INBOX_GROUP_PREFIX, unrouted_entry
from ._redis_dead_letters import RedisDeadLetters
from ._redis_dedup import RedisDedupStore
from ._redis_groups import RedisGroups
from ._redis_heartbeats import RedisHeartbeats
from ._redis_leases import RedisLeaseStore
from ._redis_rates import RedisRateStore
from ._registry import registered
from ._wire_fields import group_from_wire
from .base import BaseDelivery, Capabilities, DeadLetterChange, Delivery, Transport

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

__all__ = ["RedisTransport"]

logger = logging.getLogger("asyncbus.transport.redis")

#: The URL schemes redis-py takes, and what a URL looks like (for errors).
_SCHEMES = tuple(registered("redis").schemes)
_URL_FORM = "redis://[[user]:password@]host[:port][/db] (rediss:// for TLS, unix:///path)"

_EXTRA_MISSING = "RedisTransport needs the 'redis' extra: pip install 'asyncbus[redis]'"
#: Why a delivery its subscription gave back cannot be settled.
_RELEASED = "was released when its subscription ended"
#: Consumer that owns handed-back entries until a live consumer claims them.
_SENTINEL = "asyncbus:released"
#: Idle time given to handed-back entries: older than any ack_timeout.
_RELEASED_IDLE_MS = 365 * 24 * 3600 * 1000
#: Longest wait of the delayed-retry mover between two looks at the sorted set.
_DELAY_POLL = 0.1
#: Due retries moved per script call.
_DELAY_BATCH = 500
#: Claim rounds between two sweeps for dead consumers that hold nothing.
_REAP_EVERY = 20
#: Seconds the hand-back of a leaving consumer may take before it is left to reclaim.
_RELEASE_TIMEOUT = 5.0
#: Seconds closing the connections may take.
_CLOSE_TIMEOUT = 0.5
#: Seconds the first answer (a PING) may take before connecting fails.
_CONNECT_WAIT = 10.0
_BACKOFF_MAX = 2.0
#: Longest blocking read (ms): an hour; a read that long holds a pooled connection.
_BLOCK_MS_MAX = 3_600_000
#: Seconds the ack writer waits for more acks before writing (bounds their delay).
_ACK_LINGER = 0.002
_PAGE = 1000
#: Topics remembered as valid (so a publish does not check its topic again).
_VALID_TOPICS = 8192

#: One publish waiting to be written: its topic, its envelopes as (meta, body), and the
#: binding streams the writer wrote them to (filled in by the writer).
_Publish = tuple[str, list[tuple[bytes, bytes]], set[str]]


def _escape(name: str) -> str:
    # Injective (``%`` itself is escaped) and keeps the usual names readable.
    return quote(name, safe=":*><$")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _is_inbox(group: str) -> bool:
    return group.startswith(INBOX_GROUP_PREFIX)


def _vanished(error: BaseException) -> bool:
    """Whether a Redis error says the stream or its group is gone."""
    message = str(error)
    return (
        message.startswith(("NOGROUP", "UNBLOCKED"))
        or "no such key" in message
        or "requires the key to exist" in message
    )


#: Argument types hiredis packs exactly as redis-py's encoder writes them.
_AS_THEY_ARE = frozenset({bytes, int})


def _packing_by_hiredis(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` packing its commands with hiredis (C) when it is installed.

    redis-py's asyncio connections pack a command in Python, growing one buffer an
    argument at a time: for a publish batch (a script call with a few hundred
    arguments) that cost more than everything else the transport does for those
    envelopes. The arguments are still encoded by the connection's own encoder (the
    same bytes on the wire, the same errors for a bad argument); only the framing
    moves to hiredis. Without hiredis the class is returned as it is.
    """
    try:
        from hiredis import pack_command as pack
    except ImportError:
        return connection_class

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str):
            args = (*head.encode().split(), *args[1:])
        elif b" " in head:
            args = (*head.split(), *args[1:])
        encode = self.encoder.encode
        # Bytes and ints (not bools) are written as the encoder would write them.
        return [pack(tuple([arg if type(arg) in _AS_THEY_ARE else encode(arg) for arg in args]))]

    return type(
        f"HiredisPacked{connection_class.__name__}",
        (connection_class,),
        {"pack_command": pack_command, "__doc__": connection_class.__doc__},
    )


def _as_it_came(response: Any, **options: Any) -> Any:
    return response


class _Verbatim:
    """A codec that always encodes to one body: a delivery's raw body, kept as it came."""

    content_type = "application/octet-stream"

    def __init__(self, body: bytes) -> None:
        self.body = body

    def encode(self, value: Any) -> bytes:
        return self.body

    def decode(self, data: bytes) -> Any:
        return data


class _RedisDelivery(BaseDelivery):
    """A delivery from :class:`RedisTransport`; its acks are written behind.

    Acks are written together by the transport's writer (within a moment, before
    the subscription or the transport closes): a process that dies first gets the
    entry redelivered, as at-least-once delivery allows.
    """

    __slots__ = ("_body", "_consumer", "_entry")

    acks_behind = True

    def __init__(
        self,
        consumer: _Consumer,
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
        consumer = self._consumer
        await consumer.transport._settle(
            consumer, self._entry, retry=(self._retry_meta(), self._body), delay=delay
        )

    async def _reject(self, entry: DeadLetter) -> None:
        """Move it to the dead-letter stream and remove the entry, in one transaction.

        The dead letter keeps the body as it came (byte for byte, also when it did not
        decode).
        """
        consumer = self._consumer
        await consumer.transport._settle(consumer, self._entry, dead=(entry, self._body))


class _Consumer:
    """One subscription: a named consumer of a binding's group, and what it holds.

    It is what ``subscribe`` yields: an iterator of deliveries whose prefetch can
    change (:class:`~asyncbus.transports.SubscriptionControl`).
    """

    def __init__(
        self, transport: RedisTransport, pattern: str, group: str, stream: str, prefetch: int
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
        self.held: dict[bytes, _RedisDelivery] = {}
        #: Fetched, not yet yielded.
        self.ready: deque[_RedisDelivery] = deque()
        self.room = anyio.Event()
        self.claim_cursor: bytes | str = "0-0"
        self.next_claim = 0.0
        self.claim_rounds = 0
        self.backoff = Backoff(0.05, _BACKOFF_MAX)

    def __aiter__(self) -> _Consumer:
        return self

    async def __anext__(self) -> Delivery:
        """The next delivery: what is fetched, then (room permitting) a new fetch."""
        return await self.transport._next(self)

    async def set_prefetch(self, prefetch: int) -> None:
        """Hold at most ``prefetch`` unsettled entries (see ``SubscriptionControl``)."""
        await self.transport._resize(self, checked_prefetch(prefetch))

    async def flush(self) -> None:
        """Write the acks queued for this consumer's entries (see ``SubscriptionControl``)."""
        with self.transport.cleanup_scope(_RELEASE_TIMEOUT):
            await self.transport._acks.flush([self.ack_key])


#: Most replicas ``wait_replicas`` may ask for.
_WAIT_REPLICAS_MAX = 64
#: Share of ``publish_timeout`` a publish's ``WAIT`` may take (the rest: the write).
_WAIT_SHARE = 0.8


class _CaughtErrors:
    """redis-py's errors the transport catches: ``RedisError`` includes the cluster
    client's own (``RedisClusterException``: no node answers, a slot not covered)."""

    def __init__(self, errors: Any) -> None:
        self.RedisError = (errors.RedisError, errors.RedisClusterException)
        self.ResponseError = errors.ResponseError


def _check_nodes(nodes: list[str], cluster: bool, prefix: object) -> None:
    """Refuse what cannot work with ``cluster`` (see :class:`RedisTransport`)."""
    if not cluster:
        if len(nodes) > 1:
            shown = ",".join(redact(one) for one in nodes)
            raise ConfigurationError(
                "RedisTransport: several URLs name the nodes of a Redis Cluster: pass "
                f"cluster=True (one server takes one URL), got {shown!r}"
            )
        return
    for one in nodes:
        parts = urlsplit(one)
        if parts.scheme not in ("redis", "rediss") or parts.path not in ("", "/", "/0"):
            raise ConfigurationError(
                "RedisTransport: a cluster node is redis://[[user]:password@]host[:port] "
                f"(rediss:// for TLS; database 0, the only one a cluster has), got {redact(one)!r}"
            )
    if isinstance(prefix, str) and ("{" in prefix or "}" in prefix):
        raise ConfigurationError(
            "RedisTransport: on a cluster the prefix becomes the keys' hash tag and "
            f"cannot hold braces, got {prefix!r}"
        )


def _cluster_client(nodes: list[str], retry: Any, timeouts: dict[str, float]) -> Any:
    """redis-py's cluster client, starting from ``nodes`` (credentials of the first)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    first = urlsplit(nodes[0])
    startup = []
    for one in nodes:
        parts = urlsplit(one)
        startup.append(ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379))
    return RedisCluster(
        startup_nodes=startup,
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        ssl=first.scheme == "rediss",
        retry=retry,
        socket_connect_timeout=timeouts["socket_connect_timeout"],
        socket_timeout=timeouts["socket_timeout"],
    )


class RedisTransport(Transport):
    """Envelopes in Redis Streams: durable, shared by every process using the server.

    Runs on asyncio only (redis-py's client is asyncio-only).

    :param url: the server, ``redis://[[user]:password@]host[:port][/db]``; with
        ``cluster=True``, the nodes of a Redis Cluster to start from (one, several
        separated by commas, or a list: any that answers tells the client the rest).
    :param prefix: prepended to every key, so several buses (or tests) can share a server.
    :param ack_timeout: seconds after which the entries of a consumer that stopped
        (a killed process) go to another consumer of the group.
    :param codec: how payloads become bytes (JSON by default; never pickle).
    :param block_ms: longest wait of one XREADGROUP; claims run between reads.
    :param claim_interval: seconds between two looks for entries to reclaim.
    :param max_message_size: largest envelope (meta + body, in bytes) ``publish``
        accepts; a larger one is refused with :class:`TransportError` before anything
        is written.
    :param keep_alive: while a delivery is held (queued in its stage, handled, waiting
        for a retry), reset its idle time every ``ack_timeout / 3``, so only a dead
        process's entries go to another consumer (a hung one keeps them until it
        leaves). Off, a delivery held longer than ``ack_timeout`` is also given to
        another consumer.
    :param max_deliveries: deliveries of one entry, none settled, after which the next
        one is handed over with ``error`` set (the bus dead-letters it ``rejected``).
    :param publish_timeout: longest a ``publish`` waits for Redis to confirm it (queued
        behind other writes included) before raising :class:`TransportError`; it is
        also the socket timeout of every other call (at least ``block_ms`` plus a
        second), so a server that stops answering fails calls instead of hanging them.
    :param cluster: talk to a Redis Cluster through redis-py's cluster client (it
        follows ``MOVED``/``ASK`` and a master's failover to its replica). Every key of
        one ``prefix`` carries the hash tag ``{prefix}``, so each script and
        transaction stays in one slot: a prefix lives on one master (and its
        replicas), and several prefixes spread over the cluster.
    :param wait_replicas: a publish returns once that many replicas of the server have
        it too (Redis ``WAIT``, on the connection that wrote it), and raises
        :class:`TransportError` when fewer had it within ``publish_timeout``: a
        confirmed publish then survives the master's loss. ``0`` (the default): once
        the server has it (its replicas follow asynchronously).
    :raises ConfigurationError: for a URL without a scheme, with another broker's or
        the web's (not ``redis``, ``rediss``, ``unix``) or with a bad port, several
        URLs without ``cluster=True``, a cluster node given by a socket path or a
        database other than 0, a prefix with braces on a cluster, ``wait_replicas``
        with ``cluster=True`` or out of range, or a
        timeout, interval, size or cap that is not a positive number in range (NaN,
        infinities, bools, huge values included).
    :raises ImportError: (also a ``ConnectError`` and a ``ConfigurationError``) when
        redis-py is not installed: the message names the extra.
    """

    #: Seconds the inbox of a process that died stays in Redis (see the module docstring).
    inbox_ttl: float = 300.0

    capabilities: ClassVar[Capabilities] = Capabilities(
        delayed_nack=True,
        dedup=False,
        per_message_ttl=False,
        replay=True,
        durable=True,
        ordered=True,
    )
    name: ClassVar[str] = "redis"
    #: Every publish awaits the broker's confirmation (the call's one yield).
    publish_waits: ClassVar[bool] = True

    def __init__(
        self,
        url: str | Sequence[str] = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "asyncbus",
        ack_timeout: float = 30.0,
        codec: Codec | None = None,
        block_ms: int = 200,
        claim_interval: float = 0.5,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        keep_alive: bool = True,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        publish_timeout: float = 10.0,
        cluster: bool = False,
        wait_replicas: int = 0,
    ) -> None:
        super().__init__(codec=codec)
        require_extra("RedisTransport", "redis", "redis")
        check_url("RedisTransport", url, _SCHEMES, _URL_FORM)
        if not isinstance(cluster, bool):
            raise ConfigurationError(f"RedisTransport: cluster must be a bool, got {cluster!r}")
        nodes = split_urls(url)
        _check_nodes(nodes, cluster, prefix)
        wait_replicas = check_count(
            wait_replicas, "RedisTransport: wait_replicas", 0, _WAIT_REPLICAS_MAX
        )
        if wait_replicas and cluster:
            raise ConfigurationError(
                "RedisTransport: wait_replicas is not available with cluster=True yet "
                "(a cluster's client cannot keep a write and its WAIT on one connection)"
            )
        ack_timeout = checked_seconds(ack_timeout, "RedisTransport: ack_timeout")
        publish_timeout = checked_seconds(publish_timeout, "RedisTransport: publish_timeout")
        # A blocking read is one call: it must fit well within a socket timeout.
        block_ms = check_count(block_ms, "RedisTransport: block_ms", 1, _BLOCK_MS_MAX)
        claim_interval = checked_seconds(claim_interval, "RedisTransport: claim_interval")
        if not isinstance(keep_alive, bool):
            raise ConfigurationError(
                f"RedisTransport: keep_alive must be a bool, got {keep_alive!r}"
            )
        if not isinstance(prefix, str) or not prefix:
            raise ConfigurationError("prefix must be a non-empty string")
        #: The URLs given (the cluster's nodes to start from, with ``cluster=True``).
        self.nodes = nodes
        #: The URLs given, comma-separated.
        self.url = ",".join(nodes)
        self.cluster = cluster
        self.wait_replicas = wait_replicas
        #: What every key starts with: ``prefix``, or ``{prefix}`` on a cluster (one
        #: hash tag: one slot for everything a script or transaction touches).
        self.key_base = f"{{{prefix}}}" if cluster else prefix
        self.max_message_size = checked_max_message_size(max_message_size)
        self.keep_alive = keep_alive
        self.max_deliveries = checked_max_deliveries(max_deliveries)
        self.prefix = prefix
        self.ack_timeout = ack_timeout
        self.block_ms = block_ms
        self.claim_interval = claim_interval
        self.publish_timeout = publish_timeout
        base = self.key_base
        self._bindings_key = f"{base}:bindings"
        self._version_key = f"{base}:bindings:version"
        self._delayed_key = f"{base}:delayed"
        self._delayed_counts_key = f"{base}:delayed:counts"
        self._dead_key = f"{base}:deadletters"
        self._shared_dead = RedisDeadLetters(self, self._dead_key)
        self._groups = RedisGroups(self)
        self._heartbeats = RedisHeartbeats(self)
        self._inboxes_key = f"{base}:inboxes"
        self._client: Redis | None = None
        self._errors: Any = None  # redis-py's errors the transport catches, once imported
        self._scripts: dict[str, AsyncScript] = {}
        #: The background tasks: the publish writer, the ack writer, the delayed-retry
        #: mover, the inbox keeper, and each subscription's keep-alive.
        self._tasks = TaskOwner("RedisTransport")
        self._consumers: set[_Consumer] = set()
        self._bound: set[str] = set()
        # Routing cache: bindings as of ``_version``, and topic -> streams.
        self._version: bytes | None = None
        self._bindings: list[tuple[Callable[[str], bool], str]] | None = None
        #: Binding stream -> its stage name ("pattern@group").
        self._names: dict[str, str] = {}
        #: Binding streams a publish reached -> their stage names, sorted.
        self._stage_names: dict[frozenset[str], tuple[str, ...]] = {}
        self._routes = TopicMatches()
        self._valid_topics: set[str] = set()
        #: Streams of request inboxes among the bindings (written with NOMKSTREAM).
        self._inbox_streams: set[str] = set()
        self._next_due = float("inf")
        #: Acks written behind, by (stream, group): entry ids, in one MULTI per write.
        self._acks = AckWriter[tuple[str, str], bytes](
            "RedisTransport",
            self._write_acks,
            self.cleanup_scope,
            linger=_ACK_LINGER,
            timeout=_RELEASE_TIMEOUT,
        )
        # Made in ``connect``, inside the event loop that uses them.
        self._delay_wake: anyio.Event
        self._publishes: Coalescer[_Publish]

    # -- keys -----------------------------------------------------------------

    def stream_key(self, pattern: str, group: str) -> str:
        """The Redis key of the stream of binding (``pattern``, ``group``)."""
        return f"{self.key_base}:stage:{_escape(pattern)}@{_escape(group)}"

    def _shown(self) -> str:
        """The URLs given, credentials hidden."""
        return ",".join(redact(one) for one in self.nodes)

    # -- life cycle -----------------------------------------------------------

    async def connect(self) -> None:
        """Connect and ping; start the delayed-retry mover.

        :raises ConnectError: when redis-py is missing, the server does not answer, or
            not running on asyncio.
        :raises ConfigurationError: for a URL redis-py cannot read (an unknown scheme).
        """
        if self._client is not None:
            return
        try:
            import redis.asyncio as aioredis
            import redis.exceptions as errors
            from redis.asyncio.retry import Retry
            from redis.backoff import ExponentialBackoff
        except ImportError as error:
            raise ConnectError(_EXTRA_MISSING) from error
        require_asyncio("RedisTransport", "redis-py")
        # A few quick retries on a broken connection: a server that restarted leaves
        # pooled connections dead, and the first command on each must not fail for it.
        # Not on a timeout: a server that stopped answering fails the call at once.
        retry = Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 3, supported_errors=(errors.ConnectionError,)
        )
        timeouts = {
            "socket_connect_timeout": min(5.0, self.publish_timeout),
            # Every call is bounded; a blocking read waits block_ms, well within it.
            "socket_timeout": max(self.publish_timeout, self.block_ms / 1000 + 1.0),
        }
        client: Any
        if self.cluster:
            client = _cluster_client(self.nodes, retry, timeouts)
        else:
            # A blocking pool: a burst of concurrent publishes waits for a connection
            # instead of failing with "Too many connections".
            try:
                pool = aioredis.BlockingConnectionPool.from_url(
                    self.url, max_connections=256, timeout=None, retry=retry, **timeouts
                )
            except ValueError as error:  # a URL redis-py cannot read (an unknown scheme)
                raise ConfigurationError(
                    f"RedisTransport: {error}, got {self._shown()!r}: write it like {_URL_FORM}"
                ) from error
            pool.connection_class = _packing_by_hiredis(pool.connection_class)
            client = aioredis.Redis.from_pool(pool)
        # XREADGROUP's reply as it came (lists, or a map on RESP3), read by ``_fetch``
        # alone: redis-py's parsing made a dict per entry.
        client.set_response_callback("XREADGROUP", _as_it_came)
        try:
            with anyio.fail_after(_CONNECT_WAIT):
                await client.ping()
        except BaseException as error:  # deliberate: close the client on any way out
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
                await client.aclose()
            if not isinstance(
                error, errors.RedisError | errors.RedisClusterException | OSError | TimeoutError
            ):
                raise
            reason = str(error) or f"{type(error).__name__}: no answer within {_CONNECT_WAIT:g} s"
            raise ConnectError(f"cannot connect to Redis at {self._shown()}: {reason}") from (error)
        self._client = client
        self._errors = _CaughtErrors(errors)
        self._scripts = {
            name: client.register_script(getattr(_redis_scripts, name))
            for name in _redis_scripts.__all__
        }
        self._delay_wake = anyio.Event()
        self._acks.open()
        self._publishes = Coalescer(self._write_publishes, timeout=self.publish_timeout)
        await self._tasks.open()
        self._tasks.start_soon(self._move_due_loop)
        self._tasks.start_soon(self._acks.run)
        self._tasks.start_soon(self._publishes.run)
        self._tasks.start_soon(self._inbox_loop)
        self._tasks.start_soon(self._binding_loop)

    async def aclose(self) -> None:
        """Write pending acks, stop the background tasks, close the connections (shielded)."""
        if self._client is not None:
            with self.cleanup_scope(_RELEASE_TIMEOUT):
                try:
                    await self._acks.flush()
                except Exception as error:
                    logger.warning("Redis: acks lost at close (redelivered later): %s", error)
        running = self._tasks.running
        try:
            # The background tasks are cancelled and awaited, then the client is closed
            # shielded.
            await self._tasks.aclose()
        finally:
            # What is still queued (a write cut short puts its acks back) is lost.
            self._acks.close()
            if running:  # however the tasks ended: no publish waits on
                self._publishes.close("RedisTransport is closed: nothing more can be published")
            client, self._client = self._client, None
            if client is not None:
                # Closing sockets is local and quick: it runs even past the close
                # deadline (bounded), so no connection is left open.
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
                    await client.aclose()

    def _redis(self) -> Redis:
        if self._client is None:
            raise TransportError("RedisTransport is not connected: use `async with transport:`")
        return self._client

    def _failed(self, doing: str, error: BaseException) -> TransportError:
        return TransportError(f"Redis at {self._shown()}: {doing} failed: {error}")

    # -- routing --------------------------------------------------------------

    async def _bind(self, pattern: str, group: str) -> str:
        """Create the binding's stream and group (if needed) and register it."""
        self._redis()  # not connected: TransportError, before any redis error is looked at
        try:
            return await self._bind_raw(pattern, group)
        except self._errors.RedisError as error:
            raise self._failed(f"binding {pattern}@{group}", error) from error

    async def _bind_raw(self, pattern: str, group: str) -> str:
        stream = self.stream_key(pattern, group)
        client = self._redis()
        try:
            await client.xgroup_create(stream, group, id="0", mkstream=True)
        except self._errors.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        pipe = client.pipeline(transaction=True)
        pipe.hset(self._bindings_key, stream, json.dumps([pattern, group]))
        pipe.set(self._version_key, secrets.token_hex(8))
        if _is_inbox(group):
            self._queue_inbox_expiry(pipe, stream)
        await pipe.execute()
        self._bound.add(stream)
        return stream

    def _queue_inbox_expiry(self, pipe: Any, stream: str) -> None:
        ttl_ms = math.ceil(self.inbox_ttl * 1000)
        pipe.zadd(self._inboxes_key, {stream: int(time.time() * 1000) + ttl_ms})
        pipe.pexpire(stream, ttl_ms)

    async def _read_bindings(self) -> tuple[dict[bytes, bytes], bytes | None]:
        pipe = self._redis().pipeline(transaction=True)
        pipe.hgetall(self._bindings_key)
        pipe.get(self._version_key)
        found, version = await pipe.execute()
        return found, version

    async def _load_bindings(self) -> None:
        found, version = await self._read_bindings()
        if version is None and self._consumers:
            # No version although this process has bindings: the server lost them (a
            # restart without persistence, a flush). Make ours again before routing, so
            # a publish does not miss this process's groups until their next read.
            for consumer in list(self._consumers):
                await self._bind_raw(consumer.pattern, consumer.group)
            found, version = await self._read_bindings()
        bindings: list[tuple[Callable[[str], bool], str]] = []
        inboxes: set[str] = set()
        names: dict[str, str] = {}
        for stream, value in found.items():
            try:
                pattern, group = group_from_wire(value)
                key = _text(stream)
            except (DecodeError, UnicodeDecodeError) as error:  # written by another client
                logger.warning("Redis: skipping unreadable binding %r: %s", stream[:200], error)
                continue
            bindings.append((compile_pattern(pattern), key))
            names[key] = f"{pattern}@{group}"
            if _is_inbox(group):
                inboxes.add(key)
        self._bindings = bindings
        self._inbox_streams = inboxes
        self._names = names
        self._stage_names = {}
        self._version = version
        self._routes.clear()

    def _route(self, topic: str) -> tuple[str, ...]:
        return self._routes.lookup(topic, self._bindings or ())

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """XADD each envelope to every binding whose pattern matches ``topic``.

        Publishes from concurrent tasks are written together (see the module docstring);
        this one returns once the MULTI/EXEC holding its envelopes succeeded.

        :raises EncodeError: when a payload cannot be encoded (nothing is published).
        :raises TransportError: when an envelope is over ``max_message_size`` (nothing
            is published) or Redis fails.
        """
        await self._publish(topic, envelopes)

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`publish`; with no binding for ``topic`` in Redis, dead-letter instead.

        The bindings are every process's groups, and the write that finds none for the
        topic also reads their version (a binding registered meanwhile is caught), so
        "no group" is exact at that moment.

        :returns: the stage names of the bindings written to (``()``: none; then each
            envelope is a ``no_subscribers`` dead letter in the dead-letter stream).
        """
        reached = await self._publish(topic, envelopes)
        if reached or not envelopes:
            key = frozenset(reached)
            named = self._stage_names.get(key)
            if named is None:
                named = tuple(sorted(self._names.get(stream, stream) for stream in reached))
                if len(self._stage_names) >= _VALID_TOPICS:
                    self._stage_names.clear()
                self._stage_names[key] = named
            return named
        pipe = self._redis().pipeline(transaction=True)
        for envelope in envelopes:
            self._queue_dead_letter(pipe, unrouted_entry(envelope))
        try:
            with anyio.fail_after(self.publish_timeout):
                await pipe.execute()
        except (self._errors.RedisError, TimeoutError) as error:
            raise self._failed(f"dead-lettering what {topic!r} reached no group", error) from (
                error
            )
        return ()

    async def _publish(self, topic: str, envelopes: Sequence[Envelope]) -> set[str]:
        """Write the envelopes (coalesced); return the binding streams written to."""
        valid = self._valid_topics
        if topic not in valid:
            validate_topic(topic)
            if len(valid) >= _VALID_TOPICS:
                valid.clear()
            valid.add(topic)
        self._redis()
        reached: set[str] = set()
        if not envelopes:
            await anyio.lowlevel.checkpoint()
            return reached
        wire = [self._encode(envelope) for envelope in envelopes]
        size = sum(len(meta) + len(body) for meta, body in wire)
        # Bounded by the coalescer (publish_timeout, per batch): no cancel scope per publish.
        error = await self._publishes.submit((topic, wire, reached), size)
        if error is not None:
            if isinstance(error, TimeoutError):
                raise TransportError(
                    f"Redis at {self._shown()}: publish to {topic!r} not confirmed within "
                    f"publish_timeout={self.publish_timeout:g} s (it may or may not be written)"
                ) from error
            raise self._failed(f"publish to {topic!r}", error) from error
        return reached

    def _encode(self, envelope: Envelope) -> tuple[bytes, bytes]:
        meta, body = envelope_to_wire(envelope, self.codec)
        refuse_oversized(envelope, len(meta) + len(body), self.max_message_size)
        return meta, body

    async def _write_publishes(self, batch: list[_Publish]) -> None:
        """Write a batch of publishes with one script that also reads the bindings' version.

        When the version moved (a binding was added or deleted anywhere), nothing is
        written: the bindings are read again and the batch routed anew. The coalescer
        bounds it by the batch's ``publish_timeout``: a writer stuck on a silent server
        would hold up every publish.
        """
        if self._bindings is None:
            await self._load_bindings()
        written = [done for _topic, _wire, done in batch]
        while True:
            inboxes = self._inbox_streams
            keys: list[str] = [self._version_key]
            index: dict[str, int] = {}
            args: list[bytes | str | int] = []
            targets: list[list[str]] = []
            # Consecutive publishes to the same streams (the usual burst: one topic) go
            # in one group of the script's arguments: their streams named once.
            group: list[str] | None = None
            count_at = grouped = 0
            for topic, wire, done in batch:
                route = self._route(topic)
                streams = [stream for stream in route if stream not in done] if done else [*route]
                targets.append(streams)
                if not streams:
                    continue
                if streams != group:
                    group = streams
                    args.append(len(streams))
                    for stream in streams:
                        if stream not in index:
                            keys.append(stream)
                            index[stream] = len(keys)
                        # A negative index: an inbox, written only while it exists.
                        args.append(-index[stream] if stream in inboxes else index[stream])
                    count_at, grouped = len(args), 0
                    args.append(0)
                grouped += len(wire)
                args[count_at] = grouped
                for meta, body in wire:
                    args += (meta, body)
            # Written only if the bindings are still those of the routes (a group
            # deleted since must not be written to, nor named).
            script = functools.partial(
                self._scripts["PUBLISH"], keys=keys, args=[self._version or b"", *args]
            )
            reply = await self._replicated(script)
            if int(reply[0]):
                for done, streams in zip(written, targets, strict=True):
                    done.update(streams)
                return
            await self._load_bindings()

    async def _replicated(self, write: Callable[..., Awaitable[Any]]) -> Any:
        """``write(client=...)``; with ``wait_replicas``, on one connection followed by
        ``WAIT``, raising when fewer replicas than that have it within the deadline."""
        client = self._redis()
        if not self.wait_replicas:
            return await write(client=client)
        one = client.client()  # one connection: WAIT counts the writes made on it
        try:
            reply = await write(client=one)
            wait_ms = max(1, int(self.publish_timeout * 1000 * _WAIT_SHARE))
            acked = int(await one.wait(self.wait_replicas, wait_ms))
        finally:
            with anyio.CancelScope(shield=True):
                await one.aclose(close_connection_pool=False)
        if acked < self.wait_replicas:
            raise TransportError(
                f"Redis at {self._shown()}: the publish is on the server but on {acked} of "
                f"the {self.wait_replicas} replicas wait_replicas asks for "
                f"(after {wait_ms / 1000:g} s): it may be lost with the server"
            )
        return reply

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """XADD the envelopes to the stream of (``pattern``, ``group``) only."""
        stream = self.stream_key(pattern, group)
        if stream not in self._bound:
            await self._bind(pattern, group)
        entries = [self._encode(envelope) for envelope in envelopes]

        async def write(*, client: Any) -> Any:
            pipe = client.pipeline(transaction=True)
            for meta, body in entries:
                pipe.xadd(stream, {"meta": meta, "body": body})
            return await pipe.execute()

        try:
            await self._replicated(write)
        except self._errors.RedisError as error:
            raise self._failed(f"publish to {pattern}@{group}", error) from error

    # -- consuming ------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AsyncIterator[AsyncIterator[Delivery]]:
        """Join ``group`` on ``pattern`` as a new consumer; what it holds goes back at the end.

        :raises ConfigurationError: for a bad pattern or ``prefetch`` < 1.
        """
        compile_pattern(pattern)
        checked_prefetch(prefetch)
        stream = await self._bind(pattern, group)
        consumer = _Consumer(self, pattern, group, stream, prefetch)
        if not _is_inbox(group):
            await self._told(self._groups.tell_reading([consumer]))
        self._consumers.add(consumer)
        if self.keep_alive and self._tasks.running:
            self._tasks.start_soon(self._keep_alive, consumer)
        try:
            yield consumer
        finally:
            with self.cleanup_scope():
                await self._release(consumer)

    async def _next(self, consumer: _Consumer) -> Delivery:
        """``consumer``'s next delivery (its ``__anext__``)."""
        while True:
            if not consumer.ready:
                while len(consumer.held) >= consumer.prefetch:
                    consumer.room = anyio.Event()
                    await consumer.room.wait()
                try:
                    await self._fetch(consumer)
                except self._errors.RedisError as error:
                    # Lost connections, a server loading or out of memory, a stream
                    # made again meanwhile: none ends the subscription.
                    pause = consumer.backoff.next()
                    logger.warning(
                        "Redis at %s: reading %s@%s failed, retrying in %.2f s: %s",
                        self._shown(),
                        consumer.pattern,
                        consumer.group,
                        pause,
                        error,
                    )
                    await anyio.sleep(pause)
                    continue
                consumer.backoff.reset()
                if not consumer.ready:
                    continue
            # No yield per delivery: a fetched batch is handed over in one go (the read
            # above is the yield; the stage's room bounds the batch).
            delivery = consumer.ready.popleft()
            if delivery.settleable:
                return delivery

    async def _resize(self, consumer: _Consumer, prefetch: int) -> None:
        """Set ``consumer``'s prefetch; give back, uncounted, the entries fetched beyond
        it that were not handed out yet (the newest first)."""
        consumer.prefetch = prefetch
        excess = min(len(consumer.held) - prefetch, len(consumer.ready))
        if excess <= 0:
            consumer.room.set()  # (room to fetch more, perhaps)
            return
        given = [consumer.ready.pop() for _ in range(excess)]
        for delivery in given:
            delivery.take_back(_RELEASED)
            del consumer.held[delivery._entry]
        with self.cleanup_scope(_RELEASE_TIMEOUT):
            try:
                await self._scripts["GIVE_BACK"](
                    keys=[consumer.stream],
                    args=[
                        consumer.group,
                        consumer.name,
                        _SENTINEL,
                        _RELEASED_IDLE_MS,
                        *(delivery._entry for delivery in given),
                    ],
                )
            except self._errors.RedisError as error:
                logger.warning(
                    "Redis: giving back %d entries of %s@%s failed (they return after "
                    "ack_timeout): %s",
                    len(given),
                    consumer.pattern,
                    consumer.group,
                    error,
                )
                return
        for other in self._consumers:
            if other.stream == consumer.stream:
                other.next_claim = 0.0

    async def _fetch(self, consumer: _Consumer) -> None:
        """Fill ``consumer.ready`` with up to its room: reclaimed entries, else new ones."""
        room = consumer.prefetch - len(consumer.held)
        now = time.monotonic()
        if now >= consumer.next_claim:
            consumer.next_claim = now + self.claim_interval
            if await self._claim(consumer, room):
                return
        client = self._redis()
        try:
            # The command itself, not ``client.xreadgroup``: its reply is read as it came
            # (see ``connect``), without a dict per entry nor redis-py's wrapper per read.
            reply: Any = await client.execute_command(  # type: ignore[no-untyped-call]
                "XREADGROUP",
                "GROUP",
                consumer.group,
                consumer.name,
                "COUNT",
                room,
                "BLOCK",
                self.block_ms,
                "STREAMS",
                consumer.stream,
                ">",
            )
        except self._errors.ResponseError as error:
            if not _vanished(error):
                raise
            await self._rebind(consumer, error)
            return
        if not reply:
            return
        deliver = self._deliver
        for _stream, entries in reply.items() if isinstance(reply, dict) else reply:
            for entry, flat in entries:
                deliver(consumer, entry, flat, 1)

    async def _claim(self, consumer: _Consumer, room: int) -> int:
        """Take entries of the group idle for ``ack_timeout`` (dead or leaving consumers)."""
        consumer.claim_rounds += 1
        try:
            if consumer.claim_rounds % _REAP_EVERY == 0:
                await self._scripts["REAP"](
                    keys=[consumer.stream],
                    args=[consumer.group, int(self.ack_timeout * 2000)],
                )
            reply: Any = await self._scripts["CLAIM"](
                keys=[consumer.stream],
                args=[
                    consumer.group,
                    consumer.name,
                    int(self.ack_timeout * 1000),
                    consumer.claim_cursor,
                    room,
                ],
            )
        except self._errors.ResponseError as error:
            if not _vanished(error):
                raise
            await self._rebind(consumer, error)
            return 0
        cursor, claimed = reply
        consumer.claim_cursor = cursor
        delivered = 0
        for entry, flat, count in claimed:
            if entry in consumer.held:
                # Still held by this consumer (waiting in a local queue past ack_timeout):
                # claiming it only refreshed its idle time; delivering it again would
                # duplicate it. (Another consumer's entries are taken: it may be hung.)
                continue
            self._deliver(consumer, entry, flat, int(count))
            delivered += 1
        if claimed and cursor not in (b"0-0", "0-0"):
            consumer.next_claim = 0.0  # more may wait: look again at once
        return delivered

    async def _rebind(self, consumer: _Consumer, error: BaseException) -> None:
        """The stream or group is gone (deleted, flushed, a server restarted empty): make
        both again, and claim whatever the new group may need."""
        logger.warning(
            "Redis: the stream of %s@%s vanished (%s); re-creating it",
            consumer.pattern,
            consumer.group,
            error,
        )
        await self._bind_raw(consumer.pattern, consumer.group)
        consumer.claim_cursor = "0-0"
        consumer.next_claim = 0.0

    def _deliver(
        self, consumer: _Consumer, entry: bytes, flat: list[bytes] | None, count: int
    ) -> None:
        """Hand over the entry ``entry`` with fields ``flat`` (name, value, ...)."""
        if flat and len(flat) == 4 and flat[0] == b"meta" and flat[2] == b"body":
            meta, body = flat[1], flat[3]  # as this transport writes them
        else:  # written by another client, or fields gone: whatever is there
            fields = dict(zip(flat[::2], flat[1::2], strict=False)) if flat else {}
            meta = fields.get(b"meta", b"")
            body = fields.get(b"body", b"")
        error: str | None
        try:
            envelope, error = envelope_from_wire(meta, body, self.codec)
            if count > 1:
                envelope = envelope.evolve(attempt=envelope.attempt + count - 1)
        except DecodeError as problem:
            # Nothing to rebuild: hand the bus a stand-in carrying the raw entry, with
            # the error set, so it is dead-lettered instead of blocking the group.
            envelope = Envelope(
                id=f"redis:{_text(entry)}",
                topic=consumer.pattern,
                payload=RawBody(body),
                attempt=count,
            )
            error = str(problem)
        if error is None and count > 1:  # a first delivery is never one too many
            error = over_max_deliveries(count, self.max_deliveries)
        delivery = _RedisDelivery(consumer, entry, envelope, body, error)
        delivery.redeliveries = count - 1  # (a hand-back's count was put back)
        consumer.held[entry] = delivery
        consumer.ready.append(delivery)

    async def _settle(
        self,
        consumer: _Consumer,
        entry: bytes,
        *,
        retry: tuple[bytes, bytes] | None = None,
        delay: float | None = None,
        dead: tuple[DeadLetter, bytes] | None = None,
    ) -> None:
        """XACK and XDEL ``entry``, with its re-add, delayed retry or dead letter, atomically."""
        pipe = self._redis().pipeline(transaction=True)
        due = 0.0
        if retry is not None:
            meta, body = retry
            if delay is not None and delay > 0:
                due = time.time() + delay
                item = f"{self._delayed_key}:{secrets.token_hex(12)}"
                pipe.hset(item, mapping={"stream": consumer.stream, "meta": meta, "body": body})
                pipe.zadd(self._delayed_key, {item: math.ceil(due * 1000)})  # never early
                # Not HINCRBY: a count another client garbled must not fail the nack.
                # EVAL, not the registered script: a pipeline would check that the
                # server has it first (another round trip), and a cluster's pipeline
                # does not load it on the node.
                pipe.eval(
                    _redis_scripts.COUNT_DELAYED, 1, self._delayed_counts_key, consumer.stream
                )
            else:
                pipe.xadd(consumer.stream, {"meta": meta, "body": body})
        if dead is not None:
            self._queue_dead_letter(pipe, dead[0], _Verbatim(dead[1]))
        pipe.xack(consumer.stream, consumer.group, entry)
        pipe.xdel(consumer.stream, entry)
        try:
            await pipe.execute()
        except self._errors.RedisError as error:
            raise self._failed(f"settling {_text(entry)} of {consumer.stream}", error) from error
        if due and due < self._next_due:
            self._delay_wake.set()

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the acks the transport closed without writing."""
        return self._acks.take_lost()

    async def _write_acks(
        self, batch: dict[tuple[str, str], list[tuple[bytes, str | None]]]
    ) -> tuple[()]:
        """XACK and XDEL every ack of ``batch`` in one MULTI (all of them, or none)."""
        pipe = self._redis().pipeline(transaction=True)
        for (stream, group), items in batch.items():
            entries = [entry for entry, _id in items]
            pipe.xack(stream, group, *entries)
            pipe.xdel(stream, *entries)
        await pipe.execute()
        return ()

    async def _release(self, consumer: _Consumer) -> None:
        """Hand back what ``consumer`` holds (see the module docstring); runs shielded."""
        self._consumers.discard(consumer)
        for delivery in consumer.held.values():
            delivery.take_back(_RELEASED)
        consumer.held.clear()
        consumer.ready.clear()
        if self._client is None:
            return  # the transport closed first: the entries are reclaimed after ack_timeout
        if _is_inbox(consumer.group):
            await self._drop_inbox(consumer)
            return
        with anyio.move_on_after(_RELEASE_TIMEOUT):
            await self._told(self._groups.tell_reading([consumer], ending=True))
        released = 0
        with anyio.move_on_after(_RELEASE_TIMEOUT):
            try:
                # Acks first: what was acked must not be handed back.
                await self._acks.flush()
                released = await self._scripts["RELEASE"](
                    keys=[consumer.stream],
                    args=[consumer.group, consumer.name, _SENTINEL, _RELEASED_IDLE_MS],
                )
            except self._errors.RedisError as error:
                logger.warning(
                    "Redis: handing back the entries of %s@%s failed (they return after "
                    "ack_timeout): %s",
                    consumer.pattern,
                    consumer.group,
                    error,
                )
        if released:
            for other in self._consumers:
                if other.stream == consumer.stream:
                    other.next_claim = 0.0

    async def _drop_inbox(self, consumer: _Consumer) -> None:
        """Delete a leaving inbox: its stream, binding and expiry (replies to it are moot)."""
        if any(other.stream == consumer.stream for other in self._consumers):
            return
        pipe = self._redis().pipeline(transaction=True)
        pipe.delete(consumer.stream)
        pipe.hdel(self._bindings_key, consumer.stream)
        pipe.zrem(self._inboxes_key, consumer.stream)
        pipe.set(self._version_key, secrets.token_hex(8))
        with anyio.move_on_after(_RELEASE_TIMEOUT):
            try:
                await pipe.execute()
            except self._errors.RedisError as error:
                logger.warning(
                    "Redis: deleting the inbox %s failed (it expires within %g s): %s",
                    consumer.stream,
                    self.inbox_ttl,
                    error,
                )
        self._bound.discard(consumer.stream)

    # -- background tasks -----------------------------------------------------

    async def _inbox_loop(self) -> None:
        """Push the expiry of this process's inboxes forward; delete expired ones."""
        while True:
            try:
                pipe = self._redis().pipeline(transaction=False)
                for stream in {c.stream for c in self._consumers if _is_inbox(c.group)}:
                    self._queue_inbox_expiry(pipe, stream)
                await pipe.execute()
                await self._scripts["REAP_INBOXES"](
                    keys=[self._inboxes_key, self._bindings_key, self._version_key],
                    args=[int(time.time() * 1000), secrets.token_hex(8)],
                )
            except Exception as error:  # keep going: the next round tries again
                logger.warning("Redis: keeping request inboxes failed: %s", error)
            await anyio.sleep(self.inbox_ttl / 3)

    async def _binding_loop(self) -> None:
        """Register again, every ``claim_interval``, the bindings of this process's
        subscriptions that are gone from Redis (a flush, a restart without persistence).

        A consumer that reads finds its stream gone and makes it again at once; one that
        does not read (its stage is full, its handlers are long) would leave its group
        unknown to publishers meanwhile, and their publishes dead letters
        ``no_subscribers``.
        """
        while True:
            await anyio.sleep(self.claim_interval)
            consumers = list(self._consumers)
            if not consumers:
                continue
            readers = [c for c in consumers if not _is_inbox(c.group)]
            await self._told(self._groups.tell_reading(readers))
            try:
                found = await self._redis().hmget(self._bindings_key, [c.stream for c in consumers])
                for consumer, binding in zip(consumers, found, strict=True):
                    if binding is None and consumer in self._consumers:
                        logger.warning(
                            "Redis: the binding of %s@%s is gone; registering it again",
                            consumer.pattern,
                            consumer.group,
                        )
                        await self._bind_raw(consumer.pattern, consumer.group)
            except Exception as error:  # keep going: the next round tries again
                logger.debug("Redis: looking at the bindings failed: %s", error)

    async def _told(self, telling: Awaitable[None]) -> None:
        """Await ``telling`` (which consumers read: for listings); a failure is logged
        only, it stops nothing."""
        try:
            await telling
        except Exception as error:
            logger.debug("Redis: telling which consumers read failed: %s", error)

    async def _keep_alive(self, consumer: _Consumer) -> None:
        """Reset the idle time of what ``consumer`` holds, until it leaves."""
        while True:
            await anyio.sleep(self.ack_timeout / 3)
            if consumer not in self._consumers:
                return
            held = list(consumer.held)
            if not held:
                continue
            try:
                await self._scripts["TOUCH"](
                    keys=[consumer.stream], args=[consumer.group, consumer.name, *held]
                )
            except Exception as error:  # keep trying: a failed round only risks a reclaim
                logger.warning("Redis: keeping %d entries alive failed: %s", len(held), error)

    async def _move_due_loop(self) -> None:
        """Move due delayed retries back to their streams (any process's, atomically)."""
        wait = 0.0
        backoff = Backoff(0.05, _BACKOFF_MAX)
        loop = asyncio.get_running_loop()
        while True:
            self._next_due = time.time() + wait
            wake = self._delay_wake
            if wait > 0:
                # A timer that sets the event, not a cancel scope with a deadline: a
                # scope that expires (ten times a second here) formats its task's repr.
                timer = loop.call_later(wait, wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
            else:
                await anyio.lowlevel.checkpoint()
            self._delay_wake = anyio.Event()
            try:
                reply = await self._scripts["MOVE_DUE"](
                    keys=[self._delayed_key, self._delayed_counts_key, self._bindings_key],
                    args=[int(time.time() * 1000), _DELAY_BATCH],
                )
            except Exception as error:  # keep moving whatever went wrong once
                logger.warning("Redis: moving delayed retries failed: %s", error)
                wait = backoff.next()
                continue
            backoff.reset()
            moved = int(reply[0])
            if moved >= _DELAY_BATCH:
                wait = 0.0
            elif len(reply) > 1:
                wait = min(_DELAY_POLL, max(0.0, float(reply[1]) / 1000 - time.time()))
            else:
                wait = _DELAY_POLL

    def dedup_store(self, window: float) -> RedisDedupStore:
        """``deduplicate()``'s store in Redis: a key per (stage, id), ``SET NX`` with a TTL."""
        return RedisDedupStore(self)

    def rate_store(self) -> RedisRateStore:
        """``RateLimit``'s shared turns in Redis: a key per bucket, taken by a script."""
        return RedisRateStore(self)

    def lease_store(self) -> RedisLeaseStore:
        """``max_in_flight``'s slots in Redis: a sorted set of leases per stage."""
        return RedisLeaseStore(self)

    # -- backlog and dead letters ---------------------------------------------

    async def backlog(self, pattern: str, group: str) -> int:
        """Entries of the binding not settled: in its stream (delivered or not) or delayed."""
        stream = self.stream_key(pattern, group)
        pipe = self._redis().pipeline(transaction=True)
        pipe.xlen(stream)
        pipe.hget(self._delayed_counts_key, stream)
        try:
            length, delayed = await pipe.execute()
        except self._errors.RedisError as error:
            raise self._failed(f"backlog of {pattern}@{group}", error) from error
        try:
            waiting = int(delayed or 0)
        except ValueError:  # another client wrote it: no count rather than no backlog
            logger.warning(
                "Redis: ignoring the unreadable count %r of delayed retries of %s in %s",
                delayed[:80],
                stream,
                self._delayed_counts_key,
            )
            waiting = 0
        return int(length) + max(waiting, 0)

    async def groups(self) -> list[GroupInfo]:
        """Every binding under the prefix (request inboxes aside), with its backlog, its
        consumers (idle less than twice ``ack_timeout``) and their last activity."""
        try:
            return await self._groups.groups()
        except self._errors.RedisError as error:
            raise self._failed("listing the groups", error) from error

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the binding (``pattern``, ``group``), its stream and delayed retries."""
        return await self._groups.delete_group(pattern, group)

    async def beat(self, instance: str, record: bytes) -> None:
        """Write process ``instance``'s heartbeat record (``Bus.cluster_statistics``)."""
        await self._heartbeats.beat(instance, record)

    async def beats(self) -> list[bytes]:
        """Every process's latest heartbeat record."""
        return await self._heartbeats.beats()

    async def forget(self, instance: str) -> None:
        """Delete process ``instance``'s heartbeat record."""
        await self._heartbeats.forget(instance)

    def _queue_dead_letter(self, pipe: Any, entry: DeadLetter, codec: Codec | None = None) -> None:
        if self.settings.dead_letter_maxlen <= 0:
            return  # a store of size 0 keeps nothing
        document = dead_letter_to_wire(entry, codec or self.codec)
        pipe.xadd(
            self._dead_key,
            {"id": entry.envelope.id, "entry": document},
            maxlen=self.settings.dead_letter_maxlen,
            approximate=True,
        )

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Append ``entry`` to the dead-letter stream."""
        pipe = self._redis().pipeline(transaction=False)
        self._queue_dead_letter(pipe, entry)
        try:
            await pipe.execute()
        except self._errors.RedisError as error:
            raise self._failed("adding a dead letter", error) from error

    async def _dead_entries(self) -> AsyncIterator[tuple[bytes, dict[bytes, bytes]]]:
        client = self._redis()
        start: bytes | str = "-"
        while True:
            page: Any = await client.xrange(self._dead_key, min=start, max="+", count=_PAGE)
            for entry, fields in page:
                yield entry, fields
            if len(page) < _PAGE:
                return
            start = b"(" + page[-1][0]

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        client = self._redis()
        horizon = time.time() - self.settings.dead_letter_ttl
        try:
            pipe = client.pipeline(transaction=True)
            pipe.xtrim(self._dead_key, minid=int(horizon * 1000), approximate=False)
            pipe.xtrim(
                self._dead_key, maxlen=max(self.settings.dead_letter_maxlen, 0), approximate=False
            )
            await pipe.execute()
            found: list[DeadLetter] = []
            expired: list[bytes] = []
            async for entry, fields in self._dead_entries():
                try:
                    dead = dead_letter_from_wire(fields.get(b"entry", b""), self.codec)
                except DecodeError as error:
                    logger.warning("Redis: skipping unreadable dead letter %r: %s", entry, error)
                    continue
                if dead.dead_at <= horizon:
                    expired.append(entry)
                else:
                    found.append(dead)
            if expired:
                await client.xdel(self._dead_key, *expired)
        except self._errors.RedisError as error:
            raise self._failed("listing dead letters", error) from error
        return found

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Delete the dead-letter entries of these envelope ids."""
        await self._shared_dead.take(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the dead letters of these envelope ids; return those this call deleted
        (``XDEL`` of each, in one script: the claim), telling every watcher."""
        return await self._shared_dead.take(ids)

    async def clear_dead_letters(self) -> None:
        """Delete every dead letter (every watcher reads them again)."""
        await self._shared_dead.clear()

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Append ``entries`` again (taken for a replay that failed); every watcher reads
        the dead letters again."""
        await self._shared_dead.restore(entries)

    def watch_dead_letters(self) -> AbstractAsyncContextManager[AsyncIterator[DeadLetterChange]]:
        """Every dead letter added or removed from now on, by any process."""
        return self._shared_dead.watch()
