"""A stage's pump never dies because of one delivery.

A transport hands the pump deliveries (here built on ``BaseDelivery``, whose ``error``
the pump reads); one that raises anything unexpected while the pump takes it in, or
whose ``reject`` fails, is dead-lettered ``rejected`` (or left
to the broker), and the deliveries after it are handled as usual.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetter, DeadLetterReason, Envelope
from asyncbus.transports import BaseDelivery, Transport

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(10),
    pytest.mark.backends("asyncio", "uvloop", "trio"),
]


class Recorded(BaseDelivery):
    """A delivery on asyncbus's base that records how it was settled."""

    def __init__(self, payload: Any, settled: list[tuple[str, Any]], error: str | None = None):
        super().__init__(Envelope(topic="jobs", payload=payload), error)
        self._log = settled

    async def _ack(self) -> None:
        self._log.append(("ack", self.envelope.payload))

    async def _nack(self, delay: float | None) -> None:
        self._log.append(("nack", self.envelope.payload))

    async def _reject(self, entry: DeadLetter) -> None:
        self._log.append((f"reject {entry.reason}", self.envelope.payload))


class Broken(Recorded):
    """Its ``error`` raises: a transport's bug, or a delivery object gone wrong."""

    @property  # type: ignore[override]
    def error(self) -> str | None:
        raise RuntimeError("the delivery is broken")

    @error.setter
    def error(self, value: str | None) -> None:
        pass


class Unrejectable(Recorded):
    """Undecodable, and its broker cannot take the reject (the broker redelivers it)."""

    def __init__(self, payload: Any, settled: list[tuple[str, Any]]) -> None:
        super().__init__(payload, settled, "body is not valid JSON")

    async def _reject(self, entry: DeadLetter) -> None:
        raise OSError("connection lost")


class FixedTransport(Transport):
    """Hands its deliveries to the first subscription, then waits."""

    def __init__(self, deliveries: Sequence[Recorded]) -> None:
        super().__init__()
        self._deliveries = list(deliveries)

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        raise AssertionError("nothing is published in these tests")

    async def backlog(self, pattern: str, group: str) -> int:
        return len(self._deliveries)

    def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[Recorded]]:
        return self._subscription()

    @asynccontextmanager
    async def _subscription(self) -> AsyncIterator[AsyncIterator[Recorded]]:
        async def deliveries() -> AsyncIterator[Recorded]:
            while self._deliveries:
                yield self._deliveries.pop(0)
            await anyio.sleep_forever()

        yield deliveries()


async def test_a_delivery_that_raises_is_rejected_and_the_pump_goes_on() -> None:
    settled: list[tuple[str, Any]] = []
    transport = FixedTransport(
        [Recorded(1, settled), Broken(2, settled), Unrejectable(3, settled), Recorded(4, settled)]
    )
    bus = Bus(transport)
    handled: list[int] = []

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(5):
        async with bus:
            await bus.drain()
            stage = bus.statistics().stage("jobs@g")
            entries = sorted(bus.dead_letters.list(), key=lambda entry: entry.envelope.payload)
    assert handled == [1, 4]
    assert sorted(settled) == [("ack", 1), ("ack", 4), ("reject rejected", 2)]
    assert (stage.published, stage.acked, stage.dead_lettered) == (4, 2, 2)
    assert [(e.envelope.payload, e.reason) for e in entries] == [
        (2, DeadLetterReason.REJECTED),
        (3, DeadLetterReason.REJECTED),
    ]
    assert (
        entries[0].error is not None and "RuntimeError: the delivery is broken" in entries[0].error
    )
    assert entries[1].error == "body is not valid JSON"
