"""Controlled stages (adaptive concurrency, admission control) over every broker.

A controlled stage takes at most ``min(capacity, limit)`` deliveries beyond those its
consumers hold, and its broker subscription holds no more: the rest stays in the broker
for the other replicas of its group. Its admission control sees the queue where it
stands, in the broker: a delivery's wait counts from when the broker queued it.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Adaptive, Admission, Bus, DeadLetterReason

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

QUEUED = 30


@pytest.mark.parametrize(
    "control",
    [
        pytest.param({"concurrency": Adaptive(min=1, max=2)}, id="adaptive"),
        # (A wait it never reaches: this is about what the stage takes, not shedding.)
        pytest.param({"admission": Admission(target_wait=60.0, interval=60.0)}, id="admission"),
    ],
)
async def test_a_slow_controlled_replica_leaves_the_backlog_to_a_replica_that_joins_later(
    kind: str, url: str, unique_prefix: str, control: dict[str, Any]
) -> None:
    """The slow replica (one consumer, held on a gate) takes its window, two: the one it
    handles and one queued. The fast replica that joins later gets all the rest."""
    gate = anyio.Event()
    slow_started = anyio.Event()
    fast_done = anyio.Event()
    slow_handled: list[int] = []
    fast_handled: list[int] = []

    slow = Bus(transport=make_transport(kind, url, unique_prefix))

    @slow.subscribe("jobs", group="workers", capacity=64, **control)
    async def slowly(number: int) -> None:
        slow_handled.append(number)
        slow_started.set()
        await gate.wait()

    fast = Bus(transport=make_transport(kind, url, unique_prefix))

    @fast.subscribe("jobs", group="workers")
    async def quickly(number: int) -> None:
        fast_handled.append(number)
        if len(fast_handled) == QUEUED - 2:
            fast_done.set()

    with anyio.fail_after(60):
        async with slow:
            # One write: the slow replica's first read takes its whole window at once.
            await slow.publish_many("jobs", range(QUEUED))
            await slow_started.wait()
            async with fast:
                await fast_done.wait()
                gate.set()
                await slow.drain()
                await fast.drain()
                stats = slow.statistics().stage("jobs@workers")
    assert sorted(slow_handled) == [0, 1]
    assert sorted(fast_handled) == list(range(2, QUEUED))
    assert (stats.published, stats.acked, stats.dead_lettered) == (2, 2, 0)


async def test_admission_over_a_broker_sheds_by_the_wait_in_the_broker(
    kind: str, url: str, unique_prefix: str
) -> None:
    """The first message holds the only consumer while the rest wait, most of them in the
    broker (the stage holds its window only). Once it is released, every other one has
    waited past ``target_wait``: each is shed as it is taken, none handled late."""
    gate = anyio.Event()
    started = anyio.Event()
    handled: list[int] = []
    target = 0.2
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe(
        "jobs", group="workers", capacity=64, admission=Admission(target_wait=target, interval=0.1)
    )
    async def work(number: int) -> None:
        handled.append(number)
        started.set()
        await gate.wait()

    with anyio.fail_after(60):
        async with bus:
            await bus.publish_many("jobs", range(10))
            await started.wait()
            await anyio.sleep(2 * target)  # a wait past the target: the scenario itself
            gate.set()
            await bus.drain()
            stats = bus.statistics().stage("jobs@workers")
            shed = bus.dead_letters.list(reason=DeadLetterReason.OVERLOAD)
    assert handled == [0]
    assert (stats.published, stats.acked, stats.dead_lettered, stats.shed) == (10, 1, 9, 9)
    assert sorted(entry.envelope.payload for entry in shed) == list(range(1, 10))
