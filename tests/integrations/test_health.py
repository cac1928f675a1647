"""The admin app's probes: /healthz (alive, broker answering) and /readyz (take work)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest

from asyncbus import Bus, MemoryTransport, TransportError
from asyncbus.integrations.starlette import admin_app

pytestmark = pytest.mark.anyio

TOKEN = "probe-token"


@asynccontextmanager
async def client_of(bus: Bus, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = admin_app(bus, **options)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as client:
        yield client


async def probe(client: httpx.AsyncClient, path: str) -> tuple[int, dict[str, Any]]:
    response = await client.get(path)
    return response.status_code, response.json()


async def test_readyz_turns_503_as_soon_as_aclose_begins_while_healthz_stays_alive() -> None:
    started = anyio.Event()
    gate = anyio.Event()

    async def held(payload: Any) -> None:
        started.set()
        await gate.wait()

    bus = Bus()
    bus.subscribe("jobs", held, group="w")
    with anyio.fail_after(20):
        async with client_of(bus, token=TOKEN) as client:
            assert await probe(client, "/readyz") == (
                503,
                {"status": "not ready", "reason": "the bus is new"},
            )
            assert await probe(client, "/healthz") == (
                503,
                {"status": "down", "reason": "the bus is new"},
            )
            async with bus:
                assert await probe(client, "/readyz") == (200, {"status": "ready"})
                assert await probe(client, "/healthz") == (200, {"status": "ok"})
                await bus.publish("jobs", 1)
                await started.wait()
                async with anyio.create_task_group() as group:
                    group.start_soon(bus.aclose)
                    while bus.running:  # until aclose has begun (it waits for the drain)
                        await anyio.lowlevel.checkpoint()
                    assert await probe(client, "/readyz") == (
                        503,
                        {
                            "status": "not ready",
                            "reason": "the bus is closing: draining, publishes refused",
                        },
                    )
                    # Draining is alive: a liveness probe must not kill it now.
                    assert await probe(client, "/healthz") == (200, {"status": "closing"})
                    gate.set()
            assert bus.statistics().stage("jobs@w").acked == 1
            assert await probe(client, "/readyz") == (
                503,
                {"status": "not ready", "reason": "the bus is closed"},
            )
            assert await probe(client, "/healthz") == (
                503,
                {"status": "down", "reason": "the bus is closed"},
            )


async def test_probes_answer_without_the_token_and_nothing_else_does() -> None:
    bus = Bus()
    with anyio.fail_after(20):
        async with bus, client_of(bus, token=TOKEN, metrics=True) as client:
            for path in ("/healthz", "/readyz"):
                response = await client.get(path)
                assert response.status_code == 200
                assert response.headers["cache-control"] == "no-store"
            for path in ("/stats", "/metrics", "/dead-letters", "/", "/healthz/x"):
                assert (await client.get(path)).status_code == 401, path
            # Under a mount, the probes are found below the mount point.
            mounted = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=admin_app(bus, token=TOKEN), root_path="/ops"),
                base_url="http://testserver",
            )
            async with mounted:
                assert (await mounted.get("/ops/readyz")).status_code == 200
                assert (await mounted.get("/ops/stats")).status_code == 401


class _Broker(MemoryTransport):
    """The in-process broker, with a backlog that can hang or fail, and subscriptions
    that exist only once ``subscribe_gate`` opens."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.mode = "answer"
        self.subscribe_gate: anyio.Event | None = None

    async def backlog(self, pattern: str, group: str) -> int:
        if self.mode == "hang":
            await anyio.sleep_forever()
        if self.mode == "fail":
            raise TransportError("connection reset by peer")
        return await super().backlog(pattern, group)

    @asynccontextmanager
    async def subscribe(  # type: ignore[override]
        self, pattern: str, *, group: str, prefetch: int
    ) -> AsyncIterator[Any]:
        if self.subscribe_gate is not None:
            await self.subscribe_gate.wait()
        async with super().subscribe(pattern, group=group, prefetch=prefetch) as deliveries:
            yield deliveries


async def test_healthz_is_503_when_the_broker_does_not_answer_within_a_second() -> None:
    broker = _Broker()
    bus = Bus(broker)
    bus.subscribe("jobs", print, group="w", offload="inline")
    with anyio.fail_after(20):
        async with bus, client_of(bus) as client:
            assert await probe(client, "/healthz") == (200, {"status": "ok"})
            broker.mode = "hang"
            with anyio.fail_after(5):  # the probe's own deadline is 1 s
                assert await probe(client, "/healthz") == (
                    503,
                    {"status": "down", "reason": "memory did not answer within 1s"},
                )
            broker.mode = "fail"
            assert await probe(client, "/healthz") == (
                503,
                {
                    "status": "down",
                    "reason": "memory failed: TransportError: connection reset by peer",
                },
            )
            assert await probe(client, "/readyz") == (200, {"status": "ready"})
            broker.mode = "answer"
            assert await probe(client, "/healthz") == (200, {"status": "ok"})


async def test_readyz_waits_for_the_broker_subscriptions() -> None:
    broker = _Broker()
    bus = Bus(broker)
    with anyio.fail_after(20):
        async with bus, client_of(bus) as client:
            assert await probe(client, "/readyz") == (200, {"status": "ready"})
            broker.subscribe_gate = anyio.Event()
            bus.subscribe("late", print, group="w", offload="inline")
            assert await probe(client, "/readyz") == (
                503,
                {"status": "not ready", "reason": "broker subscriptions are being set up"},
            )
            broker.subscribe_gate.set()
            await bus.subscribed()
            assert await probe(client, "/readyz") == (200, {"status": "ready"})
