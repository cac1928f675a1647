"""A handler under ``PostgresInbox`` that publishes through ``current_connection()``: the
publish is written in the inbox's transaction, so it commits with the envelope's claim or
not at all. Over ``PostgresTransport`` (the message rows) and over Redis with a
``PostgresOutbox`` (the outbox's rows), against the local PostgreSQL server.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from _in_transaction import KINDS, InTransaction, Seen, in_transaction

from asyncbus import DeadLetterReason, Envelope, Retry
from asyncbus.transports.postgres import PostgresInbox, current_connection

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: The stage of the handler under the inbox, and the one its publishes reach.
ORDERS, SHIPPED = "orders@ship", "shipped@notify"


@pytest.fixture(params=KINDS)
def made(request: pytest.FixtureRequest) -> InTransaction:
    """A bus over PostgresTransport, or over Redis with an outbox."""
    return in_transaction(request, request.param)


@pytest.fixture
def inbox(postgres_dsn: str, postgres_schemas: Any) -> PostgresInbox:
    """An inbox in a schema of the test's own."""
    return PostgresInbox(postgres_dsn, schema=postgres_schemas("inbox"))


async def claims(dsn: str, inbox: PostgresInbox) -> list[tuple[str, str]]:
    """Every committed claim of ``inbox``: (stage, envelope id)."""
    connection = await asyncpg.connect(dsn)
    try:
        found = await connection.fetch(
            f"SELECT stage, envelope_id FROM {inbox.schema}.claims ORDER BY envelope_id"
        )
    finally:
        await connection.close()
    return [(row["stage"], row["envelope_id"]) for row in found]


def notified(made: InTransaction, seen: Seen) -> None:
    """Subscribe the downstream stage, recording (envelope id, payload)."""

    @made.bus.subscribe("shipped", group="notify")
    async def notify(envelope: Envelope) -> None:
        seen.add((envelope.id, envelope.payload))


async def test_a_handler_that_raises_after_publishing_publishes_nothing_and_its_retry_once(
    made: InTransaction, inbox: PostgresInbox, postgres_dsn: str
) -> None:
    """The first attempt publishes, then raises: its publish and its claim roll back
    together; the retry publishes once, and commits with the claim."""
    bus, seen, sent = made.bus, Seen(), []
    notified(made, seen)

    @bus.subscribe(
        "orders",
        group="ship",
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
        middleware=[inbox],
    )
    async def ship(envelope: Envelope) -> None:
        payload = {"order": envelope.payload, "attempt": envelope.attempt}
        receipt = await bus.publish("shipped", payload, connection=current_connection())
        sent.append(receipt.id)
        if envelope.attempt == 1:
            raise RuntimeError("the order failed after its publish")

    async with bus:
        await bus.publish("orders", 7, id="order-7")
        await seen.reach(1)
        await made.settled("shipped", "notify")
        await bus.drain()
        assert (bus.statistics().stage(ORDERS).acked, bus.statistics().stage(ORDERS).retried) == (
            1,
            1,
        )
    assert len(sent) == 2
    assert seen.items == [(sent[1], {"order": 7, "attempt": 2})]
    assert await claims(postgres_dsn, inbox) == [(ORDERS, "order-7")]


async def test_a_handler_that_always_raises_after_publishing_publishes_nothing_and_claims_nothing(
    made: InTransaction, inbox: PostgresInbox, postgres_dsn: str
) -> None:
    bus, seen = made.bus, Seen()
    notified(made, seen)

    @bus.subscribe(
        "orders",
        group="ship",
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
        middleware=[inbox],
    )
    async def ship(order: int) -> None:
        await bus.publish("shipped", {"order": order}, connection=current_connection())
        raise RuntimeError("never ships")

    async with bus:
        await bus.publish("orders", 8, id="order-8")
        await bus.drain()
        (dead,) = bus.dead_letters.list()
        assert (dead.envelope.id, dead.reason, dead.attempts) == (
            "order-8",
            DeadLetterReason.HANDLER_FAILED,
            2,
        )
        # A publish committed after the failed ones: had they been written, they would
        # come before it (the rows go out in the order they were written).
        connection = await asyncpg.connect(postgres_dsn)
        try:
            async with connection.transaction():
                after = await bus.publish("shipped", {"order": "after"}, connection=connection)
        finally:
            await connection.close()
        await seen.reach(1)
        await made.settled("shipped", "notify")
        await bus.drain()
    assert seen.items == [(after.id, {"order": "after"})]
    assert await claims(postgres_dsn, inbox) == []


async def test_a_returning_handler_commits_its_publish_with_its_claim_and_a_copy_publishes_nothing(
    made: InTransaction, inbox: PostgresInbox, postgres_dsn: str
) -> None:
    bus, seen, sent = made.bus, Seen(), []
    notified(made, seen)

    @bus.subscribe("orders", group="ship", middleware=[inbox])
    async def ship(order: int) -> None:
        receipt = await bus.publish("shipped", {"order": order}, connection=current_connection())
        sent.append(receipt.id)

    async with bus:
        await bus.publish("orders", 9, id="order-9")
        await seen.reach(1)
        await bus.publish("orders", 9, id="order-9")  # (sent again: the inbox skips it)
        await bus.publish("orders", 10, id="order-10")
        await seen.reach(2)
        await made.settled("shipped", "notify")
        await bus.drain()
        orders = bus.statistics().stage(ORDERS)
        assert (orders.published, orders.acked, orders.failed) == (3, 3, 0)
    assert len(sent) == 2
    assert seen.items == [(sent[0], {"order": 9}), (sent[1], {"order": 10})]
    assert await claims(postgres_dsn, inbox) == [(ORDERS, "order-10"), (ORDERS, "order-9")]
