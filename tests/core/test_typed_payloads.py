"""Typed payloads: a handler annotated with a dataclass, msgspec Struct or pydantic model."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import msgspec
import pydantic
import pytest

from asyncbus import Bus, DeadLetterReason, Retry

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class OrderPlaced:
    id: int
    total: float


class Refund(msgspec.Struct, frozen=True):
    order: int
    amount: float


class Shipment(pydantic.BaseModel):
    order: int
    carrier: str


async def test_a_dataclass_payload_is_decoded_and_validated() -> None:
    bus = Bus()
    seen: list[OrderPlaced] = []
    calls = 0

    @bus.subscribe("orders", group="g", retry=Retry(max_attempts=3, backoff=0))
    async def handle(order: OrderPlaced) -> None:
        nonlocal calls
        calls += 1
        seen.append(order)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("orders", {"id": 1, "total": 9.5})
            await bus.publish("orders", OrderPlaced(2, 1.0))
            bad = await bus.publish("orders", {"id": "not a number", "total": 1})
            await bus.drain()
            assert seen == [OrderPlaced(1, 9.5), OrderPlaced(2, 1.0)]
            assert calls == 2
            [dead] = bus.dead_letters.list()
            assert (dead.envelope.id, dead.reason, dead.attempts) == (
                bad.id,
                DeadLetterReason.REJECTED,
                1,
            )
            assert dead.error is not None
            assert "OrderPlaced" in dead.error
            assert bus.statistics().stage("orders@g").retried == 0


async def test_a_msgspec_struct_payload_is_decoded() -> None:
    bus = Bus()
    seen: list[Refund] = []

    @bus.subscribe("refunds", group="g")
    def handle(refund: Refund) -> None:  # sync: decoded on the loop, run on the pool
        seen.append(refund)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("refunds", {"order": 7, "amount": 2.5})
            missing = await bus.publish("refunds", {"order": 7})
            await bus.drain()
            assert seen == [Refund(order=7, amount=2.5)]
            [dead] = bus.dead_letters.list()
            assert dead.envelope.id == missing.id
            assert dead.reason == DeadLetterReason.REJECTED
            assert dead.error is not None
            assert "amount" in dead.error


async def test_a_pydantic_model_payload_is_validated() -> None:
    bus = Bus()
    seen: list[Shipment] = []

    @bus.subscribe("shipments", group="g")
    async def handle(shipment: Shipment) -> None:
        seen.append(shipment)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("shipments", {"order": 3, "carrier": "post"})
            wrong = await bus.publish("shipments", {"order": "x", "carrier": "post"})
            await bus.drain()
            assert seen == [Shipment(order=3, carrier="post")]
            [dead] = bus.dead_letters.list()
            assert (dead.envelope.id, dead.reason) == (wrong.id, DeadLetterReason.REJECTED)
            assert dead.error is not None
            assert "Shipment" in dead.error
            stats = bus.statistics().stage("shipments@g")
            assert (stats.published, stats.acked, stats.dead_lettered) == (2, 1, 1)


async def test_a_plain_annotation_passes_the_payload_through() -> None:
    bus = Bus()
    seen: list[object] = []

    @bus.subscribe("raw", group="g")
    async def handle(payload: dict[str, int]) -> None:
        seen.append(payload)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("raw", {"a": 1})
            await bus.drain()
    assert seen == [{"a": 1}]
