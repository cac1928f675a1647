"""asyncbus.testing.capture: what it records, its helpers, and that it cleans up."""

from __future__ import annotations

import functools

import anyio
import pytest

from asyncbus import HEADER_REPLAYED, Bus, ConfigurationError, Envelope
from asyncbus._observe import observers
from asyncbus.testing import Captured, Record, capture

pytestmark = pytest.mark.anyio


async def test_capture_records_topic_payload_headers_and_envelope(bus: Bus) -> None:
    bus.subscribe("orders.created", lambda order: None)
    with capture(bus) as published:
        receipt = await bus.publish("orders.created", {"id": 1}, headers={"k": "v"})
        await bus.drain(timeout=5)

    assert len(published) == 1
    record = published[0]
    assert isinstance(record, Record)
    assert record.topic == "orders.created"
    assert record.payload == {"id": 1}
    assert dict(record.headers) == {"k": "v"}
    assert isinstance(record.envelope, Envelope)
    assert record.envelope.id == receipt.id
    assert list(published) == [record]
    assert published.records == [record]
    assert published.envelopes() == [record.envelope]


async def test_capture_records_publishes_nobody_subscribed_to(bus: Bus) -> None:
    with capture(bus) as published:
        await bus.publish("nobody.home", 1)
        bus.publish_nowait("nobody.home", 2)
    assert published.payloads("nobody.home") == [1, 2]
    assert len(bus.dead_letters) == 2


async def test_topics_and_payloads_keep_publish_order_and_filter_by_pattern(bus: Bus) -> None:
    with capture(bus) as published:
        await bus.publish("orders.created", {"id": 1})
        await bus.publish("users.created", {"id": 7})
        await bus.publish("orders.paid", {"id": 1})
        await bus.publish("orders.created", {"id": 2})

    assert published.topics() == [
        "orders.created",
        "users.created",
        "orders.paid",
        "orders.created",
    ]
    assert published.payloads() == [{"id": 1}, {"id": 7}, {"id": 1}, {"id": 2}]
    assert published.payloads("orders.created") == [{"id": 1}, {"id": 2}]
    assert published.payloads("orders.*") == [{"id": 1}, {"id": 1}, {"id": 2}]
    assert published.payloads(">") == published.payloads()
    assert [record.topic for record in published.select("users.>")] == ["users.created"]
    assert published.payloads("nothing") == []


async def test_capture_with_a_topic_pattern_records_only_matching_topics(bus: Bus) -> None:
    with capture(bus, "orders.*") as orders:
        await bus.publish("orders.created", 1)
        await bus.publish("users.created", 2)
        await bus.publish("orders.created.late", 3)
    assert orders.topics() == ["orders.created"]


def test_capture_rejects_an_invalid_pattern() -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError), capture(bus, "orders.>.late"):
        pass
    assert observers(bus) == []


async def test_capture_records_every_routing_slip_hop(bus: Bus) -> None:
    bus.subscribe("ingest", lambda raw: raw.strip())
    bus.subscribe("transform", lambda text: text.upper())
    bus.subscribe("sink", lambda text: None)
    with capture(bus) as published:
        await bus.publish("ingest", "  hello ", slip=["transform", "sink"])
        await bus.drain(timeout=5)

    assert published.topics() == ["ingest", "transform", "sink"]
    assert published.payloads() == ["  hello ", "hello", "HELLO"]
    first, second, third = published.envelopes()
    assert second.causation_id == first.id
    assert third.causation_id == second.id
    assert {first.correlation_id, second.correlation_id, third.correlation_id} == {
        first.correlation_id
    }


async def test_capture_records_requests_and_threadsafe_publishes(bus: Bus) -> None:
    bus.subscribe("math.add", lambda numbers: numbers["a"] + numbers["b"])
    with capture(bus) as published:
        assert await bus.request("math.add", {"a": 1, "b": 2}, timeout=5) == 3
        future = await anyio.to_thread.run_sync(
            lambda: bus.publish_threadsafe("math.add", {"a": 2, "b": 2})
        )
        await bus.drain(timeout=5)
        assert future.result(timeout=5)

    assert published.payloads("math.add") == [{"a": 1, "b": 2}, {"a": 2, "b": 2}]


async def test_capture_records_a_replay_by_topic(bus: Bus) -> None:
    await bus.publish("nobody.home", {"n": 1})
    [dead] = bus.dead_letters.list()
    with capture(bus) as published:
        await bus.dead_letters.replay(dead.envelope.id)
    assert published.payloads() == [{"n": 1}]
    assert published[0].headers[HEADER_REPLAYED] == "1"


async def test_capture_records_a_replay_into_its_stage(bus: Bus) -> None:
    fail = True

    def flaky(payload: object) -> None:
        if fail:
            raise RuntimeError("boom")

    bus.subscribe("jobs", flaky)
    await bus.publish("jobs", {"n": 1})
    await bus.drain(timeout=5)
    [dead] = bus.dead_letters.list()
    fail = False
    with capture(bus) as published:
        await bus.dead_letters.replay(dead.envelope.id)
        await bus.drain(timeout=5)
    assert published.payloads() == [{"n": 1}]
    assert published[0].headers[HEADER_REPLAYED] == "1"


async def test_capture_stops_recording_and_removes_its_observer_on_exit(bus: Bus) -> None:
    assert observers(bus) == []
    with capture(bus) as published:
        assert len(observers(bus)) == 1
        await bus.publish("a", 1)
    await bus.publish("a", 2)

    assert observers(bus) == []
    assert published.payloads() == [1]


async def test_capture_removes_its_observer_when_the_block_raises(bus: Bus) -> None:
    with pytest.raises(RuntimeError, match="inside"), capture(bus):
        raise RuntimeError("inside")
    assert observers(bus) == []


async def test_nested_captures_record_independently(bus: Bus) -> None:
    with capture(bus) as outer:
        await bus.publish("a", 1)
        with capture(bus) as inner:
            await bus.publish("a", 2)
        await bus.publish("a", 3)
        assert len(observers(bus)) == 1
    assert outer.payloads() == [1, 2, 3]
    assert inner.payloads() == [2]
    assert observers(bus) == []


def test_capture_works_on_a_bus_that_is_not_running() -> None:
    bus = Bus()
    with capture(bus) as published:
        pass
    assert len(published) == 0
    assert not published
    assert observers(bus) == []


async def test_clear_forgets_what_was_recorded_and_keeps_recording(bus: Bus) -> None:
    with capture(bus) as published:
        await bus.publish("a", 1)
        published.clear()
        await bus.publish("a", 2)
    assert published.payloads() == [2]
    assert published[-1:] == published.records
    assert "1 records" in repr(published)


async def test_wait_for_returns_once_enough_matching_envelopes_were_published(bus: Bus) -> None:
    bus.subscribe("start", lambda n: n + 1)
    bus.subscribe("finish", lambda n: None)
    with capture(bus) as published:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(bus.publish, "start", 1, slip=["finish"]))
            records = await published.wait_for(1, topic="finish", timeout=5)
    assert [record.payload for record in records] == [2]
    assert await published.wait_for(0) == published.records


async def test_wait_for_raises_timeout_error_with_what_it_saw(bus: Bus) -> None:
    with capture(bus) as published:
        await bus.publish("a", 1)
        with pytest.raises(TimeoutError, match="captured 1 of 2 expected envelopes on 'a'"):
            await published.wait_for(2, topic="a", timeout=0.05)
    assert isinstance(published, Captured)
