"""RabbitMQ acks written behind: each delivery tag written once, and ``backlog()`` (what
``Bus.drain`` waits on) answers only once the broker has the acks of what was handled.

Against the real RabbitMQ, on asyncio only. The channel's ``basic_ack`` is wrapped to
record the acks handed to the connection and, where a test says so, to make their
write slow (a busy connection: the call waits until the socket took the frame).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from asyncbus import Envelope
from asyncbus.transports.base import Delivery
from asyncbus.transports.rabbit import RabbitTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _take(deliveries: AsyncIterator[Delivery], count: int) -> list[Delivery]:
    with anyio.fail_after(30):
        return [await anext(deliveries) for _ in range(count)]


def _record_acks(
    deliveries: AsyncIterator[Delivery],
    written: list[tuple[int, bool]],
    monkeypatch: pytest.MonkeyPatch,
    slow: Any = None,
    *,
    slow_multiple: bool = False,
) -> Any:
    """Record ``(tag, multiple)`` of each ack handed to the connection on the
    subscription's channel; a single ack (any ack with ``slow_multiple``) then awaits
    ``slow()`` as its write drains, when given. Returns the channel."""
    channel = deliveries.consumer.channel  # type: ignore[attr-defined]
    original = channel.basic_ack

    async def recorded(delivery_tag: int, multiple: bool = False, **options: Any) -> Any:
        result = await original(delivery_tag, multiple=multiple, **options)
        written.append((delivery_tag, multiple))
        if slow is not None and (slow_multiple or not multiple):
            await slow()  # the frame went; its write is still being awaited
        return result

    monkeypatch.setattr(channel, "basic_ack", recorded)
    return channel


async def test_a_write_of_acks_cut_short_writes_each_tag_once_later(
    rabbit_url: str, rabbit_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain whose deadline lands in the middle of a write (the single ack of tag 3
    sent, its write still awaited): the acks go back to the writer, and the next write
    sends neither again. RabbitMQ closes a channel that acks a tag twice."""
    monkeypatch.setattr("asyncbus.transports.rabbit._ACK_LINGER", 3600.0)  # backlog writes
    envelopes = [Envelope(topic="acks.cut", payload=n) for n in range(3)]
    written: list[tuple[int, bool]] = []
    busy = True

    async def drains() -> None:
        if busy:
            await anyio.sleep(30)

    async with (
        RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport,
        transport.subscribe("acks.cut", group="g", prefetch=10) as deliveries,
    ):
        await transport.publish("acks.cut", envelopes)
        first, second, third = await _take(deliveries, 3)
        channel = _record_acks(deliveries, written, monkeypatch, drains)
        await first.ack()
        await third.ack()  # the second is still being handled
        with anyio.move_on_after(0.5) as scope:  # bus.drain(timeout=...) running out
            await transport.backlog("acks.cut", "g")
        assert scope.cancelled_caught
        assert written == [(1, True), (3, False)]
        busy = False
        assert await transport.backlog("acks.cut", "g") == 1  # the second, held
        assert written == [(1, True), (3, False)]  # nothing twice
        await second.ack()
        assert await transport.backlog("acks.cut", "g") == 0
        assert written == [(1, True), (3, False), (2, True)]  # 2 and the 3 before it
        assert not channel.is_closed  # (unknown delivery tag: PRECONDITION_FAILED)


async def test_backlog_waits_for_a_write_of_acks_already_going_on(
    rabbit_url: str, rabbit_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer took an ack and is writing it (a busy connection) when backlog is
    asked: backlog waits for that write before its round trip, and answers after it."""
    written: list[tuple[int, bool]] = []
    started = anyio.Event()
    writes_done = 0

    async def drains() -> None:
        nonlocal writes_done
        started.set()
        await anyio.sleep(0.5)
        writes_done += 1

    async with (
        RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport,
        transport.subscribe("acks.busy", group="g", prefetch=2) as deliveries,
    ):
        await transport.publish("acks.busy", [Envelope(topic="acks.busy", payload=0)])
        [delivery] = await _take(deliveries, 1)
        _record_acks(deliveries, written, monkeypatch, drains, slow_multiple=True)
        await delivery.ack()  # prefetch 2: a batch of one, written at once
        with anyio.fail_after(10):
            await started.wait()  # the writer holds it
        backlog = await transport.backlog("acks.busy", "g")
        finished = writes_done
    assert (backlog, written, finished) == (0, [(1, True)], 1)


async def test_backlog_writes_the_acks_of_deliveries_handled_during_its_round_trip(
    rabbit_url: str, rabbit_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery handled while backlog waits for the broker (its ack queued after the
    acks were looked at): backlog answers 0 only once that ack is written too, so a
    connection lost right after a drain redelivers nothing that was handled."""
    monkeypatch.setattr("asyncbus.transports.rabbit._ACK_LINGER", 3600.0)  # backlog writes
    written: list[tuple[int, bool]] = []
    async with (
        RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport,
        transport.subscribe("acks.late", group="g", prefetch=10) as deliveries,
    ):
        await transport.publish("acks.late", [Envelope(topic="acks.late", payload=0)])
        [delivery] = await _take(deliveries, 1)
        _record_acks(deliveries, written, monkeypatch)
        [subscription] = [s for s in transport._subscriptions if s.queue.endswith("acks.late@g")]
        original = subscription.sync
        calls = 0

        async def sync() -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                await delivery.ack()  # handled while the first round trip travels
            await original()

        monkeypatch.setattr(subscription, "sync", sync)
        backlog = await transport.backlog("acks.late", "g")
        written_then = list(written)
    assert (backlog, written_then) == (0, [(1, True)])
