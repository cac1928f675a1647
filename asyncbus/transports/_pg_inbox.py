"""The inbox: a handler's writes to PostgreSQL and "this envelope was handled" commit together.

:class:`PostgresInbox` is a middleware. For each envelope it takes a connection from
its pool, opens a transaction and inserts a claim row (the stage's name and the
envelope's id). A claim already there was committed by an earlier handling: the
envelope is skipped (the :class:`~asyncbus.Skip` verdict, as ``deduplicate()`` gives a
duplicate). Otherwise the handler runs with the connection at hand
(:func:`current_connection`), and the transaction commits when the chain below
returned a result, or rolls back when it raised, returned a verdict or was cancelled.
A copy handled at the same moment waits on the claim's row lock inside PostgreSQL:
it is skipped if the first commits and runs if the first rolls back.
"""

from __future__ import annotations

import logging
import threading
from contextvars import ContextVar
from types import TracebackType
from typing import Any

import anyio

from .._checks import check_count, check_seconds
from .._envelope import Envelope
from .._exceptions import ConfigurationError, ConnectError, TransportError
from .._handling import Handling, current_handling
from .._types import Handler
from .._verdicts import Skip, Verdict
from ._kit import redact, require_asyncio
from ._pg_common import check_dsn, check_schema, database_errors, load_asyncpg

__all__ = ["PostgresInbox", "current_connection"]

logger = logging.getLogger("asyncbus.inbox")

#: The layout of the inbox's tables this code writes; a schema of a later one is refused.
SCHEMA_VERSION = 1
#: A claim found: the envelope was handled and committed before.
_SKIP = Skip()
#: Seconds to connect (each connection of the pool).
_CONNECT_TIMEOUT = 10.0
#: Seconds a rollback, a release or the pool's close may take before the connection
#: is terminated instead (the server then rolls back on its own).
_SETTLE_TIMEOUT = 5.0
#: Seconds between two deletions of expired claims, at most (less for a short window).
_PURGE_EVERY = 60.0
#: Claims deleted per statement, and statements per purge: the purge's cost is bounded.
_PURGE_BATCH = 1000
_PURGE_ROUNDS = 10

#: The connection of the handling in this context, and the thread it was set on.
_current: ContextVar[tuple[Any, int] | None] = ContextVar("asyncbus_inbox", default=None)


def current_connection() -> Any:
    """The asyncpg connection of the :class:`PostgresInbox` transaction in which the
    calling handler runs: what is written through it commits with the envelope's claim.

    :raises RuntimeError: outside a handler run by a :class:`PostgresInbox` (a
        handler without one, code after the handler returned), or from a thread (a sync
        handler offloaded to the worker pool: an asyncpg connection is used on its
        event loop only; write the handler as ``async def``).
    """
    found = _current.get()
    if found is None:
        raise RuntimeError(
            "current_connection() is called outside a handler run by a PostgresInbox "
            "(subscribe(..., middleware=[inbox]))"
        )
    connection, thread = found
    if threading.get_ident() != thread:
        raise RuntimeError(
            "current_connection() is called from a worker thread: the inbox's asyncpg "
            "connection is used on the event loop only; make the handler 'async def'"
        )
    return connection


class PostgresInbox:
    """Middleware: a handler's PostgreSQL writes and the envelope's claim commit together,
    so the effects of an envelope delivered twice are made once.

    Use it in ``bus.subscribe(..., middleware=[inbox])`` (or ``Bus(middleware=...)``);
    the handler writes through :func:`current_connection`. A handler that raises rolls
    back (its writes and the claim) and the exception goes on unchanged, so ``Retry``
    and dead-lettering work as usual; a claim already committed skips the envelope.
    For ``async def`` handlers on asyncio only (asyncpg); not for batch subscriptions.

    The pool is created on the first envelope (or by ``async with inbox:``). One created
    by an envelope is closed when the bus that handled it stops; one opened by ``async
    with inbox:`` when that block ends; :meth:`aclose` closes either.

    :param dsn: ``postgresql://user:password@host:5432/database``, one server.
    :param schema: where the inbox's tables live (created if missing).
    :param window: seconds a claim is kept; a copy arriving later than that is handled
        again. Older claims are deleted now and then, a bounded number at a time.
    :param pool_size: connections at most; each handler holds one while it runs, so
        give at least the concurrency of the stages that use the inbox.
    :raises ConfigurationError: for a dsn, schema, window or pool size that cannot work.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "asyncbus_inbox",
        window: float = 7 * 24 * 3600,
        pool_size: int = 10,
    ) -> None:
        self.dsn = check_dsn("PostgresInbox", dsn)
        self.schema = check_schema("PostgresInbox", schema)
        self.window = check_seconds(window, "PostgresInbox: window")
        self.pool_size = check_count(pool_size, "PostgresInbox: pool_size", 1)
        self._pool: Any = None
        #: Set when the pool being opened is ready (or failed); ``None`` when none is.
        self._opening: anyio.Event | None = None
        #: The loop clock's time of the next purge of expired claims.
        self._next_purge = -float("inf")
        self._purging = False
        self._claims = f"{self.schema}.claims"

    def __repr__(self) -> str:
        return f"PostgresInbox({redact(self.dsn)!r}, schema={self.schema!r})"

    # -- life cycle ----------------------------------------------------------------

    async def __aenter__(self) -> PostgresInbox:
        """Open the pool and create the tables now (a database that cannot be reached,
        or tables of a later version, fail here rather than at the first envelope)."""
        await self._connected(None)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        """Close the pool (:meth:`aclose`)."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pool, waiting at most a few seconds for connections in use (then
        they are terminated, which rolls their transactions back). The next envelope
        opens a new one."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await _close_pool(pool)

    async def _connected(self, handling: Handling | None) -> Any:
        """The pool, opened (with the tables made) by the first caller; the others wait."""
        while True:
            pool = self._pool
            if pool is not None:
                return pool
            opening = self._opening
            if opening is not None:
                await opening.wait()  # (it failed: this caller tries in turn)
                continue
            self._opening = opening = anyio.Event()
            try:
                pool = await self._open()
                self._pool = pool
                if handling is not None:
                    # Opened for a bus: closed when the bus's task group ends.
                    handling.host.start_soon(self._close_with_the_bus, pool, name="inbox pool")
                return pool
            finally:
                self._opening = None
                opening.set()

    async def _open(self) -> Any:
        """A new pool, with the inbox's tables made and their version checked."""
        require_asyncio("PostgresInbox", "asyncpg")
        asyncpg = load_asyncpg()
        try:
            pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=self.pool_size, timeout=_CONNECT_TIMEOUT
            )
        except database_errors() as error:
            raise ConnectError(
                f"PostgresInbox: cannot connect to {redact(self.dsn)}: "
                f"{type(error).__name__}: {error}"
            ) from error
        try:
            async with pool.acquire() as connection:
                await self._make_tables(connection)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _close_pool(pool)
            raise
        return pool

    async def _make_tables(self, connection: Any) -> None:
        """Create the schema and tables if missing (under an advisory lock, so replicas
        starting together do not race) and check the version they were made for."""
        schema = self.schema
        try:
            async with connection.transaction():
                await connection.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                    f"asyncbus.inbox:{schema}",
                )
                await connection.execute(
                    f"""
                    CREATE SCHEMA IF NOT EXISTS {schema};
                    CREATE TABLE IF NOT EXISTS {schema}.version (
                        single boolean PRIMARY KEY DEFAULT true CHECK (single),
                        version integer NOT NULL
                    );
                    CREATE TABLE IF NOT EXISTS {schema}.claims (
                        stage text NOT NULL,
                        envelope_id text NOT NULL,
                        claimed_at timestamptz NOT NULL DEFAULT now(),
                        PRIMARY KEY (stage, envelope_id)
                    );
                    CREATE INDEX IF NOT EXISTS claims_claimed_at
                        ON {schema}.claims (claimed_at);
                    """
                )
                found = await connection.fetchval(f"SELECT version FROM {schema}.version")
                if found is None:
                    await connection.execute(
                        f"INSERT INTO {schema}.version (version) VALUES ($1)", SCHEMA_VERSION
                    )
        except database_errors() as error:
            raise TransportError(
                f"PostgresInbox: cannot create the tables in schema {schema!r}: "
                f"{type(error).__name__}: {error}"
            ) from error
        if found is not None and found > SCHEMA_VERSION:
            raise ConfigurationError(
                f"PostgresInbox: schema {schema!r} holds inbox tables of version {found}, "
                f"newer than this asyncbus knows ({SCHEMA_VERSION}): upgrade asyncbus"
            )

    async def _close_with_the_bus(self, pool: Any) -> None:
        """Wait until the bus's task group ends, then close ``pool``."""
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                if self._pool is pool:
                    self._pool = None
                await _close_pool(pool)

    # -- per envelope ----------------------------------------------------------------

    def __call__(self, call_next: Handler) -> Handler:
        """Wrap ``call_next`` (once per stage): each envelope is handled in a transaction
        that holds its claim."""

        async def handle(envelope: Envelope) -> Any:
            handling = current_handling()
            if handling is not None and handling.batch is not None:
                raise ConfigurationError(
                    "PostgresInbox: a batch subscription's handler runs once for many "
                    "envelopes, outside their transactions: use it on per-envelope stages"
                )
            stage = handling.stage.name if handling is not None else ""
            pool = await self._connected(handling)
            try:
                connection = await pool.acquire()
            except database_errors() as error:
                raise _failed("take a connection", envelope, stage, error) from error
            try:
                result = await self._in_transaction(connection, envelope, stage, call_next)
            finally:
                with anyio.CancelScope(shield=True):
                    await _release(pool, connection)
            if not isinstance(result, Verdict):
                self._purge_soon(pool, handling)
            return result

        return handle

    async def _in_transaction(
        self, connection: Any, envelope: Envelope, stage: str, call_next: Handler
    ) -> Any:
        """Claim ``envelope`` and run ``call_next`` in one transaction on ``connection``."""
        errors = database_errors()
        transaction = connection.transaction()
        try:
            await transaction.start()
            claimed = await connection.fetchval(
                f"INSERT INTO {self._claims} (stage, envelope_id) VALUES ($1, $2) "
                "ON CONFLICT DO NOTHING RETURNING true",
                stage,
                envelope.id,
            )
        except errors as error:
            await _roll_back(connection, transaction)
            raise _failed("claim", envelope, stage, error) from error
        except BaseException:
            await _roll_back(connection, transaction)
            raise
        if not claimed:
            await _roll_back(connection, transaction)
            return _SKIP
        token = _current.set((connection, threading.get_ident()))
        try:
            result = await call_next(envelope)
        except BaseException:  # deliberate: failure or cancellation, nothing is kept
            await _roll_back(connection, transaction)
            raise
        finally:
            _current.reset(token)
        if isinstance(result, Verdict):
            # Not handled (deferred, retried, dead-lettered, skipped further in): the
            # claim goes, so the envelope runs when it comes back.
            await _roll_back(connection, transaction)
            return result
        try:
            # A failed statement the handler caught leaves the transaction aborted, and
            # COMMIT would then roll back without an error: asked first, it raises.
            await connection.execute("SELECT 1")
            await transaction.commit()
        except errors as error:
            await _roll_back(connection, transaction)
            raise _failed("commit", envelope, stage, error) from error
        except BaseException:
            await _roll_back(connection, transaction)
            raise
        return result

    # -- expired claims ---------------------------------------------------------------

    def _purge_soon(self, pool: Any, handling: Handling | None) -> None:
        """Start a deletion of expired claims when one is due (on the bus's task group;
        none outside a bus)."""
        now = anyio.current_time()
        if self._purging or now < self._next_purge or handling is None:
            return
        self._purging = True
        self._next_purge = now + min(_PURGE_EVERY, self.window)
        handling.host.start_soon(self._purge, pool, name="inbox purge")

    async def _purge(self, pool: Any) -> None:
        """Delete claims older than the window, at most a bounded number."""
        try:
            async with pool.acquire() as connection:
                for _ in range(_PURGE_ROUNDS):
                    status = await connection.execute(
                        f"DELETE FROM {self._claims} WHERE ctid = ANY(ARRAY("
                        f"SELECT ctid FROM {self._claims} "
                        "WHERE claimed_at < now() - make_interval(secs => $1) LIMIT $2))",
                        self.window,
                        _PURGE_BATCH,
                    )
                    if int(status.rpartition(" ")[2]) < _PURGE_BATCH:
                        break
        except database_errors() as error:  # the next purge tries again
            logger.warning("PostgresInbox: could not delete expired claims: %s", error)
        finally:
            self._purging = False


def _failed(what: str, envelope: Envelope, stage: str, error: BaseException) -> TransportError:
    """The error of a handling whose ``what`` failed in the database: the envelope fails."""
    return TransportError(
        f"PostgresInbox: could not {what} envelope {envelope.id} of stage {stage!r}: "
        f"{type(error).__name__}: {error}"
    )


async def _roll_back(connection: Any, transaction: Any) -> None:
    """Roll ``transaction`` back, shielded and bounded; a connection that cannot is
    terminated (the server rolls back what it held)."""
    with anyio.CancelScope(shield=True):
        with anyio.move_on_after(_SETTLE_TIMEOUT) as scope:
            try:
                if connection.is_in_transaction():
                    await transaction.rollback()
                return
            except database_errors() as error:
                logger.warning("PostgresInbox: rollback failed, closing the connection: %s", error)
        if scope.cancelled_caught:
            logger.warning("PostgresInbox: rollback took too long, closing the connection")
        connection.terminate()


async def _release(pool: Any, connection: Any) -> None:
    """Give ``connection`` back to ``pool`` (terminated when that fails)."""
    try:
        await pool.release(connection, timeout=_SETTLE_TIMEOUT)
    except database_errors() as error:
        logger.warning("PostgresInbox: could not release a connection: %s", error)
        connection.terminate()


async def _close_pool(pool: Any) -> None:
    """Close ``pool``, bounded: what is still in use after a while is terminated."""
    with anyio.move_on_after(_SETTLE_TIMEOUT) as scope:
        try:
            await pool.close()
            return
        except database_errors() as error:
            logger.warning("PostgresInbox: could not close the pool cleanly: %s", error)
    if scope.cancelled_caught:
        logger.warning("PostgresInbox: connections still in use at close were terminated")
    pool.terminate()
