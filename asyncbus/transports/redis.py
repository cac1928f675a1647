"""The Redis Streams transport: consumer groups, delayed retries and dead letters in Redis.

Layout of the keys (all under ``prefix``; with ``cluster=True`` the shared ones under
``{prefix}``, one hash tag, and each binding's stream and delayed retries under a tag of
their own, so that every script and transaction stays in one slot of a Redis Cluster and
a deployment's groups spread over its masters: see :mod:`._redis_delayed` and
:meth:`~._redis_publish.RedisPublisher.write` for what then takes several calls):

* ``{prefix}:stage:{pattern}@{group}``: one stream per (pattern, group) binding, with
  one consumer group (``group``) on it (on a cluster ``{{prefix}:stage:{pattern}@{group}}``).
  Pattern and group are percent-escaped (``@``, ``%``, spaces, braces...), so two
  bindings never share a key.
* ``{prefix}:bindings``: hash of binding stream key to ``[pattern, group]``, written by
  ``subscribe``; ``{prefix}:bindings:version`` changes on every registration and
  deletion (listing and deleting groups: :mod:`._redis_groups`).
* ``{prefix}:readers``: hash of ``{stream} {consumer}`` to ``{seen ms}:{until ms}``,
  which consumers read each binding (written every ``claim_interval``), for listings.
* ``{prefix}:delayed``: sorted set of delayed retries by due time (ms), each one a hash
  ``{prefix}:delayed:{token}`` (stream, meta, body, id); ``{prefix}:delayed:counts``
  counts them per stream (for :meth:`RedisTransport.backlog`). On a cluster each
  binding has its own, ``{stream}:delayed`` (its ``ZCARD`` the count), and
  ``{prefix}:delayed:due`` indexes the bindings with retries by the first one's time.
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
  registered before a publish always receives it and one deleted never does. On a
  cluster the version is read first and the streams of each slot written by a call of
  their own (see :meth:`~._redis_publish.RedisPublisher.write`): not atomic across
  slots, and a group deleted during the publish may still get it. A
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

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote

import anyio

from .._checks import check_count
from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import ConfigurationError, TransportError
from .._groups import GroupInfo
from .._routing import compile_pattern
from . import _redis_scripts
from ._codec import Codec
from ._kit import AckWriter, TaskOwner, check_url, redact, require_extra, split_urls
from ._kit.options import (
    DEFAULT_MAX_MESSAGE_SIZE,
    checked_max_message_size,
    checked_prefetch,
    checked_seconds,
)
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, checked_max_deliveries
from ._kit.routes import INBOX_TTL, is_inbox
from ._redis_bindings import RedisBindings
from ._redis_connection import (
    CLOSE_TIMEOUT,
    SCHEMES,
    URL_FORM,
    check_nodes,
    open_client,
    socket_timeouts,
)
from ._redis_consumer import RELEASE_TIMEOUT, RedisConsumer
from ._redis_dead_letters import RedisDeadLetters
from ._redis_dedup import RedisDedupStore
from ._redis_delayed import DelayedRetries
from ._redis_groups import RedisGroups
from ._redis_heartbeats import RedisHeartbeats
from ._redis_leases import RedisLeaseStore
from ._redis_master import PrefixMaster
from ._redis_publish import RedisPublisher
from ._redis_rates import RedisRateStore
from .base import Capabilities, DeadLetterChange, Delivery, Transport

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

__all__ = ["RedisTransport"]

logger = logging.getLogger("asyncbus.transport.redis")

#: Longest blocking read (ms): an hour; a read that long holds a pooled connection.
_BLOCK_MS_MAX = 3_600_000
#: Most replicas ``wait_replicas`` may ask for.
_WAIT_REPLICAS_MAX = 64
#: Seconds the ack writer waits for more acks before writing (bounds their delay).
_ACK_LINGER = 0.002


def _escape(name: str) -> str:
    # Injective (``%`` itself is escaped) and keeps the usual names readable.
    return quote(name, safe=":*><$")


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
        follows ``MOVED``/``ASK`` and a master's failover to its replica). Each
        group's stream and delayed retries carry a hash tag of their own, the
        prefix's shared keys the tag ``{prefix}``, so each script and transaction
        stays in one slot and the groups spread over the masters; a publish reaching
        groups in several slots is one write per slot (no longer atomic across them).
    :param wait_replicas: a publish returns once that many replicas of the server have
        it too (Redis ``WAIT``, on the connection that wrote it), and raises
        :class:`TransportError` when fewer had it within ``publish_timeout``: a
        confirmed publish then survives the master's loss. ``0`` (the default): once
        the server has it (its replicas follow asynchronously). On a cluster the write
        and its ``WAIT`` go to the master of the slot written directly; a master that
        is gone or moved is looked up again and the write tried again within
        ``publish_timeout`` (after a failover the new master has its replicas only
        once the old one came back as one).
    :raises ConfigurationError: for a URL without a scheme, with another broker's or
        the web's (not ``redis``, ``rediss``, ``unix``) or with a bad port, several
        URLs without ``cluster=True``, a cluster node given by a socket path or a
        database other than 0, a prefix with braces on a cluster, ``wait_replicas``
        out of range, or a
        timeout, interval, size or cap that is not a positive number in range (NaN,
        infinities, bools, huge values included).
    :raises ImportError: (also a ``ConnectError`` and a ``ConfigurationError``) when
        redis-py is not installed: the message names the extra.
    """

    #: Seconds the inbox of a process that died stays in Redis (see the module docstring).
    inbox_ttl: float = INBOX_TTL

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
        check_url("RedisTransport", url, SCHEMES, URL_FORM)
        if not isinstance(cluster, bool):
            raise ConfigurationError(f"RedisTransport: cluster must be a bool, got {cluster!r}")
        nodes = split_urls(url)
        check_nodes(nodes, cluster, prefix)
        wait_replicas = check_count(
            wait_replicas, "RedisTransport: wait_replicas", 0, _WAIT_REPLICAS_MAX
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
        #: What every shared key starts with: ``prefix``, or ``{prefix}`` on a cluster
        #: (one hash tag: one slot for the scripts and transactions over them).
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
        self._inboxes_key = f"{base}:inboxes"
        #: On a cluster: the bindings with delayed retries, by when the first is due (ms).
        self._delayed_index_key = f"{base}:delayed:due"
        self._shared_dead = RedisDeadLetters(self, f"{base}:deadletters")
        self._groups = RedisGroups(self)
        self._heartbeats = RedisHeartbeats(self)
        self._client: Redis | None = None
        self._errors: Any = None  # redis-py's errors the transport catches, once imported
        self._scripts: dict[str, AsyncScript] = {}
        #: The background tasks: the publish writer, the ack writer, the delayed-retry
        #: mover, the inbox keeper, the binding keeper, and each subscription's keep-alive.
        self._tasks = TaskOwner("RedisTransport")
        self._consumers: set[RedisConsumer] = set()
        #: The bindings made and routed by (see the module docstring: routing).
        self._bindings = RedisBindings(self)
        self._publisher = RedisPublisher(self)
        #: The masters of the slots written, reached directly (``wait_replicas`` on a
        #: cluster).
        self._master = PrefixMaster(
            nodes, self._version_key, socket_timeouts(publish_timeout, block_ms)
        )
        self._delayed = DelayedRetries(self)
        #: Acks written behind, by (stream, group): entry ids, in one MULTI per write.
        self._acks = AckWriter[tuple[str, str], bytes](
            "RedisTransport",
            self._write_acks,
            self.cleanup_scope,
            linger=_ACK_LINGER,
            timeout=RELEASE_TIMEOUT,
        )

    # -- keys -----------------------------------------------------------------

    def stream_key(self, pattern: str, group: str) -> str:
        """The Redis key of the stream of binding (``pattern``, ``group``); on a cluster
        a hash tag of its own, so the bindings spread over the cluster's slots."""
        name = f"{self.prefix}:stage:{_escape(pattern)}@{_escape(group)}"
        return f"{{{name}}}" if self.cluster else name

    def delayed_key_of(self, stream: str) -> str:
        """The sorted set of delayed retries ``stream``'s are in: the prefix's one, or
        on a cluster the binding's own (in its slot)."""
        return f"{stream}:delayed" if self.cluster else self._delayed_key

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
        client, errors = await open_client(
            self.nodes,
            cluster=self.cluster,
            publish_timeout=self.publish_timeout,
            block_ms=self.block_ms,
            shown=self._shown(),
        )
        self._client = client
        self._errors = errors
        self._scripts = {
            name: client.register_script(getattr(_redis_scripts, name))
            for name in _redis_scripts.__all__
        }
        self._delayed.open()
        self._acks.open()
        self._publisher.open()
        await self._tasks.open()
        self._tasks.start_soon(self._delayed.move_due)
        self._tasks.start_soon(self._acks.run)
        self._tasks.start_soon(self._publisher.writes.run)
        self._tasks.start_soon(self._bindings.keep_inboxes)
        self._tasks.start_soon(self._bindings.keep_registered)

    async def aclose(self) -> None:
        """Write pending acks, stop the background tasks, close the connections (shielded)."""
        if self._client is not None:
            with self.cleanup_scope(RELEASE_TIMEOUT):
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
                self._publisher.writes.close(
                    "RedisTransport is closed: nothing more can be published"
                )
            client, self._client = self._client, None
            await self._master.aclose()
            if client is not None:
                # Closing sockets is local and quick: it runs even past the close
                # deadline (bounded), so no connection is left open.
                with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                    await client.aclose()

    def _redis(self) -> Redis:
        if self._client is None:
            raise TransportError("RedisTransport is not connected: use `async with transport:`")
        return self._client

    def _failed(self, doing: str, error: BaseException) -> TransportError:
        return TransportError(f"Redis at {self._shown()}: {doing} failed: {error}")

    # -- publishing -----------------------------------------------------------

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """XADD each envelope to every binding whose pattern matches ``topic``.

        Publishes from concurrent tasks are written together (see the module docstring);
        this one returns once the script call holding its envelopes succeeded (on a
        cluster, every slot's).

        :raises EncodeError: when a payload cannot be encoded (nothing is published).
        :raises TransportError: when an envelope is over ``max_message_size`` (nothing
            is published) or Redis fails.
        """
        await self._publisher.send(topic, envelopes)

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
        reached = await self._publisher.send(topic, envelopes)
        if reached or not envelopes:
            named = self._bindings.stage_names.get(frozenset(reached))
            if named is None:
                named = self._bindings.name(reached)
            return named
        await self._publisher.unrouted(topic, envelopes)
        return ()

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """XADD the envelopes to the stream of (``pattern``, ``group``) only."""
        await self._publisher.to_group(pattern, group, envelopes)

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
        stream = await self._bindings.bind(pattern, group)
        consumer = RedisConsumer(self, pattern, group, stream, prefetch)
        if not is_inbox(group):
            await self._groups.tell_reading([consumer])
        self._consumers.add(consumer)
        if self.keep_alive and self._tasks.running:
            self._tasks.start_soon(consumer.keep_entries_alive)
        try:
            yield consumer
        finally:
            with self.cleanup_scope():
                await consumer.release()

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the acks the transport closed without writing."""
        return self._acks.take_lost()

    async def _write_acks(
        self, batch: dict[tuple[str, str], list[tuple[bytes, str | None]]]
    ) -> tuple[()]:
        """XACK and XDEL every ack of ``batch`` in one MULTI (all of them, or none); on
        a cluster one MULTI per stream (each in its slot; a failed write is tried again
        whole, and an ack written twice is harmless)."""
        if self.cluster:
            for (stream, group), items in batch.items():
                one = self._redis().pipeline(transaction=True)
                entries = [entry for entry, _id in items]
                one.xack(stream, group, *entries)
                one.xdel(stream, *entries)
                await one.execute()
            return ()
        pipe = self._redis().pipeline(transaction=True)
        for (stream, group), items in batch.items():
            entries = [entry for entry, _id in items]
            pipe.xack(stream, group, *entries)
            pipe.xdel(stream, *entries)
        await pipe.execute()
        return ()

    # -- stores -----------------------------------------------------------------

    def dedup_store(self, window: float) -> RedisDedupStore:
        """``deduplicate()``'s store in Redis: a key per (stage, id), ``SET NX`` with a TTL."""
        return RedisDedupStore(self)

    def rate_store(self) -> RedisRateStore:
        """``RateLimit``'s shared turns in Redis: a key per bucket, taken by a script."""
        return RedisRateStore(self)

    def lease_store(self) -> RedisLeaseStore:
        """``max_in_flight``'s slots in Redis: a sorted set of leases per stage."""
        return RedisLeaseStore(self)

    # -- backlog, groups and heartbeats ---------------------------------------

    async def backlog(self, pattern: str, group: str) -> int:
        """Entries of the binding not settled: in its stream (delivered or not) or delayed."""
        stream = self.stream_key(pattern, group)
        pipe = self._redis().pipeline(transaction=True)
        pipe.xlen(stream)
        if self.cluster:  # the binding's retries are in its own set, in its slot
            pipe.zcard(self.delayed_key_of(stream))
        else:
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

    # -- dead letters -----------------------------------------------------------

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Append ``entry`` to the dead-letter stream."""
        await self._shared_dead.add(entry)

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        return await self._shared_dead.read()

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
