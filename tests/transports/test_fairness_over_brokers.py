"""Fairness over a broker: the wait for the broker's confirmation is a publish's one yield.

In memory a publish yields before it admits anything (tests/core/test_fairness.py). Over a
broker the call only checks for a cancellation before it sends, then yields while the
broker confirms: a publish in a cancelled scope sends nothing, other tasks run during
every publish, and a ``$deadletter`` publish (which stays in this process, with no
broker round trip), a ``publish_many`` of nothing and a publish refused before it reaches
the broker still yield once.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]
from _turns import publish_runs, run_lengths, ticker  # type: ignore[import-not-found]

from asyncbus import DEADLETTER_TOPIC, Bus, EncodeError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


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


async def test_a_publish_many_of_nothing_yields(kind: str, url: str, unique_prefix: str) -> None:
    """No payloads, no broker round trip to be the call's yield: it yields all the same."""
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("fair.nothing", group="g")
    async def handle(n: int) -> None:
        pass

    async def publish_nothing(n: int) -> None:
        assert await bus.publish_many("fair.nothing", []) == []

    with anyio.fail_after(45):
        async with bus:
            runs = await publish_runs(publish_nothing, 10)
    assert runs == [1] * 10


async def test_a_publish_the_transport_refuses_before_sending_yields(
    kind: str, url: str, unique_prefix: str
) -> None:
    """A payload the codec cannot encode is refused before any broker round trip: the
    call yields before it raises, so a loop that logs such refusals lets others run."""
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("fair.unencodable", group="g")
    async def handle(n: object) -> None:
        pass

    async def refused(n: int) -> None:
        with pytest.raises(EncodeError):
            await bus.publish("fair.unencodable", object())

    with anyio.fail_after(45):
        async with bus:
            runs = await publish_runs(refused, 10)
    assert runs == [1] * 10
    assert bus.dead_letters.list() == []


async def test_rabbit_a_publish_right_after_a_subscribe_on_the_running_bus_reaches_it(
    rabbit_url: str, rabbit_prefix: str
) -> None:
    """The pump of a subscription made on the running bus starts in the background; the
    next publish yields until it has begun to declare its queue, and RabbitMQ's publish
    waits for that declaration (instead of finding the message unroutable). (Redis and
    NATS make the group with a round trip of their own: there ``await bus.subscribed()``
    first, as the guide says.)"""
    handled: list[int] = []
    bus = Bus(transport=make_transport("rabbit", rabbit_url, rabbit_prefix))

    @bus.subscribe("fair.first", group="first")
    async def first(n: int) -> None:
        pass

    with anyio.fail_after(45):
        async with bus:
            bus.subscribe("fair.late", handled.append, group="late")
            await bus.publish("fair.late", 1)
            await bus.drain(30)
    assert bus.dead_letters.list() == []
    assert handled == [1]
