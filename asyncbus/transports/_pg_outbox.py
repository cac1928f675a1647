"""The transactional outbox: envelopes written in the caller's PostgreSQL transaction,
forwarded through the bus's transport once it has committed.

``publish(..., connection=conn)`` on a bus given ``outbox=PostgresOutbox(dsn)`` writes
one row per envelope (its fields and encoded payload) into ``{schema}.outbox`` through
the caller's connection, with a ``NOTIFY`` that PostgreSQL delivers at commit. The
relay, a task of the running bus, holds the schema's advisory lock on its connection
(a session lock: one relay at a time across every process sharing the schema, so rows
go out in order; taken by another relay when this one's connection goes, or when its
transport fails), reads committed rows in id order, publishes each envelope as it was
built (same id) and deletes what it sent. No transaction around a batch: on the path
from a commit to the send there is one statement, the read. A relay stopped between
the send and the delete sends the rows again on its next run (at least once;
``deduplicate()`` makes that harmless). A
row that does not decode is logged and kept aside (``dead`` says why), never retried.
The relay also keeps the count of rows waiting (:attr:`PostgresOutbox.known_pending`,
``statistics().outbox_pending``): counted when the bus starts and every
``poll_interval`` after, lowered by what it forwards in between.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from .._checks import check_count, check_seconds
from .._envelope import Envelope
from .._exceptions import BusClosedError, ConfigurationError, ConnectError, TransportError
from ._codec import Codec, default_codec, envelope_from_wire, envelope_to_wire
from ._kit import redact
from ._kit.backoff import Backoff
from ._pg_common import (
    caller_connection,
    check_dsn,
    check_schema,
    database_errors,
    load_asyncpg,
)

__all__ = ["PostgresOutbox"]

logger = logging.getLogger("asyncbus.outbox")

_OWNER = "PostgresOutbox"
#: The version of the outbox's tables this code writes and reads.
SCHEMA_VERSION = 1
#: Seconds to connect, and to close a connection at the stop.
_CONNECT_TIMEOUT = 10.0
_CLOSE_TIMEOUT = 2.0
#: The most rows one batch forwards.
_MAX_BATCH = 10_000


class PostgresOutbox:
    """An outbox for any transport: ``Bus(outbox=PostgresOutbox(dsn))`` lets
    ``publish(..., connection=asyncpg_connection)`` publish inside the caller's
    transaction.

    Envelopes published so are rows of ``{schema}.outbox`` until the bus's relay has
    forwarded them through the bus's transport: each at least once, in the order they
    were written (one relay at a time among the buses sharing the schema). The relay
    forwards while its bus runs: what is left when the bus stops waits in the table for
    its next start, or for another bus sharing the schema (``drain()`` does not wait for
    it; :meth:`pending` counts it, and :attr:`known_pending` is the relay's latest count).
    Runs on asyncio only (asyncpg is asyncio-only).

    :param dsn: the PostgreSQL server and database, ``postgresql://user@host/db``.
    :param schema: the schema of the outbox's tables (made when the bus starts).
    :param poll_interval: seconds between two looks at the table when no notification
        came (one can be lost while the relay reconnects).
    :param batch_size: most rows one read of the relay takes.
    :raises ConfigurationError: for a value that cannot work.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "asyncbus_outbox",
        poll_interval: float = 1.0,
        batch_size: int = 100,
    ) -> None:
        self.dsn = check_dsn(_OWNER, dsn)
        self.schema = check_schema(_OWNER, schema)
        self.poll_interval = check_seconds(poll_interval, f"{_OWNER}: poll_interval")
        self.batch_size = check_count(batch_size, f"{_OWNER}: batch_size", 1, _MAX_BATCH)
        self._sql = _Statements(self.schema)
        #: The notification channel (an identifier: at most 63 characters).
        self._channel = f"asyncbus_outbox_{self.schema}"[:63]
        self._codec: Codec | None = None
        self._opened = False
        #: The relay's connection: it listens, and forwards batches.
        self._connection: Any = None
        #: Whether the relay's connection holds the schema's relay lock.
        self._holds_lock = False
        #: Set by a notification (a commit of rows) while the relay runs.
        self._wake: anyio.Event | None = None
        #: The rows waiting as last counted, less what was forwarded since (None: never
        #: counted); and the loop clock's time of the next count.
        self._pending: int | None = None
        self._next_count = -float("inf")

    def __repr__(self) -> str:
        return f"PostgresOutbox({redact(self.dsn)!r}, schema={self.schema!r})"

    @property
    def known_pending(self) -> int | None:
        """How many committed rows wait for a relay, as this bus's relay last knew it
        (``None`` before its bus first started): counted when the bus starts and every
        ``poll_interval`` seconds while it runs (also while another relay holds the
        schema's lock, or the transport refuses what it forwards), and lowered by each
        row it forwards or sets aside in between. Read without asking the database
        (``statistics().outbox_pending``); :meth:`pending` asks it now."""
        return self._pending

    # -- the bus's side (``asyncbus._transactional.Outbox``) ---------------------

    def attach(self, codec: Codec) -> None:
        """Become the outbox of one bus, whose payloads ``codec`` encodes.

        :raises ConfigurationError: when it is another bus's outbox already.
        """
        if self._codec is not None:
            raise ConfigurationError(
                f"{_OWNER}: this outbox belongs to a bus already; give each bus its own "
                "(outboxes with the same dsn and schema share one table and one relay)"
            )
        self._codec = codec

    async def open(self) -> None:
        """Connect, and make the outbox's schema and tables if they are missing.

        :raises ConnectError: when the database cannot be reached or refuses.
        :raises ConfigurationError: when the tables were made by a newer asyncbus, or
            the outbox is open for a running bus already.
        """
        if self._opened:
            raise ConfigurationError(f"{_OWNER}: already open (its bus is running)")
        try:
            connection = await self._connect()
        except database_errors() as error:
            raise ConnectError(
                f"{_OWNER}: cannot connect to {redact(self.dsn)}: {_described(error)}"
            ) from error
        try:
            await self._make_tables(connection)
            try:
                await self._count(connection)
            except database_errors() as error:  # (only when the connection broke)
                raise ConnectError(
                    f"{_OWNER}: the connection to {redact(self.dsn)} broke while opening: "
                    f"{_described(error)}"
                ) from error
            await self._listen(connection)
        except BaseException:
            await _close(connection)
            raise
        self._opened = True

    async def relay(
        self, forward: Callable[[Envelope], Awaitable[object]], running: Callable[[], bool]
    ) -> None:
        """Forward committed envelopes through ``forward`` while ``running()``, until
        cancelled (the bus's stop). Database errors are logged and retried."""
        backoff = Backoff(0.1, 5.0, jitter=True)
        while True:
            wake = self._wake = anyio.Event()  # (a notification from now on wakes the wait)
            more = False
            try:
                if running():
                    connection = self._connection or await self._reconnect()
                    if anyio.current_time() >= self._next_count:
                        await self._count(connection)
                    more = await self._forward_batch(connection, forward, running)
                    backoff.reset()
            except _SendFailed as failed:
                if not isinstance(failed.error, BusClosedError):  # (closing: rows wait)
                    logger.warning(
                        "outbox %s: forwarding failed (%s); the relay tries again",
                        self.schema,
                        _described(failed.error),
                    )
                    await backoff.sleep()
                    continue
            except Exception as error:  # deliberate: the database's errors, and whatever
                # else asyncpg raises when its connection breaks mid-operation
                # (``InternalClientError``): a new connection, after a pause.
                logger.warning(
                    "outbox %s: the database failed (%s); the relay tries again",
                    self.schema,
                    _described(error),
                )
                await self._drop_connection()
                await backoff.sleep()
                continue
            if not more:
                with anyio.move_on_after(self.poll_interval):
                    await wake.wait()

    async def aclose(self) -> None:
        """Close the relay's connection (shielded, bounded)."""
        self._opened = False
        await self._drop_connection()

    # -- writing in the caller's transaction ------------------------------------

    async def publish_in(self, connection: Any, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Write ``envelopes`` (all on ``topic``) as rows through ``connection``, inside
        the transaction the caller opened on it; the relay forwards them once it commits.

        :raises ConfigurationError: when ``connection`` is not an asyncpg connection
            inside a transaction (nothing is written).
        :raises EncodeError: when a payload cannot be encoded (nothing is written).
        :raises TransportError: when the database refused the write (the caller's
            transaction is then failed: roll it back).
        """
        connection = caller_connection(_OWNER, connection)
        codec = self._codec if self._codec is not None else default_codec()
        metas: list[bytes] = []
        bodies: list[bytes] = []
        for envelope in envelopes:
            meta, body = envelope_to_wire(envelope, codec)
            metas.append(meta)
            bodies.append(body)
        if not metas:
            return
        try:
            await connection.execute(self._sql.insert, metas, bodies, self._channel)
        except database_errors() as error:
            raise TransportError(
                f"{_OWNER}: writing {len(metas)} envelope(s) on {topic!r} into "
                f"{self.schema}.outbox failed: {_described(error)}"
            ) from error

    async def pending(self) -> int:
        """How many committed rows wait for the relay (not counting rows kept aside).

        :raises TransportError: when the database cannot be asked.
        """
        asyncpg = load_asyncpg()
        try:
            connection = await self._connect()
            try:
                return int(await connection.fetchval(self._sql.pending))
            except asyncpg.UndefinedTableError:
                return 0  # (never opened: nothing was written)
            finally:
                await _close(connection)
        except database_errors() as error:
            raise TransportError(
                f"{_OWNER}: cannot count {self.schema}.outbox: {_described(error)}"
            ) from error

    # -- inside ---------------------------------------------------------------------

    async def _count(self, connection: Any) -> None:
        """Count the rows waiting now (:attr:`known_pending`); the next count is due
        ``poll_interval`` seconds later. A count that fails (a huge backlog past the
        statement timeout, say) is logged and leaves the last one: it never keeps the
        relay from forwarding, which is what shrinks the backlog."""
        self._next_count = anyio.current_time() + self.poll_interval
        try:
            self._pending = int(await connection.fetchval(self._sql.pending))
        except database_errors() as error:
            if connection.is_closed():
                raise  # the connection is gone: the relay connects again (and says so once)
            logger.warning(
                "outbox %s: counting the waiting rows failed (%s); the relay forwards all the same",
                self.schema,
                _described(error),
            )

    async def _connect(self) -> Any:
        asyncpg = load_asyncpg()
        # Every statement bounded too: a server that stops answering (a half-open
        # connection after a failover) fails the relay's batch, which connects again.
        return await asyncpg.connect(
            self.dsn, timeout=_CONNECT_TIMEOUT, command_timeout=_CONNECT_TIMEOUT
        )

    async def _make_tables(self, connection: Any) -> None:
        """The schema and tables, made once (under a lock: processes starting together
        would otherwise race on ``CREATE ... IF NOT EXISTS``); their version checked."""
        sql = self._sql
        try:
            async with connection.transaction():
                await connection.execute(sql.setup_lock, self.schema)
                await connection.execute(sql.create_version)
                version = await connection.fetchval(sql.version)
                if version is None:
                    await connection.execute(sql.create_outbox)
                    await connection.execute(sql.record_version, SCHEMA_VERSION)
                elif version > SCHEMA_VERSION:
                    raise ConfigurationError(
                        f"{_OWNER}: the tables of schema {self.schema!r} are at version "
                        f"{version}, made by a newer asyncbus (this one knows version "
                        f"{SCHEMA_VERSION} at most): upgrade asyncbus, or use another schema"
                    )
        except database_errors() as error:
            raise ConnectError(
                f"{_OWNER}: cannot make the tables of schema {self.schema!r}: {_described(error)}"
            ) from error

    async def _reconnect(self) -> Any:
        """A new connection for the relay, listening (a notification sent while there
        was none is made up for by the batch that follows)."""
        connection = await self._connect()
        try:
            await self._listen(connection)
        except BaseException:
            await _close(connection)
            raise
        return connection

    async def _listen(self, connection: Any) -> None:
        """Listen on ``connection``, which becomes the relay's."""
        try:
            await connection.add_listener(self._channel, self._notified)
        except database_errors() as error:
            raise ConnectError(f"{_OWNER}: cannot listen: {_described(error)}") from error
        self._connection = connection

    def _notified(self, *_: object) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._holds_lock = False  # (the server lets go of it with the connection)
        if connection is not None:
            await _close(connection)

    async def _forward_batch(
        self,
        connection: Any,
        forward: Callable[[Envelope], Awaitable[object]],
        running: Callable[[], bool],
    ) -> bool:
        """Forward one batch of committed rows, in id order, and delete what was sent;
        whether a whole batch went out (more may wait).

        Only the holder of the schema's relay lock forwards: taken here when not held yet
        (another relay holds it: nothing to do), kept by the connection until it closes,
        or until forwarding fails (another relay may do better). What went out is
        deleted even when the bus's stop cancels the batch (shielded, within a bound): a
        clean stop sends nothing twice.
        """
        sql = self._sql
        if not self._holds_lock:
            self._holds_lock = bool(await connection.fetchval(sql.relay_lock, self.schema))
            if not self._holds_lock:
                return False  # (another relay is at work)
        rows = await connection.fetch(sql.batch, self.batch_size)
        sent: list[int] = []
        dead: list[tuple[int, str]] = []
        failure: _SendFailed | None = None
        try:
            for row in rows:
                if not running():
                    break
                envelope, why = self._decoded(row["meta"], row["body"])
                if envelope is None:
                    logger.error(
                        "outbox %s: row %d cannot be forwarded (%s); it is kept aside "
                        "(its dead column says why)",
                        self.schema,
                        row["id"],
                        why,
                    )
                    dead.append((row["id"], why))
                    continue
                try:
                    await forward(envelope)
                except Exception as error:  # deliberate: what went out is still deleted
                    failure = _SendFailed(error)
                    break
                sent.append(row["id"])
        finally:
            with anyio.fail_after(_CLOSE_TIMEOUT, shield=True):
                if sent:
                    await self._mark_sent(connection, sent)
                if dead:
                    await connection.execute(
                        sql.set_aside, [i for i, _ in dead], [why for _, why in dead]
                    )
                if failure is not None:
                    self._holds_lock = False
                    await connection.execute(sql.relay_unlock, self.schema)
        if self._pending is not None:  # (rows committed since the last count wait for the next)
            self._pending = max(0, self._pending - len(sent) - len(dead))
        if failure is not None:
            raise failure from failure.error
        return len(rows) == self.batch_size and len(sent) + len(dead) == len(rows)

    async def _mark_sent(self, connection: Any, ids: list[int]) -> None:
        """Delete the rows forwarded."""
        await connection.execute(self._sql.delete, ids)

    def _decoded(self, meta: bytes, body: bytes) -> tuple[Envelope | None, str]:
        """The envelope a row holds, or ``None`` and why it cannot be sent."""
        codec = self._codec if self._codec is not None else default_codec()
        try:
            envelope, undecodable = envelope_from_wire(bytes(meta), bytes(body), codec)
        except Exception as error:  # a DecodeError, whatever the bytes
            return None, f"undecodable fields: {error}"
        if undecodable is not None:
            return None, f"undecodable payload: {undecodable}"
        return envelope, ""


class _SendFailed(Exception):
    """The bus refused to send an envelope (its transport failed, or it is closing)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Statements:
    """The outbox's SQL for one schema (a plain name, checked: written unquoted)."""

    def __init__(self, schema: str) -> None:
        table = f"{schema}.outbox"
        self.setup_lock = (
            "SELECT pg_advisory_xact_lock(hashtext('asyncbus.outbox.setup'), hashtext($1))"
        )
        #: The relay's lock, held by its connection (a session lock) until released.
        self.relay_lock = (
            "SELECT pg_try_advisory_lock(hashtext('asyncbus.outbox.relay'), hashtext($1))"
        )
        self.relay_unlock = (
            "SELECT pg_advisory_unlock(hashtext('asyncbus.outbox.relay'), hashtext($1))"
        )
        self.create_version = (
            f"CREATE SCHEMA IF NOT EXISTS {schema};"
            f"CREATE TABLE IF NOT EXISTS {schema}.version (version integer NOT NULL)"
        )
        self.version = f"SELECT max(version) FROM {schema}.version"
        self.record_version = f"INSERT INTO {schema}.version (version) VALUES ($1)"
        self.create_outbox = (
            f"CREATE TABLE IF NOT EXISTS {table} ("
            "id bigserial PRIMARY KEY, meta bytea NOT NULL, body bytea NOT NULL, "
            "written_at timestamptz NOT NULL DEFAULT now(), dead text, dead_at timestamptz);"
            f"CREATE INDEX IF NOT EXISTS outbox_pending ON {table} (id) WHERE dead IS NULL"
        )
        # One statement: the rows in the given order, and a notification at commit.
        self.insert = (
            f"WITH written AS (INSERT INTO {table} (meta, body) "
            "SELECT meta, body FROM unnest($1::bytea[], $2::bytea[]) "
            "WITH ORDINALITY AS given(meta, body, n) ORDER BY n RETURNING id) "
            "SELECT pg_notify($3, count(*)::text) FROM written"
        )
        self.batch = f"SELECT id, meta, body FROM {table} WHERE dead IS NULL ORDER BY id LIMIT $1"
        self.delete = f"DELETE FROM {table} WHERE id = ANY($1::bigint[])"
        self.set_aside = (
            f"UPDATE {table} SET dead = aside.why, dead_at = now() "
            "FROM unnest($1::bigint[], $2::text[]) AS aside(id, why) "
            f"WHERE {table}.id = aside.id"
        )
        self.pending = f"SELECT count(*) FROM {table} WHERE dead IS NULL"


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


async def _close(connection: Any) -> None:
    """Close ``connection`` shielded from cancellation, within a bound; a connection
    that does not close in time (or is broken) is terminated."""
    with anyio.CancelScope(shield=True):
        try:
            with anyio.fail_after(_CLOSE_TIMEOUT):
                await connection.close(timeout=_CLOSE_TIMEOUT)
        except Exception:  # deliberate: broken or slow, it goes all the same
            connection.terminate()
