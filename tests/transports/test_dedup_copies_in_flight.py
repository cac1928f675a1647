"""deduplicate() over every broker: a copy delivered while the first is being handled.

Each id is published twice, back to back, to a stage with two consumers: both copies
are held at once, one per consumer. The copy waits for the first's outcome and is
skipped (the first succeeded), whether the claim lives in the broker (Redis, NATS) or
in the process (RabbitMQ). (NATS's stream drops a second publish of one id, so there
the copies are sent to the group as replays are, each with its own message id.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, Handler, middleware
from asyncbus.middleware import deduplicate

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

IDS = [f"order-{n}" for n in range(10)]


async def test_a_copy_held_beside_the_first_is_skipped_once_the_first_succeeds(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[str] = []
    entered: Counter[str] = Counter()
    both_in = {envelope_id: anyio.Event() for envelope_id in IDS}
    gates = {envelope_id: anyio.Event() for envelope_id in IDS}

    @middleware
    async def count_entries(env: Envelope, call_next: Handler) -> Any:
        entered[env.id] += 1
        if entered[env.id] == 2:
            both_in[env.id].set()
        return await call_next(env)

    # A short lease: a store's waiting copy asks again within a fraction of it.
    transport = make_transport(kind, url, unique_prefix)
    bus = Bus(transport=transport, middleware=[count_entries, deduplicate(lease=0.8)])

    async def publish_twice(envelope_id: str) -> None:
        if kind != "nats":
            await bus.publish("orders", "charge", id=envelope_id)
            await bus.publish("orders", "charge", id=envelope_id)
            return
        for _ in range(2):  # (each has its own timestamp, so its own message id)
            copy = Envelope(topic="orders", payload="charge", id=envelope_id)
            await transport.publish_to_group("orders", "billing", [copy])

    @bus.subscribe("orders", group="billing", concurrency=2)
    async def bill(env: Envelope) -> None:
        handled.append(env.id)
        await gates[env.id].wait()

    with anyio.fail_after(60):
        async with bus:
            for envelope_id in IDS:
                await publish_twice(envelope_id)
                await both_in[envelope_id].wait()  # each copy with a consumer
                gates[envelope_id].set()
                await bus.drain()
            stats = bus.statistics().stage("orders@billing")
    assert Counter(handled) == Counter(IDS)  # each once
    assert (stats.published, stats.acked, stats.dead_lettered) == (2 * len(IDS), 2 * len(IDS), 0)
