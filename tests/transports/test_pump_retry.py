"""A stage whose broker subscription cannot be made, or fails, never takes the bus down.

The pump logs, waits (a pause that doubles, bounded) and subscribes again until the
bus stops; once the broker is back the stage consumes as usual. Over a transport
whose ``subscribe`` raises (when it is called, when it is entered, while iterating),
and over real brokers (private servers on other ports) that are down when a stage
subscribes on a running bus.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from _brokers import BROKERS, make_transport, names  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, Envelope, TransportError
from asyncbus.transports import Transport

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(60),
    pytest.mark.backends("asyncio", "uvloop", "trio"),
]


class _Delivery:
    def __init__(self, envelope: Envelope, transport: FlakyTransport) -> None:
        self.envelope = envelope
        self._transport = transport

    async def ack(self) -> None:
        self._transport.unsettled -= 1
        self._transport.acked.append(self.envelope.payload)

    async def nack(self, *, delay: float | None = None) -> None:
        raise AssertionError("nothing fails in these tests")

    async def reject(self, reason: str) -> None:
        raise AssertionError("nothing fails in these tests")


class FlakyTransport(Transport):
    """Its subscriptions fail as told (``failures``: where each attempt fails), then
    deliver what is published."""

    def __init__(self, failures: Sequence[str]) -> None:
        super().__init__()
        self.failures = list(failures)
        #: Raises a cancellation the calling task was not asked for (a "cancelled" failure).
        self.cancelled_elsewhere: Callable[[], Awaitable[None]] | None = None
        self.attempts = 0
        self.acked: list[Any] = []
        #: Published and not acked: the broker's backlog.
        self.unsettled = 0
        self._send, self._receive = anyio.create_memory_object_stream[Envelope](100)

    async def aclose(self) -> None:
        self._send.close()
        self._receive.close()

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        for envelope in envelopes:
            self.unsettled += 1
            await self._send.send(envelope)

    async def backlog(self, pattern: str, group: str) -> int:
        return self.unsettled

    def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[_Delivery]]:
        self.attempts += 1
        failure = self.failures.pop(0) if self.failures else None
        if failure == "call":
            raise TransportError("the broker is down (subscribe)")
        if failure == "config":
            raise ConfigurationError("a pattern this broker cannot take")
        return self._subscription(failure)

    @asynccontextmanager
    async def _subscription(self, failure: str | None) -> AsyncIterator[AsyncIterator[_Delivery]]:
        if failure == "enter":
            raise OSError("connection refused (entering)")

        async def deliveries() -> AsyncIterator[_Delivery]:
            if failure == "iterate":
                raise TransportError("connection lost (iterating)")
            if failure == "cancelled":  # a client library cancelled what it awaited
                await self.cancelled_elsewhere()
            async for envelope in self._receive:
                yield _Delivery(envelope, self)

        yield deliveries()


async def _consume_three(transport: FlakyTransport, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Publish 0, 1 and 2 on a bus over ``transport`` and assert each was handled, the bus
    running to the end; return the pump's warnings ("trying again")."""
    bus = Bus(transport)
    handled: list[int] = []

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with caplog.at_level(logging.WARNING), anyio.fail_after(10):
        async with bus:  # the first attempts fail while it starts: it waits for one
            for n in range(3):
                await bus.publish("jobs", n)
            await bus.drain()
            assert bus.running
    assert handled == [0, 1, 2]
    return [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]


async def test_a_subscription_that_fails_is_made_again_and_the_bus_consumes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = FlakyTransport(["call", "enter", "iterate", "call"])
    warned = await _consume_three(transport, caplog)
    assert transport.attempts == 5
    assert len(warned) == 4
    assert "the broker is down (subscribe)" in warned[0]
    assert "connection refused (entering)" in warned[1]
    assert "connection lost (iterating)" in warned[2]


async def test_a_cancellation_the_broker_client_raised_is_a_failed_subscription(
    cancelled_elsewhere: Callable[[], Awaitable[None]], caplog: pytest.LogCaptureFixture
) -> None:
    """A client library that cancels what it awaits (a connection it gave up on) raises
    a cancellation in the pump that nobody asked of it: the subscription failed and is
    made again; the bus does not stop."""
    transport = FlakyTransport(["cancelled", "cancelled"])
    transport.cancelled_elsewhere = cancelled_elsewhere
    warned = await _consume_three(transport, caplog)
    assert transport.attempts == 3
    assert len(warned) == 2


async def test_a_subscription_failing_on_a_running_bus_leaves_the_bus_up() -> None:
    transport = FlakyTransport([])
    bus = Bus(transport)
    handled: list[int] = []

    async with bus:
        transport.failures = ["call", "enter", "enter"]
        bus.subscribe("late", lambda n: handled.append(n), group="late")
        with anyio.fail_after(10):
            await bus.subscribed()
            await bus.publish("late", 7)
            await bus.drain()
    assert handled == [7]
    assert transport.attempts == 4


async def test_a_configuration_error_is_not_retried() -> None:
    bus = Bus(FlakyTransport(["config"]))
    bus.subscribe("jobs", lambda n: None, group="g")
    with anyio.fail_after(10), pytest.raises(Exception) as caught:
        async with bus:
            pytest.fail("the bus started although its stage cannot subscribe")
    error = caught.value
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]  # the bus's task group's, as any stage's end
    assert isinstance(error, ConfigurationError)
    assert str(error) == "a pattern this broker cannot take"
    assert bus.statistics().stage("jobs@g").published == 0


# -- over real brokers ------------------------------------------------------------------


async def _publish_until_confirmed(bus: Bus, topic: str, payload: Any) -> None:
    """Publish until the broker confirms it *and* it reached a group.

    After a restart without persistence the broker knows no group until each stage has
    registered its group again (on its next read or within ``claim_interval``); a publish
    before that is dead-lettered ``no_subscribers``, as documented, and tried again here.
    """
    with anyio.fail_after(30):
        while True:
            try:
                receipt = await bus.publish(topic, payload)
            except TransportError:
                await anyio.sleep(0.1)
                continue
            if receipt.accepted:
                return
            await anyio.sleep(0.1)


@pytest.mark.chaos
@pytest.mark.backends("asyncio")
@pytest.mark.parametrize("kind", names("quick_restart"))
async def test_a_stage_subscribed_while_the_broker_is_down_consumes_once_it_is_back(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with BROKERS[kind].start_private(tmp_path) as server:
        options: dict[str, Any] = {"publish_timeout": 1.0}
        if kind == "nats":
            options["request_timeout"] = 1.0
        bus = Bus(transport=make_transport(kind, server.url, "pump", **options))
        handled: list[tuple[str, int]] = []

        @bus.subscribe("early", group="g")
        async def early(n: int) -> None:
            handled.append(("early", n))

        with caplog.at_level(logging.WARNING), anyio.fail_after(50):
            async with bus:
                await bus.publish("early", 1)
                await bus.drain()
                await server.kill()
                # Subscribing on a running bus while the broker is down: the pump
                # fails, waits, and tries again.
                bus.subscribe("late", lambda n: handled.append(("late", n)), group="g")
                while not any("late@g: subscribing" in r.getMessage() for r in caplog.records):
                    await anyio.sleep(0.05)  # until the pump failed once
                await server.start()
                await bus.subscribed()
                await _publish_until_confirmed(bus, "late", 2)
                await _publish_until_confirmed(bus, "early", 3)
                await bus.drain()
        assert sorted(handled) == [("early", 1), ("early", 3), ("late", 2)]
