"""PostgreSQL as the broker, and the outbox and inbox that commit with the caller's data.

:class:`PostgresTransport` keeps envelopes in tables of its own schema (see
:mod:`._pg_schema`): a publish writes one row per group its topic reaches, found by the
same statement, and notifies the group's consumers (``LISTEN/NOTIFY``, delivered when
the publish commits); consumers claim rows with ``FOR UPDATE SKIP LOCKED`` and a
deadline, so a dead consumer's rows are claimed again after ``ack_timeout``. A publish
given ``connection=`` writes its rows in the caller's transaction: they exist if and
only if it commits.

Runs on asyncio only (asyncpg is asyncio-only).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ClassVar

import anyio

from .._checks import check_count
from .._dead_letters import DeadLetter
from .._dedup import DedupStore
from .._envelope import Envelope
from .._exceptions import ConfigurationError, ConnectError, TransportError
from .._groups import GroupInfo
from ._codec import Codec, dead_letter_to_wire, envelope_to_wire
from ._kit import AckWriter, TaskOwner, redact, require_asyncio
from ._kit.options import (
    DEFAULT_MAX_MESSAGE_SIZE,
    checked_max_message_size,
    checked_prefetch,
    checked_seconds,
    refuse_oversized,
)
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, checked_max_deliveries
from ._kit.routes import INBOX_TTL, is_inbox, unrouted_entry
from ._pg_common import caller_connection, check_dsn, check_schema, database_errors, load_asyncpg
from ._pg_consumer import PgSubscription
from ._pg_dead_letters import PgDeadLetters
from ._pg_dedup import PgDedupStore
from ._pg_heartbeats import PgHeartbeats
from ._pg_inbox import PostgresInbox, current_connection
from ._pg_leases import PgLeaseStore
from ._pg_outbox import PostgresOutbox
from ._pg_rates import PgRateStore
from ._pg_schema import migrate, pattern_regex
from ._pg_statements import Statements
from .base import Capabilities, DeadLetterChange, Transport

__all__ = ["PostgresInbox", "PostgresOutbox", "PostgresTransport", "current_connection"]

logger = logging.getLogger("asyncbus.postgres")

#: Seconds between two prunings of dead letters and expired claims.
_PRUNE_EVERY = 60.0


async def _keep_session(_connection: Any) -> None:
    """A pool connection given back needs no reset query: the transport sets nothing on
    its session (its ``LISTEN`` has a connection of its own, its locks end with their
    transactions), and asyncpg still rolls back a transaction left open."""


class PostgresTransport(Transport):
    """Envelopes in PostgreSQL tables: durable, shared by every process using the database.

    :param dsn: the database, ``postgresql://user[:password]@host[:port]/database``.
    :param schema: the schema its tables live in (made and migrated by the transport;
        several buses, or tests, can share a database with one schema each).
    :param ack_timeout: seconds after which the rows a consumer claimed and did not
        settle (a killed process) are claimed by another consumer of the group.
    :param codec: how payloads become bytes (JSON by default; never pickle).
    :param poll_interval: longest a consumer waits before looking for work again
        without a notification (one can be missed across a reconnect).
    :param pool_size: most connections of its pool.
    :param max_message_size: largest envelope (meta + body, in bytes) it accepts.
    :param keep_alive: while a delivery is held, renew its claim every
        ``ack_timeout / 3``, so only a dead process's rows go to another consumer.
    :param max_deliveries: deliveries of one row, none settled, after which the next is
        handed over with ``error`` set (the bus dead-letters it ``rejected``).
    :param publish_timeout: longest a statement may run (every call: a database that
        stops answering fails calls instead of hanging them).
    :raises ConfigurationError: for a DSN that is not one PostgreSQL URL, a schema that
        is not a plain lower-case name, or a number out of range.
    :raises ImportError: (also a ``ConnectError``) when asyncpg is not installed: the
        message names the extra.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        delayed_nack=True,
        dedup=False,
        per_message_ttl=False,
        replay=True,
        durable=True,
        ordered=True,
    )
    name: ClassVar[str] = "postgres"
    publish_waits: ClassVar[bool] = True

    def __init__(
        self,
        dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres",
        *,
        schema: str = "asyncbus",
        ack_timeout: float = 30.0,
        codec: Codec | None = None,
        poll_interval: float = 1.0,
        pool_size: int = 10,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        keep_alive: bool = True,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        publish_timeout: float = 10.0,
    ) -> None:
        super().__init__(codec=codec)
        self.dsn = check_dsn("PostgresTransport", dsn)
        self.schema = check_schema("PostgresTransport", schema)
        self.ack_timeout = checked_seconds(ack_timeout, "PostgresTransport: ack_timeout")
        self.poll_interval = checked_seconds(poll_interval, "PostgresTransport: poll_interval")
        self.publish_timeout = checked_seconds(
            publish_timeout, "PostgresTransport: publish_timeout"
        )
        self.pool_size = check_count(pool_size, "PostgresTransport: pool_size", 1, 1000)
        self.max_message_size = checked_max_message_size(max_message_size)
        self.max_deliveries = checked_max_deliveries(max_deliveries)
        if not isinstance(keep_alive, bool):
            raise ConfigurationError(
                f"PostgresTransport: keep_alive must be a bool, got {keep_alive!r}"
            )
        self.keep_alive = keep_alive
        #: Seconds clean-up with the database may take (giving rows back, closing).
        self.close_timeout = min(5.0, self.publish_timeout)
        #: The SQL of every statement, for this schema.
        self.sql = Statements(self.schema)
        self._dead = PgDeadLetters(self, f"{self.schema}_dead")
        self._heartbeats = PgHeartbeats(self)
        self._pool: Any = None
        self._listener: Any = None
        self._tasks = TaskOwner("PostgresTransport")
        self._subscriptions: dict[int, set[PgSubscription]] = {}
        self._next_prune = 0.0
        self._listening = anyio.Lock()
        self._upkeep_every = min(self.ack_timeout / 3, 5.0)
        #: Acks queued by deliveries (``ack_nowait``), deleted in batches by one task.
        self.acks: AckWriter[int, int] = AckWriter(
            "PostgresTransport", self._write_acks, self.cleanup_scope, timeout=self.close_timeout
        )

    def __repr__(self) -> str:
        return f"PostgresTransport({redact(self.dsn)!r}, schema={self.schema!r})"

    # -- life -----------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the pool, make or migrate the schema, and start listening for wake-ups."""
        require_asyncio("PostgresTransport", "asyncpg")
        if self._pool is not None:
            return
        asyncpg = load_asyncpg()
        try:
            with anyio.fail_after(self.publish_timeout):
                self._pool = await asyncpg.create_pool(
                    self.dsn,
                    min_size=1,
                    max_size=self.pool_size,
                    command_timeout=self.publish_timeout,
                    reset=_keep_session,
                )
                async with self._pool.acquire() as connection:
                    await migrate(connection, self.schema)
        except BaseException as error:
            await self._close_pool()
            if isinstance(error, database_errors()) and not isinstance(error, TransportError):
                why = str(error) or f"no answer within {self.publish_timeout} s"
                raise ConnectError(
                    f"PostgreSQL at {redact(self.dsn)} could not be used: "
                    f"{type(error).__name__}: {why}"
                ) from error
            raise
        self._listening = anyio.Lock()
        self.acks.open()
        await self._tasks.open()
        self._tasks.start_soon(self.acks.run, name="asyncbus postgres acks")
        self._tasks.start_soon(self._maintain, name="asyncbus postgres upkeep")

    async def aclose(self) -> None:
        """Write the acks queued, stop the background tasks and close every connection
        (shielded, bounded)."""
        if self._pool is not None:
            with self.cleanup_scope(self.close_timeout):
                try:
                    await self.acks.flush()
                except TransportError as error:
                    logger.warning("PostgreSQL: acks lost at close (delivered again): %s", error)
        try:
            await self._tasks.aclose()
        finally:
            self.acks.close()  # what is still queued is lost: reported by unsettled_acks
            await self._close_pool()

    async def _write_acks(self, batch: dict[int, list[tuple[int, str | None]]]) -> tuple[()]:
        """Delete the rows of every ack queued, in one statement."""
        rows = [seq for acks in batch.values() for seq, _ in acks]
        await self.run("acking", "execute", self.sql.ack_many, rows)
        return ()

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the acks the transport closed without writing."""
        return self.acks.take_lost()

    async def _close_pool(self) -> None:
        """Close the connections, politely within the close's time (shielded, bounded by
        the bus's deadline), then at once: a server that does not answer holds nothing."""
        pool, self._pool = self._pool, None
        listener, self._listener = self._listener, None
        closed = False
        with self.cleanup_scope(self.close_timeout):
            try:
                if listener is not None:
                    await listener.close()
                if pool is not None:
                    await pool.close()
                closed = True
            except database_errors() as error:
                logger.debug("PostgreSQL: closing: %s", error)
        if not closed:
            if listener is not None:
                listener.terminate()
            if pool is not None:
                pool.terminate()

    async def run(self, doing: str, method: str, statement: str, *args: Any) -> Any:
        """``pool.<method>(statement, *args)``; a database error is a
        :class:`TransportError` saying what was being done."""
        pool = self._pool
        if pool is None:
            raise TransportError("PostgresTransport is not connected: use `async with transport:`")
        try:
            with anyio.fail_after(self.publish_timeout):
                return await getattr(pool, method)(statement, *args)
        except database_errors() as error:
            raise self._failed(doing, error) from error

    def _failed(self, doing: str, error: BaseException) -> TransportError:
        """What a database error means to the caller (a timeout says how long it waited)."""
        why = str(error) or f"no answer within {self.publish_timeout} s"
        return TransportError(f"PostgreSQL: {doing} failed: {type(error).__name__}: {why}")

    # -- publishing -------------------------------------------------------------------

    def _rows(
        self, envelopes: Sequence[Envelope]
    ) -> tuple[list[str], list[bytes], list[bytes], list[int]]:
        ids: list[str] = []
        metas: list[bytes] = []
        bodies: list[bytes] = []
        attempts: list[int] = []
        for envelope in envelopes:
            meta, body = envelope_to_wire(envelope, self.codec)
            refuse_oversized(envelope, len(meta) + len(body), self.max_message_size)
            ids.append(envelope.id)
            metas.append(meta)
            bodies.append(body)
            attempts.append(envelope.attempt)
        return ids, metas, bodies, attempts

    async def _write(
        self, connection: Any, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...]:
        """Write ``envelopes`` for every group ``topic`` reaches, through ``connection``
        (in its transaction); none reached: dead-letter each ``no_subscribers``."""
        rows = self._rows(envelopes)
        found = await connection.fetch(self.sql.publish, topic, *rows)
        if not found:
            await connection.executemany(
                self.sql.add_dead_letter,
                [
                    (entry.envelope.id, entry.dead_at, dead_letter_to_wire(entry, self.codec))
                    for entry in map(unrouted_entry, envelopes)
                ],
            )
        return tuple(sorted(f"{row[0]}@{row[1]}" for row in found))

    async def _write_own(self, topic: str, envelopes: Sequence[Envelope]) -> tuple[str, ...]:
        pool = self._pool
        if pool is None:
            raise TransportError("PostgresTransport is not connected: use `async with transport:`")
        try:
            # One deadline for the whole call. No transaction around it: the publish is
            # one statement (atomic alone); the dead letters of an envelope that reached
            # no group follow it, as they would a moment later.
            with anyio.fail_after(self.publish_timeout):
                async with pool.acquire() as connection:
                    return await self._write(connection, topic, envelopes)
        except database_errors() as error:
            raise self._failed(f"publishing on {topic!r}", error) from error

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Write one row per envelope and group reached, in one transaction."""
        if envelopes:
            await self._write_own(topic, envelopes)

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`publish`, naming the groups reached (none: dead-lettered)."""
        if not envelopes:
            return None
        return await self._write_own(topic, envelopes)

    async def publish_in(self, connection: Any, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Write the rows through the caller's ``connection``, in its transaction: the
        envelopes are published (and their consumers woken) if and only if it commits."""
        connection = caller_connection("PostgresTransport", connection)
        if not envelopes:
            return
        try:
            await self._write(connection, topic, envelopes)
        except database_errors() as error:
            raise self._failed(
                f"publishing on {topic!r} in the caller's transaction", error
            ) from error

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Write the rows for (``pattern``, ``group``) only (made if it is new)."""
        if not envelopes:
            return
        group_id = await self._group_id(pattern, group)
        await self.run(
            "publishing to a group",
            "execute",
            self.sql.publish_to_group,
            group_id,
            *self._rows(envelopes),
        )

    async def backlog(self, pattern: str, group: str) -> int:
        """Rows of (``pattern``, ``group``) not settled yet, claimed or not."""
        found = await self.run("counting a backlog", "fetchval", self.sql.backlog, pattern, group)
        return int(found or 0)

    # -- consuming --------------------------------------------------------------------

    async def _group_id(self, pattern: str, group: str) -> int:
        """The id of (``pattern``, ``group``), registered when it is new (not cached: a
        group deleted by any process is registered again by the next who needs it)."""
        alive = time.time() + INBOX_TTL if is_inbox(group) else None
        found = await self.run(
            f"registering group {group!r}",
            "fetchval",
            self.sql.register,
            pattern,
            group,
            pattern_regex(pattern),
            alive,
        )
        return int(found)

    def _alive_until(self) -> float:
        """Until when a live consumer's row counts, renewed every upkeep."""
        return time.time() + 3 * self._upkeep_every

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AsyncIterator[PgSubscription]:
        """Join ``group`` on ``pattern`` (registered before this yields); leaving gives
        back what it still holds (and drops a request inbox's rows)."""
        prefetch = checked_prefetch(prefetch)
        group_id = await self._group_id(pattern, group)
        consumer = f"{secrets.token_hex(8)}:{group}"
        subscription = PgSubscription(self, group_id, pattern, group, prefetch, consumer)
        await self.run(
            "joining a group", "execute", self.sql.join, consumer, group_id, self._alive_until()
        )
        self._subscriptions.setdefault(group_id, set()).add(subscription)
        await self.listen()
        try:
            yield subscription
        finally:
            listening = self._subscriptions.get(subscription.group_id, set())
            listening.discard(subscription)
            if not listening:
                self._subscriptions.pop(subscription.group_id, None)
            await subscription.release()
            await self._leave(subscription)

    async def _leave(self, subscription: PgSubscription) -> None:
        """Forget a subscription's consumer row (and a request inbox with its rows)."""
        if self._pool is None:
            return
        inbox = is_inbox(subscription.group)
        with self.cleanup_scope(self.close_timeout):
            try:
                await self.run("leaving a group", "execute", self.sql.leave, subscription.consumer)
                if inbox:
                    await self.run(
                        "dropping a request inbox",
                        "execute",
                        self.sql.drop_group,
                        subscription.group_id,
                    )
            except TransportError as error:
                logger.warning("%s (it expires by itself)", error)

    # -- wake-ups and upkeep -------------------------------------------------------------

    def _dead_letter_news(self, _connection: Any, _pid: int, _channel: str, news: str) -> None:
        """A notification on the dead-letter channel."""
        self._dead.heard(news)

    def _wake(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        """A notification: the rows of group ``payload`` changed."""
        try:
            group_id = int(payload)
        except ValueError:
            return
        for subscription in self._subscriptions.get(group_id, ()):
            subscription.wake.set()

    async def listen(self) -> None:
        """Listen on the schema's channel (again, after a lost connection); a failure is
        logged: consumers still poll."""
        async with self._listening:  # one connection, however many subscribe at once
            if self._listener is not None and not self._listener.is_closed():
                return
            stale, self._listener = self._listener, None
            if stale is not None:
                stale.terminate()
            asyncpg = load_asyncpg()
            listener = None
            try:
                with anyio.fail_after(self.publish_timeout):
                    listener = await asyncpg.connect(self.dsn)
                    await listener.add_listener(self.schema, self._wake)
                    await listener.add_listener(self._dead.channel, self._dead_letter_news)
            except database_errors() as error:  # TimeoutError among them
                if listener is not None:
                    listener.terminate()
                logger.warning("PostgreSQL: cannot listen for wake-ups (polling): %s", error)
                return
            self._listener = listener
            if stale is not None:
                self._dead.missed()  # what was said while nobody listened
        for subscriptions in self._subscriptions.values():  # what was missed meanwhile
            for subscription in subscriptions:
                subscription.wake.set()

    async def _maintain(self) -> None:
        """Renew held claims and live inboxes; sweep dead inboxes, old dead letters and
        claims; listen again after a lost connection."""
        while True:
            await anyio.sleep(self._upkeep_every)
            try:
                await self._upkeep()
            except TransportError as error:
                logger.warning("%s (tried again in a moment)", error)
            except Exception:  # deliberate: the upkeep outlives what it meets
                logger.exception("PostgreSQL: the upkeep failed (tried again in a moment)")

    async def _upkeep(self) -> None:
        live = [s for subscriptions in self._subscriptions.values() for s in subscriptions]
        held = [s.consumer for s in live if s.keep_alive and s.held]
        if held:  # first: nothing else the upkeep does may make a claim run out
            await self.run("renewing claims", "execute", self.sql.renew, held, self.ack_timeout)
        await self.listen()
        await self._bind_again()
        now = time.time()
        await self.run(
            "keeping consumers",
            "execute",
            self.sql.keep_consumers,
            [s.consumer for s in live],
            now,
            self._alive_until(),
        )
        inboxes = [s.group_id for s in live if is_inbox(s.group)]
        await self.run(
            "keeping inboxes", "execute", self.sql.keep_inboxes, inboxes, now, now + INBOX_TTL
        )
        if anyio.current_time() >= self._next_prune:
            self._next_prune = anyio.current_time() + _PRUNE_EVERY
            await self._dead.prune()
            await self.run("pruning expired rows", "execute", self.sql.prune)

    async def _bind_again(self) -> None:
        """Register again the groups this process reads that were deleted (by any
        process): their subscriptions go on under the new record."""
        if not self._subscriptions:
            return
        rows = await self.run(
            "looking for deleted groups",
            "fetch",
            self.sql.existing_groups,
            list(self._subscriptions),
        )
        existing = {row[0] for row in rows}
        for old in [group_id for group_id in self._subscriptions if group_id not in existing]:
            subscriptions = self._subscriptions.pop(old)
            first = next(iter(subscriptions))
            group_id = await self._group_id(first.pattern, first.group)
            self._subscriptions.setdefault(group_id, set()).update(subscriptions)
            for subscription in subscriptions:
                subscription.group_id = group_id
                for gone in subscription.held.values():  # their rows went with the group
                    gone.take_back("was deleted with its group")
                subscription.held.clear()
                subscription.ready.clear()
                await self.run(
                    "joining a group",
                    "execute",
                    self.sql.join,
                    subscription.consumer,
                    group_id,
                    self._alive_until(),
                )
                subscription.wake.set()

    # -- groups and heartbeats ------------------------------------------------------------

    async def groups(self) -> list[GroupInfo]:
        """Every group of the schema (request inboxes left out), with its backlog, its
        live consumers (every process's) and when one was last seen reading."""
        rows = await self.run("listing groups", "fetch", self.sql.groups, time.time())
        return [
            GroupInfo(pattern, group, int(backlog), int(consumers), last_active)
            for pattern, group, backlog, consumers, last_active in rows
        ]

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the group with every row it holds; whether it existed."""
        found = await self.run(
            f"deleting group {group!r}", "fetchval", self.sql.delete_group, pattern, group
        )
        return found is not None

    async def beat(self, instance: str, record: bytes) -> None:
        """Write process ``instance``'s heartbeat record (``Bus.cluster_statistics``)."""
        await self._heartbeats.beat(instance, record)

    async def beats(self) -> list[bytes]:
        """Every process's latest heartbeat record."""
        return await self._heartbeats.beats()

    async def forget(self, instance: str) -> None:
        """Delete process ``instance``'s heartbeat record."""
        await self._heartbeats.forget(instance)

    # -- dead letters ---------------------------------------------------------------------

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Store a dead letter the bus recorded without a delivery."""
        await self._dead.add(entry)

    async def dead_letters(self) -> list[DeadLetter]:
        """Every dead letter kept, oldest first (expired and surplus ones dropped first)."""
        return await self._dead.listed()

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Forget the dead letters of these envelope ids."""
        await self._dead.take(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Remove the dead letters of these ids; those this call removed, oldest first."""
        return await self._dead.take(ids)

    async def clear_dead_letters(self) -> None:
        """Remove every dead letter kept (every watcher reads the store again)."""
        await self._dead.clear()

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Keep ``entries`` again (every watcher reads the store again)."""
        await self._dead.restore(entries)

    def watch_dead_letters(self) -> AbstractAsyncContextManager[AsyncIterator[DeadLetterChange]]:
        """Every change to the dead letters from now on, by any process."""
        return self._dead.watch()

    # -- stores ---------------------------------------------------------------------------

    def dedup_store(self, window: float) -> DedupStore:
        """``deduplicate()``'s store in the database: one row per key, claimed with a
        lease and kept ``window`` seconds once done."""
        return PgDedupStore(self)

    def rate_store(self) -> PgRateStore:
        """``RateLimit``'s shared turns in the database: a row per bucket, one statement a turn."""
        return PgRateStore(self)

    def lease_store(self) -> PgLeaseStore:
        """``max_in_flight``'s slots in the database: a row of leases per stage."""
        return PgLeaseStore(self)
