"""Tracing with OpenTelemetry: the exact span tree of each way a message travels.

Spans go to the SDK's in-memory exporter; each test prints the finished spans as a
tree (``tests/_spans.py``) and compares it whole, then checks the attributes, links,
events and statuses that the tree line does not show.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asyncbus import (
    DEADLETTER_TOPIC,
    Backpressure,
    Bus,
    DeadLetter,
    Envelope,
    PublishTimeout,
    Reject,
    Retry,
)
from asyncbus._instrument import Instrumentation
from asyncbus._observe import attach
from asyncbus.integrations.opentelemetry import instrument, uninstrument

_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)
spans_module = importlib.import_module("_spans")
tree, records, named = spans_module.tree, spans_module.records, spans_module.named

pytestmark = pytest.mark.anyio


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def traced_bus(provider: TracerProvider, **options: Any) -> Bus:
    bus = Bus(**options)
    instrument(bus, tracer_provider=provider)
    return bus


def finished(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    return records(exporter.get_finished_spans())


async def echo(payload: Any) -> Any:
    return payload


# -- the span trees ----------------------------------------------------------------


async def test_fan_out_gives_each_group_its_own_consumer_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = traced_bus(provider)
    for group in ("audit", "mailer", "billing"):
        bus.subscribe("orders.created", echo, group=group)
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("orders.created", {"id": 1})
            await bus.drain()

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "publish orders.created [PRODUCER]",
            "  process orders.created [CONSUMER] group=audit attempt=1 outcome=acked",
            "  process orders.created [CONSUMER] group=billing attempt=1 outcome=acked",
            "  process orders.created [CONSUMER] group=mailer attempt=1 outcome=acked",
        ]
    )
    (producer,) = named(spans, "publish orders.created")
    assert producer["attributes"] == {
        "messaging.system": "asyncbus",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": "orders.created",
        "messaging.message.id": receipt.id,
        "messaging.message.conversation_id": receipt.id,
    }
    consumers = named(spans, "process orders.created")
    (audit,) = [s for s in consumers if s["attributes"]["messaging.consumer.group.name"] == "audit"]
    assert audit["attributes"] == {
        "messaging.system": "asyncbus",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "orders.created",
        "messaging.destination.template": "orders.created",
        "messaging.destination.subscription.name": "orders.created@audit",
        "messaging.consumer.group.name": "audit",
        "messaging.message.id": receipt.id,
        "messaging.message.conversation_id": receipt.id,
        "messaging.asyncbus.attempt": 1,
        "messaging.asyncbus.outcome": "acked",
    }
    assert {span["status"] for span in spans} == {"UNSET"}


async def test_a_retry_is_an_event_and_the_next_attempt_is_linked_to_the_first(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async def flaky(envelope: Envelope) -> None:
        if envelope.attempt < 3:
            raise ConnectionError(f"gateway down (attempt {envelope.attempt})")

    bus = traced_bus(provider)
    bus.subscribe("pay", flaky, group="charger", retry=Retry(backoff=0.01, jitter=False))
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("pay", 7)
            await bus.drain()
            assert bus.statistics().stage("pay@charger").acked == 1

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "publish pay [PRODUCER]",
            "  process pay [CONSUMER] group=charger attempt=1 outcome=retry event=retry",
            "  process pay [CONSUMER] group=charger attempt=2 outcome=retry event=retry"
            " link=process pay#1",
            "  process pay [CONSUMER] group=charger attempt=3 outcome=acked link=process pay#1",
        ]
    )
    first, second, _ = named(spans, "process pay")
    assert first["events"] == [
        {
            "name": "retry",
            "attributes": {
                "messaging.asyncbus.retry.delay": 0.01,
                "messaging.asyncbus.retry.attempt": 2,
                "exception.type": "ConnectionError",
                "exception.message": "gateway down (attempt 1)",
            },
        }
    ]
    assert second["events"][0]["attributes"]["messaging.asyncbus.retry.delay"] == 0.02
    assert {span["status"] for span in spans} == {"UNSET"}


async def test_a_dead_letter_sets_error_with_the_reason_and_records_the_exception(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async def broken(payload: Any) -> None:
        raise ValueError(f"cannot charge {payload}")

    async def refuse(payload: Any) -> None:
        raise Reject("not ours")

    bus = traced_bus(provider)
    bus.subscribe("pay", broken, group="charger", retry=Retry(max_attempts=2, backoff=0.01))
    bus.subscribe("refund", refuse, group="refunder")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("pay", 5)
            await bus.publish("refund", 6)
            await bus.drain()
            assert len(bus.dead_letters) == 2

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "publish pay [PRODUCER]",
            "  process pay [CONSUMER] group=charger attempt=1 outcome=retry event=retry",
            "  process pay [CONSUMER] group=charger attempt=2 outcome=dead_lettered"
            " ERROR(handler_failed: ValueError: cannot charge 5) event=exception"
            " link=process pay#1",
            "publish refund [PRODUCER]",
            "  process refund [CONSUMER] group=refunder attempt=1 outcome=dead_lettered"
            " ERROR(rejected: Reject: not ours) event=exception",
        ]
    )
    _, last = named(spans, "process pay")
    assert last["attributes"]["messaging.asyncbus.dead_letter.reason"] == "handler_failed"
    assert last["attributes"]["error.type"] == "handler_failed"
    (exception,) = last["events"]
    assert exception["attributes"]["exception.type"] == "ValueError"
    assert exception["attributes"]["exception.message"] == "cannot charge 5"


async def test_an_expired_envelope_is_dead_lettered_without_an_exception(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = traced_bus(provider)
    bus.subscribe("t", echo, group="g")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1, ttl=1e-9)
            await bus.drain()

    assert tree(finished(exporter)) == "\n".join(
        [
            "publish t [PRODUCER]",
            "  process t [CONSUMER] group=g attempt=1 outcome=dead_lettered ERROR(expired)",
        ]
    )


async def test_a_three_stage_slip_is_one_trace_hop_by_hop(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = traced_bus(provider)
    for topic in ("ingest", "transform", "sink"):
        bus.subscribe(topic, echo, group=topic)
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("ingest", "raw", slip=["transform", "sink"])
            await bus.drain()

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "publish ingest [PRODUCER]",
            "  process ingest [CONSUMER] group=ingest attempt=1 outcome=acked",
            "    forward transform [PRODUCER]",
            "      process transform [CONSUMER] group=transform attempt=1 outcome=acked",
            "        forward sink [PRODUCER]",
            "          process sink [CONSUMER] group=sink attempt=1 outcome=acked",
        ]
    )
    assert {span["attributes"]["messaging.message.conversation_id"] for span in spans} == {
        receipt.id
    }
    (hop,) = named(spans, "forward transform")
    assert hop["attributes"]["messaging.operation.name"] == "forward"
    assert hop["attributes"]["messaging.asyncbus.causation_id"] == receipt.id


async def test_a_request_and_its_reply_are_one_trace(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async def add(payload: dict[str, int]) -> int:
        return payload["a"] + payload["b"]

    bus = traced_bus(provider)
    bus.subscribe("math.add", add, group="calc")
    with anyio.fail_after(10):
        async with bus:
            assert await bus.request("math.add", {"a": 1, "b": 2}) == 3
            await bus.drain()

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "request math.add [PRODUCER]",
            "  process math.add [CONSUMER] group=calc attempt=1 outcome=acked",
            "    reply [PRODUCER]",
        ]
    )
    (request,) = named(spans, "request math.add")
    (reply,) = named(spans, "reply")
    assert request["attributes"]["messaging.operation.name"] == "request"
    assert reply["attributes"]["messaging.destination.temporary"] is True
    assert (
        reply["attributes"]["messaging.destination.name"]
        == request["attributes"]["messaging.message.id"]
    )  # in memory a request's reply address is its id
    assert (
        reply["attributes"]["messaging.message.conversation_id"]
        == (request["attributes"]["messaging.message.id"])
    )


async def test_a_replay_continues_the_trace_the_envelope_was_first_sent_in(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    fail = True

    async def flaky(payload: Any) -> None:
        if fail:
            raise RuntimeError("down")

    bus = traced_bus(provider)
    bus.subscribe("jobs", flaky, group="worker")
    tracer = provider.get_tracer("test")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1)
            await bus.drain()
            fail = False
            with tracer.start_as_current_span("operator replays"):
                await bus.dead_letters.replay(receipt.id)
            await bus.drain()

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "operator replays [INTERNAL]",
            "publish jobs [PRODUCER]",
            "  process jobs [CONSUMER] group=worker attempt=1 outcome=dead_lettered"
            " ERROR(handler_failed: RuntimeError: down) event=exception",
            "  replay jobs [PRODUCER] link=operator replays#None",
            "    process jobs [CONSUMER] group=worker attempt=1 outcome=acked",
        ]
    )
    (replay,) = named(spans, "replay jobs")
    assert replay["attributes"]["messaging.message.id"] == receipt.id


async def test_what_a_handler_publishes_is_a_child_of_its_consumer_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async def place(envelope: Envelope) -> None:
        await bus.publish("orders.placed", envelope.payload)
        bus.publish_nowait("orders.audit", envelope.payload)

    def ship_in_a_thread(payload: Any) -> None:  # offloaded to the worker pool
        bus.publish_threadsafe("orders.shipped", payload).result(timeout=5)

    bus = traced_bus(provider)
    bus.subscribe("orders.new", place, group="placer")
    bus.subscribe("orders.placed", ship_in_a_thread, group="shipper")
    bus.subscribe("orders.audit", echo, group="auditor")
    bus.subscribe("orders.shipped", echo, group="tracker")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("orders.new", 1)
            await bus.drain()

    assert tree(finished(exporter)) == "\n".join(
        [
            "publish orders.new [PRODUCER]",
            "  process orders.new [CONSUMER] group=placer attempt=1 outcome=acked",
            "    publish orders.audit [PRODUCER]",
            "      process orders.audit [CONSUMER] group=auditor attempt=1 outcome=acked",
            "    publish orders.placed [PRODUCER]",
            "      process orders.placed [CONSUMER] group=shipper attempt=1 outcome=acked",
            "        publish orders.shipped [PRODUCER]",
            "          process orders.shipped [CONSUMER] group=tracker attempt=1 outcome=acked",
        ]
    )


async def test_a_publish_is_a_child_of_the_span_current_where_it_is_made(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = traced_bus(provider)
    bus.subscribe("t", echo, group="g")
    tracer = provider.get_tracer("test")
    with anyio.fail_after(10):
        async with bus:
            with tracer.start_as_current_span("POST /orders"):
                await bus.publish("t", 1)
            await bus.drain()

    assert tree(finished(exporter)) == "\n".join(
        [
            "POST /orders [INTERNAL]",
            "  publish t [PRODUCER]",
            "    process t [CONSUMER] group=g attempt=1 outcome=acked",
        ]
    )


async def test_the_context_travels_in_the_w3c_headers_with_baggage(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    seen: list[tuple[dict[str, str], str | None, int]] = []

    async def look(envelope: Envelope) -> None:
        current = trace.get_current_span().get_span_context().span_id
        seen.append((dict(envelope.headers), baggage.get_baggage("tenant"), current))

    bus = traced_bus(provider)
    bus.subscribe("t", look, group="g")
    with anyio.fail_after(10):
        async with bus:
            token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
            try:
                await bus.publish("t", 1, headers={"k": "v"})
            finally:
                otel_context.detach(token)
            await bus.drain()

    spans = finished(exporter)
    (producer,) = named(spans, "publish t")
    (consumer,) = named(spans, "process t")
    ((headers, tenant, current),) = seen
    flags = headers.pop("traceparent").removeprefix(
        f"00-{producer['trace_id']}-{producer['span_id']}-"
    )
    assert int(flags, 16) & 1  # sampled
    assert headers == {"k": "v", "baggage": "tenant=acme"}
    assert tenant == "acme"  # the handler runs in the extracted context
    assert f"{current:016x}" == consumer["span_id"]  # with its own span current


async def test_a_dead_letter_announcement_is_traced_from_where_the_envelope_died(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    alerts: list[DeadLetter] = []

    async def broken(payload: Any) -> None:
        raise RuntimeError("boom")

    async def alert(entry: DeadLetter) -> None:
        alerts.append(entry)

    bus = traced_bus(provider)
    bus.subscribe("t", broken, group="g")
    bus.subscribe(DEADLETTER_TOPIC, alert, group="alerts")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()
    assert len(alerts) == 1

    assert tree(finished(exporter)) == "\n".join(
        [
            "publish t [PRODUCER]",
            "  process t [CONSUMER] group=g attempt=1 outcome=dead_lettered"
            " ERROR(handler_failed: RuntimeError: boom) event=exception",
            "    announce $deadletter [PRODUCER]",
            "      process $deadletter [CONSUMER] group=alerts attempt=1 outcome=acked",
        ]
    )


async def test_a_publish_that_times_out_ends_its_span_with_the_error(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    gate = anyio.Event()

    async def held(payload: Any) -> None:
        await gate.wait()

    bus = traced_bus(provider)
    bus.subscribe("t", held, group="g", capacity=1, backpressure=Backpressure.BLOCK)
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1)  # taken by the consumer
            await bus.publish("t", 2)  # fills the stage
            with pytest.raises(PublishTimeout):
                await bus.publish("t", 3, timeout=0.01)
            gate.set()
            await bus.drain()

    spans = finished(exporter)
    failed = [span for span in spans if span["status"] == "ERROR"]
    assert [(span["name"], span["description"]) for span in failed] == [
        ("publish t", "PublishTimeout: stage 't@g' stayed full for 0.01s")
    ]
    assert len(named(spans, "process t")) == 2


async def test_publish_many_gives_each_envelope_its_own_producer_span_and_trace(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = traced_bus(provider)
    bus.subscribe("batch.t", echo, group="g")
    with anyio.fail_after(10):
        async with bus:
            receipts = await bus.publish_many("batch.t", [1, 2, 3])
            await bus.drain()

    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "publish batch.t [PRODUCER]",
            "  process batch.t [CONSUMER] group=g attempt=1 outcome=acked",
        ]
        * 3
    )
    producers = named(spans, "publish batch.t")
    assert sorted(span["attributes"]["messaging.message.id"] for span in producers) == [
        receipt.id for receipt in receipts
    ]
    assert len({span["trace_id"] for span in producers}) == 3  # siblings, not nested
    for producer in producers:
        (consumer,) = [
            span
            for span in named(spans, "process batch.t")
            if span["parent_id"] == producer["span_id"]
        ]
        assert (
            consumer["attributes"]["messaging.message.id"]
            == producer["attributes"]["messaging.message.id"]
        )


async def test_publish_many_cut_off_by_its_timeout_ends_each_span_by_its_fate(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    gate = anyio.Event()

    async def held(payload: Any) -> None:
        await gate.wait()

    bus = traced_bus(provider)
    bus.subscribe("batch.full", held, group="g", capacity=1, backpressure=Backpressure.BLOCK)
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("batch.full", 0)  # taken by the consumer
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(PublishTimeout) as caught:
                await bus.publish_many("batch.full", [1, 2, 3], timeout=0.01)
            gate.set()
            await bus.drain()

    assert len(caught.value.receipts) == 1
    spans = finished(exporter)
    producers = named(spans, "publish batch.full")
    assert len(producers) == 4
    failed = [span for span in producers if span["status"] == "ERROR"]
    # 2 timed out waiting for room, 3 was never published: both end with the error.
    assert [span["description"] for span in failed] == [
        "PublishTimeout: stage 'batch.full@g' stayed full past the timeout of 0.01s for the batch"
    ] * 2
    assert len(named(spans, "process batch.full")) == 2


async def test_an_envelope_abandoned_at_shutdown_ends_its_span_as_abandoned(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    started = anyio.Event()

    async def stuck(payload: Any) -> None:
        started.set()
        await anyio.sleep_forever()

    bus = traced_bus(provider)
    bus.subscribe("t", stuck, group="g")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1)
            await started.wait()
            report = await bus.aclose(timeout=0.05)
    assert len(report.abandoned) == 1

    assert tree(finished(exporter)) == "\n".join(
        [
            "publish t [PRODUCER]",
            "  process t [CONSUMER] group=g attempt=1 outcome=abandoned"
            " ERROR(abandoned: cancelled unsettled)",
        ]
    )


# -- instrumenting -------------------------------------------------------------------


async def test_without_an_sdk_provider_nothing_is_attached() -> None:
    for provider in (trace.NoOpTracerProvider(), trace.ProxyTracerProvider()):
        bus = Bus()
        instrument(bus, tracer_provider=provider)
        assert bus._services.instrumentation is None  # the hot path stays as fast as ever
    bus = Bus()
    instrument(bus)  # the global provider: the API's proxy while no SDK is set
    assert bus._services.instrumentation is None


async def test_uninstrument_stops_tracing_and_instrument_twice_traces_once(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = Bus()
    bus.subscribe("t", echo, group="g")
    instrument(bus, tracer_provider=provider)
    instrument(bus, tracer_provider=provider)
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()
            uninstrument(bus)
            uninstrument(bus)  # twice: nothing more happens
            await bus.publish("t", 2)
            await bus.drain()
    assert tree(finished(exporter)) == "\n".join(
        ["publish t [PRODUCER]", "  process t [CONSUMER] group=g attempt=1 outcome=acked"]
    )
    assert bus._services.instrumentation is None


async def test_contextvars_and_tracing_together(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from contextvars import ContextVar

    request_id: ContextVar[str] = ContextVar("request_id")
    seen: list[tuple[str, dict[str, str]]] = []

    async def look(envelope: Envelope) -> Any:
        seen.append((request_id.get("-"), dict(envelope.headers)))
        return envelope.payload

    bus = traced_bus(provider, propagate_contextvars=[request_id])
    bus.subscribe("a", look, group="a")
    bus.subscribe("b", look, group="b")
    with anyio.fail_after(10):
        async with bus:
            request_id.set("r-1")
            await bus.publish("a", 1, slip=["b"])
            await bus.drain()

    assert [value for value, _ in seen] == ["r-1", "r-1"]
    assert all(set(headers) == {"traceparent"} for _, headers in seen)
    assert tree(finished(exporter)).count("\n") == 3


class _Broken(Instrumentation):
    """An observer whose every hook raises."""

    def send(self, kind: Any, envelope: Envelope, system: str) -> tuple[Envelope, object]:
        raise RuntimeError("send")

    def enter(self, consumer: Any, envelope: Envelope) -> object:
        raise RuntimeError("enter")


class _BrokenExit(Instrumentation):
    def exit(self, token: object, result: Any) -> None:
        raise RuntimeError("exit")

    def sent(self, token: object, receipt: Any, error: Any) -> None:
        raise RuntimeError("sent")


async def test_an_observer_that_raises_never_breaks_the_bus(
    provider: TracerProvider, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    async def half(payload: int) -> int:
        if payload % 2:
            raise RuntimeError("odd")
        return payload

    bus = Bus()
    attach(bus, _Broken())
    instrument(bus, tracer_provider=provider)
    attach(bus, _BrokenExit())
    bus.subscribe("t", half, group="g")
    with anyio.fail_after(10):
        async with bus:
            for n in range(4):
                await bus.publish("t", n)
            await bus.drain()
    stage = bus.statistics().stage("t@g")
    assert (stage.published, stage.acked, stage.dead_lettered) == (4, 2, 2)
    assert len(named(finished(exporter), "process t")) == 4  # the others still observed
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for hook in ("failed on send", "failed on enter", "hook", "sent", "exit"):
        assert hook in logged


def test_import_asyncbus_imports_neither_opentelemetry_nor_prometheus() -> None:
    code = (
        "import sys, asyncbus, asyncbus.integrations\n"
        "bus = asyncbus.Bus()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('opentelemetry', 'prometheus_client'))\n"
        "print(loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


async def test_publish_threadsafe_from_a_plain_thread_is_a_child_of_that_thread_s_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = traced_bus(provider)
    bus.subscribe("t", echo, group="g")
    tracer = provider.get_tracer("test")

    def from_thread() -> None:
        with tracer.start_as_current_span("job"):
            bus.publish_threadsafe("t", 1).result(timeout=5)

    with anyio.fail_after(10):
        async with bus:
            await anyio.to_thread.run_sync(from_thread)
            await bus.drain()
    assert tree(finished(exporter)) == "\n".join(
        [
            "job [INTERNAL]",
            "  publish t [PRODUCER]",
            "    process t [CONSUMER] group=g attempt=1 outcome=acked",
        ]
    )


async def test_a_batch_handler_gives_each_envelope_its_own_consumer_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from asyncbus import Batch, BatchError, Reject

    bus = traced_bus(provider)
    calls: list[list[int]] = []

    @bus.subscribe("rows", group="g", batch=Batch(max_size=10, max_wait=0))
    async def insert(items: list[int]) -> None:
        calls.append(items)
        raise BatchError({items.index(1): Reject("bad row")})

    with anyio.fail_after(10):
        async with bus:
            for n in range(3):
                bus.publish_nowait("rows", n)
            await bus.drain()

    assert calls == [[0, 1, 2]]
    spans = finished(exporter)
    assert tree(spans) == "\n".join(
        [
            "publish rows [PRODUCER]",
            "  process rows [CONSUMER] group=g attempt=1 outcome=acked",
            "publish rows [PRODUCER]",
            "  process rows [CONSUMER] group=g attempt=1 outcome=dead_lettered"
            " ERROR(rejected: Reject: bad row) event=exception",
            "publish rows [PRODUCER]",
            "  process rows [CONSUMER] group=g attempt=1 outcome=acked",
        ]
    )
