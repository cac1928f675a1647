"""PostgresInbox: a handler's PostgreSQL writes and the envelope's claim commit together,
so an envelope delivered twice has its effects once, and a failed or cancelled handling
leaves neither its writes nor a claim."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import anyio
import asyncpg
import pytest

from asyncbus import (
    Batch,
    Bus,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    Handler,
    Retry,
    Skip,
    StageStatistics,
    middleware,
)
from asyncbus.transports.postgres import PostgresInbox, current_connection

pytestmark = pytest.mark.anyio


@pytest.fixture
async def schema(postgres_dsn: str, postgres_schemas: Callable[[str], str]) -> str:
    """A schema of this test's own, holding ``effects`` (what handlers write); dropped
    with everything in it afterwards."""
    name = postgres_schemas("inbox")
    connection = await asyncpg.connect(postgres_dsn)
    try:
        await connection.execute(
            f"CREATE SCHEMA {name}; CREATE TABLE {name}.effects "
            "(envelope_id text NOT NULL, attempt integer NOT NULL)"
        )
    finally:
        await connection.close()
    return name


async def rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    connection = await asyncpg.connect(dsn)
    try:
        return [tuple(row) for row in await connection.fetch(query)]
    finally:
        await connection.close()


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


def ledger(stats: StageStatistics) -> tuple[int, int, int, int, int, int]:
    return (
        stats.published,
        stats.acked,
        stats.failed,
        stats.retried,
        stats.dead_lettered,
        stats.abandoned,
    )


def writer(schema: str, calls: list[int]) -> Handler:
    """A handler writing one ``effects`` row through the inbox's connection."""

    async def write(envelope: Envelope) -> None:
        calls.append(envelope.attempt)
        await current_connection().execute(
            f"INSERT INTO {schema}.effects VALUES ($1, $2)", envelope.id, envelope.attempt
        )

    return write


@pytest.mark.timeout(30)
async def test_a_handled_envelope_writes_once_and_leaves_its_claim(
    postgres_dsn: str, schema: str
) -> None:
    calls: list[int] = []
    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe("orders", writer(schema, calls), group="g", middleware=[inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", {"n": 1}, id="a")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 1, 0, 0, 0, 0)
    assert calls == [1]
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == [("a", 1)]
    assert await rows(postgres_dsn, f"SELECT stage, envelope_id FROM {schema}.claims") == [
        ("orders@g", "a")
    ]
    assert await rows(postgres_dsn, f"SELECT version FROM {schema}.version") == [(1,)]


@pytest.mark.timeout(30)
async def test_the_same_id_twice_has_its_effect_once_and_the_copy_is_skipped(
    postgres_dsn: str, schema: str
) -> None:
    calls: list[int] = []
    outcomes: list[Any] = []

    @middleware
    async def record(envelope: Envelope, call_next: Handler) -> Any:
        result = await call_next(envelope)
        outcomes.append(result)
        return result

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe("orders", writer(schema, calls), group="g", middleware=[record, inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", {"n": 1}, id="x")
            await bus.publish("orders", {"n": 1}, id="x")
            await bus.drain()
            # A skip is acked, as deduplicate()'s duplicates are.
            assert ledger(stage_stats(bus, "orders@g")) == (2, 2, 0, 0, 0, 0)
    assert calls == [1]
    assert outcomes == [None, Skip()]
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == [("x", 1)]
    assert await rows(postgres_dsn, f"SELECT envelope_id FROM {schema}.claims") == [("x",)]


@pytest.mark.timeout(30)
async def test_a_copy_handled_at_the_same_time_waits_for_the_first_then_is_skipped(
    postgres_dsn: str, schema: str
) -> None:
    calls: list[int] = []
    started = anyio.Event()
    go_on = anyio.Event()

    async def slow(envelope: Envelope) -> None:
        calls.append(envelope.attempt)
        await current_connection().execute(
            f"INSERT INTO {schema}.effects VALUES ($1, $2)", envelope.id, envelope.attempt
        )
        started.set()
        await go_on.wait()

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe("orders", slow, group="g", concurrency=2, middleware=[inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="x")
            await bus.publish("orders", 1, id="x")
            await started.wait()
            # The copy's claim waits on the first's uncommitted row, inside PostgreSQL.
            assert stage_stats(bus, "orders@g").in_flight == 2
            go_on.set()
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (2, 2, 0, 0, 0, 0)
    assert calls == [1]
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == [("x", 1)]


@pytest.mark.timeout(30)
async def test_a_failed_first_attempt_is_rolled_back_and_the_retry_commits(
    postgres_dsn: str, schema: str
) -> None:
    calls: list[int] = []
    write = writer(schema, calls)

    async def fails_once(envelope: Envelope) -> None:
        await write(envelope)
        if envelope.attempt == 1:
            raise RuntimeError("first attempt fails after writing")

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe(
        "orders",
        fails_once,
        group="g",
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
        middleware=[inbox],
    )
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="r")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 1, 1, 1, 0, 0)
    assert calls == [1, 2]
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == [("r", 2)]
    assert await rows(postgres_dsn, f"SELECT envelope_id FROM {schema}.claims") == [("r",)]


@pytest.mark.timeout(30)
async def test_a_handler_that_always_fails_is_dead_lettered_with_no_row_and_no_claim(
    postgres_dsn: str, schema: str
) -> None:
    calls: list[int] = []
    write = writer(schema, calls)

    async def always_fails(envelope: Envelope) -> None:
        await write(envelope)
        raise RuntimeError("never works")

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe(
        "orders",
        always_fails,
        group="g",
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
        middleware=[inbox],
    )
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="d")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 0, 2, 1, 1, 0)
            (dead,) = bus.dead_letters.list()
            assert (dead.envelope.id, dead.reason, dead.error, dead.attempts) == (
                "d",
                DeadLetterReason.HANDLER_FAILED,
                "RuntimeError: never works",
                2,
            )
    assert calls == [1, 2]
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == []
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.claims") == []


@pytest.mark.timeout(30)
async def test_a_handler_that_swallows_a_failed_statement_fails_instead_of_losing_its_writes(
    postgres_dsn: str, schema: str
) -> None:
    async def swallows(envelope: Envelope) -> None:
        connection = current_connection()
        await connection.execute(f"INSERT INTO {schema}.effects VALUES ($1, 1)", envelope.id)
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            # Caught: the transaction is aborted now, and COMMIT would roll back in silence.
            await connection.execute("SELECT 1 / 0")

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe("orders", swallows, group="g", middleware=[inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="s")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 0, 1, 0, 1, 0)
            (dead,) = bus.dead_letters.list()
            assert dead.reason is DeadLetterReason.HANDLER_FAILED
            assert dead.error is not None
            assert dead.error.startswith("TransportError: PostgresInbox: could not commit")
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == []
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.claims") == []


@pytest.mark.timeout(30)
async def test_a_handler_cancelled_by_the_bus_stopping_leaves_no_row_and_no_claim(
    postgres_dsn: str, schema: str
) -> None:
    written = anyio.Event()

    async def hangs(envelope: Envelope) -> None:
        await current_connection().execute(
            f"INSERT INTO {schema}.effects VALUES ($1, $2)", envelope.id, envelope.attempt
        )
        written.set()
        await anyio.sleep_forever()

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe("orders", hangs, group="g", middleware=[inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="c")
            await written.wait()
            report = await bus.aclose(timeout=0)
    assert (report.drained, report.published, report.completed, report.abandoned) == (
        False,
        1,
        0,
        ["c"],
    )
    assert ledger(stage_stats(bus, "orders@g")) == (1, 0, 0, 0, 0, 1)
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.effects") == []
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.claims") == []


@pytest.mark.timeout(30)
async def test_a_handler_timed_out_in_a_slow_query_leaves_no_row_and_no_claim(
    postgres_dsn: str, schema: str
) -> None:
    async def maybe_slow(envelope: Envelope) -> None:
        connection = current_connection()
        await connection.execute(f"INSERT INTO {schema}.effects VALUES ($1, 1)", envelope.id)
        if envelope.payload == "slow":
            await connection.execute("SELECT pg_sleep(20)")

    bus = Bus()
    # One connection: the next envelope gets the one the timed-out query was cancelled on.
    inbox = PostgresInbox(postgres_dsn, schema=schema, pool_size=1)
    bus.subscribe("orders", maybe_slow, group="g", timeout=0.5, middleware=[inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", "slow", id="q1")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 0, 1, 0, 1, 0)
            (dead,) = bus.dead_letters.list()
            assert dead.reason is DeadLetterReason.TIMEOUT
            await bus.publish("orders", "fast", id="q2")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (2, 1, 1, 0, 1, 0)
    assert await rows(postgres_dsn, f"SELECT envelope_id FROM {schema}.effects") == [("q2",)]
    assert await rows(postgres_dsn, f"SELECT envelope_id FROM {schema}.claims") == [("q2",)]


@pytest.mark.timeout(30)
async def test_an_unreachable_database_fails_the_envelope_without_running_the_handler() -> None:
    calls: list[int] = []

    async def handler(envelope: Envelope) -> None:
        calls.append(envelope.attempt)

    bus = Bus()
    inbox = PostgresInbox("postgresql://postgres@127.0.0.1:1/test", schema="nowhere")
    bus.subscribe(
        "orders",
        handler,
        group="g",
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
        middleware=[inbox],
    )
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="u")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 0, 2, 1, 1, 0)
            (dead,) = bus.dead_letters.list()
            assert dead.reason is DeadLetterReason.HANDLER_FAILED
            assert dead.error is not None
            assert dead.error.startswith("ConnectError: PostgresInbox: cannot connect to ")
    assert calls == []


@pytest.mark.timeout(30)
async def test_a_sync_handler_on_a_thread_cannot_take_the_connection(
    postgres_dsn: str, schema: str
) -> None:
    def sync_handler(payload: Any) -> None:
        current_connection()

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe("orders", sync_handler, group="g", middleware=[inbox])
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="t")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (1, 0, 1, 0, 1, 0)
            (dead,) = bus.dead_letters.list()
            assert dead.error is not None
            assert "called from a worker thread" in dead.error
    assert await rows(postgres_dsn, f"SELECT * FROM {schema}.claims") == []


@pytest.mark.timeout(30)
async def test_a_batch_subscription_is_refused_per_envelope(postgres_dsn: str, schema: str) -> None:
    calls: list[list[Any]] = []

    async def batch_handler(payloads: list[Any]) -> None:
        calls.append(payloads)

    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    bus.subscribe(
        "orders", batch_handler, group="g", batch=Batch(max_size=2, max_wait=0), middleware=[inbox]
    )
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("orders", 1, id="b1")
            await bus.publish("orders", 2, id="b2")
            await bus.drain()
            assert ledger(stage_stats(bus, "orders@g")) == (2, 0, 2, 0, 2, 0)
            errors = {dead.error for dead in bus.dead_letters.list()}
    assert calls == []
    assert len(errors) == 1
    (error,) = errors
    assert error is not None
    assert error.startswith("ConfigurationError: PostgresInbox: a batch subscription")


@pytest.mark.timeout(30)
async def test_the_pool_opened_for_a_bus_closes_with_it_and_opens_again_for_the_next(
    postgres_dsn: str, schema: str
) -> None:
    calls: list[int] = []
    inbox = PostgresInbox(postgres_dsn, schema=schema)
    with anyio.fail_after(20):
        for number in (1, 2):
            bus = Bus()
            bus.subscribe("orders", writer(schema, calls), group="g", middleware=[inbox])
            async with bus:
                await bus.publish("orders", number, id=f"p{number}")
                await bus.drain()
            assert inbox._pool is None  # closed as the bus stopped
    assert calls == [1, 1]
    assert await rows(postgres_dsn, f"SELECT envelope_id FROM {schema}.effects ORDER BY 1") == [
        ("p1",),
        ("p2",),
    ]


@pytest.mark.timeout(10)
async def test_current_connection_outside_a_handler_raises() -> None:
    with pytest.raises(RuntimeError, match="outside a handler run by a PostgresInbox"):
        current_connection()


@pytest.mark.timeout(30)
async def test_tables_of_a_newer_version_are_refused(postgres_dsn: str, schema: str) -> None:
    async with PostgresInbox(postgres_dsn, schema=schema):
        pass
    connection = await asyncpg.connect(postgres_dsn)
    try:
        await connection.execute(f"UPDATE {schema}.version SET version = 99")
    finally:
        await connection.close()
    with pytest.raises(ConfigurationError, match="version 99, newer than this asyncbus"):
        async with PostgresInbox(postgres_dsn, schema=schema):
            pass


@pytest.mark.timeout(30)
async def test_claims_older_than_the_window_are_deleted(postgres_dsn: str, schema: str) -> None:
    calls: list[int] = []
    bus = Bus()
    inbox = PostgresInbox(postgres_dsn, schema=schema, window=3600)
    bus.subscribe("orders", writer(schema, calls), group="g", middleware=[inbox])
    with anyio.fail_after(20):
        async with inbox:
            connection = await asyncpg.connect(postgres_dsn)
            try:
                await connection.execute(
                    f"INSERT INTO {schema}.claims SELECT 'orders@g', 'old-' || n, "
                    f"now() - interval '2 hours' FROM generate_series(1, 2500) AS n"
                )
            finally:
                await connection.close()
            async with bus:
                await bus.publish("orders", 1, id="new")
                await bus.drain()
            # The purge a handled envelope starts runs beside the work; run one here to
            # see what it deletes.
            await inbox._purge(inbox._pool)
    assert await rows(postgres_dsn, f"SELECT envelope_id FROM {schema}.claims") == [("new",)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"dsn": 5}, "dsn must be a string"),
        ({"dsn": "redis://127.0.0.1:6379"}, "PostgresInbox"),
        ({"schema": "Bad-Name"}, "schema must be lower-case"),
        ({"schema": 3}, "schema must be lower-case"),
        ({"window": 0}, "window must be a finite number of seconds > 0"),
        ({"window": -5}, "window must be a finite number of seconds > 0"),
        ({"window": math.nan}, "window must be a finite number of seconds > 0"),
        ({"window": math.inf}, "window must be a finite number of seconds > 0"),
        ({"window": True}, "window must be a finite number of seconds > 0"),
        ({"window": "60"}, "window must be a finite number of seconds > 0"),
        ({"pool_size": 0}, "pool_size must be an int >= 1"),
        ({"pool_size": -1}, "pool_size must be an int >= 1"),
        ({"pool_size": True}, "pool_size must be an int >= 1"),
        ({"pool_size": 2.0}, "pool_size must be an int >= 1"),
    ],
)
async def test_bad_arguments_are_configuration_errors(
    arguments: dict[str, Any], message: str
) -> None:
    given = {"dsn": "postgresql://postgres@127.0.0.1:5432/test", **arguments}
    dsn = given.pop("dsn")
    with pytest.raises(ConfigurationError, match=message):
        PostgresInbox(dsn, **given)
