"""A transport written to the public ``Delivery`` protocol alone works with the bus.

The protocol has ``envelope``, ``ack()``, ``nack(delay=)`` and ``reject(reason, *,
error=None, stage=None, attempts=None)``, which a delivery written as ``reject(self,
reason)`` still answers: the bus gives the details (and reads ``error``) only to
deliveries built on :class:`~asyncbus.transports.BaseDelivery`. (Like any transport, it
reports ``backlog()`` so that ``drain()`` knows about envelopes still on their way to a
stage.)
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
import anyio.lowlevel
import pytest
from _turns import assert_each_yielded, publish_runs  # type: ignore[import-not-found]
from anyio.streams.memory import MemoryObjectSendStream

from asyncbus import Bus, DeadLetter, DeadLetterReason, Envelope, Reject, Retry
from asyncbus._routing import compile_pattern
from asyncbus.transports import BaseDelivery, Transport

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(10),
    pytest.mark.backends("asyncio", "uvloop", "trio"),
]


class ProtocolDelivery:
    """Exactly the protocol: no ``error``, ``reject`` takes the reason only."""

    def __init__(self, envelope: Envelope, settled: list[tuple[str, str, object]]) -> None:
        self.envelope = envelope
        self._settled = settled

    async def ack(self) -> None:
        self._settled.append(("ack", self.envelope.topic, self.envelope.payload))

    async def nack(self, *, delay: float | None = None) -> None:
        self._settled.append(("nack", self.envelope.topic, self.envelope.payload))

    async def reject(self, reason: str) -> None:
        self._settled.append((f"reject {reason}", self.envelope.topic, self.envelope.payload))


class ProtocolTransport(Transport):
    """Every matching subscription gets every envelope; nothing is ever redelivered."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[tuple[str, str, object]] = []
        self._routes: list[tuple[object, MemoryObjectSendStream[Envelope]]] = []
        #: Published and not yet handed to a consumer (in a buffer or being handed
        #: over), what ``drain()`` asks ``backlog`` about.
        self._unhanded = 0

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        for matches, send in self._routes:
            if matches(topic):  # type: ignore[operator]
                for envelope in envelopes:
                    self._unhanded += 1
                    send.send_nowait(envelope)

    async def backlog(self, pattern: str, group: str) -> int:
        return self._unhanded

    def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[ProtocolDelivery]]:
        return self._subscription(pattern)

    @asynccontextmanager
    async def _subscription(self, pattern: str) -> AsyncIterator[AsyncIterator[ProtocolDelivery]]:
        send, receive = anyio.create_memory_object_stream[Envelope](math.inf)
        route = (compile_pattern(pattern), send)
        self._routes.append(route)

        async def deliveries() -> AsyncIterator[ProtocolDelivery]:
            async for envelope in receive:
                self._unhanded -= 1
                yield ProtocolDelivery(envelope, self.settled)

        try:
            yield deliveries()
        finally:
            self._routes.remove(route)
            send.close()
            receive.close()


async def test_the_bus_acks_and_rejects_through_the_protocol_alone() -> None:
    transport = ProtocolTransport()
    bus = Bus(transport)
    attempts: list[int] = []

    @bus.subscribe("jobs.ok", group="ok")
    async def fine(n: int) -> int:
        return n

    @bus.subscribe("jobs.refused", group="refused")
    async def refuse(n: int) -> None:
        raise Reject("not today")

    @bus.subscribe("jobs.failing", group="failing", retry=Retry(max_attempts=2, backoff=0.001))
    async def fail(env: Envelope) -> None:
        attempts.append(env.attempt)
        raise ValueError("boom")

    async with bus:
        await bus.publish("jobs.ok", 1)
        await bus.publish("jobs.refused", 2)
        await bus.publish("jobs.failing", 3)
        await bus.drain()
        entries = bus.dead_letters.list()
        dead = sorted((entry.stage, entry.reason, entry.attempts) for entry in entries)
    assert attempts == [1, 2]
    assert sorted(transport.settled) == [
        ("ack", "jobs.ok", 1),
        ("reject handler_failed", "jobs.failing", 3),
        ("reject rejected", "jobs.refused", 2),
    ]
    assert dead == [
        ("jobs.failing@failing", "handler_failed", 2),
        ("jobs.refused@refused", "rejected", 1),
    ]
    for stage in bus.statistics().stages:
        assert stage.published == stage.acked + stage.dead_lettered, stage


class DetailedDelivery(BaseDelivery):
    """A delivery on asyncbus's base: the one ``reject``, with every detail."""

    def __init__(self, envelope: Envelope, settled: list[tuple[str, str, object]]) -> None:
        super().__init__(envelope)
        self._log = settled

    async def _reject(self, entry: DeadLetter) -> None:
        self._log.append(
            (
                f"reject {entry.reason} {entry.stage} {entry.error}",
                entry.envelope.topic,
                entry.attempts,
            )
        )


async def test_reject_gives_the_entry_to_a_base_delivery_and_the_reason_to_others() -> None:
    from asyncbus._delivering import reject_delivery

    settled: list[tuple[str, str, object]] = []
    envelope = Envelope(topic="jobs")
    entry = DeadLetter(envelope, DeadLetterReason.REJECTED, "E: x", "j@g", 2, 0.0)
    await reject_delivery(DetailedDelivery(envelope, settled), entry)
    await reject_delivery(ProtocolDelivery(envelope, settled), entry)
    assert settled == [
        ("reject rejected j@g E: x", "jobs", 2),
        ("reject rejected", "jobs", None),
    ]


async def test_a_protocol_only_delivery_is_a_delivery() -> None:
    from asyncbus import Delivery

    delivery = ProtocolDelivery(Envelope(topic="jobs"), [])
    assert isinstance(delivery, Delivery)
    assert not isinstance(delivery, BaseDelivery)  # no ``error``: taken as decoded
    assert isinstance(DetailedDelivery(Envelope(topic="jobs"), []), Delivery)


async def test_a_publish_through_a_transport_that_never_awaits_still_yields_once(
    anyio_backend_name: str,
) -> None:
    """``publish_waits`` left False: the bus yields before sending, so a publishing loop
    still lets another task run between any two publishes, and a cancelled publish
    sends nothing."""
    assert ProtocolTransport.publish_waits is False
    transport = ProtocolTransport()
    bus = Bus(transport)
    handled: list[int] = []

    @bus.subscribe("turns", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await bus.publish("turns", -1)
        assert scope.cancelled_caught
        runs = await publish_runs(lambda n: bus.publish("turns", n), 10)
        await bus.drain()
    assert_each_yielded(runs, 10, anyio_backend_name)
    assert handled == list(range(10))
    [stage] = bus.statistics().stages
    assert (stage.published, stage.acked) == (10, 10)
