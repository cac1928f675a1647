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

    def __init__(self, failure: str = "connection reset by peer") -> None:
        super().__init__(direct=False)
        self.mode = "answer"
        self.failure = failure
        self.subscribe_gate: anyio.Event | None = None

    async def backlog(self, pattern: str, group: str) -> int:
        if self.mode == "hang":
            await anyio.sleep_forever()
        if self.mode == "fail":
            raise TransportError(self.failure)
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
                    {"status": "down", "reason": "broker did not answer"},
                )
            broker.mode = "fail"
            # Without a token to present, the probe says what, never the broker's words.
            assert await probe(client, "/healthz") == (
                503,
                {"status": "down", "reason": "broker failed"},
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


async def test_a_failing_broker_is_described_to_the_token_holder_and_the_log_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failure = (
        "Redis at redis://opsadmin:***@127.0.0.1:6399/0: backlog of hz.items@billing failed: "
        "Connection refused"
    )
    broker = _Broker(failure)
    bus = Bus(broker)
    bus.subscribe("hz.items", print, group="billing", offload="inline")
    secret = {"Authorization": f"Bearer {TOKEN}"}
    with anyio.fail_after(20):
        async with bus, client_of(bus, token=TOKEN) as client:
            broker.mode = "fail"
            for _ in range(3):
                anonymous = await client.get("/healthz")
                assert (anonymous.status_code, anonymous.json()) == (
                    503,
                    {"status": "down", "reason": "broker failed"},
                )
                for leak in ("opsadmin", "127.0.0.1", "6399", "hz.items", "billing", "Redis"):
                    assert leak not in anonymous.text, leak
            authorised = await client.get("/healthz", headers=secret)
            assert (authorised.status_code, authorised.json()) == (
                503,
                {
                    "status": "down",
                    "reason": "broker failed",
                    "detail": f"memory failed: TransportError: {failure}",
                },
            )
            wrong = await client.get("/healthz", headers={"Authorization": "Bearer nope"})
            assert wrong.json() == {"status": "down", "reason": "broker failed"}
            broker.mode = "hang"
            with anyio.fail_after(5):
                assert (await client.get("/healthz", headers=secret)).json() == {
                    "status": "down",
                    "reason": "broker did not answer",
                    "detail": "memory did not answer within 1s",
                }
            broker.mode = "answer"
            assert await probe(client, "/healthz") == (200, {"status": "ok"})
    # The operator finds the detail in the log: once per change, not once per probe.
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncbus.integrations.starlette"]
    assert logged == [
        f"health probe: memory failed: TransportError: {failure}",
        "health probe: memory did not answer within 1s",
        "health probe: the broker answers again",
    ]
