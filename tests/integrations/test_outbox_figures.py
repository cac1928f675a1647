"""What waits in the outbox, where an operator looks: ``asyncbus_outbox_pending`` in the
Prometheus metrics, ``outbox_pending`` in the admin app's ``/stats`` and a card of the
dashboard. The outbox's relay is held (another relay holds the schema's lock) while
envelopes are committed, then let go; against the local PostgreSQL server.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncbus import Bus
from asyncbus.integrations.starlette import admin_app
from asyncbus.transports.postgres import PostgresOutbox

pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio"), pytest.mark.timeout(60)]

#: A deadline for every wait (a regression fails, never hangs).
WAIT = 20.0


@pytest.fixture
async def schema(postgres_dsn: str) -> AsyncIterator[str]:
    """A schema name of the test's own, dropped (with the outbox's tables) after it."""
    name = f"asyncbus_test_{uuid.uuid4().hex[:8]}_outbox"
    yield name
    with anyio.CancelScope(shield=True):
        connection = await asyncpg.connect(postgres_dsn)
        try:
            await connection.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        finally:
            await connection.close()


def client_of(bus: Bus) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=admin_app(bus, metrics=True)),
        base_url="http://testserver",
    )


async def figures(client: httpx.AsyncClient) -> tuple[list[tuple[dict[str, str], float]], Any]:
    """``asyncbus_outbox_pending``'s samples (labels, value) and ``/stats``'s
    ``outbox_pending``."""
    metrics = (await client.get("/metrics")).text
    samples = [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "asyncbus_outbox_pending"
    ]
    return samples, (await client.get("/stats")).json()["outbox_pending"]


async def reads(bus: Bus, count: int) -> None:
    """Wait until the bus's statistics count ``count`` envelopes in its outbox."""
    with anyio.fail_after(WAIT):
        while bus.statistics().outbox_pending != count:
            await anyio.sleep(0.02)


async def test_the_metrics_and_the_stats_show_what_waits_in_the_outbox(
    postgres_dsn: str, schema: str
) -> None:
    outbox = PostgresOutbox(postgres_dsn, schema=schema, poll_interval=0.1)
    bus = Bus(name="shop", outbox=outbox)
    handled: list[int] = []

    @bus.subscribe("orders.created", group="audit")
    async def audit(n: int) -> None:
        handled.append(n)

    database = await asyncpg.connect(postgres_dsn)
    holder = await asyncpg.connect(postgres_dsn)
    try:
        assert await holder.fetchval(outbox._sql.relay_lock, schema) is True
        async with bus, client_of(bus) as client:
            assert await figures(client) == ([({"bus": "shop"}, 0.0)], 0)
            async with database.transaction():
                await bus.publish_many("orders.created", [1, 2, 3], connection=database)
            async with database.transaction():
                await bus.publish("orders.created", 4, connection=database)
            await reads(bus, 4)
            assert await figures(client) == ([({"bus": "shop"}, 4.0)], 4)
            await holder.fetchval(outbox._sql.relay_unlock, schema)  # (the relay forwards)
            await reads(bus, 0)
            await bus.drain()
            assert await figures(client) == ([({"bus": "shop"}, 0.0)], 0)
    finally:
        with anyio.CancelScope(shield=True):
            await holder.close()
            await database.close()
    assert handled == [1, 2, 3, 4]


async def test_a_bus_without_an_outbox_has_no_outbox_figures() -> None:
    bus = Bus(name="plain")
    async with bus, client_of(bus) as client:
        assert await figures(client) == ([], None)


async def test_the_dashboard_has_an_outbox_card_shown_for_a_bus_with_an_outbox() -> None:
    async with client_of(Bus()) as client:
        page = (await client.get("/")).text
    totals = page.split('<section class="cards" id="totals">', 1)[1].split("</section>", 1)[0]
    # One card among the totals, hidden until /stats says the bus has an outbox.
    (card,) = [line for line in totals.splitlines() if 'data-total="outbox_pending"' in line]
    assert '<div class="card" id="outbox-card" hidden ' in card
    assert '<div class="label">Outbox</div>' in card
    script = page.split("function renderStats(stats) {", 1)[1].split("\n  }\n", 1)[0]
    assert "const outbox = stats.outbox_pending;" in script
    assert '$("#outbox-card").hidden = typeof outbox !== "number";' in script
    assert (
        "setText(document.querySelector('[data-total=\"outbox_pending\"]'), count(outbox));"
        in script
    )
