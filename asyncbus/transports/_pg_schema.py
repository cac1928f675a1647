"""The tables of :class:`~asyncbus.transports.postgres.PostgresTransport`, made and
migrated by the transport itself, in its own schema.

``groups`` holds one row per (pattern, group) a subscription ever joined, with the
pattern as a PostgreSQL regular expression, so a publish finds the groups its topic
reaches in the same statement that writes to them (a group registered by another
process is seen by the next publish that starts after it committed). ``messages`` holds
one row per (group, envelope); a second publish of one id is a second row (at least
once, as on the other brokers: ``deduplicate()`` drops the copy). A claim is
``claimed_by``/``claimed_until`` set with ``FOR UPDATE SKIP LOCKED``; ``available_at``
delays a nacked row; ``attempt`` and ``deliveries`` count attempts (``attempt`` the
envelope's at the last nack, ``deliveries`` the claims since). ``consumers`` holds the
live subscriptions (renewed while they live, for the groups listing); ``dead_letters``
and ``claims`` (``deduplicate()``'s store) complete it.

Version 2 adds what the processes of a deployment share besides envelopes: ``rates``
(``RateLimit``'s buckets, see :mod:`._pg_rates`), ``slots`` (``max_in_flight``'s leases,
:mod:`._pg_leases`) and ``heartbeats`` (:mod:`._pg_heartbeats`). They are ``UNLOGGED``:
written without the write-ahead log, so a turn or a lease commits without waiting for a
disk flush; a crash of the server empties them (buckets start full, leases are free,
heartbeats are written again within an interval) and replicas do not have them.
``version`` says which of these layouts the schema holds.
"""

from __future__ import annotations

from typing import Any

from .._exceptions import ConfigurationError

__all__ = ["SCHEMA_VERSION", "migrate", "pattern_regex"]

#: The layout this code writes and reads.
SCHEMA_VERSION = 2

#: Statements that bring a schema from the version before to each version.
_STEPS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE {s}.groups (
            id serial PRIMARY KEY,
            pattern text NOT NULL,
            grp text NOT NULL,
            regex text NOT NULL,
            alive_until double precision,
            last_active double precision,
            UNIQUE (pattern, grp)
        )""",
        """CREATE TABLE {s}.consumers (
            id text PRIMARY KEY,
            group_id integer NOT NULL REFERENCES {s}.groups (id) ON DELETE CASCADE,
            alive_until double precision NOT NULL
        )""",
        """CREATE TABLE {s}.messages (
            seq bigserial PRIMARY KEY,
            group_id integer NOT NULL REFERENCES {s}.groups (id) ON DELETE CASCADE,
            envelope_id text NOT NULL,
            meta bytea NOT NULL,
            body bytea NOT NULL,
            attempt integer NOT NULL,
            deliveries integer NOT NULL DEFAULT 0,
            queued_at double precision NOT NULL
                DEFAULT extract(epoch FROM clock_timestamp()),
            available_at timestamptz NOT NULL DEFAULT now(),
            claimed_by text,
            claimed_until timestamptz
        )""",
        "CREATE INDEX ON {s}.messages (group_id, seq)",
        "CREATE INDEX ON {s}.messages (claimed_by) WHERE claimed_by IS NOT NULL",
        """CREATE TABLE {s}.dead_letters (
            seq bigserial PRIMARY KEY,
            envelope_id text NOT NULL,
            dead_at double precision NOT NULL,
            entry bytea NOT NULL
        )""",
        "CREATE INDEX ON {s}.dead_letters (envelope_id)",
        """CREATE TABLE {s}.claims (
            key text PRIMARY KEY,
            owner text NOT NULL,
            until timestamptz NOT NULL
        )""",
    ),
    2: (
        """CREATE UNLOGGED TABLE {s}.rates (
            bucket text PRIMARY KEY,
            tat double precision NOT NULL,
            asked_at double precision NOT NULL,
            full_at double precision NOT NULL
        )""",
        """CREATE UNLOGGED TABLE {s}.slots (
            name text PRIMARY KEY,
            leases jsonb NOT NULL
        )""",
        """CREATE UNLOGGED TABLE {s}.heartbeats (
            instance text PRIMARY KEY,
            record bytea NOT NULL,
            seen timestamptz NOT NULL
        )""",
    ),
}


async def migrate(connection: Any, schema: str) -> None:
    """Make ``schema``'s tables, or bring them to :data:`SCHEMA_VERSION`, in one
    transaction under an advisory lock (two processes starting at once wait for each
    other instead of colliding).

    :raises ConfigurationError: when the schema was made by a newer asyncbus.
    """
    async with connection.transaction():
        await connection.execute(
            "SELECT pg_advisory_xact_lock(hashtext($1))", f"asyncbus schema {schema}"
        )
        await connection.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await connection.execute(
            f"CREATE TABLE IF NOT EXISTS {schema}.version (version integer NOT NULL)"
        )
        found = await connection.fetchval(f"SELECT max(version) FROM {schema}.version")
        current = 0 if found is None else int(found)
        if current > SCHEMA_VERSION:
            raise ConfigurationError(
                f"PostgreSQL schema {schema!r} is at version {current}, made by a newer "
                f"asyncbus; this one knows version {SCHEMA_VERSION}: upgrade asyncbus, "
                "or give this transport another schema"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            for statement in _STEPS[version]:
                await connection.execute(statement.format(s=schema))
            await connection.execute(f"INSERT INTO {schema}.version VALUES ($1)", version)


def pattern_regex(pattern: str) -> str:
    """``pattern`` (NATS syntax: ``*`` one token, ``>`` the rest) as an anchored
    PostgreSQL regular expression matching the topics it routes."""
    parts: list[str] = []
    for token in pattern.split("."):
        if token == "*":
            parts.append("[^.]+")
        elif token == ">":
            parts.append(".+")
        else:
            parts.append("".join(c if c.isalnum() or c == "_" else f"\\{c}" for c in token))
    return "^" + "\\.".join(parts) + "$"
