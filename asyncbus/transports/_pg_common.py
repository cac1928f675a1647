"""What every PostgreSQL piece of asyncbus shares (the transport, the outbox, the inbox).

The DSN and schema checks made when one is created, asyncpg imported when it connects,
the errors of a database that went away or refused, the caller's connection checked
before anything is written through it, and the key of a shared store's row.
"""

from __future__ import annotations

import hashlib
import re
from contextlib import AbstractContextManager
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio

from .._exceptions import ConfigurationError
from ._codec import Codec
from ._kit import AckWriter, check_url, redact, require_extra
from ._pg_statements import Statements
from .base import TransportSettings

__all__ = [
    "DSN_FORM",
    "SCHEMES",
    "PgHost",
    "caller_connection",
    "check_dsn",
    "check_schema",
    "database_errors",
    "load_asyncpg",
    "row_key",
]

#: The URL schemes of a PostgreSQL DSN.
SCHEMES = ("postgresql", "postgres")
#: What a DSN looks like, for messages.
DSN_FORM = "postgresql://user@host:5432/database"

#: A schema name asyncbus quotes nowhere: lower-case letters, digits and ``_`` (57 at
#: most, so its channels' names stay within PostgreSQL's 63 bytes).
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,56}")


def check_dsn(owner: str, dsn: object) -> str:
    """``dsn`` when it is one PostgreSQL DSN, else :class:`ConfigurationError` (it is
    shown without its password)."""
    require_extra(owner, "postgres", "asyncpg")
    if not isinstance(dsn, str):
        raise ConfigurationError(f"{owner}: dsn must be a string like {DSN_FORM}, got {dsn!r}")
    if "," in dsn:
        # One server: asyncpg would try several hosts in turn, but every claim must be
        # made on one database.
        raise ConfigurationError(f"{owner}: one PostgreSQL server per dsn, got {redact(dsn)!r}")
    check_url(owner, dsn, SCHEMES, DSN_FORM)
    if not urlsplit(dsn.strip()).path.strip("/"):
        # asyncpg would take the user's name for it: a quiet guess at where work goes.
        raise ConfigurationError(
            f"{owner}: the dsn names no database: write it like {DSN_FORM}, got {redact(dsn)!r}"
        )
    return dsn.strip()


def check_schema(owner: str, schema: object) -> str:
    """``schema`` when it is a plain name (``asyncbus``, ``orders_bus``), else
    :class:`ConfigurationError`: it is written into SQL, unquoted."""
    if not isinstance(schema, str) or _SCHEMA.fullmatch(schema) is None:
        raise ConfigurationError(
            f"{owner}: schema must be lower-case letters, digits and '_' (at most 57, "
            f"not starting with a digit), got {schema!r}"
        )
    return schema


def row_key(name: str) -> str:
    """The key of ``name``'s row in a shared store (a rate bucket, a stage's slots): a
    hash, as a name (a stage and a user's key) may be of any length."""
    return hashlib.sha256(name.encode()).hexdigest()[:40]


def load_asyncpg() -> Any:
    """The asyncpg module (imported on first use, never when asyncbus is)."""
    import asyncpg

    return asyncpg


def database_errors() -> tuple[type[BaseException], ...]:
    """What asyncpg raises when the database refuses, goes away or does not answer."""
    asyncpg = load_asyncpg()
    return (
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,  # a connection the server ended mid-operation
        OSError,
        TimeoutError,
    )


def caller_connection(owner: str, connection: Any) -> Any:
    """The asyncpg connection a caller handed over to publish through, checked.

    Takes an ``asyncpg.Connection`` or a pool's connection (what ``pool.acquire()``
    gives); SQLAlchemy users pass the asyncpg connection under theirs (``(await
    conn.get_raw_connection()).driver_connection``), once a statement has begun the
    transaction (SQLAlchemy begins the database's at its first statement).

    :raises ConfigurationError: for anything else, or a connection not inside a
        transaction (the publish would commit on its own: not what was asked).
    """
    asyncpg = load_asyncpg()
    proxy = getattr(getattr(asyncpg, "pool", None), "PoolConnectionProxy", ())
    if not isinstance(connection, asyncpg.Connection | proxy):
        raise ConfigurationError(
            f"{owner}: connection= takes an asyncpg connection (for SQLAlchemy: "
            f"(await conn.get_raw_connection()).driver_connection), got "
            f"{type(connection).__name__}"
        )
    if not connection.is_in_transaction():
        raise ConfigurationError(
            f"{owner}: connection= must be inside a transaction (async with "
            "connection.transaction(): ...), so the publish commits with it; SQLAlchemy "
            "begins the database's transaction at its first statement: publish after "
            "one (after session.flush())"
        )
    return connection


class PgHost(Protocol):
    """What the transport's consumers and stores use of it (so they need not import it)."""

    sql: Statements
    acks: AckWriter[int, int]
    codec: Codec
    settings: TransportSettings
    ack_timeout: float
    publish_timeout: float
    poll_interval: float
    close_timeout: float
    max_deliveries: int
    keep_alive: bool

    async def run(self, doing: str, method: str, statement: str, *args: Any) -> Any:
        """``pool.<method>(statement, *args)``, a database error a ``TransportError``."""

    async def listen(self) -> None:
        """Listen for notifications (again, after a lost connection)."""

    def cleanup_scope(self, timeout: float = ...) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded, bounded scope for clean-up with the database."""
