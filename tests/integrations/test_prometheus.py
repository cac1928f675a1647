"""Prometheus metrics: scraped through the admin app, parsed with prometheus_client's
parser, and checked number by number against ``bus.statistics()``."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from asyncbus import Backpressure, Bus, ConfigurationError, Envelope, MemoryTransport, Retry
from asyncbus._observe import stage_timings
from asyncbus.integrations.prometheus import BusCollector
from asyncbus.integrations.starlette import admin_app

pytestmark = pytest.mark.anyio

TOKEN = "metrics-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEDGER = (
    "published",
    "acked",
    "failed",
    "retried",
    "deferred",
    "dead_lettered",
    "rejected",
    "dropped",
    "expired",
    "abandoned",
    "shed",
)
GAUGES = ("depth", "in_flight", "concurrency", "capacity", "limit", "saturation", "shedding")


@asynccontextmanager
async def client_of(bus: Bus, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = admin_app(bus, **options)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as client:
        yield client


def parse(text: str) -> dict[str, list[Sample]]:
    """Samples by sample name (``x_total``, ``x_bucket``, ...), as the parser reads them."""
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def by_stage(samples: list[Sample]) -> dict[str, float]:
    return {sample.labels["stage"]: sample.value for sample in samples}


def busy_bus() -> tuple[Bus, anyio.Event]:
    """Stages that between them fill every ledger column."""
    gate = anyio.Event()
    bus = Bus(name="shop")

    async def fine(payload: Any) -> None:
        pass

    async def flaky(envelope: Envelope) -> None:
        if envelope.payload == "doomed" or envelope.attempt == 1:
            raise RuntimeError("flaky")

    async def held(payload: Any) -> None:
        await gate.wait()

    bus.subscribe("orders.*", fine, group="audit")
    bus.subscribe("orders.paid", flaky, group="charger", retry=Retry(max_attempts=2, backoff=0))
    bus.subscribe("slow", held, group="r", capacity=1, backpressure=Backpressure.REJECT)
    bus.subscribe("slow", held, group="d", capacity=1, backpressure=Backpressure.DROP_NEWEST)
    return bus, gate


async def fill(bus: Bus) -> None:
    for n in range(20):
        await bus.publish("orders.created", n)
    for payload in ("ok", "ok", "doomed"):
        await bus.publish("orders.paid", payload)
    await bus.publish("orders.created", "stale", ttl=1e-9)
    await bus.publish("nobody.listens", 1)
    for n in range(3):  # one handled (held), one queued, one refused or dropped
        await bus.publish("slow", n)


async def test_scraped_metrics_are_the_statistics_number_for_number() -> None:
    bus, gate = busy_bus()
    with anyio.fail_after(20):
        async with bus, client_of(bus, token=TOKEN, metrics=True) as client:
            await fill(bus)
            gate.set()
            await bus.drain()  # from here on nothing moves
            assert (await client.get("/metrics")).status_code == 401
            response = await client.get("/metrics", headers=AUTH)
            statistics = bus.statistics()
            timings = stage_timings(bus)
            dead = Counter((e.stage, e.reason.value) for e in bus.dead_letters.list())

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = parse(response.text)
    names = {stage.name for stage in statistics.stages}
    assert names == {"orders.*@audit", "orders.paid@charger", "slow@r", "slow@d"}
    for column in LEDGER:
        counted = samples[f"asyncbus_stage_{column}_total"]
        assert by_stage(counted) == {s.name: getattr(s, column) for s in statistics.stages}
    for column in GAUGES:
        gauge = samples[f"asyncbus_stage_{column}"]
        assert by_stage(gauge) == {s.name: getattr(s, column) for s in statistics.stages}
    # What the ledger says happened, so the comparison above compared something.
    charger = statistics.stage("orders.paid@charger")
    assert (charger.published, charger.acked, charger.failed, charger.retried) == (3, 2, 4, 3)
    assert charger.dead_lettered == 1
    assert statistics.stage("slow@r").rejected == 1
    assert statistics.stage("slow@d").dropped == 1
    assert statistics.stage("orders.*@audit").expired == 1
    for sample in samples["asyncbus_stage_published_total"]:
        stage = statistics.stage(sample.labels["stage"])
        assert sample.labels == {
            "bus": "shop",
            "stage": stage.name,
            "pattern": stage.topic,
            "group": stage.group,
        }

    for metric, index in (("latency", 0), ("wait", 1)):
        for stage in statistics.stages:
            histogram = timings[stage.name][index]
            buckets = [
                s
                for s in samples[f"asyncbus_stage_{metric}_seconds_bucket"]
                if s.labels["stage"] == stage.name
            ]
            edges = [(float(s.labels["le"]), s.value) for s in buckets]
            assert edges == [*histogram.cumulative(), (float("inf"), histogram.count)]
            (count,) = [
                s.value
                for s in samples[f"asyncbus_stage_{metric}_seconds_count"]
                if s.labels["stage"] == stage.name
            ]
            (total,) = [
                s.value
                for s in samples[f"asyncbus_stage_{metric}_seconds_sum"]
                if s.labels["stage"] == stage.name
            ]
            assert (count, total) == (histogram.count, pytest.approx(histogram.total))
    assert timings["orders.*@audit"][0].count == 3  # 1st, 9th, 17th of 21 admitted

    letters = {
        (s.labels["stage"] or None, s.labels["reason"]): s.value
        for s in samples["asyncbus_dead_letters"]
    }
    assert letters == dict(dead)
    assert letters == {
        ("orders.paid@charger", "handler_failed"): 1,
        ("orders.*@audit", "expired"): 1,
        ("slow@d", "dropped"): 1,
        (None, "no_subscribers"): 1,
    }
    (no_stage,) = [s for s in samples["asyncbus_dead_letters"] if not s.labels["stage"]]
    assert (no_stage.labels["pattern"], no_stage.labels["group"]) == ("", "")
    assert [s.value for s in samples["asyncbus_dead_letters_evicted_total"]] == [0]
    assert [s.value for s in samples["asyncbus_bus_running"]] == [1]
    assert "asyncbus_stage_backlog" not in samples  # in memory there is no broker


async def test_depth_and_in_flight_are_the_moment_s_numbers() -> None:
    bus, gate = busy_bus()
    registry = CollectorRegistry()
    registry.register(BusCollector(bus))
    with anyio.fail_after(20):
        async with bus:
            await fill(bus)
            # Nothing runs between the two reads (no await): the same moment.
            samples = parse(generate_latest(registry).decode())
            statistics = bus.statistics()
            gate.set()
            await bus.drain()
    for column in (*LEDGER, *GAUGES):
        name = f"asyncbus_stage_{column}" + ("_total" if column in LEDGER else "")
        assert by_stage(samples[name]) == {s.name: getattr(s, column) for s in statistics.stages}
    held = [statistics.stage(name) for name in ("slow@r", "slow@d")]
    assert [(stage.depth, stage.in_flight) for stage in held] == [(1, 1), (1, 1)]


async def test_metric_names_follow_prometheus_conventions() -> None:
    bus, gate = busy_bus()
    registry = CollectorRegistry()
    registry.register(BusCollector(bus))
    with anyio.fail_after(20):
        async with bus:
            await fill(bus)
            gate.set()
            await bus.drain()
            text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    assert families
    for family in families:
        assert family.name.startswith("asyncbus_")
        assert family.documentation
        if family.type == "counter":
            assert all(sample.name == f"{family.name}_total" for sample in family.samples)
        if family.type == "histogram":
            assert family.name.endswith("_seconds")
    assert {family.type for family in families} == {"counter", "gauge", "histogram"}


async def test_a_scrape_from_another_thread_reads_the_bus_on_its_own_loop() -> None:
    bus, gate = busy_bus()
    registry = CollectorRegistry()
    registry.register(BusCollector(bus))
    with anyio.fail_after(20):
        async with bus:
            await fill(bus)
            gate.set()
            await bus.drain()
            here = generate_latest(registry)
            there = await anyio.to_thread.run_sync(generate_latest, registry)
    assert parse(here.decode()) == parse(there.decode())
    # A closed bus is read directly.
    assert [s.value for s in parse(generate_latest(registry).decode())["asyncbus_bus_running"]] == [
        0
    ]


class _HeldTransport(MemoryTransport):
    """The in-process broker, whose backlog answers only once ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.answer = anyio.Event()
        self.answered = anyio.Event()
        self.asked = 0

    async def backlog(self, pattern: str, group: str) -> int:
        self.asked += 1
        await self.answer.wait()
        count = await super().backlog(pattern, group)
        # (The reader stores the answer before it next yields: the waiter sees it.)
        self.answered.set()
        return count


async def test_the_broker_backlog_is_read_in_the_background_never_by_a_scrape() -> None:
    gate = anyio.Event()

    async def held(payload: Any) -> None:
        await gate.wait()

    transport = _HeldTransport()
    bus = Bus(transport)
    bus.subscribe("jobs", held, group="w", capacity=2)
    registry = CollectorRegistry()
    registry.register(BusCollector(bus, backlog_interval=0.01))
    with anyio.fail_after(20):
        async with bus:
            for n in range(5):
                await bus.publish("jobs", n)
            # The broker is silent: a scrape still answers, at once, with no backlog.
            first = parse(generate_latest(registry).decode())
            assert "asyncbus_stage_backlog" not in first
            assert "asyncbus_backlog_refreshed_timestamp_seconds" not in first
            transport.answer.set()
            await transport.answered.wait()  # the background task's first answer
            second = parse(generate_latest(registry).decode())
            gate.set()
            await bus.drain()
    # 5 published; the stage holds at most capacity (2) deliveries, unsettled in the
    # broker as well, so the broker's backlog counts all 5.
    assert by_stage(second["asyncbus_stage_backlog"]) == {"jobs@w": 5}
    assert second["asyncbus_backlog_refreshed_timestamp_seconds"][0].value > 0
    assert transport.asked >= 1


async def test_collector_settings_are_checked() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(ConfigurationError):
            BusCollector(Bus(), backlog_interval=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            BusCollector(Bus(), backlog_timeout=bad)  # type: ignore[arg-type]


async def test_metrics_are_only_served_when_asked_for() -> None:
    bus = Bus()
    with anyio.fail_after(20):
        async with bus, client_of(bus) as client:
            assert (await client.get("/metrics")).status_code == 404


async def test_the_grafana_dashboard_queries_only_metrics_the_collector_exposes() -> None:
    import json
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"
    dashboard = json.loads(path.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    expressions = [target["expr"] for panel in panels for target in panel["targets"]]
    variables = dashboard["templating"]["list"]
    expressions += [v["query"]["query"] for v in variables if isinstance(v["query"], dict)]
    queried = {name for expr in expressions for name in re.findall(r"\basyncbus_\w+", expr)}

    # Every family the collector can produce: a bus over a broker, with a dead letter.
    transport = _HeldTransport()
    transport.answer.set()
    bus = Bus(transport)

    async def broken(payload: Any) -> None:
        raise RuntimeError("broken")

    bus.subscribe("jobs", broken, group="w")
    failing = bus.schedule("reports", every=3600, name="hourly")
    collector = BusCollector(bus)
    registry = CollectorRegistry()
    registry.register(collector)
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("jobs", 1)
            await bus.publish("jobs", 2, delay=3600)
            # What a tick that failed to publish leaves (this one is an hour away).
            failing.last_fire = datetime.now(UTC)
            failing.last_outcome = "failed: the broker is down"
            await bus.drain()
            await collector.refresh_backlog()
            exposed = set(parse(generate_latest(registry).decode()))
    assert queried <= exposed, sorted(queried - exposed)
    # ... and the dashboard shows every ledger column and gauge.
    for column in (*LEDGER, *GAUGES):
        assert any(f"asyncbus_stage_{column}" in name for name in queried), column
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["description"]


async def test_one_collector_reports_several_buses_and_a_registry_takes_one() -> None:
    orders, billing = Bus(name="orders"), Bus(name="billing")

    async def fine(payload: Any) -> None:
        pass

    orders.subscribe("orders.created", fine, group="audit")
    billing.subscribe("invoices", fine, group="mailer")
    registry = CollectorRegistry()
    registry.register(BusCollector(orders, billing))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(BusCollector(Bus(name="other")))
    with pytest.raises(ConfigurationError, match="distinct names"):
        BusCollector(Bus(), Bus())
    with anyio.fail_after(20):
        async with orders, billing:
            for _ in range(3):
                await orders.publish("orders.created", 1)
            await billing.publish("invoices", 2)
            await orders.drain()
            await billing.drain()
            samples = parse(generate_latest(registry).decode())
    acked = {
        (s.labels["bus"], s.labels["stage"]): s.value for s in samples["asyncbus_stage_acked_total"]
    }
    assert acked == {("orders", "orders.created@audit"): 3, ("billing", "invoices@mailer"): 1}
    assert {s.labels["bus"]: s.value for s in samples["asyncbus_bus_running"]} == {
        "orders": 1,
        "billing": 1,
    }


async def test_scheduled_envelopes_and_periodic_schedules_are_exposed() -> None:
    bus = Bus(name="clock")
    ticked = anyio.Event()

    @bus.periodic(every=0.05, name="often", group="janitor")
    async def often(payload: Any) -> None:
        ticked.set()

    bus.schedule("reports", every=3600, name="hourly")
    registry = CollectorRegistry()
    registry.register(BusCollector(bus))
    with anyio.fail_after(20):
        async with bus:
            await bus.publish("reports", 1, delay=600)
            await bus.publish("reports", 2, delay=900)
            await ticked.wait()
            # Read on the bus's own loop, with no await between: one moment's numbers.
            samples = parse(generate_latest(registry).decode())
            statistics = bus.statistics()
    assert [(s.labels, s.value) for s in samples["asyncbus_scheduled"]] == [({"bus": "clock"}, 2)]
    schedules = {schedule.name: schedule for schedule in statistics.schedules}
    often_stats, hourly = schedules["often"], schedules["hourly"]
    assert often_stats.next_fire is not None and often_stats.last_fire is not None
    assert hourly.next_fire is not None and hourly.last_fire is None

    def by_schedule(name: str) -> dict[str, float]:
        return {s.labels["schedule"]: s.value for s in samples[name]}

    assert by_schedule("asyncbus_schedule_next_fire_timestamp_seconds") == {
        "often": often_stats.next_fire.timestamp(),
        "hourly": hourly.next_fire.timestamp(),
    }
    assert by_schedule("asyncbus_schedule_last_fire_timestamp_seconds") == {
        "often": often_stats.last_fire.timestamp()
    }
    assert by_schedule("asyncbus_schedule_fired_total") == {
        "often": often_stats.fired,
        "hourly": 0,
    }
    assert [
        (s.labels["schedule"], s.labels["topic"], s.labels["outcome"], s.value)
        for s in samples["asyncbus_schedule_last_outcome"]
    ] == [("often", "periodic.often", "published", 1)]
