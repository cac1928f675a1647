"""Fairness over a broker: the wait for the broker's confirmation is a publish's one yield.

In memory a publish yields before it admits anything (tests/test_fairness.py). Over a
broker the call only checks for a cancellation before it sends, then yields while the
broker confirms: a publish in a cancelled scope sends nothing, other tasks run during
every publish, and a ``$deadletter`` publish (which stays in this process, with no
broker round trip) still yields once.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from _kinds import make_transport  # type: ignore[import-not-found]
from _turns import run_lengths, ticker  # type: ignore[import-not-found]

from asyncbus import DEADLETTER_TOPIC, Bus

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the broker clients are asyncio libraries


async def test_a_publish_in_a_cancelled_scope_sends_nothing(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[int] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("fair.cancelled", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(45):
        async with bus:
            published: list[str] = []
            with anyio.CancelScope() as scope:
                scope.cancel()
                await bus.publish("fair.cancelled", 1)
                published.append("publish")
            assert scope.cancelled_caught
            with anyio.CancelScope() as scope:
                scope.cancel()
                await bus.publish_many("fair.cancelled", [2, 3])
                published.append("publish_many")
            assert scope.cancelled_caught
            await bus.publish("fair.cancelled", 4)
            await bus.drain(30)
    assert published == []
    assert handled == [4]  # the broker got the last one only
    stage = bus.statistics().stage("fair.cancelled@g")
    assert (stage.published, stage.acked, stage.dead_lettered, stage.abandoned) == (1, 1, 0, 0)


@pytest.mark.parametrize("topic", ["fair.turns", DEADLETTER_TOPIC])
async def test_another_task_runs_during_every_publish(
    kind: str, url: str, unique_prefix: str, topic: str
) -> None:
    events: list[str] = []
    stop = anyio.Event()
    handled: list[int] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe(topic, group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(45):
        async with bus:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(ticker, events, stop)
                await anyio.lowlevel.checkpoint()  # the ticker has started
                for n in range(10):
                    await bus.publish(topic, n)
                    events.append("publish")
                for start in range(10, 30, 10):
                    await bus.publish_many(topic, range(start, start + 10))
                    events.append("publish")
                stop.set()
            await bus.drain(30)
    assert run_lengths(events, "publish") == [1] * 12
    assert sorted(handled) == list(range(30))
    stage = bus.statistics().stage(f"{topic}@g")
    assert (stage.published, stage.acked, stage.dead_lettered, stage.abandoned) == (30, 30, 0, 0)
