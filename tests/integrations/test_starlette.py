"""The Starlette/FastAPI embedding and the admin API, through httpx and a real uvicorn."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import anyio
import httpx
import msgspec
import pytest
import uvicorn
from fastapi import Depends, FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncbus import (
    HEADER_REPLAYED,
    Bus,
    BusClosedError,
    ConfigurationError,
    Envelope,
    Reject,
    ShutdownReport,
    StageStatistics,
)
from asyncbus.integrations.starlette import admin_app, get_bus, lifespan

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FULFIL = "orders.created@fulfil"
AUDIT = "orders.created@audit"

BusDependency = Annotated[Bus, Depends(get_bus)]


class Order(BaseModel):
    id: int
    fail: bool = False
    hold: bool = False


@dataclasses.dataclass
class OrderService:
    """A FastAPI order service: POST /orders publishes, two stages handle, /admin administers."""

    app: FastAPI
    bus: Bus
    fulfilled: list[int]
    audited: list[int]
    at_shutdown: list[StageStatistics]


def make_service(*, release_at_shutdown: anyio.Event | None = None) -> OrderService:
    """Build the service; with ``release_at_shutdown``, held orders wait for it.

    The event is set by the app's own lifespan after the server stopped taking requests
    and before the bus drains, so only the drain at shutdown can finish those orders.
    """
    bus = Bus()
    service = OrderService(FastAPI(), bus, [], [], [])

    @bus.subscribe("orders.created", group="fulfil")
    async def fulfil(env: Envelope) -> None:
        order = env.payload
        if order["hold"] and release_at_shutdown is not None:
            await release_at_shutdown.wait()
        if order["fail"] and HEADER_REPLAYED not in env.headers:
            raise ValueError(f"cannot fulfil order {order['id']}")
        service.fulfilled.append(order["id"])

    @bus.subscribe("orders.created", group="audit")
    async def audit(order: dict[str, Any]) -> None:
        service.audited.append(order["id"])

    if release_at_shutdown is None:
        app = FastAPI(lifespan=lifespan(bus))
    else:
        gate = release_at_shutdown

        @contextlib.asynccontextmanager
        async def app_lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with lifespan(bus, timeout=10)(app):
                yield
                service.at_shutdown.append(bus.statistics().stage(FULFIL))
                gate.set()

        app = FastAPI(lifespan=app_lifespan)

    app.mount("/admin", admin_app(bus, token=TOKEN))

    @app.post("/orders", status_code=202)
    async def create_order(order: Order, bus: BusDependency) -> dict[str, Any]:
        receipt = await bus.publish("orders.created", order.model_dump())
        return {"id": receipt.id, "accepted": sorted(receipt.accepted)}

    service.app = app
    return service


@contextlib.asynccontextmanager
async def over_asgi(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """Run ``app``'s lifespan (ASGITransport does not) and talk to it in process."""
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://testserver"
        ) as client,
    ):
        yield client


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # A server inside a test must leave the test runner's signal handlers alone.
        yield


@contextlib.asynccontextmanager
async def over_uvicorn(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port; stop it (lifespan shutdown) at exit.

    The socket is bound and listening before the server starts, so requests made at
    once wait in its backlog until startup has finished: no polling for readiness.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="on",
        http="h11",
        ws="none",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(server.serve, [sock])
            try:
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10
                ) as client:
                    yield client
            finally:
                server.should_exit = True
    finally:
        sock.close()


@pytest.fixture
def asyncio_only(anyio_backend: tuple[str, dict[str, Any]]) -> None:
    """Skip on trio: uvicorn serves on asyncio (plain or uvloop) only."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("uvicorn runs on asyncio event loops only, not on trio")


def as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def stage_of(stats: dict[str, Any], name: str) -> dict[str, Any]:
    (stage,) = [stage for stage in stats["stages"] if stage["name"] == name]
    return stage


def ledger(stage: dict[str, Any]) -> tuple[int, ...]:
    """(published, acked, dead_lettered, abandoned, depth, in_flight)."""
    return tuple(
        stage[field]
        for field in ("published", "acked", "dead_lettered", "abandoned", "depth", "in_flight")
    )


async def post_orders(client: httpx.AsyncClient, *orders: dict[str, Any]) -> None:
    for order in orders:
        response = await client.post("/orders", json=order)
        assert response.status_code == 202, response.text
        assert response.json()["accepted"] == [AUDIT, FULFIL]


# -- the app, in process and over the wire ------------------------------------------


async def test_fastapi_app_over_asgi_publishes_handles_and_admin_stats_show_the_ledger() -> None:
    service = make_service()
    bus = service.bus
    with anyio.fail_after(20):
        async with over_asgi(service.app) as client:
            await post_orders(client, *({"id": i, "fail": i == 3} for i in range(5)))
            await bus.drain(timeout=5)

            response = await client.get("/admin/stats", headers=AUTH)
            assert response.status_code == 200
            stats = response.json()
            assert stats == as_json(dataclasses.asdict(bus.statistics()))
            assert ledger(stage_of(stats, FULFIL)) == (5, 4, 1, 0, 0, 0)
            assert ledger(stage_of(stats, AUDIT)) == (5, 5, 0, 0, 0, 0)
            assert (stats["published"], stats["acked"], stats["dead_lettered"]) == (10, 9, 1)
            assert stats["dead_letter_queue"] == 1
            assert sorted(service.fulfilled) == [0, 1, 2, 4]
            assert sorted(service.audited) == [0, 1, 2, 3, 4]

            page = (await client.get("/admin/dead-letters", headers=AUTH)).json()
            assert page["total"] == 1
            (entry,) = page["items"]
            assert entry["reason"] == "handler_failed"
            assert entry["stage"] == FULFIL
            assert entry["topic"] == "orders.created"
            assert entry["attempts"] == 1
            assert entry["error"].startswith("ValueError: cannot fulfil order 3")
            assert entry["envelope"]["payload"] == {"id": 3, "fail": True, "hold": False}
        assert not bus.running
    assert await bus.aclose() == ShutdownReport(
        drained=True, published=10, completed=9, dead_lettered=1, abandoned=[]
    )


async def test_app_shutdown_drains_the_bus_before_the_lifespan_ends() -> None:
    release = anyio.Event()
    service = make_service(release_at_shutdown=release)
    with anyio.fail_after(20):
        async with over_asgi(service.app) as client:
            await post_orders(client, *({"id": i, "hold": True} for i in range(3)))
            assert service.fulfilled == []
        # Held until the shutdown began; only the drain can have finished them.
        (at_shutdown,) = service.at_shutdown
        assert at_shutdown.acked == 0
        assert at_shutdown.depth + at_shutdown.in_flight == 3
        assert sorted(service.fulfilled) == [0, 1, 2]
        stage = dataclasses.asdict(service.bus.statistics().stage(FULFIL))
        assert ledger(stage) == (3, 3, 0, 0, 0, 0)
    assert await service.bus.aclose() == ShutdownReport(
        drained=True, published=6, completed=6, dead_lettered=0, abandoned=[]
    )


async def test_fastapi_app_over_uvicorn_publishes_handles_replays_and_drains_at_shutdown(
    asyncio_only: None,
) -> None:
    release = anyio.Event()
    service = make_service(release_at_shutdown=release)
    bus = service.bus
    with anyio.fail_after(30):
        async with over_uvicorn(service.app) as client:
            await post_orders(client, *({"id": i, "fail": i == 2} for i in range(4)))
            await bus.drain(timeout=5)
            stats = (await client.get("/admin/stats", headers=AUTH)).json()
            assert stats == as_json(dataclasses.asdict(bus.statistics()))
            assert ledger(stage_of(stats, FULFIL)) == (4, 3, 1, 0, 0, 0)
            assert ledger(stage_of(stats, AUDIT)) == (4, 4, 0, 0, 0, 0)

            wrong = await client.get("/admin/stats", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert "wrong bearer token" in wrong.json()["error"]
            # (Over a real server: httpx's in-process transport warns on trio when an app
            # answers before reading the whole body.)
            too_large = await client.post(
                "/admin/dead-letters/purge", json={"ids": ["x" * (1 << 20)]}, headers=AUTH
            )
            assert too_large.status_code == 413
            assert "over 1048576 bytes" in too_large.json()["error"]
            assert (await client.get("/admin/stats", headers=AUTH)).json() == stats

            (dead,) = (await client.get("/admin/dead-letters", headers=AUTH)).json()["items"]
            replayed = await client.post(
                "/admin/dead-letters/replay", json={"ids": [dead["id"]]}, headers=AUTH
            )
            assert replayed.status_code == 200, replayed.text
            assert replayed.json()["receipts"][0]["accepted"] == [FULFIL]
            await bus.drain(timeout=5)
            assert len(bus.dead_letters) == 0
            assert sorted(service.fulfilled) == [0, 1, 2, 3]
            stats = (await client.get("/admin/stats", headers=AUTH)).json()
            # The replay re-entered the stage: published again, acked this time.
            assert ledger(stage_of(stats, FULFIL)) == (5, 4, 1, 0, 0, 0)

            await post_orders(client, *({"id": i, "hold": True} for i in range(10, 13)))
        # The server stopped: its lifespan released the held orders, then drained.
        assert not bus.running
        (at_shutdown,) = service.at_shutdown
        assert (at_shutdown.acked, at_shutdown.depth + at_shutdown.in_flight) == (4, 3)
        assert sorted(service.fulfilled) == [0, 1, 2, 3, 10, 11, 12]
    assert await bus.aclose() == ShutdownReport(
        drained=True, published=15, completed=14, dead_lettered=1, abandoned=[]
    )


async def test_get_bus_serves_plain_starlette_endpoints_and_fails_clearly_without_lifespan() -> (
    None
):
    bus = Bus()

    async def publish(request: Request) -> Response:
        receipt = await get_bus(request).publish("nowhere", {"via": "starlette"})
        return JSONResponse({"id": receipt.id})

    app = Starlette(routes=[Route("/publish", publish, methods=["POST"])], lifespan=lifespan(bus))
    with anyio.fail_after(10):
        async with over_asgi(app) as client:
            response = await client.post("/publish")
            assert response.status_code == 200
            entry = bus.dead_letters.get(response.json()["id"])
            assert entry is not None
            assert entry.envelope.payload == {"via": "starlette"}
    # After the lifespan, the app holds no bus any more.
    scope = {"type": "http", "app": app, "headers": [], "path": "/", "query_string": b""}
    with pytest.raises(RuntimeError, match="no running bus on this app"):
        get_bus(Request(scope))
    with pytest.raises(RuntimeError, match="no running bus on this app"):
        get_bus(Request({**scope, "app": Starlette()}))


async def test_a_module_level_bus_the_app_does_not_run_says_how_to_start_it() -> None:
    """A FastAPI app without ``lifespan=lifespan(bus)``: the publish names both ways."""
    bus = Bus()
    app = FastAPI()  # the lifespan forgotten

    @app.post("/orders")
    async def create(order: dict[str, Any]) -> dict[str, str]:
        receipt = await bus.publish("orders.created", order)
        return {"id": receipt.id}

    with anyio.fail_after(10):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://testserver"
        ) as client:
            with pytest.raises(BusClosedError) as caught:
                await client.post("/orders", json={"id": 1})
    message = str(caught.value)
    assert "the bus has not started" in message
    assert "`async with bus:`" in message
    assert "`lifespan=lifespan(bus)`" in message
    assert bus.statistics().published == 0


def test_importing_asyncbus_does_not_import_starlette() -> None:
    code = (
        "import sys, asyncbus, asyncbus.integrations\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'fastapi'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_without_starlette_the_integration_names_its_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['starlette'] = None  # as if it were not installed\n"
        "try:\n"
        "    import asyncbus.integrations.starlette\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == (
        "asyncbus.integrations.starlette needs the 'starlette' extra: "
        "pip install 'asyncbus[starlette]'"
    ), out.stderr


def test_admin_app_refuses_an_empty_token() -> None:
    with pytest.raises(ConfigurationError, match="token"):
        admin_app(Bus(), token="")


# -- the admin API ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def admin_over_asgi(bus: Bus, token: str | None = TOKEN) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(lifespan=lifespan(bus))
    app.mount("/admin", admin_app(bus, token=token))
    async with over_asgi(app) as client:
        yield client


def failing_bus() -> Bus:
    """A bus with a fulfil stage that fails odd orders and a refunds stage that rejects."""
    bus = Bus()

    @bus.subscribe("orders.created", group="fulfil")
    async def fulfil(env: Envelope) -> None:
        if env.payload["id"] % 2 and HEADER_REPLAYED not in env.headers:
            raise ValueError(f"order {env.payload['id']} is odd")

    @bus.subscribe("refunds", group="refunds")
    async def refund(payload: Any) -> None:
        raise Reject("refunds are closed")

    return bus


async def make_dead_letters(bus: Bus) -> None:
    for i in range(6):
        await bus.publish("orders.created", {"id": i})  # 1, 3, 5 fail
    await bus.publish("nowhere", "lost")
    await bus.publish("nowhere.else", "lost too")
    await bus.publish("refunds", {"id": 9})
    await bus.drain(timeout=5)


async def test_dead_letters_are_filtered_paginated_and_counted_by_reason() -> None:
    bus = failing_bus()
    with anyio.fail_after(20):
        async with admin_over_asgi(bus) as client:
            await make_dead_letters(bus)
            ids = [entry.envelope.id for entry in bus.dead_letters.list()]

            async def page(**query: Any) -> dict[str, Any]:
                response = await client.get("/admin/dead-letters", params=query, headers=AUTH)
                assert response.status_code == 200, response.text
                body: dict[str, Any] = response.json()
                return body

            everything = await page()
            assert [item["id"] for item in everything["items"]] == ids
            assert (everything["total"], everything["queue_length"]) == (6, 6)
            assert everything["by_reason"] == {
                "no_subscribers": 2,
                "handler_failed": 3,
                "rejected": 1,
                "expired": 0,
                "dropped": 0,
                "timeout": 0,
                "overload": 0,
                "key_stopped": 0,
            }
            failed = await page(reason="handler_failed")
            assert [item["envelope"]["payload"]["id"] for item in failed["items"]] == [1, 3, 5]
            assert failed["total"] == 3
            assert failed["by_reason"] == everything["by_reason"]
            (lost,) = (await page(topic="nowhere"))["items"]
            assert (lost["reason"], lost["stage"], lost["envelope"]["payload"]) == (
                "no_subscribers",
                None,
                "lost",
            )
            (rejected,) = (await page(reason="rejected"))["items"]
            assert rejected["error"].startswith("Reject: refunds are closed")
            assert rejected["stage"] == "refunds@refunds"

            first = await page(limit=2)
            second = await page(limit=2, offset=2)
            rest = await page(limit=2, offset=4)
            beyond = await page(limit=2, offset=6)
            assert [i["id"] for p in (first, second, rest) for i in p["items"]] == ids
            assert beyond["items"] == []
            assert {p["total"] for p in (first, second, rest, beyond)} == {6}
            newest = await page(order="newest", limit=3)
            assert [item["id"] for item in newest["items"]] == ids[::-1][:3]

            one = await client.get(f"/admin/dead-letters/{ids[0]}", headers=AUTH)
            assert one.status_code == 200
            assert [item["id"] for item in one.json()["items"]] == [ids[0]]


async def test_replay_and_purge_through_the_admin_api() -> None:
    bus = failing_bus()
    with anyio.fail_after(20):
        async with admin_over_asgi(bus) as client:
            await make_dead_letters(bus)
            failed = [entry.envelope.id for entry in bus.dead_letters.list("handler_failed")]
            lost = [entry.envelope.id for entry in bus.dead_letters.list("no_subscribers")]

            response = await client.post(
                "/admin/dead-letters/replay", json={"ids": failed[:2]}, headers=AUTH
            )
            assert response.status_code == 200, response.text
            assert response.json()["replayed"] == failed[:2]
            assert [r["accepted"] for r in response.json()["receipts"]] == [
                ["orders.created@fulfil"],
                ["orders.created@fulfil"],
            ]
            await bus.drain(timeout=5)
            stage = bus.statistics().stage("orders.created@fulfil")
            assert (stage.published, stage.acked, stage.dead_lettered) == (8, 5, 3)
            rejected = [entry.envelope.id for entry in bus.dead_letters.list("rejected")]
            assert sorted(entry.envelope.id for entry in bus.dead_letters.list()) == sorted(
                [failed[2], *lost, *rejected]
            )

            response = await client.post(
                "/admin/dead-letters/purge", json={"ids": lost}, headers=AUTH
            )
            assert response.json() == {"purged": 2}
            assert len(bus.dead_letters) == 2
            response = await client.post(
                "/admin/dead-letters/purge", json={"all": True}, headers=AUTH
            )
            assert response.json() == {"purged": 2}
            assert len(bus.dead_letters) == 0


BAD_REQUESTS = [
    # (id, method, path, httpx kwargs (+ "auth": False to send no token), status,
    #  fragment of the error message)
    (
        "replay-unknown-id",
        "POST",
        "/admin/dead-letters/replay",
        {"json": {"ids": ["{known}", "no-such-id"]}},
        404,
        "not in the dead-letter queue: no-such-id",
    ),
    (
        "purge-unknown-id",
        "POST",
        "/admin/dead-letters/purge",
        {"json": {"ids": ["{known}", "no-such-id"]}},
        404,
        "not in the dead-letter queue: no-such-id",
    ),
    (
        "malformed-json",
        "POST",
        "/admin/dead-letters/replay",
        {"content": b'{"ids": ["', "headers": {"Content-Type": "application/json"}},
        400,
        "malformed JSON",
    ),
    (
        "not-utf8",
        "POST",
        "/admin/dead-letters/purge",
        {"content": b"\xff\xfe{", "headers": {"Content-Type": "application/json"}},
        400,
        "malformed JSON",
    ),
    (
        "empty-body",
        "POST",
        "/admin/dead-letters/purge",
        {"content": b"", "headers": {"Content-Type": "application/json"}},
        400,
        "malformed JSON",
    ),
    (
        "not-json-content-type",
        "POST",
        "/admin/dead-letters/purge",
        {"content": b'{"all": true}', "headers": {"Content-Type": "text/plain"}},
        415,
        "must be JSON",
    ),
    ("body-not-object", "POST", "/admin/dead-letters/replay", {"json": ["x"]}, 422, "object"),
    ("ids-not-list", "POST", "/admin/dead-letters/replay", {"json": {"ids": "x"}}, 422, "ids"),
    ("ids-empty", "POST", "/admin/dead-letters/replay", {"json": {"ids": []}}, 422, "non-empty"),
    ("ids-not-str", "POST", "/admin/dead-letters/purge", {"json": {"ids": [1]}}, 422, "strings"),
    (
        "unexpected-field",
        "POST",
        "/admin/dead-letters/replay",
        {"json": {"id": "{known}"}},
        422,
        "unexpected field(s) 'id'",
    ),
    (
        "replay-all",
        "POST",
        "/admin/dead-letters/replay",
        {"json": {"all": True}},
        422,
        "unexpected field(s) 'all'",
    ),
    ("purge-all-false", "POST", "/admin/dead-letters/purge", {"json": {"all": False}}, 422, "all"),
    (
        "purge-all-and-ids",
        "POST",
        "/admin/dead-letters/purge",
        {"json": {"all": True, "ids": ["{known}"]}},
        422,
        "not both",
    ),
    (
        "wrong-token",
        "POST",
        "/admin/dead-letters/purge",
        {"json": {"all": True}, "headers": {"Authorization": "Bearer wrong"}},
        401,
        "wrong bearer token",
    ),
    (
        "missing-token",
        "POST",
        "/admin/dead-letters/purge",
        {"json": {"all": True}, "auth": False},
        401,
        "missing bearer token",
    ),
    (
        "token-in-query-for-the-api",
        "POST",
        f"/admin/dead-letters/purge?token={TOKEN}",
        {"json": {"all": True}, "auth": False},
        401,
        "missing bearer token",
    ),
    (
        "basic-auth",
        "GET",
        "/admin/stats",
        {"headers": {"Authorization": "Basic " + base64.b64encode(b"a:b").decode()}},
        401,
        "missing bearer token",
    ),
    ("wrong-page-token", "GET", "/admin/?token=nope", {"auth": False}, 401, "wrong bearer token"),
    ("unknown-reason", "GET", "/admin/dead-letters?reason=bogus", {}, 400, "unknown reason"),
    ("limit-zero", "GET", "/admin/dead-letters?limit=0", {}, 400, "'limit'"),
    ("limit-not-int", "GET", "/admin/dead-letters?limit=ten", {}, 400, "'limit'"),
    ("offset-negative", "GET", "/admin/dead-letters?offset=-1", {}, 400, "'offset'"),
    ("bad-order", "GET", "/admin/dead-letters?order=sideways", {}, 400, "'order'"),
    ("unknown-entry", "GET", "/admin/dead-letters/nope", {}, 404, "not in the dead-letter queue"),
    ("unknown-route", "GET", "/admin/nothing-here", {}, 404, "Not Found"),
    ("wrong-method", "DELETE", "/admin/stats", {}, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
async def test_bad_admin_input_gets_a_4xx_with_a_message_and_changes_nothing(
    method: str, path: str, kwargs: dict[str, Any], status: int, message: str
) -> None:
    bus = failing_bus()
    with anyio.fail_after(20):
        async with admin_over_asgi(bus) as client:
            await make_dead_letters(bus)
            known = bus.dead_letters.list()[0].envelope.id
            request = dict(kwargs)
            auth = request.pop("auth", True)
            if "json" in request:
                request["json"] = json.loads(json.dumps(request["json"]).replace("{known}", known))
            request["headers"] = {**(AUTH if auth else {}), **request.get("headers", {})}
            before = (bus.statistics(), bus.dead_letters.list(), len(bus.dead_letters))

            response = await client.request(method, path, **request)
            await bus.drain(timeout=5)

            assert response.status_code == status, response.text
            assert response.headers["content-type"] == "application/json"
            assert message in response.json()["error"]
            if status == 401:
                assert response.headers["www-authenticate"].startswith("Bearer")
            if "no-such-id" in path + json.dumps(kwargs.get("json")):
                assert response.json()["unknown_ids"] == ["no-such-id"]
            assert (bus.statistics(), bus.dead_letters.list(), len(bus.dead_letters)) == before


async def test_replay_on_a_stopped_bus_is_a_409_and_keeps_the_entry() -> None:
    bus = failing_bus()
    with anyio.fail_after(20):
        async with admin_over_asgi(bus):
            await make_dead_letters(bus)
        known = bus.dead_letters.list()[0].envelope.id
        before = (bus.statistics(), bus.dead_letters.list())
        app = admin_app(bus, token=TOKEN)  # served without any lifespan
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://testserver"
        ) as client:
            response = await client.post(
                "/dead-letters/replay", json={"ids": [known]}, headers=AUTH
            )
            assert response.status_code == 409
            assert "not running" in response.json()["error"]
            assert (await client.get("/stats", headers=AUTH)).status_code == 200
        assert (bus.statistics(), bus.dead_letters.list()) == before


async def test_any_payload_is_shown_as_json() -> None:
    @dataclasses.dataclass
    class Point:
        x: int
        y: float

    class Opaque:
        def __repr__(self) -> str:
            raise RuntimeError("no repr for you")

    class Money(msgspec.Struct):
        amount: int
        currency: str

    class Colour(enum.Enum):
        RED = "red"

    cycle: list[Any] = []
    cycle.append(cycle)
    payload = {
        "struct": Money(5, "EUR"),
        "model": Order(id=4),
        "enum": Colour.RED,
        "huge": list(range(1000)),
        "nan": math.nan,
        "bytes": b"\x00\x01" * 100,
        "point": Point(1, math.inf),
        "set": {3},
        "opaque": Opaque(),
        "long": "x" * 10_000,
        "cycle": cycle,
        7: "int key",
    }
    bus = Bus()
    with anyio.fail_after(20):
        async with admin_over_asgi(bus, token=None) as client:
            await bus.publish("nowhere", payload, ttl=3600)  # (an infinite ttl is refused)
            response = await client.get("/admin/dead-letters")
            assert response.status_code == 200
            (item,) = response.json()["items"]
            shown = item["envelope"]["payload"]
    assert item["envelope"]["ttl"] == 3600
    assert shown["struct"] == {"amount": 5, "currency": "EUR"}
    assert shown["model"] == {"id": 4, "fail": False, "hold": False}
    assert shown["enum"] == "red"
    assert shown["huge"] == [*range(200), "… (800 more)"]
    assert shown["nan"] == "nan"
    assert shown["bytes"].startswith("b'\\x00\\x01") and "(136 more bytes)" in shown["bytes"]
    assert shown["point"] == {"x": 1, "y": "inf"}
    assert shown["set"] == [3]
    assert "Opaque" in shown["opaque"]
    assert shown["long"].startswith("x" * 4096) and "(5904 more characters)" in shown["long"]
    assert "..." in json.dumps(shown["cycle"])
    assert shown["7"] == "int key"


# -- the dashboard page -------------------------------------------------------------


async def test_dashboard_page_is_self_contained_and_takes_the_token_in_the_query() -> None:
    bus = Bus()
    with anyio.fail_after(20):
        async with admin_over_asgi(bus) as client:
            assert (await client.get("/admin/")).status_code == 401
            for url, headers in (("/admin/?token=" + TOKEN, {}), ("/admin/", AUTH)):
                response = await client.get(url, headers=headers)
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/html")
            html = response.text
            policy = response.headers["content-security-policy"]
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["referrer-policy"] == "no-referrer"
    # No CDN, nothing fetched from elsewhere: every URL in the page is a data: URL.
    assert all(url.startswith("data:") for url in re.findall(r'(?:src|href)="([^"]*)"', html))
    assert "https://" not in html
    assert set(re.findall(r"http://[^\"' ]+", html)) == {"http://www.w3.org/2000/svg"}
    # The page's own inline script and style are the only ones the policy allows.
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in policy
    assert "connect-src 'self'" in policy
    # The script passes the query token on as a header, and polls both routes.
    assert "Authorization" in html and '"Bearer "' in html
    assert 'api("stats")' in html and "dead-letters?" in html
