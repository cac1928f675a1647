"""The admin app's groups: ``GET /groups`` and ``POST /groups/delete``."""

from __future__ import annotations

import anyio
import httpx
import pytest

from asyncbus import Bus, MemoryTransport
from asyncbus.integrations.starlette import admin_app

pytestmark = [pytest.mark.backends("asyncio"), pytest.mark.anyio, pytest.mark.timeout(30)]

JSON = {"Content-Type": "application/json"}


def _client(bus: Bus) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=admin_app(bus)), base_url="http://testserver"
    )


async def test_the_admin_app_lists_the_groups_and_deletes_one_left_behind() -> None:
    transport = MemoryTransport(direct=False)
    old = Bus(transport=transport)
    old.subscribe("orders.*", lambda n: None, group="old")
    bus = Bus(transport=transport)
    bus.subscribe("orders.*", lambda n: None, group="new")
    with anyio.fail_after(10):
        async with old:
            await old.subscribed()
        async with bus, _client(bus) as client:
            await bus.subscribed()
            await bus.publish("orders.created", 1)
            await bus.drain(timeout=5)
            listed = (await client.get("/groups")).json()
            assert listed == {
                "groups": [
                    {
                        "pattern": "orders.*",
                        "group": "new",
                        "name": "orders.*@new",
                        "backlog": 0,
                        "consumers": 1,
                        "last_active": None,
                        "local": True,
                    },
                    {
                        "pattern": "orders.*",
                        "group": "old",
                        "name": "orders.*@old",
                        "backlog": 1,
                        "consumers": 0,
                        "last_active": None,
                        "local": False,
                    },
                ]
            }
            refused = await client.post(
                "/groups/delete", json={"pattern": "orders.*", "group": "new"}, headers=JSON
            )
            assert refused.status_code == 409
            assert "subscribed in this process" in refused.json()["error"]
            deleted = await client.post(
                "/groups/delete", json={"pattern": "orders.*", "group": "old"}, headers=JSON
            )
            assert (deleted.status_code, deleted.json()) == (
                200,
                {"deleted": True, "name": "orders.*@old"},
            )
            again = await client.post(
                "/groups/delete", json={"pattern": "orders.*", "group": "old"}, headers=JSON
            )
            assert again.json() == {"deleted": False, "name": "orders.*@old"}
            names = [info["name"] for info in (await client.get("/groups")).json()["groups"]]
            assert names == ["orders.*@new"]
            bad = await client.post("/groups/delete", json={"pattern": "x"}, headers=JSON)
            assert bad.status_code == 422


async def test_over_a_broker_the_groups_need_a_running_bus() -> None:
    bus = Bus(transport=MemoryTransport(direct=False))
    async with _client(bus) as client:
        response = await client.get("/groups")
    assert response.status_code == 409
    assert "not running" in response.json()["error"]
