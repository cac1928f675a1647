"""Causality without tracing: what a handler sends continues the handled conversation,
and ``Bus(propagate_contextvars=...)`` carries context variables to the handlers."""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any

import anyio
import anyio.to_thread
import pytest

from asyncbus import Bus, ConfigurationError, DeadLetterReason, Envelope, Retry
from asyncbus._carry import CarryingHeaders
from asyncbus.transports._codec import default_codec, envelope_from_wire, envelope_to_wire

pytestmark = pytest.mark.anyio

request_id: ContextVar[str] = ContextVar("request_id", default="-")
tenant: ContextVar[str] = ContextVar("tenant")


def collector(seen: list[Envelope]) -> Any:
    async def collect(envelope: Envelope) -> None:
        seen.append(envelope)

    return collect


# -- correlation and causation ---------------------------------------------------------


async def test_a_publish_made_by_a_handler_continues_its_conversation() -> None:
    seen: list[Envelope] = []

    async def react(envelope: Envelope) -> None:
        await bus.publish("reacted", 1)
        bus.publish_nowait("reacted", 2, headers={"k": "v"})

    bus = Bus()
    bus.subscribe("started", react, group="react")
    bus.subscribe("reacted", collector(seen), group="collect")
    with anyio.fail_after(10):
        async with bus:
            first = await bus.publish("started", 0, slip=["started"])
            await bus.drain()

    # The first envelope and its slip hop each published two: one conversation.
    assert len(seen) == 4
    hop = seen[2].causation_id
    assert [env.causation_id for env in seen] == [first.id, first.id, hop, hop]
    assert hop != first.id
    assert {env.correlation_id for env in seen} == {first.id}
    assert all(env.id not in (first.id, hop) for env in seen)


async def test_a_request_made_by_a_handler_continues_its_conversation() -> None:
    seen: list[Envelope] = []

    async def ask(envelope: Envelope) -> None:
        await bus.request("math.double", 21)

    async def double(envelope: Envelope) -> int:
        seen.append(envelope)
        return int(envelope.payload) * 2

    bus = Bus()
    bus.subscribe("asked", ask, group="ask")
    bus.subscribe("math.double", double, group="calc")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("asked", None)
            await bus.drain()

    (request,) = seen
    assert (request.correlation_id, request.causation_id) == (receipt.id, receipt.id)


async def test_a_publish_outside_any_handler_starts_a_conversation() -> None:
    seen: list[Envelope] = []
    bus = Bus()
    bus.subscribe("t", collector(seen), group="g")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("t", 1)
            await bus.drain()
    (envelope,) = seen
    assert (envelope.correlation_id, envelope.causation_id) == (receipt.id, None)


async def test_a_thread_safe_publish_from_an_offloaded_handler_continues_its_conversation() -> None:
    seen: list[Envelope] = []

    def in_a_thread(payload: Any) -> None:
        bus.publish_threadsafe("out", payload).result(timeout=5)

    bus = Bus()
    bus.subscribe("in", in_a_thread, group="worker")  # sync: offloaded to a thread
    bus.subscribe("out", collector(seen), group="g")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("in", 1)
            await bus.drain()
    (envelope,) = seen
    assert (envelope.correlation_id, envelope.causation_id) == (receipt.id, receipt.id)


async def test_a_thread_abandoned_by_a_timeout_still_publishes_as_its_own_envelope() -> None:
    """The consumer goes on to the next envelope while the timed-out thread runs on;
    what that thread publishes is still caused by the envelope it was given."""
    seen: list[Envelope] = []
    release = threading.Event()
    published = threading.Event()

    def handle(payload: str) -> None:
        if payload == "slow":
            release.wait(timeout=10)  # until the consumer handles "next"
            bus.publish_threadsafe("out", "late").result(timeout=5)
            published.set()
        else:
            release.set()
            published.wait(timeout=10)  # hold the consumer on "next" meanwhile

    bus = Bus(workers=2)
    bus.subscribe("in", handle, group="worker", timeout=0.2)
    bus.subscribe("out", collector(seen), group="g")
    with anyio.fail_after(20):
        async with bus:
            slow = await bus.publish("in", "slow")
            await bus.publish("in", "next")
            await bus.drain()
            assert bus.dead_letters.list()[0].reason == DeadLetterReason.TIMEOUT
    (late,) = seen
    assert (late.correlation_id, late.causation_id) == (slow.id, slow.id)


# -- contextvars -------------------------------------------------------------------------


async def test_contextvars_travel_from_the_publisher_to_the_handler() -> None:
    seen: list[tuple[Any, str, str]] = []

    async def look(payload: Any) -> None:
        seen.append((payload, request_id.get(), tenant.get("unset")))

    bus = Bus(propagate_contextvars=[request_id, tenant])
    bus.subscribe("t", look, group="g")
    with anyio.fail_after(10):
        async with bus:

            async def publish_as(value: str | None, payload: int) -> None:
                # Each in its own context, as separate requests of a web app would be.
                if value is not None:
                    request_id.set(value)
                    tenant.set(f"tenant-{value}")
                await bus.publish("t", payload)

            async with anyio.create_task_group() as group:
                group.start_soon(publish_as, "r-1", 1)
            async with anyio.create_task_group() as group:
                group.start_soon(publish_as, None, 2)
            async with anyio.create_task_group() as group:
                group.start_soon(publish_as, "r-3", 3)
            await bus.drain()
            assert request_id.get() == "-"  # nothing leaked into the publisher's context

    assert seen == [(1, "r-1", "tenant-r-1"), (2, "-", "unset"), (3, "r-3", "tenant-r-3")]


async def test_contextvars_follow_slip_hops_retries_and_offloaded_handlers() -> None:
    seen: list[tuple[str, int, str]] = []

    async def first(envelope: Envelope) -> Any:
        seen.append((envelope.topic, envelope.attempt, request_id.get()))
        if envelope.attempt == 1:
            raise RuntimeError("once")
        request_id.set(request_id.get() + "+first")  # a hop carries what is set now
        return envelope.payload

    def second(payload: Any) -> Any:  # in a worker thread
        seen.append(("second", 1, request_id.get()))
        return payload

    bus = Bus(propagate_contextvars=[request_id])
    bus.subscribe("first", first, group="a", retry=Retry(backoff=0.01))
    bus.subscribe("second", second, group="b")
    with anyio.fail_after(10):
        async with bus:
            request_id.set("r-9")
            await bus.publish("first", 1, slip=["second"])
            await bus.drain()
    assert seen == [("first", 1, "r-9"), ("first", 2, "r-9"), ("second", 1, "r-9+first")]


async def test_a_thread_safe_publish_carries_the_calling_thread_s_contextvars() -> None:
    seen: list[str] = []

    async def look(payload: Any) -> None:
        seen.append(request_id.get())

    def from_a_thread() -> None:
        request_id.set("from-thread")
        bus.publish_threadsafe("t", 1).result(timeout=5)

    bus = Bus(propagate_contextvars=[request_id])
    bus.subscribe("t", look, group="g")
    with anyio.fail_after(10):
        async with bus:
            await anyio.to_thread.run_sync(from_a_thread)
            await bus.drain()
    assert seen == ["from-thread"]


async def test_a_replay_carries_what_the_envelope_first_carried() -> None:
    seen: list[str] = []
    fail = True

    async def flaky(payload: Any) -> None:
        seen.append(request_id.get())
        if fail:
            raise RuntimeError("down")

    bus = Bus(propagate_contextvars=[request_id])
    bus.subscribe("t", flaky, group="g")
    with anyio.fail_after(10):
        async with bus:

            async def publish() -> None:
                request_id.set("r-1")
                await bus.publish("t", 1)

            async with anyio.create_task_group() as group:
                group.start_soon(publish)
            await bus.drain()
            fail = False
            request_id.set("operator")
            (entry,) = bus.dead_letters.list()
            await bus.dead_letters.replay(entry.envelope.id)
            await bus.drain()
    assert seen == ["r-1", "r-1"]


async def test_carried_values_are_not_in_the_headers_and_never_reach_a_wire() -> None:
    captured: list[Envelope] = []

    async def look(envelope: Envelope) -> None:
        captured.append(envelope)

    bus = Bus(propagate_contextvars=[request_id])
    bus.subscribe("t", look, group="g")
    with anyio.fail_after(10):
        async with bus:
            request_id.set("secret")
            await bus.publish("t", 1, headers={"k": "v"})
            await bus.drain()
    (envelope,) = captured
    assert isinstance(envelope.headers, CarryingHeaders)
    assert envelope.headers == {"k": "v"}
    assert dict(envelope.headers) == {"k": "v"} and len(envelope.headers) == 1
    assert repr(envelope.headers) == "{'k': 'v'}"
    meta, body = envelope_to_wire(envelope, default_codec())
    again, error = envelope_from_wire(meta, body, default_codec())
    assert error is None
    assert again.headers == {"k": "v"}
    assert not isinstance(again.headers, CarryingHeaders)
    assert b"secret" not in meta + body


@pytest.mark.parametrize("variables", ["request_id", ["request_id"], [request_id, "tenant"]])
async def test_propagate_contextvars_takes_contextvar_objects_only(variables: Any) -> None:
    with pytest.raises(ConfigurationError, match="ContextVar"):
        Bus(propagate_contextvars=variables)
