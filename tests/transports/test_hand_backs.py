"""Deliveries handed back unhandled are no deliveries toward ``max_deliveries``.

A bus that shuts down gives back what it holds and has not handled (its stage's
queue, a handler cancelled at the close deadline). The broker delivers it again, and
counts that delivery: RabbitMQ's quorum queues in ``x-delivery-count``, JetStream in
``num_delivered``, Redis in the pending entry's count. Counted toward the cap, a
service restarted ``max_deliveries`` times would dead-letter healthy messages as
poison; the cap must count only the deliveries that were never settled nor given
back (a consumer that crashed on them).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

MAX_DELIVERIES = 2
#: More hand-backs than the cap allows deliveries.
HAND_BACKS = 5


async def test_a_delivery_handed_back_again_and_again_is_not_poison(
    kind: str, url: str, unique_prefix: str
) -> None:
    options: dict[str, Any] = {"max_deliveries": MAX_DELIVERIES}
    async with make_transport(kind, url, unique_prefix, **options) as transport:
        with anyio.fail_after(60):
            async with transport.subscribe("handback", group="g", prefetch=4):
                pass  # the group exists from here on
            await transport.publish("handback", [Envelope(topic="handback", payload=1)])
            for round in range(HAND_BACKS + 1):
                async with transport.subscribe("handback", group="g", prefetch=4) as deliveries:
                    delivery = await anext(deliveries)
                    assert (delivery.envelope.payload, delivery.error) == (1, None), round
                    if round == HAND_BACKS:
                        await delivery.ack()
                # Left unsettled: handed back.
            assert await transport.dead_letters() == []


async def test_a_bus_restarted_more_often_than_the_cap_still_handles_what_it_held(
    kind: str, url: str, unique_prefix: str
) -> None:
    """Each run's handler is still at work when its bus closes (the deadline cuts it
    short): the envelope goes back each time, and the last run handles it."""
    handled: list[int] = []
    with anyio.fail_after(80):
        for run in range(HAND_BACKS + 1):
            bus = Bus(
                transport=make_transport(kind, url, unique_prefix, max_deliveries=MAX_DELIVERIES)
            )
            started = anyio.Event()

            @bus.subscribe("restarts", group="g")
            async def handle(n: int, run: int = run, started: anyio.Event = started) -> None:
                started.set()
                if run < HAND_BACKS:
                    await anyio.sleep_forever()  # cut short by the close deadline
                handled.append(n)

            async with bus:
                if run == 0:
                    await bus.publish("restarts", 7)
                await started.wait()
                if run == HAND_BACKS:
                    await bus.drain()
                    assert bus.dead_letters.list() == []
                    break
                report = await bus.aclose(timeout=0.1)
                assert len(report.abandoned) == 1
    assert handled == [7]
