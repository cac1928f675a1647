"""``subscribe(..., max_in_flight=N)``: at most N handlers of the stage at once.

In one process the bound is counted exactly: handlers meet until N run together, and
the most ever seen running is N. A retry waiting for its timer holds no slot.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from _meeting import Meeting  # type: ignore[import-not-found]

from asyncbus import Batch, Bus, ConfigurationError, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_no_more_than_max_in_flight_handlers_run_at_once() -> None:
    bus = Bus()
    gauge = Meeting(3)

    @bus.subscribe("t", group="g", concurrency=8, max_in_flight=3)
    async def handle(n: int) -> None:
        await gauge.attend()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(20))
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert gauge.most == 3
    assert (stage.acked, stage.max_in_flight, stage.slots_held, stage.slots_waiting) == (
        20,
        3,
        0,
        0,
    )


async def test_the_subscriptions_of_a_stage_share_its_slots() -> None:
    bus = Bus()
    gauge = Meeting(4)

    async def first(n: int) -> None:
        await gauge.attend()

    async def second(n: int) -> None:
        await gauge.attend()

    bus.subscribe("t", first, group="g", concurrency=3, max_in_flight=4)
    bus.subscribe("t", second, group="g", concurrency=3, max_in_flight=4)
    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(30))
            await bus.drain()
    assert gauge.most == 4


async def test_a_retry_waiting_for_its_timer_holds_no_slot() -> None:
    bus = Bus()
    order: list[str] = []
    retried = anyio.Event()

    @bus.subscribe(
        "t",
        group="g",
        concurrency=2,
        max_in_flight=1,
        retry=Retry(max_attempts=2, backoff=0.05, jitter=False),
    )
    async def handle(name: str) -> None:
        order.append(name)
        if name == "a" and not retried.is_set():
            retried.set()
            raise RuntimeError("once")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", "a")
            await retried.wait()
            await bus.publish("t", "b")
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert order == ["a", "b", "a"]
    assert (stage.acked, stage.retried) == (2, 1)


async def test_statistics_show_held_and_waiting_slots() -> None:
    bus = Bus()
    meeting = Meeting(2, hold=anyio.Event())

    @bus.subscribe("t", group="g", concurrency=5, max_in_flight=2)
    async def handle(n: int) -> None:
        await meeting.attend()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(5))
            await meeting.full.wait()
            while bus.statistics().stage("t@g").slots_waiting < 3:
                await anyio.sleep(0)
            stage = bus.statistics().stage("t@g")
            assert (stage.slots_held, stage.slots_waiting, stage.in_flight) == (2, 3, 5)
            assert meeting.hold is not None
            meeting.hold.set()
            await bus.drain()
    assert (meeting.arrived, meeting.most) == (5, 2)


async def test_max_in_flight_is_checked_at_subscribe() -> None:
    bus = Bus()

    async def handle(n: int) -> None:
        pass

    for wrong in (0, -1, True, 2.5, "3"):
        with pytest.raises(ConfigurationError, match="max_in_flight must be an int >= 1"):
            bus.subscribe("t", handle, max_in_flight=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_in_flight cannot be combined with batch"):
        bus.subscribe("t", handle, max_in_flight=2, batch=Batch(max_size=2))
    bus.subscribe("t", handle, group="g", max_in_flight=2)
    with pytest.raises(ConfigurationError, match="already has max_in_flight=2"):
        bus.subscribe("t", handle, group="g", max_in_flight=3)
    with pytest.raises(ConfigurationError, match="already has max_in_flight=2"):
        bus.subscribe("t", group="g")


def test_a_bus_with_max_in_flight_runs_again_on_another_event_loop() -> None:
    bus = Bus()
    most = running = 0

    @bus.subscribe("t", group="g", concurrency=4, max_in_flight=2)
    async def handle(n: int) -> None:
        nonlocal most, running
        running += 1
        most = max(most, running)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        running -= 1

    async def run() -> None:
        with anyio.fail_after(10):
            async with bus:
                await bus.publish_many("t", range(10))
                await bus.drain()

    anyio.run(run, backend="asyncio")
    anyio.run(run, backend="trio")  # (its slots are not the first loop's)
    stage = bus.statistics().stage("t@g")
    assert (stage.acked, stage.dead_lettered, most) == (20, 0, 2)
