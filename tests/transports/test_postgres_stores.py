"""PostgresTransport's shared stores, where the broker table's tests do not reach: the
schema's migration that adds their tables, what the upkeep prunes, a turn timed once its
bucket's row is locked, and a server that does not answer.

(The rate limit, ``max_in_flight`` and deployment-view tests over every broker with the
feature run on PostgreSQL too.) Each test uses a schema of its own, dropped afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from _brokers import url_for  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import Envelope, TransportError
from asyncbus._dedup import Claim
from asyncbus.transports._pg_common import row_key
from asyncbus.transports._pg_schema import _STEPS, SCHEMA_VERSION
from asyncbus.transports.postgres import PostgresTransport

pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio", "uvloop"), pytest.mark.timeout(60)]

#: The tables version 2 added, all unlogged.
SHARED_TABLES = ["heartbeats", "rates", "slots"]


@pytest.fixture
def schema(postgres_schemas: Callable[[str], str]) -> str:
    """A schema name unique to the test, dropped (with its tables) afterwards."""
    return postgres_schemas("stores")


def _transport(dsn: str, schema: str, **options: Any) -> PostgresTransport:
    options.setdefault("poll_interval", 0.5)
    return PostgresTransport(dsn, schema=schema, **options)


async def _make_version_1(dsn: str, schema: str) -> None:
    """``schema`` as the previous asyncbus left it: version 1's tables, with a group, a
    message, a dead letter and a done claim in them."""
    import asyncpg

    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute(f"CREATE SCHEMA {schema}")
            await connection.execute(f"CREATE TABLE {schema}.version (version integer NOT NULL)")
            for statement in _STEPS[1]:
                await connection.execute(statement.format(s=schema))
            await connection.execute(f"INSERT INTO {schema}.version VALUES (1)")
            group = await connection.fetchval(
                f"INSERT INTO {schema}.groups (pattern, grp, regex) "
                "VALUES ('orders', 'g', '^orders$') RETURNING id"
            )
            transport = _transport(dsn, schema)  # (not connected: its SQL and codec only)
            await connection.fetch(
                transport.sql.publish_to_group,
                group,
                *transport._rows([Envelope(topic="orders", payload="kept", id="old-1")]),
            )
            await connection.execute(
                f"INSERT INTO {schema}.dead_letters (envelope_id, dead_at, entry) "
                "VALUES ('dead-1', 1700000000.0, '\\x7b7d')"
            )
            await connection.execute(
                f"INSERT INTO {schema}.claims (key, owner, until) "
                "VALUES ('done-1', '', now() + interval '1 hour')"
            )
    finally:
        await connection.close()


async def _layout(dsn: str, schema: str) -> tuple[list[int], dict[str, str]]:
    """The schema's version rows, and its tables with their persistence (``p``, ``u``)."""
    import asyncpg

    connection = await asyncpg.connect(dsn)
    try:
        versions = await connection.fetch(f"SELECT version FROM {schema}.version ORDER BY 1")
        tables = await connection.fetch(
            "SELECT c.relname, c.relpersistence::text FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relkind = 'r'",
            schema,
        )
    finally:
        await connection.close()
    return [row[0] for row in versions], {row[0]: row[1] for row in tables}


async def test_a_version_1_schema_gains_the_shared_stores_and_keeps_its_rows(
    postgres_dsn: str, schema: str
) -> None:
    assert SCHEMA_VERSION == 2
    await _make_version_1(postgres_dsn, schema)
    with anyio.fail_after(30):
        async with (
            _transport(postgres_dsn, schema) as transport,
            transport.subscribe("orders", group="g", prefetch=1) as deliveries,
        ):
            versions, tables = await _layout(postgres_dsn, schema)
            assert versions == [1, 2]
            assert tables == {
                "version": "p",
                "groups": "p",
                "consumers": "p",
                "messages": "p",
                "dead_letters": "p",
                "claims": "p",
                **dict.fromkeys(SHARED_TABLES, "u"),
            }
            delivery = await anext(deliveries)  # the row written under version 1
            assert (delivery.envelope.id, delivery.envelope.payload) == ("old-1", "kept")
            await delivery.ack()
            assert [
                row[0] for row in await transport.run("", "fetch", transport.sql.dead_letters)
            ] == [b"{}"]
            claims = transport.dedup_store(60)
            assert await claims.claim("done-1", "me", 30) == Claim.DONE
            # the new stores work on the migrated schema
            assert await transport.rate_store().take("b", 60.0, 1) == 0.0
            assert await transport.lease_store().acquire("s@g", 1, "h", 30.0)
            await transport.beat("i", b"{}")
            assert await transport.beats() == [b"{}"]


async def test_two_processes_migrating_at_once_add_version_2_once(
    postgres_dsn: str, schema: str
) -> None:
    await _make_version_1(postgres_dsn, schema)

    async def start_and_stop() -> None:
        async with _transport(postgres_dsn, schema):
            pass

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(start_and_stop)
            tasks.start_soon(start_and_stop)
    versions, tables = await _layout(postgres_dsn, schema)
    assert versions == [1, 2]
    assert {name: tables[name] for name in SHARED_TABLES} == dict.fromkeys(SHARED_TABLES, "u")


async def test_the_upkeep_prunes_full_buckets_run_out_slots_and_old_heartbeats(
    postgres_dsn: str, schema: str
) -> None:
    with anyio.fail_after(30):
        async with _transport(postgres_dsn, schema) as transport:
            rates, slots = transport.rate_store(), transport.lease_store()
            for bucket in ("idle", "owing"):
                assert await rates.take(bucket, 60.0, 1) == 0.0
            assert await slots.acquire("gone@g", 2, "dead", 60.0)
            assert await slots.acquire("held@g", 2, "dead", 60.0)
            assert await slots.acquire("held@g", 2, "alive", 60.0)
            await transport.beat("long-gone", b'"old"')
            await transport.beat("alive", b'"new"')
            # Time passes for some rows only: written as the database's clock would have.
            s = transport.schema
            await transport.run(
                "ageing",
                "execute",
                f"UPDATE {s}.rates SET full_at = full_at - 61 WHERE bucket = $1",
                row_key("idle"),
            )
            await transport.run(
                "ageing",
                "execute",
                f"UPDATE {s}.slots SET leases = jsonb_set(leases, '{{dead}}', '0')",
            )
            await transport.run(
                "ageing",
                "execute",
                f"UPDATE {s}.heartbeats SET seen = seen - interval '301 seconds' "
                "WHERE instance = 'long-gone'",
            )
            assert await transport.beats() == [b'"new"']  # read or not, it is not listed
            await transport.run("pruning", "execute", transport.sql.prune)

            async def keys(table: str, column: str) -> list[str]:
                rows = await transport.run("", "fetch", f"SELECT {column} FROM {s}.{table}")
                return sorted(row[0] for row in rows)

            assert await keys("rates", "bucket") == [row_key("owing")]
            assert await keys("slots", "name") == [row_key("held@g")]
            assert await keys("heartbeats", "instance") == ["alive"]
            # the run-out lease left a free slot; the owing bucket still owes
            assert await slots.acquire("held@g", 2, "next", 60.0)
            assert 59.0 < await rates.take("owing", 60.0, 1) <= 60.0


async def test_a_heartbeat_is_one_record_per_process_until_forgotten(
    postgres_dsn: str, schema: str
) -> None:
    with anyio.fail_after(30):
        async with (
            _transport(postgres_dsn, schema) as one,
            _transport(postgres_dsn, schema) as two,
        ):
            await one.beat("a", b"a1")
            await two.beat("b", b"b1")
            await one.beat("a", b"a2")
            assert await two.beats() == [b"a2", b"b1"]
            await two.forget("a")
            await two.forget("never")
            assert await one.beats() == [b"b1"]


async def test_a_bucket_whose_tat_is_infinite_counts_as_new(postgres_dsn: str, schema: str) -> None:
    async with _transport(postgres_dsn, schema) as transport:
        rates = transport.rate_store()
        assert await rates.take("b", 10.0, 1) == 0.0
        for garbled in ("Infinity", "-Infinity"):
            await transport.run(
                "garbling", "execute", f"UPDATE {transport.schema}.rates SET tat = '{garbled}'"
            )
            assert await rates.take("b", 10.0, 1) == 0.0
            assert 9.0 < await rates.take("b", 10.0, 1) <= 10.0


async def test_a_turn_waited_for_in_line_is_timed_when_taken(
    postgres_dsn: str, schema: str
) -> None:
    """The clock is read once the bucket's row is locked: a turn that stood in line
    behind another transaction is not given the time spent there twice."""
    import asyncpg

    async with _transport(postgres_dsn, schema) as transport:
        rates = transport.rate_store()
        assert await rates.take("b", 1.0, 1) == 0.0  # the next turn is due a second later
        first = anyio.current_time()
        admin = await asyncpg.connect(postgres_dsn)
        try:
            holding = admin.transaction()
            await holding.start()
            await admin.execute(
                f"SELECT 1 FROM {transport.schema}.rates WHERE bucket = $1 FOR UPDATE",
                row_key("b"),
            )
            waits: list[float] = []
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(lambda: _take_into(rates, waits))
                    while not await admin.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE wait_event_type = 'Lock' AND query LIKE $1",
                        f"%{transport.schema}.rates%",
                    ):
                        await anyio.sleep(0.01)
                    await anyio.sleep(0.5)  # the line: held deliberately
                    released = anyio.current_time()
                    await holding.commit()
        finally:
            await admin.close()
    [wait] = waits
    assert 0.0 < wait <= 1.0 - (released - first) + 0.05


async def _take_into(rates: Any, waits: list[float]) -> None:
    waits.append(await rates.take("b", 1.0, 1))


async def test_stores_on_a_server_gone_silent_raise_transport_error(
    postgres_url: str, schema: str
) -> None:
    with TcpProxy(5432) as proxy:
        async with _transport(url_for("postgres", proxy.port), schema, publish_timeout=0.5) as t:
            rates, slots = t.rate_store(), t.lease_store()
            calls = {
                "taking a turn of rate limit 'b'": lambda: rates.take("b", 1.0, 1),
                "taking a slot of 's@g'": lambda: slots.acquire("s@g", 1, "h", 15.0),
                "renewing slots of 's@g'": lambda: slots.renew("s@g", ["h"], 15.0),
                "giving back a slot of 's@g'": lambda: slots.release("s@g", "h"),
                "writing a heartbeat": lambda: t.beat("i", b"{}"),
                "reading the heartbeats": t.beats,
                "deleting a heartbeat": lambda: t.forget("i"),
            }
            proxy.blackhole()
            for doing, call in calls.items():
                started = anyio.current_time()
                with anyio.fail_after(10), pytest.raises(TransportError, match=doing):
                    await call()
                assert anyio.current_time() - started < 0.5 + 1.0
            proxy.forward()


async def test_stores_of_a_transport_not_connected_raise_transport_error(
    postgres_dsn: str, schema: str
) -> None:
    transport = _transport(postgres_dsn, schema)
    with pytest.raises(TransportError, match="not connected"):
        await transport.rate_store().take("b", 1.0, 1)
    with pytest.raises(TransportError, match="not connected"):
        await transport.lease_store().acquire("s@g", 1, "h", 15.0)
    with pytest.raises(TransportError, match="not connected"):
        await transport.beats()


async def test_limits_past_a_32_bit_integer_are_kept_in_the_database(
    postgres_dsn: str, schema: str
) -> None:
    """A burst or a slot limit over 2**31 - 1 is a bigint to the database, as Redis takes
    it (an int4 parameter refused it, and every call fell back to per-process limits)."""
    huge = 3_000_000_000
    async with _transport(postgres_dsn, schema) as transport:
        rates, slots = transport.rate_store(), transport.lease_store()
        assert [await rates.take("b", 1e-9, huge) for _ in range(3)] == [0.0, 0.0, 0.0]
        assert await slots.acquire("s@g", huge, "one", 30.0)
        assert await slots.acquire("s@g", huge, "two", 30.0)


async def test_a_refused_slot_request_leaves_the_row_unwritten(
    postgres_dsn: str, schema: str
) -> None:
    """Every slot held by others: asking again (each waiting envelope polls) writes no new
    row version; the holder renewing, or a free slot, still does."""
    async with _transport(postgres_dsn, schema) as transport:
        slots = transport.lease_store()
        assert await slots.acquire("s@g", 1, "one", 30.0)

        async def version() -> int:
            found = await transport.run(
                "reading", "fetchval", f"SELECT xmin::text::bigint FROM {transport.schema}.slots"
            )
            return int(found)

        before = await version()
        assert [await slots.acquire("s@g", 1, "two", 30.0) for _ in range(3)] == [False] * 3
        assert await version() == before
        assert await slots.acquire("s@g", 1, "one", 30.0)  # (its own: kept, renewed)
        assert await version() != before
        assert await slots.acquire("s@g", 2, "two", 30.0)  # (a second slot)
