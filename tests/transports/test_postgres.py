"""PostgresTransport against the local PostgreSQL (127.0.0.1:5432, database ``test``):
the conformance suite and what only it does (schema versions, publishing in the
caller's transaction, notifications missed).

asyncpg runs on asyncio only: plain and with uvloop, never on trio. Each test uses a
schema of its own, dropped afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from _brokers import url_for  # type: ignore[import-not-found]
from _private_brokers import free_port  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import (
    Bus,
    ConfigurationError,
    ConnectError,
    DeadLetterReason,
    Envelope,
    Retry,
    TransportError,
)
from asyncbus._dedup import Claim
from asyncbus.testing.transport_suite import QUIET, TransportSuite
from asyncbus.transports import Transport
from asyncbus.transports._codec import envelope_to_wire
from asyncbus.transports._kit.routes import INBOX_GROUP_PREFIX
from asyncbus.transports.base import SubscriptionControl
from asyncbus.transports.postgres import PostgresTransport

pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio", "uvloop"), pytest.mark.timeout(60)]

#: ack_timeout of the transports under test: short, so redelivery tests are quick.
ACK_TIMEOUT = 2.0


@pytest.fixture
def schema(postgres_schemas: Callable[[str], str]) -> str:
    """A schema name unique to the test, dropped (with its tables) afterwards."""
    return postgres_schemas("bus")


class TestPostgres(TransportSuite):
    """PostgresTransport passes the conformance suite."""

    ack_timeout = ACK_TIMEOUT

    @pytest.fixture
    async def transport(self, postgres_dsn: str, schema: str) -> AsyncIterator[Transport]:
        """An entered PostgresTransport with a schema unique to the test."""
        async with PostgresTransport(
            postgres_dsn, schema=schema, ack_timeout=self.ack_timeout, poll_interval=0.5
        ) as transport:
            yield transport

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        """A row whose meta is the transport's own and whose body is ``body``."""
        assert isinstance(transport, PostgresTransport)
        envelope = Envelope(topic=topic)
        meta, _ = envelope_to_wire(envelope, transport.codec)
        await transport.run(
            "publishing raw",
            "fetch",
            transport.sql.publish,
            topic,
            [envelope.id],
            [meta],
            [body],
            [1],
        )


def _transport(dsn: str, schema: str, **options: Any) -> PostgresTransport:
    options.setdefault("ack_timeout", ACK_TIMEOUT)
    options.setdefault("poll_interval", 0.5)
    return PostgresTransport(dsn, schema=schema, **options)


def _ledger_exact(bus: Bus) -> None:
    for stage in bus.statistics().stages:
        assert stage.published == (
            stage.acked + stage.dead_lettered + stage.abandoned + stage.depth + stage.in_flight
        ), stage


async def test_a_bus_fans_out_retries_dead_letters_and_replays(
    postgres_dsn: str, schema: str
) -> None:
    transport = _transport(postgres_dsn, schema)
    bus = Bus(transport=transport)
    audited: list[int] = []
    worked: list[int] = []
    attempts: list[int] = []
    healed = False

    @bus.subscribe("orders.*", group="audit")
    async def audit(n: int) -> None:
        audited.append(n)

    @bus.subscribe("orders.created", group="work", concurrency=4)
    async def work(n: int) -> None:
        worked.append(n)

    @bus.subscribe("jobs", group="g", retry=Retry(max_attempts=3, backoff=0.001, jitter=False))
    async def job(envelope: Envelope) -> None:
        attempts.append(envelope.attempt)
        if not healed:
            raise ValueError("not yet")

    with anyio.fail_after(30):
        async with bus:
            for n in range(50):
                receipt = await bus.publish("orders.created", n)
                assert receipt.accepted == ("orders.*@audit", "orders.created@work")
            failing = await bus.publish("jobs", 7)
            await bus.drain()
            assert (sorted(audited), sorted(worked)) == (list(range(50)), list(range(50)))
            assert attempts == [1, 2, 3]
            [dead] = bus.dead_letters.list()
            assert (dead.reason, dead.stage, dead.attempts) == (
                DeadLetterReason.HANDLER_FAILED,
                "jobs@g",
                3,
            )
            assert [entry.envelope.id for entry in await transport.dead_letters()] == [failing.id]
            healed = True
            await bus.dead_letters.replay(failing.id)
            await bus.drain()
            assert attempts == [1, 2, 3, 1]
            assert await transport.dead_letters() == []
            for pattern, group in (
                ("orders.*", "audit"),
                ("orders.created", "work"),
                ("jobs", "g"),
            ):
                assert await transport.backlog(pattern, group) == 0
            stats = bus.statistics()
            assert (stats.stage("orders.*@audit").acked, stats.stage("jobs@g").acked) == (50, 1)
            _ledger_exact(bus)


async def test_requests_are_answered_and_their_inbox_leaves_with_the_bus(
    postgres_dsn: str, schema: str
) -> None:
    transport = _transport(postgres_dsn, schema)
    bus = Bus(transport=transport)

    @bus.subscribe("double", group="d")
    async def double(n: int) -> int:
        return n * 2

    async def groups() -> list[str]:
        import asyncpg

        connection = await asyncpg.connect(postgres_dsn)
        try:
            rows = await connection.fetch(f"SELECT grp FROM {schema}.groups ORDER BY grp")
        finally:
            await connection.close()
        return [row[0] for row in rows]

    with anyio.fail_after(30):
        async with bus:
            assert [await bus.request("double", n, timeout=10) for n in range(3)] == [0, 2, 4]
            inboxes = [name for name in await groups() if name.startswith(INBOX_GROUP_PREFIX)]
            assert len(inboxes) == 1
        assert inboxes[0] not in await groups()
        assert "d" in await groups()


async def test_a_publish_in_the_callers_transaction_exists_only_if_it_commits(
    postgres_dsn: str, schema: str
) -> None:
    import asyncpg

    seen: list[str] = []
    with anyio.fail_after(30):
        async with _transport(postgres_dsn, schema) as transport:
            async with transport.subscribe("orders", group="g", prefetch=10) as deliveries:
                connection = await asyncpg.connect(postgres_dsn)
                try:
                    rolled_back = Envelope(topic="orders", payload="no")
                    with pytest.raises(RuntimeError):
                        async with connection.transaction():
                            await transport.publish_in(connection, "orders", [rolled_back])
                            raise RuntimeError("the caller's work failed")
                    kept = Envelope(topic="orders", payload="yes")
                    async with connection.transaction():
                        await transport.publish_in(connection, "orders", [kept])
                        assert await transport.backlog("orders", "g") == 0  # not committed
                    with pytest.raises(ConfigurationError, match="inside a transaction"):
                        await transport.publish_in(connection, "orders", [rolled_back])
                finally:
                    await connection.close()
                with pytest.raises(ConfigurationError, match="asyncpg connection"):
                    await transport.publish_in(object(), "orders", [rolled_back])
                delivery = await anext(deliveries)
                seen.append(delivery.envelope.payload)
                await delivery.ack()
                with anyio.move_on_after(QUIET):
                    extra = await anext(deliveries)
                    seen.append(extra.envelope.payload)
            assert await transport.backlog("orders", "g") == 0
    assert seen == ["yes"]


async def test_a_consumer_still_gets_work_when_its_notifications_are_lost(
    postgres_dsn: str, schema: str
) -> None:
    """The listening connection killed by the server: consumers poll, and the transport
    listens again."""
    import asyncpg

    with anyio.fail_after(30):
        async with (
            _transport(postgres_dsn, schema, ack_timeout=1.5) as transport,
            transport.subscribe("t", group="g", prefetch=10) as deliveries,
        ):
            admin = await asyncpg.connect(postgres_dsn)
            try:
                killed = await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN%' AND query LIKE $1",
                    f"%{schema}%",
                )
                assert killed == 1
                sent = Envelope(topic="t", payload=1)
                await transport.publish("t", [sent])
                delivery = await anext(deliveries)
                assert delivery.envelope.id == sent.id
                await delivery.ack()
                # Listening again within the upkeep's period (ack_timeout / 3).
                for _ in range(50):
                    listening = await admin.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE query LIKE 'LISTEN%' AND query LIKE $1",
                        f"%{schema}%",
                    )
                    if listening == 1:
                        break
                    await anyio.sleep(0.1)
                assert listening == 1
            finally:
                await admin.close()


async def test_a_schema_made_by_a_newer_asyncbus_is_refused(postgres_dsn: str, schema: str) -> None:
    import asyncpg

    async with _transport(postgres_dsn, schema):
        pass
    connection = await asyncpg.connect(postgres_dsn)
    try:
        await connection.execute(f"INSERT INTO {schema}.version VALUES (99)")
    finally:
        await connection.close()
    with pytest.raises(ConfigurationError, match="version 99"):
        async with _transport(postgres_dsn, schema):
            pass


async def test_deduplicate_claims_are_shared_by_two_transports(
    postgres_dsn: str, schema: str
) -> None:
    async with (
        _transport(postgres_dsn, schema) as first,
        _transport(postgres_dsn, schema) as second,
    ):
        one, two = first.dedup_store(60), second.dedup_store(60)
        assert await one.claim("k", "a", 30) == Claim.CLAIMED
        assert await two.claim("k", "b", 30) == Claim.BUSY
        assert await two.extend("k", "b", 30) is False
        assert await one.extend("k", "a", 30) is True
        await one.done("k", "a", 60)
        assert await two.claim("k", "b", 30) == Claim.DONE
        assert await two.claim("other", "b", 30) == Claim.CLAIMED
        await two.release("other", "b")
        assert await one.claim("other", "a", 30) == Claim.CLAIMED


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dsn": "redis://127.0.0.1:6379/0"}, "scheme 'redis'"),
        ({"dsn": "postgresql://h1,h2/db"}, "one PostgreSQL server"),
        ({"schema": "Bad-Name"}, "schema must be"),
        ({"schema": "x; DROP TABLE y"}, "schema must be"),
        ({"ack_timeout": float("nan")}, "ack_timeout"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"pool_size": True}, "pool_size"),
        ({"keep_alive": 1}, "keep_alive"),
    ],
)
def test_bad_settings_are_refused_when_made(options: dict[str, Any], message: str) -> None:
    options.setdefault("dsn", "postgresql://postgres@127.0.0.1:5432/test")
    with pytest.raises(ConfigurationError, match=message):
        PostgresTransport(**options)


async def test_an_unreachable_server_is_a_connect_error_without_the_password() -> None:
    port = free_port()
    transport = PostgresTransport(
        f"postgresql://me:secret@127.0.0.1:{port}/test", publish_timeout=2.0
    )
    with pytest.raises(ConnectError) as caught:
        async with transport:
            pass
    assert "secret" not in str(caught.value)
    assert "secret" not in repr(transport)


async def test_a_consumer_that_lost_its_claim_leaves_the_row_to_its_holder(
    postgres_dsn: str, schema: str
) -> None:
    """A hung consumer's claims ran out and another took the rows: the first one's late
    nack and reject change nothing (no reset of the holder's claim, no dead letter)."""
    async with (
        _transport(postgres_dsn, schema, ack_timeout=1.0, keep_alive=False) as transport,
        transport.subscribe("t", group="g", prefetch=2) as first,
        transport.subscribe("t", group="g", prefetch=2) as second,
    ):
        await transport.publish("t", [Envelope(topic="t", payload=n) for n in range(2)])
        with anyio.fail_after(10):
            lost = [await anext(first), await anext(first)]
            taken = [await anext(second), await anext(second)]  # after 1 s
        assert sorted(d.envelope.payload for d in taken) == [0, 1]
        await lost[0].nack()
        await lost[1].reject(DeadLetterReason.REJECTED.value)
        assert await transport.dead_letters() == []
        assert await transport.backlog("t", "g") == 2
        for delivery in taken:
            await delivery.ack()
        assert isinstance(second, SubscriptionControl)
        await second.flush()
        assert await transport.backlog("t", "g") == 0


async def test_a_claim_from_a_server_gone_silent_is_a_transport_error(
    postgres_url: str, schema: str
) -> None:
    with TcpProxy(5432) as proxy:
        async with (
            _transport(
                url_for("postgres", proxy.port), schema, publish_timeout=1.0, poll_interval=0.2
            ) as transport,
            transport.subscribe("t", group="g", prefetch=1) as deliveries,
        ):
            proxy.blackhole()
            started = anyio.current_time()
            with anyio.fail_after(10), pytest.raises(TransportError, match="claiming"):
                await anext(deliveries)
            assert anyio.current_time() - started < 1.0 + 0.2 + 1.5
            proxy.forward()


async def test_rows_nacked_with_delays_each_come_back_at_their_own_time(
    postgres_dsn: str, schema: str
) -> None:
    """A subscription looks for each delayed row when it is due, not only for the
    soonest one (the later ones waited for the next poll: here 30 s away)."""
    delays = [0.3, 0.9, 1.5]
    with anyio.fail_after(20):
        async with (
            _transport(postgres_dsn, schema, ack_timeout=20.0, poll_interval=30.0) as transport,
            transport.subscribe("t", group="g", prefetch=10) as deliveries,
        ):
            sent = [Envelope(topic="t", payload=n) for n in range(len(delays))]
            await transport.publish("t", sent)
            firsts = [await anext(deliveries) for _ in sent]
            nacked_at = anyio.current_time()
            for delivery, delay in zip(
                sorted(firsts, key=lambda d: d.envelope.payload), delays, strict=True
            ):
                await delivery.nack(delay=delay)
            came: list[tuple[int, float]] = []
            for _ in sent:
                again = await anext(deliveries)
                came.append((again.envelope.payload, anyio.current_time() - nacked_at))
                await again.ack()
    assert [payload for payload, _ in came] == [0, 1, 2]
    for (_, after), delay in zip(came, delays, strict=True):
        assert delay - 0.05 <= after <= delay + 1.0, came


async def test_a_nan_nack_delay_is_none_and_an_infinite_one_is_capped(
    postgres_dsn: str, schema: str
) -> None:
    with anyio.fail_after(20):
        async with (
            _transport(postgres_dsn, schema, poll_interval=30.0) as transport,
            transport.subscribe("t", group="g", prefetch=10) as deliveries,
        ):
            now, later = Envelope(topic="t", payload="nan"), Envelope(topic="t", payload="inf")
            await transport.publish("t", [now, later])
            first = {d.envelope.payload: d for d in [await anext(deliveries) for _ in "ab"]}
            await first["inf"].nack(delay=float("inf"))
            await first["nan"].nack(delay=float("nan"))
            again = await anext(deliveries)  # at once: NaN is no delay
            assert again.envelope.id == now.id
            await again.ack()
            with anyio.move_on_after(1.0) as waited:
                await anext(deliveries)
            assert waited.cancelled_caught  # the infinite one stays away
            assert await transport.backlog("t", "g") == 1
