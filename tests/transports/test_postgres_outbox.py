"""The transactional outbox: ``publish(connection=)`` on ``Bus(outbox=PostgresOutbox(dsn))``.

A publish made in the caller's transaction is forwarded by the bus's relay once that
transaction commits, and never when it rolls back; in order, at least once (a relay
stopped between its send and its delete sends again, with the same id), one relay at a
time among the buses sharing the outbox's schema. Run over the in-memory transport and
over Redis, against the local PostgreSQL server; each test has a schema of its own,
dropped afterwards.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import pytest
from _in_transaction import WAIT, Seen, until

from asyncbus import (
    Bus,
    BusClosedError,
    ConfigurationError,
    ConnectError,
    EncodeError,
    Envelope,
    middleware,
)
from asyncbus.middleware import deduplicate
from asyncbus.transports.postgres import PostgresOutbox
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def schema(postgres_schemas: Callable[[str], str]) -> str:
    """A schema name unique to the test; the schema is dropped after it."""
    return postgres_schemas("outbox")


@pytest.fixture
async def database(postgres_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The test's own connection, the one it publishes through."""
    connection = await asyncpg.connect(postgres_dsn)
    try:
        yield connection
    finally:
        with anyio.CancelScope(shield=True):
            await connection.close()


@pytest.fixture(params=["memory", "redis"])
def make_bus(
    request: pytest.FixtureRequest, postgres_dsn: str, schema: str
) -> Callable[..., tuple[Bus, PostgresOutbox]]:
    """``make_bus(middleware=(), **outbox_options)``: a bus with an outbox in the
    test's schema, over the in-memory transport or Redis (under a prefix of the test's,
    deleted after)."""
    prefix = request.getfixturevalue("redis_prefix") if request.param == "redis" else None

    def make(*, middleware: Any = (), **options: Any) -> tuple[Bus, PostgresOutbox]:
        outbox = PostgresOutbox(postgres_dsn, schema=schema, **options)
        transport = None
        if prefix is not None:
            transport = RedisTransport(request.getfixturevalue("redis_url"), prefix=prefix)
        return Bus(transport, middleware=middleware, outbox=outbox), outbox

    return make


@pytest.fixture
def memory_bus(postgres_dsn: str, schema: str) -> tuple[Bus, PostgresOutbox]:
    """An in-memory bus with an outbox in the test's schema."""
    outbox = PostgresOutbox(postgres_dsn, schema=schema)
    return Bus(outbox=outbox), outbox


async def forwarded(outbox: PostgresOutbox) -> None:
    """Wait until the relay has forwarded and deleted every committed row."""

    async def empty() -> bool:
        return await outbox.pending() == 0

    await until(empty)


async def rows(connection: asyncpg.Connection, schema: str) -> list[tuple[int, str | None]]:
    """Every row of the outbox table: (id, dead)."""
    found = await connection.fetch(f"SELECT id, dead FROM {schema}.outbox ORDER BY id")
    return [(row["id"], row["dead"]) for row in found]


async def test_a_committed_publish_is_delivered_once(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]], database: asyncpg.Connection
) -> None:
    bus, outbox = make_bus()
    seen = Seen()

    @bus.subscribe("orders.created", group="audit")
    async def audit(envelope: Envelope) -> None:
        seen.add((envelope.id, envelope.payload))

    async with bus:
        async with database.transaction():
            await database.execute("SELECT 1")  # (the caller's own writes go here)
            receipt = await bus.publish("orders.created", {"id": 1}, connection=database)
        assert (receipt.accepted, receipt.rejected, receipt.dropped) == ((), (), ())
        assert receipt
        await seen.reach(1)
        await forwarded(outbox)
        await bus.drain()
        assert seen.items == [(receipt.id, {"id": 1})]
    assert await outbox.pending() == 0


async def test_a_rolled_back_publish_is_never_delivered(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]], database: asyncpg.Connection
) -> None:
    bus, outbox = make_bus()
    seen = Seen()

    @bus.subscribe("orders.created", group="audit")
    async def audit(n: int) -> None:
        seen.add(n)

    class Abort(Exception):
        pass

    async with bus:
        with pytest.raises(Abort):
            async with database.transaction():
                await bus.publish("orders.created", 1, connection=database)
                raise Abort
        assert await outbox.pending() == 0
        async with database.transaction():  # a later commit: forwarded, the first never
            await bus.publish("orders.created", 2, connection=database)
        await seen.reach(1)
        await forwarded(outbox)
        await bus.drain()
        assert seen.items == [2]
    assert await outbox.pending() == 0


async def test_publish_many_in_a_transaction_keeps_its_order(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]], database: asyncpg.Connection
) -> None:
    bus, outbox = make_bus(batch_size=7)  # (several batches)
    seen = Seen()

    @bus.subscribe("ticks", group="counter")
    async def count(n: int) -> None:
        seen.add(n)

    async with bus:
        async with database.transaction():
            receipts = await bus.publish_many("ticks", range(20), connection=database)
        async with database.transaction():
            await bus.publish("ticks", 20, connection=database)
            more = await bus.publish_many("ticks", [21, 22, 23], connection=database)
        assert len({receipt.id for receipt in [*receipts, *more]}) == 23
        assert [receipt.accepted for receipt in receipts] == [()] * 20
        await seen.reach(24)
        await forwarded(outbox)
        await bus.drain()
        assert seen.items == list(range(24))


async def test_two_relays_sharing_the_schema_forward_each_row_once_in_order(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]],
    database: asyncpg.Connection,
    request: pytest.FixtureRequest,
) -> None:
    first, first_outbox = make_bus(batch_size=3)
    second, _ = make_bus(batch_size=3)
    over_redis = request.node.callspec.params["make_bus"] == "redis"
    seen = Seen()
    by_bus: dict[str, list[int]] = {"first": [], "second": []}

    def subscribe(bus: Bus, label: str) -> None:
        async def record(n: int) -> None:
            by_bus[label].append(n)
            seen.add(n)

        bus.subscribe("ticks", record, group="counter")

    subscribe(first, "first")
    if not over_redis:
        subscribe(second, "second")  # (in memory a bus delivers what its own relay sends)

    async with first, second:
        async with database.transaction():
            await first.publish_many("ticks", range(30), connection=database)
        await seen.reach(30)
        await forwarded(first_outbox)
        await first.drain()
        await second.drain()
    if over_redis:
        # One group, one consumer: the stream's order is the rows' order.
        assert (by_bus["first"], by_bus["second"]) == (list(range(30)), [])
    else:
        assert sorted(seen.items) == list(range(30))  # each row once
        for label in ("first", "second"):  # each relay's batches in order
            assert by_bus[label] == sorted(by_bus[label])


async def test_a_relay_whose_bus_stops_leaves_the_rest_to_another_in_order(
    postgres_dsn: str, database: asyncpg.Connection, schema: str
) -> None:
    """The first bus's relay is held mid-batch (its stage full, its handler waiting),
    then its bus closes: what it sent is deleted, the rest goes out through the other."""
    first_outbox = PostgresOutbox(postgres_dsn, schema=schema, batch_size=5)
    second_outbox = PostgresOutbox(postgres_dsn, schema=schema, batch_size=5, poll_interval=0.1)
    first, second = Bus(outbox=first_outbox), Bus(outbox=second_outbox)
    got: dict[str, list[int]] = {"first": [], "second": []}
    holding, gate, seen = anyio.Event(), anyio.Event(), Seen()
    reports = []

    @first.subscribe("ticks", group="counter", capacity=1)
    async def held(n: int) -> None:
        got["first"].append(n)
        holding.set()
        await gate.wait()

    @second.subscribe("ticks", group="counter")
    async def counted(n: int) -> None:
        got["second"].append(n)
        seen.add(n)

    async def close_first() -> None:
        reports.append(await first.aclose())

    async def first_is_closing() -> bool:
        return not first.running

    async with first:
        async with database.transaction():
            await first.publish_many("ticks", range(30), connection=database)
        with anyio.fail_after(WAIT):
            await holding.wait()
        async with second:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(close_first)
                await until(first_is_closing)
                gate.set()
            await seen.reach(30 - len(got["first"]))
            await forwarded(second_outbox)
            await second.drain()
    (report,) = reports
    assert report.drained and report.abandoned == []
    assert got["first"] + got["second"] == list(range(30))
    assert (got["first"][0], got["second"][-1]) == (0, 29)


async def test_a_relay_stopped_between_send_and_delete_sends_again_with_the_same_id(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]],
    database: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    arrivals: list[str] = []

    @middleware
    async def arrived(envelope: Envelope, call_next: Any) -> Any:
        arrivals.append(envelope.id)
        return await call_next(envelope)

    bus, outbox = make_bus(middleware=[arrived])
    seen = Seen()
    marks: list[list[int]] = []
    mark_sent = outbox._mark_sent

    async def failing_once(connection: Any, ids: list[int]) -> None:
        marks.append(list(ids))
        if len(marks) == 1:
            raise ConnectionResetError("the relay's connection dropped before its delete")
        await mark_sent(connection, ids)

    outbox._mark_sent = failing_once  # type: ignore[method-assign]

    @bus.subscribe("orders.created", group="audit", middleware=[deduplicate()])
    async def audit(envelope: Envelope) -> None:
        seen.add(envelope.id)

    async with bus:
        async with database.transaction():
            receipt = await bus.publish("orders.created", {"id": 1}, connection=database)
        await seen.reach(1)
        await forwarded(outbox)
        await bus.drain()
        (stage,) = bus.statistics().stages
        assert (stage.published, stage.acked) == (2, 2)
    assert arrivals == [receipt.id, receipt.id]
    assert seen.items == [receipt.id]
    assert len(marks) == 2 and marks[0] == marks[1]
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncbus.outbox"]
    assert len(logged) == 1 and "the relay tries again" in logged[0], logged


async def test_a_garbage_row_is_set_aside_and_the_relay_goes_on(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]],
    database: asyncpg.Connection,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus, outbox = make_bus()
    seen = Seen()

    @bus.subscribe("orders.created", group="audit")
    async def audit(n: int) -> None:
        seen.add(n)

    async with bus:
        async with database.transaction():
            await database.execute(
                f"INSERT INTO {schema}.outbox (meta, body) VALUES ($1, $2), ($3, $4)",
                b"\xffnot json",
                b"1",
                b'{"id":"x1","topic":"orders.created","timestamp":1.0,"attempt":1}',
                b"\xff{not a payload",
            )
            await bus.publish("orders.created", 1, connection=database)
        await seen.reach(1)
        await forwarded(outbox)
        await bus.drain()
        assert seen.items == [1]
        kept = await rows(database, schema)
    assert [dead is not None for _, dead in kept] == [True, True]
    assert kept[0][1].startswith("undecodable fields")  # type: ignore[union-attr]
    assert kept[1][1].startswith("undecodable payload")  # type: ignore[union-attr]
    errors = [r for r in caplog.records if r.name == "asyncbus.outbox" and r.levelname == "ERROR"]
    assert len(errors) == 2


async def test_the_relay_reconnects_and_a_lost_notification_is_made_up_by_the_poll(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]],
    database: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus, outbox = make_bus(poll_interval=0.2)
    seen = Seen()

    @bus.subscribe("orders.created", group="audit")
    async def audit(n: int) -> None:
        seen.add(n)

    async with bus:
        relay_pid = outbox._connection.get_server_pid()
        assert await database.fetchval("SELECT pg_terminate_backend($1)", relay_pid) is True
        async with database.transaction():  # (its notification finds no relay listening)
            await bus.publish("orders.created", 1, connection=database)
        await seen.reach(1)
        await forwarded(outbox)
        await bus.drain()
        assert seen.items == [1]
        assert outbox._connection.get_server_pid() != relay_pid
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncbus.outbox"]
    assert len(logged) == 1 and "the database failed" in logged[0], logged


def counted(bus: Bus, count: int) -> Callable[[], Awaitable[bool]]:
    """Whether the bus's statistics count ``count`` envelopes waiting in its outbox."""

    async def check() -> bool:
        return bus.statistics().outbox_pending == count

    return check


async def test_statistics_count_what_waits_in_the_outbox_while_another_relay_holds_it(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]],
    database: asyncpg.Connection,
    postgres_dsn: str,
    schema: str,
) -> None:
    """The schema's relay lock is held by someone else (another replica's relay, busy):
    the bus's relay forwards nothing but counts what waits, at its start and every
    poll_interval; once the lock is free it forwards, taking what it sent off the count
    at once (the second bus's next count is half a minute away)."""
    first, first_outbox = make_bus(poll_interval=0.1)
    second, second_outbox = make_bus(poll_interval=30.0)
    seen = Seen()

    @second.subscribe("orders.created", group="audit")
    async def audit(n: int) -> None:
        seen.add(n)

    assert Bus().statistics().outbox_pending is None  # (no outbox)
    assert first.statistics().outbox_pending is None  # (not counted before its start)
    holder = await asyncpg.connect(postgres_dsn)
    try:
        assert await holder.fetchval(first_outbox._sql.relay_lock, schema) is True
        async with first:
            assert first.statistics().outbox_pending == 0
            async with database.transaction():
                await first.publish_many("orders.created", [1, 2], connection=database)
            async with database.transaction():
                await first.publish("orders.created", 3, connection=database)
            await until(counted(first, 3))
            await anyio.sleep(0.3)  # (three counts later, nothing forwarded)
            assert first.statistics().outbox_pending == 3
            assert await first_outbox.pending() == 3
        assert first.statistics().outbox_pending == 3  # (what it last knew)
        async with second:
            assert second.statistics().outbox_pending == 3  # (counted at the start)
            await holder.fetchval(first_outbox._sql.relay_unlock, schema)
            await database.execute("SELECT pg_notify($1, '')", second_outbox._channel)  # (a wake)
            await seen.reach(3)
            await until(counted(second, 0))
            await forwarded(second_outbox)
            await second.drain()
            assert second.statistics().outbox_pending == 0
    finally:
        with anyio.CancelScope(shield=True):
            await holder.close()
    assert seen.items == [1, 2, 3]


async def test_a_payload_the_codec_refuses_is_an_encode_error_and_nothing_is_written(
    memory_bus: tuple[Bus, PostgresOutbox], database: asyncpg.Connection, schema: str
) -> None:
    bus, _ = memory_bus
    async with bus:
        async with database.transaction():
            with pytest.raises(EncodeError):
                await bus.publish("orders.created", object(), connection=database)
        assert await rows(database, schema) == []


async def test_a_connection_outside_a_transaction_is_refused_and_nothing_is_written(
    memory_bus: tuple[Bus, PostgresOutbox], database: asyncpg.Connection, schema: str
) -> None:
    bus, outbox = memory_bus
    async with bus:
        with pytest.raises(ConfigurationError, match="inside a transaction"):
            await bus.publish("orders.created", 1, connection=database)
        with pytest.raises(ConfigurationError, match="inside a transaction"):
            await bus.publish_many("orders.created", [1, 2], connection=database)
        assert await rows(database, schema) == []
        assert await outbox.pending() == 0


async def test_an_object_that_is_no_asyncpg_connection_is_refused(
    memory_bus: tuple[Bus, PostgresOutbox], database: asyncpg.Connection, schema: str
) -> None:
    bus, _ = memory_bus
    async with bus:
        with pytest.raises(ConfigurationError, match="takes an asyncpg connection"):
            await bus.publish("orders.created", 1, connection=object())
        assert await rows(database, schema) == []


async def test_connection_on_a_bus_that_cannot_write_in_a_transaction_is_refused() -> None:
    async with Bus() as bus:
        with pytest.raises(ConfigurationError, match=r"outbox=PostgresOutbox\(dsn\)"):
            await bus.publish("orders.created", 1, connection=object())
        with pytest.raises(ConfigurationError, match="PostgresTransport"):
            await bus.publish_many("orders.created", [1], connection=object())


async def test_connection_with_delay_or_at_is_refused(
    memory_bus: tuple[Bus, PostgresOutbox], database: asyncpg.Connection, schema: str
) -> None:
    bus, _ = memory_bus
    async with bus:
        async with database.transaction():
            with pytest.raises(ConfigurationError, match="delay= or at="):
                await bus.publish("t", 1, connection=database, delay=5.0)
            with pytest.raises(ConfigurationError, match="delay= or at="):
                await bus.publish_many("t", [1], connection=database, delay=5.0)
        assert await rows(database, schema) == []


async def test_a_closed_bus_refuses_a_publish_with_a_connection(
    memory_bus: tuple[Bus, PostgresOutbox], database: asyncpg.Connection
) -> None:
    bus, _ = memory_bus
    async with database.transaction():
        with pytest.raises(BusClosedError):
            await bus.publish("t", 1, connection=database)
    async with bus:
        pass
    async with database.transaction():
        with pytest.raises(BusClosedError):
            await bus.publish("t", 1, connection=database)


async def test_tables_of_a_newer_version_stop_the_start(
    postgres_dsn: str, database: asyncpg.Connection, schema: str
) -> None:
    async with Bus(outbox=PostgresOutbox(postgres_dsn, schema=schema)):
        pass  # (makes the tables at version 1)
    await database.execute(f"INSERT INTO {schema}.version (version) VALUES (99)")
    with pytest.raises(ConfigurationError, match="version 99"):
        async with Bus(outbox=PostgresOutbox(postgres_dsn, schema=schema)):
            pass


async def test_a_database_that_cannot_be_reached_fails_the_start() -> None:
    bus = Bus(outbox=PostgresOutbox("postgresql://postgres@127.0.0.1:1/test"))
    with anyio.fail_after(WAIT), pytest.raises(ConnectError, match="cannot connect"):
        async with bus:
            pass
    assert not bus.running


async def test_a_connection_that_breaks_while_the_outbox_opens_fails_the_start_clearly(
    postgres_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server ends the outbox's connection right after its tables are made: the first
    # count of its rows finds it gone.
    make_tables = PostgresOutbox._make_tables

    async def make_tables_then_lose_the_connection(self: PostgresOutbox, connection: Any) -> None:
        await make_tables(self, connection)
        other = await asyncpg.connect(postgres_dsn)
        try:
            await other.execute("SELECT pg_terminate_backend($1)", connection.get_server_pid())
        finally:
            await other.close()

    monkeypatch.setattr(PostgresOutbox, "_make_tables", make_tables_then_lose_the_connection)
    bus = Bus(outbox=PostgresOutbox(postgres_dsn, schema=schema))
    with anyio.fail_after(WAIT), pytest.raises(ConnectError, match="broke while opening"):
        async with bus:
            pass
    assert not bus.running


async def test_two_buses_starting_together_make_the_tables_once(
    postgres_dsn: str, database: asyncpg.Connection, schema: str
) -> None:
    buses = [Bus(outbox=PostgresOutbox(postgres_dsn, schema=schema)) for _ in range(3)]
    async with anyio.create_task_group() as tasks:
        for bus in buses:

            async def run(bus: Bus = bus) -> None:
                async with bus:
                    pass

            tasks.start_soon(run)
    assert await database.fetchval(f"SELECT count(*) FROM {schema}.version") == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dsn": 5}, "dsn must be a string"),
        ({"dsn": "redis://127.0.0.1:6379"}, "postgresql"),
        ({"schema": "Bad-Name"}, "schema must be"),
        ({"schema": ""}, "schema must be"),
        ({"poll_interval": math.nan}, "poll_interval"),
        ({"poll_interval": -1.0}, "poll_interval"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": True}, "poll_interval"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"batch_size": 10_001}, "batch_size"),
    ],
)
def test_bad_outbox_arguments_are_configuration_errors(
    options: dict[str, Any], message: str
) -> None:
    arguments: dict[str, Any] = {"dsn": "postgresql://postgres@127.0.0.1:5432/test", **options}
    dsn = arguments.pop("dsn")
    with pytest.raises(ConfigurationError, match=message):
        PostgresOutbox(dsn, **arguments)


def test_an_outbox_belongs_to_one_bus_and_an_outbox_must_be_one() -> None:
    outbox = PostgresOutbox("postgresql://postgres@127.0.0.1:5432/test")
    Bus(outbox=outbox)
    with pytest.raises(ConfigurationError, match="belongs to a bus already"):
        Bus(outbox=outbox)
    with pytest.raises(ConfigurationError, match="outbox must be"):
        Bus(outbox=object())


async def test_a_count_that_fails_never_keeps_the_relay_from_forwarding(
    make_bus: Callable[..., tuple[Bus, PostgresOutbox]],
    database: asyncpg.Connection,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Counting the waiting rows fails every time (as a count of a huge backlog past the
    statement timeout would): the bus starts, the relay forwards every row, and the
    count stays unknown, each failure logged."""
    bus, outbox = make_bus(poll_interval=0.05)
    outbox._sql.pending = "SELECT 1 / 0"  # (every count fails in the database)
    seen = Seen()

    @bus.subscribe("orders.created", group="audit")
    async def audit(n: int) -> None:
        seen.add(n)

    async with bus:
        for n in range(3):
            async with database.transaction():
                await bus.publish("orders.created", n, connection=database)
        await seen.reach(3)

        async def emptied() -> bool:
            return await rows(database, schema) == []

        await until(emptied)  # (every row forwarded and deleted)
        await bus.drain()
        assert bus.statistics().outbox_pending is None  # (never counted)
    assert sorted(seen.items) == [0, 1, 2]
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncbus.outbox"]
    assert logged and all("counting the waiting rows failed" in m for m in logged), logged


async def test_a_relay_whose_transport_refuses_lets_another_relay_forward_in_order(
    postgres_dsn: str, database: asyncpg.Connection, schema: str
) -> None:
    """The relay holding the schema's lock cannot send (its transport refuses every
    envelope): it lets go of the lock after the failure, and the other bus's relay takes
    it and forwards every row, in order, while the first bus still runs."""
    refused: list[str] = []

    class Refusing(PostgresOutbox):
        async def relay(self, forward: Any, running: Callable[[], bool]) -> None:
            async def refuse(envelope: Envelope) -> None:
                refused.append(envelope.id)
                raise ConnectionError("the transport is down")

            await super().relay(refuse, running)

    first = Bus(outbox=Refusing(postgres_dsn, schema=schema, poll_interval=0.05))
    second_outbox = PostgresOutbox(postgres_dsn, schema=schema, poll_interval=0.05)
    second = Bus(outbox=second_outbox)
    seen = Seen()

    @second.subscribe("ticks", group="counter")
    async def counted(n: int) -> None:
        seen.add(n)

    async def refused_once() -> bool:
        return bool(refused)

    async with first:
        async with database.transaction():
            await first.publish_many("ticks", range(10), connection=database)
        await until(refused_once)  # (the first relay held the lock, and failed)
        async with second:
            await seen.reach(10)
            await forwarded(second_outbox)
            await second.drain()
    assert seen.items == list(range(10))
    assert len(set(refused)) == 1  # (each attempt of the first relay was the first row)
