"""A dead letter is listed by ``bus.dead_letters`` as soon as the bus decides it, while
its delivery's reject, which stores it in the broker, may still be on its way. A replay
in that moment (an operator's click, a script reading the list) waits for the broker's
copy instead of raising ``KeyError``. Over each broker, with its reject held back."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, Reject

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: The delivery class of each broker, whose reject stores the dead letter.
DELIVERIES = {
    "redis": ("asyncbus.transports._redis_consumer", "RedisDelivery"),
    "nats": ("asyncbus.transports._nats_delivery", "NatsDelivery"),
    "rabbit": ("asyncbus.transports._rabbit_consumer", "RabbitDelivery"),
    "postgres": ("asyncbus.transports._pg_consumer", "PgDelivery"),
}
#: How long each reject is held back before it goes to the broker.
HELD = 0.3


async def test_a_replay_right_after_the_dead_letter_waits_for_the_broker_to_store_it(
    kind: str, url: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    module, name = DELIVERIES[kind]
    delivery_class: Any = getattr(importlib.import_module(module), name)
    reject = delivery_class._reject
    held: list[str] = []

    async def held_back(self: Any, entry: Any) -> None:
        held.append(entry.envelope.id)
        await anyio.sleep(HELD)
        await reject(self, entry)

    monkeypatch.setattr(delivery_class, "_reject", held_back)
    bus = Bus(transport=make_transport(kind, url, unique_prefix))
    fixed = False
    handled: list[int] = []

    @bus.subscribe("jobs", group="workers")
    async def work(n: int) -> None:
        if not fixed:
            raise Reject("not yet")
        handled.append(n)

    with anyio.fail_after(30):
        async with bus:
            receipt = await bus.publish("jobs", 7)
            while not bus.dead_letters.list():
                await anyio.sleep(0.005)
            [entry] = bus.dead_letters.list()  # (the reject is still held back)
            fixed = True
            replayed = await bus.dead_letters.replay(entry)
            while not handled:
                await anyio.sleep(0.02)
            await bus.drain()
            assert bus.dead_letters.list() == []
    assert held == [receipt.id]
    assert [r.id for r in replayed] == [receipt.id] and handled == [7]
