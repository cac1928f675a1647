"""``admin_app(bus, asyncapi=...)``: the AsyncAPI document at ``/asyncapi.json`` and its page."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette

from asyncbus import Bus, ConfigurationError
from asyncbus.asyncapi import document
from asyncbus.integrations.starlette import admin_app, lifespan

pytestmark = pytest.mark.anyio

TOKEN = "asyncapi-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclasses.dataclass
class Order:
    id: int


def shop() -> Bus:
    bus = Bus(name="shop")

    @bus.subscribe("orders.created", group="mailer")
    async def mail(order: Order) -> None:
        """Mail the confirmation."""

    return bus


@contextlib.asynccontextmanager
async def admin(bus: Bus, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The bus running, its admin app mounted at /admin, a client talking to it in process."""
    app = Starlette(lifespan=lifespan(bus))
    app.mount("/admin", admin_app(bus, **options))
    with anyio.fail_after(20):
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://testserver"
            ) as client,
        ):
            yield client


async def test_the_document_is_served_as_json_with_the_token() -> None:
    bus = shop()
    async with admin(bus, token=TOKEN) as client:
        refused = await client.get("/admin/asyncapi.json")
        assert (refused.status_code, refused.json()["error"]) == (
            401,
            "missing bearer token: send 'Authorization: Bearer <token>'",
        )
        # Only the pages take the token in the query (a browser opens them).
        query = await client.get(f"/admin/asyncapi.json?token={TOKEN}")
        assert query.status_code == 401
        wrong = await client.get("/admin/asyncapi.json", headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        response = await client.get("/admin/asyncapi.json", headers=AUTH)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.headers["cache-control"] == "no-store"
        assert response.json() == json.loads(json.dumps(document(bus)))
        assert list(response.json()["operations"]) == ["receive-orders.created-mailer"]


async def test_without_a_token_the_document_is_open_like_every_route() -> None:
    async with admin(shop()) as client:
        assert (await client.get("/admin/asyncapi.json")).status_code == 200
        assert (await client.get("/admin/asyncapi")).status_code == 200


async def test_the_document_shows_subscriptions_made_after_the_app() -> None:
    bus = shop()
    async with admin(bus, token=TOKEN) as client:

        @bus.subscribe("orders.*", group="audit")
        async def audit(order: dict[str, Any]) -> None:
            """Keep a record."""

        spec = (await client.get("/admin/asyncapi.json", headers=AUTH)).json()
    assert list(spec["operations"]) == [
        "receive-orders.created-mailer",
        "receive-orders.any-audit",
    ]
    assert spec["operations"]["receive-orders.any-audit"]["description"] == "Keep a record."


async def test_a_mapping_gives_the_document_its_title_version_and_publications() -> None:
    options = {
        "title": "Shop",
        "version": "3.1.4",
        "description": "Orders in, mails out.",
        "publications": {"orders.created": Order},
    }
    bus = shop()
    async with admin(bus, token=TOKEN, asyncapi=options) as client:
        spec = (await client.get("/admin/asyncapi.json", headers=AUTH)).json()
    assert spec == json.loads(json.dumps(document(bus, **options)))
    assert spec["info"] == {
        "title": "Shop",
        "version": "3.1.4",
        "description": "Orders in, mails out.",
    }
    assert "send-orders.created" in spec["operations"]


async def test_asyncapi_false_serves_neither_route() -> None:
    async with admin(shop(), token=TOKEN, asyncapi=False) as client:
        for path in ("/admin/asyncapi.json", "/admin/asyncapi"):
            assert (await client.get(path, headers=AUTH)).status_code == 404
        assert (await client.get("/admin/stats", headers=AUTH)).status_code == 200


@pytest.mark.parametrize(
    ("asyncapi", "message"),
    [
        ({"titel": "Shop"}, "unknown option\\(s\\) 'titel'; expected some of description, "),
        ({"version": 2}, "version must be a non-empty string"),
        ({"publications": {"orders..x": Order}}, "publications: pattern 'orders..x'"),
        ("yes", "asyncapi must be a bool or a mapping"),
    ],
)
def test_bad_asyncapi_options_fail_when_the_app_is_made(asyncapi: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        admin_app(shop(), asyncapi=asyncapi)


async def test_the_page_is_self_contained_and_takes_the_token_in_the_query() -> None:
    async with admin(shop(), token=TOKEN) as client:
        assert (await client.get("/admin/asyncapi")).status_code == 401
        for url, headers in ((f"/admin/asyncapi?token={TOKEN}", {}), ("/admin/asyncapi", AUTH)):
            response = await client.get(url, headers=headers)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/html")
    html = response.text
    policy = response.headers["content-security-policy"]
    assert response.headers["cache-control"] == "no-store"
    # Nothing is loaded from elsewhere: no URL in the page but a data: one, no http(s).
    assert all(url.startswith("data:") for url in re.findall(r'(?:src|href)="([^"]*)"', html))
    assert re.findall(r"https?://", html) == []
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in policy
    assert "connect-src 'self'" in policy
    # The script reads the document next to the page, passing the query token on.
    assert '.replace(/\\/+$/, "") + ".json"' in html
    assert '"Bearer " + token' in html
