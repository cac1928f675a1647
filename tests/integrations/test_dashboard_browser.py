"""The admin dashboard in a real headless Chromium, driven by Playwright.

Uses Debian's ``chromium`` (``apt-get install -y chromium``), never a browser that
Playwright downloads. Without it the test is skipped, unless the environment sets
``ASYNCBUS_REQUIRE_SERVICES=1`` (as CI does): then a missing browser is a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from asyncbus import HEADER_REPLAYED, Adaptive, Admission, Bus, Envelope, _control
from asyncbus.integrations.starlette import admin_app

pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio"), pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "dashboard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STAGE = "orders.created@fulfil"
TIMEOUT_MS = 15_000


def _unavailable(reason: str) -> None:
    if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (ASYNCBUS_REQUIRE_SERVICES=1: the browser test must run)")
    pytest.skip(reason)


@pytest.fixture
def chromium() -> Path:
    """Debian's Chromium, and Playwright to drive it."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        _unavailable("playwright is not installed: pip install -e '.[test]'")
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install -y chromium")
    return CHROMIUM


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # A server inside a test must leave the test runner's signal handlers alone.
        yield


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port, in this event loop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
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
                yield f"http://127.0.0.1:{port}"
            finally:
                server.should_exit = True
    finally:
        sock.close()


@pytest.mark.timeout(120)
async def test_dashboard_updates_live_and_replays_a_dead_letter(chromium: Path) -> None:
    from playwright.async_api import async_playwright, expect

    bus = Bus()
    fulfilled: list[int] = []

    @bus.subscribe("orders.created", group="fulfil")
    async def fulfil(env: Envelope) -> None:
        if env.payload.get("fail") and HEADER_REPLAYED not in env.headers:
            raise ValueError(f"warehouse rejected order {env.payload['id']}")
        fulfilled.append(env.payload["id"])

    with anyio.fail_after(90):
        async with bus, serving(admin_app(bus, token=TOKEN)) as url, async_playwright() as pw:
            for i in range(3):
                await bus.publish("orders.created", {"id": i, "fail": i == 1})
            await bus.drain(timeout=5)
            (dead,) = bus.dead_letters.list()
            dead_id = dead.envelope.id

            browser = await pw.chromium.launch(
                executable_path=str(chromium), args=CHROMIUM_ARGS, timeout=30_000
            )
            try:
                page = await browser.new_page()
                page.set_default_timeout(TIMEOUT_MS)
                errors: list[str] = []
                page.on("pageerror", lambda error: errors.append(str(error)))
                # Console errors include Content-Security-Policy violations and failed loads.
                page.on(
                    "console",
                    lambda message: (
                        errors.append(message.text) if message.type == "error" else None
                    ),
                )
                await page.goto(f"{url}/?token={TOKEN}")

                row = page.locator(f'#stages tr[data-stage="{STAGE}"]')
                published = row.locator('td[data-field="published"]')
                acked = row.locator('td[data-field="acked"]')
                await expect(page.locator("#status")).to_have_text("live", timeout=TIMEOUT_MS)
                await expect(published).to_have_text("3", timeout=TIMEOUT_MS)
                await expect(acked).to_have_text("2", timeout=TIMEOUT_MS)
                await expect(row.locator('td[data-field="dead_lettered"]')).to_have_text("1")
                await expect(
                    page.locator('#by-reason [data-reason="handler_failed"] .count')
                ).to_have_text("1")

                # A marker on the window survives only if the page is never reloaded.
                await page.evaluate("window.__sameDocument = true")
                for i in range(3, 8):
                    await bus.publish("orders.created", {"id": i})
                await bus.drain(timeout=5)
                await expect(published).to_have_text("8", timeout=TIMEOUT_MS)
                await expect(acked).to_have_text("7", timeout=TIMEOUT_MS)

                dead_row = page.locator(f'#dead-letters tr[data-dead-letter="{dead_id}"]')
                await expect(dead_row).to_have_count(1)
                await expect(dead_row.locator('td[data-field="error"]')).to_contain_text(
                    "ValueError: warehouse rejected order 1"
                )
                await dead_row.locator("button.replay").click()
                await expect(dead_row).to_have_count(0, timeout=TIMEOUT_MS)
                await expect(page.locator("#notice")).to_contain_text(f"Replayed {dead_id}")
                await bus.drain(timeout=5)
                await expect(acked).to_have_text("8", timeout=TIMEOUT_MS)
                await expect(page.locator("#no-dead-letters")).to_be_visible()
                # Stays gone on the next polls too.
                await expect(page.locator('[data-total="dead_letter_queue"]')).to_have_text("0")
                await expect(dead_row).to_have_count(0)

                assert await page.evaluate("window.__sameDocument") is True
                assert errors == []
            finally:
                await browser.close()

    assert bus.dead_letters.get(dead_id) is None
    assert sorted(fulfilled) == list(range(8))
    stage = bus.statistics().stage(STAGE)
    assert (stage.published, stage.acked, stage.dead_lettered, stage.depth, stage.in_flight) == (
        9,
        8,
        1,
        0,
        0,
    )


@pytest.mark.timeout(120)
async def test_dashboard_shows_the_limit_and_shedding_live(
    chromium: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from playwright.async_api import async_playwright, expect

    now = [0.0]
    monkeypatch.setattr(_control, "default_clock", lambda: now[0])
    started = {n: anyio.Event() for n in range(1, 8)}
    release = {n: anyio.Event() for n in range(1, 8)}

    async def handle(n: int) -> None:
        started[n].set()
        await release[n].wait()

    bus = Bus()
    bus.subscribe(
        "work",
        handle,
        group="w",
        concurrency=Adaptive(min=1, max=8),
        admission=Admission(target_wait=1.0, interval=1.0),
    )
    with anyio.fail_after(90):
        async with bus, serving(admin_app(bus, token=TOKEN)) as url, async_playwright() as pw:
            # Six wait from t=0; at t=3 the oldest has stood above 1 s for an interval.
            for n in range(1, 7):
                await bus.publish("work", n)
            await started[1].wait()
            now[0] = 1.5
            release[1].set()
            await started[2].wait()
            now[0] = 3.0
            await bus.publish("work", 7)
            release[2].set()
            await started[7].wait()  # 3..6 shed, 7 (the newest) served

            browser = await pw.chromium.launch(
                executable_path=str(chromium), args=CHROMIUM_ARGS, timeout=30_000
            )
            try:
                page = await browser.new_page()
                page.set_default_timeout(TIMEOUT_MS)
                await page.goto(f"{url}/?token={TOKEN}")
                row = page.locator('#stages tr[data-stage="work@w"]')
                shed = row.locator('td[data-field="shed"]')
                await expect(shed).to_have_text("4 shedding", timeout=TIMEOUT_MS)
                await expect(row.locator('td[data-field="in_flight"]')).to_have_text("1 / 1")
                await expect(row.locator('td[data-field="saturation"]')).to_have_text("100%")
                await expect(
                    page.locator('#by-reason [data-reason="overload"] .count')
                ).to_have_text("4")
                release[7].set()
                await bus.drain(timeout=5)
                await expect(shed).to_have_text("4", timeout=TIMEOUT_MS)  # the queue emptied
                await expect(row.locator('td[data-field="saturation"]')).to_have_text("0%")
            finally:
                await browser.close()
    stage = bus.statistics().stage("work@w")
    assert (stage.published, stage.acked, stage.shed, stage.dead_lettered) == (7, 3, 4, 4)


@pytest.mark.timeout(120)
async def test_dashboard_shows_schedules_and_scheduled_envelopes(chromium: Path) -> None:
    from playwright.async_api import expect

    bus = Bus()
    ticked = anyio.Event()

    @bus.periodic(every=0.1, name="often", group="janitor")
    async def often(payload: Any) -> None:
        ticked.set()

    hourly = bus.schedule("reports", every=3600, name="hourly")
    with anyio.fail_after(90):
        async with bus, serving(admin_app(bus, token=TOKEN)) as url:
            await bus.publish("reports", 1, delay=600)
            await ticked.wait()
            async with browser_page(chromium) as page:
                await page.goto(f"{url}/?token={TOKEN}")
                await expect(page.locator('[data-total="scheduled"]')).to_have_text("1")
                row = page.locator('#schedules tr[data-schedule="often"]')
                await expect(row.locator('td[data-field="topic"]')).to_have_text("periodic.often")
                await expect(row.locator('td[data-field="when"]')).to_have_text("every 0.1 s")
                await expect(row.locator('td[data-field="last_outcome"]')).to_have_text("published")
                await expect(row.locator('td[data-field="last_fire"]')).to_have_text(
                    re.compile(r"^\d+ s ago$")
                )
                other = page.locator('#schedules tr[data-schedule="hourly"]')
                await expect(other.locator('td[data-field="when"]')).to_have_text("every 3600 s")
                await expect(other.locator('td[data-field="next_fire"]')).to_have_text(
                    re.compile(r"^in \d+ (s|min|h)$")
                )
                # (an en dash: no tick yet)
                await expect(other.locator('td[data-field="last_fire"]')).to_have_text("\u2013")
                await expect(other.locator('td[data-field="fired"]')).to_have_text("0")
                await expect(page.locator("#no-schedules")).to_be_hidden()

                hourly.last_outcome = "failed: TransportError: the broker is down"
                outcome = other.locator('td[data-field="last_outcome"]')
                await expect(outcome).to_have_text("failed: TransportError: the broker is down")
                await expect(outcome).to_have_class(re.compile(r"\bbad\b"))
                assert await bus.cancel_scheduled(bus.scheduled()[0].id)
                await expect(page.locator('[data-total="scheduled"]')).to_have_text("0")


async def reserve_stock(order: dict[str, Any]) -> None:
    """A handler with the default group (its module and name), as most services have."""


async def bill_customer(order: dict[str, Any]) -> None:
    if order["id"] % 100 == 0:
        raise ValueError("card declined")


@contextlib.asynccontextmanager
async def browser_page(chromium: Path, width: int = 1280) -> AsyncIterator[Any]:
    """A page of a headless Chromium, ``width`` CSS pixels wide."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=str(chromium), args=CHROMIUM_ARGS, timeout=30_000
        )
        try:
            page = await browser.new_page(viewport={"width": width, "height": 800})
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            await browser.close()


async def _every_column_in_view(page: Any) -> None:
    """No column of the stage table is outside its panel (none hidden in a scroller)."""
    panel = page.locator("#stages").locator("xpath=..")
    widths = await panel.evaluate("(panel) => [panel.scrollWidth, panel.clientWidth]")
    assert widths[0] <= widths[1], f"the stage table overflows its panel: {widths}"
    box = await panel.bounding_box()
    assert box is not None
    headers = page.locator("#stages thead th")
    assert await headers.count() == 16
    for index in range(16):
        cell = await headers.nth(index).bounding_box()
        assert cell is not None
        assert cell["x"] + cell["width"] <= box["x"] + box["width"] + 0.5, index
    assert await panel.evaluate("(panel) => panel.classList.contains('overflows')") is False


@pytest.mark.timeout(120)
async def test_at_1280_px_every_stage_column_is_in_view_and_the_totals_say_what_they_count(
    chromium: Path,
) -> None:
    from playwright.async_api import expect

    bus = Bus()
    bus.subscribe("orders.created", reserve_stock)
    bus.subscribe("orders.*", bill_customer, group="billing-and-invoicing", concurrency=8)
    bus.subscribe("orders.created", reserve_stock, group="warehouse.eu-west.reservations")
    with anyio.fail_after(90):
        async with bus, serving(admin_app(bus, token=TOKEN)) as url:
            await bus.publish_many("orders.created", [{"id": n} for n in range(1, 3002)])
            await bus.drain(timeout=20)
            async with browser_page(chromium) as page:
                await page.goto(f"{url}/?token={TOKEN}")
                await expect(page.locator("#status")).to_have_text("live")
                await expect(page.locator('[data-total="published"]')).to_have_text("9003")
                await _every_column_in_view(page)

                # The door's refusals and the dead-letter reason 'rejected' are told apart,
                # and the totals say that they add up every stage an envelope reached.
                labels = {
                    name: (
                        await page.locator(f'[data-total="{name}"]')
                        .locator("xpath=..")
                        .locator(".label")
                        .inner_text()
                    ).lower()
                    for name in ("published", "rejected")
                }
                assert "door" in labels["rejected"], labels
                assert "stage" in labels["published"], labels
                note = await page.locator("#totals-note").inner_text()
                assert "once per stage" in note, note
                header = await page.locator("#stages thead th").nth(8).inner_text()
                assert "door" in header.lower(), header
                assert (
                    "dead letter" in (await page.locator("#by-reason-label").inner_text()).lower()
                )

                # A long-running service: seven-digit counts, a stage shedding.
                stats = await (await page.request.get(f"{url}/stats", headers=AUTH)).json()
                for stage in stats["stages"]:
                    stage.update(
                        {field: 1_234_567 for field in ("published", "acked", "failed")},
                        retried=123_456,
                        dead_lettered=98_765,
                        rejected=12_345,
                        shed=123_456,
                        shedding=True,
                        depth=1000,
                        in_flight=256,
                        limit=256,
                        # The widest timings a loaded machine shows (not today's).
                        latency_p50=0.1234,
                        latency_p99=0.9876,
                        wait_p99=0.5555,
                        deferred=12_345,
                    )
                await page.route(
                    "**/stats",
                    lambda route: route.fulfill(
                        status=200, content_type="application/json", body=json.dumps(stats)
                    ),
                )
                shed = page.locator('#stages td[data-field="shed"]').first
                await expect(shed).to_have_text("123456 shedding")
                await _every_column_in_view(page)

            # Narrower than the table: the scroller says so.
            async with browser_page(chromium, width=700) as page:
                await page.goto(f"{url}/?token={TOKEN}")
                await expect(page.locator("#status")).to_have_text("live")
                await expect(page.locator('[data-total="published"]')).to_have_text("9003")
                panel = page.locator("#stages").locator("xpath=..")
                await expect(panel).to_have_class(re.compile(r"\boverflows\b"))


@pytest.mark.timeout(60)
async def test_a_wrong_or_missing_token_gets_a_page_that_says_what_to_do(chromium: Path) -> None:
    bus = Bus()
    with anyio.fail_after(50):
        async with bus, serving(admin_app(bus, token=TOKEN)) as url:
            async with browser_page(chromium) as page:
                for query, heading in (("?token=not-it", "wrong token"), ("", "token needed")):
                    response = await page.goto(f"{url}/{query}")
                    assert response is not None and response.status == 401
                    assert response.headers["content-type"].startswith("text/html")
                    text = await page.locator("body").inner_text()
                    assert heading in (await page.locator("h1").inner_text()).lower()
                    assert "?token=" in text and "admin_app" in text, text
                    assert "not-it" not in await page.content()  # never echoed back
            # An API client still gets JSON.
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"{url}/?token=not-it")
                assert answer.status_code == 401
                assert answer.json() == {
                    "error": "wrong bearer token: send 'Authorization: Bearer <token>'"
                }


@dataclasses.dataclass
class Parcel:
    """A parcel to ship."""

    id: int
    weight: float


@pytest.mark.timeout(120)
async def test_asyncapi_page_shows_the_document_and_loads_nothing_from_elsewhere(
    chromium: Path,
) -> None:
    from playwright.async_api import async_playwright, expect

    bus = Bus(name="shop")

    @bus.subscribe("parcels.*", group="audit")
    async def audit(parcel: Parcel) -> None:
        """Keep a record of every parcel."""

    document = {"title": "Shop <b>", "version": "2.0.0", "publications": {"parcels.sent": Parcel}}
    with anyio.fail_after(90):
        async with (
            bus,
            serving(admin_app(bus, token=TOKEN, asyncapi=document)) as url,
            async_playwright() as pw,
        ):
            browser = await pw.chromium.launch(
                executable_path=str(chromium), args=CHROMIUM_ARGS, timeout=30_000
            )
            try:
                page = await browser.new_page()
                page.set_default_timeout(TIMEOUT_MS)
                requests: list[str] = []
                errors: list[str] = []
                page.on("request", lambda request: requests.append(request.url))
                page.on("pageerror", lambda error: errors.append(str(error)))
                page.on(
                    "console",
                    lambda message: (
                        errors.append(message.text) if message.type == "error" else None
                    ),
                )
                await page.goto(f"{url}/asyncapi?token={TOKEN}")

                # Text from the document is shown as text, never read as HTML.
                await expect(page.locator("#title")).to_have_text("Shop <b>")
                await expect(page.locator("#version")).to_have_text(
                    "version 2.0.0 · AsyncAPI 3.0.0"
                )
                await expect(page.locator("#status")).to_have_text("")
                receive = page.locator('[data-operation="receive-parcels.any-audit"]')
                await expect(receive.locator(".badge")).to_have_text("receive")
                await expect(receive.locator("h3 code")).to_have_text("parcels.{wildcard1}")
                await expect(receive).to_contain_text("Keep a record of every parcel.")
                payload = receive.locator('[data-message="Parcel"] .payload')
                await expect(payload.locator("a").first).to_have_text("Parcel")
                await expect(payload.locator('[data-property="id"]')).to_have_text("id *: integer")
                send = page.locator('[data-operation="send-parcels.sent"]')
                await expect(send.locator(".badge")).to_have_text("send")
                channel = page.locator('[data-channel="parcels.any"]')
                await expect(channel.locator('[data-parameter="wildcard1"]')).to_contain_text(
                    "any one token"
                )
                parcel = page.locator('[data-schema="Parcel"]')
                await expect(parcel).to_contain_text("A parcel to ship.")
                await expect(parcel.locator('[data-property="weight"]')).to_have_text(
                    "weight *: number"
                )
                await expect(parcel.locator('[data-property="id"]')).to_have_text("id *: integer")
                headers = page.locator('[data-schema="EnvelopeHeaders"]')
                await expect(
                    headers.locator('[data-property="asyncbus-priority"]')
                ).to_contain_text('one of "0", "1", "2"')
                assert await page.locator("#servers-section").is_hidden()
                assert requests == [f"{url}/asyncapi?token={TOKEN}", f"{url}/asyncapi.json"]
                assert errors == []
            finally:
                await browser.close()
