"""Time over every broker: scheduled envelopes the broker keeps, schedules that fire once.

A scheduled publish waits in the broker (the bus's internal ``_asyncbus.scheduled``
group), so it outlives the process that made it and is published by whichever bus
holds it when it is due; cancelling is claimed in the broker's claim store (Redis,
NATS; RabbitMQ keeps none: see the guide), and so are the ticks of periodic schedules
(over RabbitMQ one replica leads each schedule, holding a lock queue).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import anyio
import pytest
from _brokers import make_transport, names  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope
from asyncbus._time.broker import CLAIMS_WINDOW

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

#: The brokers that keep a claim store every process shares (RabbitMQ has none).
on_shared_claims = pytest.mark.parametrize("kind", names("dedup_store"), indirect=True)


class Arrivals:
    """Envelopes a handler received, with the wall-clock time of each."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []
        self.at: list[float] = []
        self.changed = anyio.Event()

    async def __call__(self, envelope: Envelope) -> None:
        self.envelopes.append(envelope)
        self.at.append(time.time())
        self.changed.set()
        self.changed = anyio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.envelopes) < count:
            await self.changed.wait()


async def test_a_scheduled_publish_outlives_its_publisher_and_is_published_once_on_time(
    kind: str, url: str, unique_prefix: str
) -> None:
    arrivals = Arrivals()
    consumer = Bus(transport=make_transport(kind, url, unique_prefix), name="consumer")
    consumer.subscribe("jobs", arrivals, group="workers")
    with anyio.fail_after(60):
        async with consumer:
            publisher = Bus(transport=make_transport(kind, url, unique_prefix), name="publisher")
            async with publisher:
                soon = await publisher.publish("jobs", "soon", delay=0.5)
                later = await publisher.publish(
                    "jobs", "later", delay=5.5
                )  # back to the broker once
                assert [s.id for s in publisher.scheduled()] == [soon.id, later.id]
                report = await publisher.aclose()
            assert report.scheduled == []  # the broker keeps them
            await arrivals.wait_for(2)
            await consumer.drain(timeout=10)
            assert consumer.statistics().stage("jobs@workers").acked == 2
            assert (
                await consumer.transport.backlog(  # type: ignore[attr-defined]
                    "_asyncbus.scheduled", "_asyncbus.scheduled"
                )
                == 0
            )
    assert [(e.id, e.payload, e.attempt) for e in arrivals.envelopes] == [
        (soon.id, "soon", 1),
        (later.id, "later", 1),
    ]
    assert "asyncbus-due" not in arrivals.envelopes[1].headers
    for receipt, arrived in zip((soon, later), arrivals.at, strict=True):
        assert receipt.scheduled is not None
        lateness = arrived - receipt.scheduled.timestamp()
        assert -0.01 < lateness < 1.0, lateness


async def test_the_internal_group_is_not_listed_among_the_groups(
    kind: str, url: str, unique_prefix: str
) -> None:
    bus = Bus(transport=make_transport(kind, url, unique_prefix))
    bus.subscribe("jobs", Arrivals(), group="workers")
    with anyio.fail_after(60):
        async with bus:
            await bus.publish("jobs", 1, delay=3600)
            assert [info.name for info in await bus.groups()] == ["jobs@workers"]
            assert [info.name for info in bus.groups()] == ["jobs@workers"]


async def test_a_delay_longer_than_a_broker_can_hold_goes_back_in_hops(
    kind: str, url: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    bus = Bus(transport=make_transport(kind, url, unique_prefix))
    bus.subscribe("jobs", Arrivals(), group="workers")
    with caplog.at_level(logging.WARNING, "asyncbus"), anyio.fail_after(60):
        async with bus:
            # 60 days: beyond RabbitMQ's longest message TTL (about 49.7 days)
            receipt = await bus.publish("jobs", 1, delay=60 * 86400)
            keeper = bus._time.keeper
            while keeper.handed_back < 1:  # (the broker delivered it early once)
                await anyio.sleep(0.01)
            assert [s.id for s in bus.scheduled()] == [receipt.id]
            assert await bus.cancel_scheduled(receipt.id) is True
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@on_shared_claims
async def test_cancel_scheduled_holds_in_every_process(
    kind: str, url: str, unique_prefix: str
) -> None:
    arrivals = Arrivals()
    one = Bus(transport=make_transport(kind, url, unique_prefix), name="one")
    other = Bus(transport=make_transport(kind, url, unique_prefix), name="other")
    one.subscribe("jobs", arrivals, group="workers")
    with anyio.fail_after(60):
        async with one, other:
            cancelled = await one.publish("jobs", "cancelled", delay=1.0)
            kept = await one.publish("jobs", "kept", delay=1.5)
            assert await other.cancel_scheduled(cancelled.id) is True
            assert await one.cancel_scheduled(cancelled.id) is False  # already
            await arrivals.wait_for(1)
            assert await other.cancel_scheduled(kept.id) is False  # published already
            await one.drain(timeout=10)
    assert [e.payload for e in arrivals.envelopes] == ["kept"]


async def _replica(kind: str, url: str, prefix: str, number: int, *, task_status: Any) -> None:
    bus = Bus(transport=make_transport(kind, url, prefix), name=f"replica-{number}")
    bus.schedule("ticks", every=0.1, name="heartbeat", payload=number)
    async with bus:
        task_status.started()
        await anyio.sleep_forever()


async def test_three_replicas_killed_in_turn_publish_every_tick_exactly_once(
    kind: str, url: str, unique_prefix: str
) -> None:
    arrivals = Arrivals()
    consumer = Bus(transport=make_transport(kind, url, unique_prefix), name="consumer")
    consumer.subscribe("ticks", arrivals, group="counter")
    with anyio.fail_after(90):
        async with consumer, anyio.create_task_group() as replicas:
            scopes: collections.deque[anyio.CancelScope] = collections.deque()

            async def start(number: int) -> None:
                scope = anyio.CancelScope()
                scopes.append(scope)

                async def run(*, task_status: Any) -> None:
                    with scope:
                        await _replica(kind, url, unique_prefix, number, task_status=task_status)

                await replicas.start(run)

            for number in range(3):
                await start(number)
            number = 3
            while len(arrivals.envelopes) < 100:
                # kill the oldest replica half-way between two ticks, start a new one
                await anyio.sleep(0.1 - time.time() % 0.1 + 0.05)
                scopes.popleft().cancel()
                await start(number)
                number += 1
                await anyio.sleep(0.4)
            # then ten ticks with no kill: a tick left by the last one killed is in
            await arrivals.wait_for(len(arrivals.envelopes) + 10)
            for scope in scopes:
                scope.cancel()
    ticks = sorted(int(envelope.id.rpartition("@")[2]) for envelope in arrivals.envelopes)
    counts = collections.Counter(ticks)
    assert [tick for tick, count in counts.items() if count != 1] == []
    assert ticks == list(range(ticks[0], ticks[0] + 100 * len(ticks), 100))  # none missing
    assert len({envelope.payload for envelope in arrivals.envelopes}) > 1  # several published


@on_shared_claims
async def test_a_replica_that_dies_holding_a_tick_does_not_make_it_disappear(
    kind: str, url: str, unique_prefix: str
) -> None:
    arrivals = Arrivals()
    bus = Bus(transport=make_transport(kind, url, unique_prefix))
    bus.subscribe("ticks", arrivals, group="counter")
    bus.schedule("ticks", every=1.0, name="beat")
    with anyio.fail_after(60):
        async with bus:
            # a replica that died right after claiming the next tick but one (its lease
            # runs on): claimed before this bus's own turn comes
            store = bus.transport.dedup_store(CLAIMS_WINDOW)  # type: ignore[attr-defined]
            next_tick = (int(time.time()) + 3) * 1000
            await store.claim(f"_asyncbus.periodic.beat/{next_tick}", "a-dead-replica", 5.0)
            while next_tick not in _ticks(arrivals):
                await arrivals.changed.wait()
            [arrived] = [
                at
                for envelope, at in zip(arrivals.envelopes, arrivals.at, strict=True)
                if envelope.id.endswith(f"@{next_tick}")
            ]
    # published by the live replica once the dead one's lease ran out
    assert 4.0 < arrived - next_tick / 1000 < 8.0
    assert collections.Counter(_ticks(arrivals))[next_tick] == 1


def _ticks(arrivals: Arrivals) -> list[int]:
    return [int(envelope.id.rpartition("@")[2]) for envelope in arrivals.envelopes]


async def test_ticks_missed_while_every_replica_was_down_are_caught_up(
    kind: str, url: str, unique_prefix: str
) -> None:
    arrivals = Arrivals()
    consumer = Bus(transport=make_transport(kind, url, unique_prefix), name="consumer")
    consumer.subscribe("ticks", arrivals, group="counter")

    def replica() -> Bus:
        bus = Bus(transport=make_transport(kind, url, unique_prefix))
        bus.schedule("ticks", every=0.5, name="catching-up", catch_up="all")
        return bus

    with anyio.fail_after(60):
        async with consumer:
            async with replica():
                await arrivals.wait_for(2)
            stopped = time.time()
            await anyio.sleep(2.2)  # every replica down: four ticks go by
            async with replica():
                await arrivals.wait_for(len(arrivals.envelopes) + 5)
    ticks = sorted(_ticks(arrivals))
    assert len(ticks) == len(set(ticks))
    assert ticks == list(range(ticks[0], ticks[0] + 500 * len(ticks), 500))  # none missing
    assert sum(1 for tick in ticks if stopped < tick / 1000 < stopped + 2.2) >= 4
