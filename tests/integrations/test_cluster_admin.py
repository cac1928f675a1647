"""The admin app's deployment view: ``GET /cluster`` says which replica answered."""

from __future__ import annotations

import os
import socket

import anyio
import httpx
import pytest

from asyncbus import Bus
from asyncbus.integrations.starlette import admin_app

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_the_admin_app_shows_the_deployment_and_the_replica_that_served_it() -> None:
    bus = Bus(name="web")
    bus.subscribe("t", lambda n: None, group="g")
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=admin_app(bus)), base_url="http://testserver"
    )
    with anyio.fail_after(10):
        async with bus, client:
            for n in range(3):
                await bus.publish("t", n)
            await bus.drain()
            response = await client.get("/cluster")
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    view = response.json()
    served_by = view["served_by"]
    assert (served_by["host"], served_by["pid"], served_by["bus"]) == (
        socket.gethostname(),
        os.getpid(),
        "web",
    )
    assert served_by["name"] == f"{socket.gethostname()}:{os.getpid()}"
    assert [p["instance"] for p in view["processes"]] == [served_by["instance"]]
    (process,) = view["processes"]
    assert (process["published"], process["acked"], process["stale"], process["this_process"]) == (
        3,
        3,
        False,
        True,
    )
    assert (view["totals"]["published"], view["totals"]["acked"]) == (3, 3)
