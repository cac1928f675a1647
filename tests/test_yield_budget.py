"""The cooperative budget: publishes and consumers yield at least every YIELD_BUDGET steps."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from asyncbus import Bus
from asyncbus._runtime import YIELD_BUDGET

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


async def test_a_publish_loop_meets_a_cancellation_within_the_budget() -> None:
    """A publish is a checkpoint at least once every YIELD_BUDGET calls."""
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("budget.cancel", capacity=100)
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        await bus.publish("budget.cancel", -1)  # the first publish yields: budget is fresh
        published: list[int] = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            for n in range(100):
                await bus.publish("budget.cancel", n)
                published.append(n)
        await bus.drain()
    assert scope.cancelled_caught
    # The publishes left in the budget went through without yielding; the next one
    # yielded and met the cancellation, admitting nothing.
    assert published == list(range(YIELD_BUDGET - 1))
    assert handled == [-1, *range(YIELD_BUDGET - 1)]
    [stage] = bus.statistics().stages
    assert (stage.published, stage.acked) == (YIELD_BUDGET, YIELD_BUDGET)


async def test_a_publish_that_waits_for_room_always_yields() -> None:
    """A full BLOCK stage makes the publisher wait whatever its budget."""
    bus = Bus()
    release = anyio.Event()

    @bus.subscribe("budget.full", capacity=1)
    async def handle(n: int) -> None:
        await release.wait()

    async with bus:
        await bus.publish("budget.full", 0)  # taken by the consumer, which waits
        await anyio.wait_all_tasks_blocked()
        await bus.publish("budget.full", 1)  # queued: the stage is full now
        with anyio.move_on_after(0.2) as scope:
            await bus.publish("budget.full", 2)
        assert scope.cancelled_caught
        release.set()
        await bus.drain()
    [stage] = bus.statistics().stages
    assert (stage.published, stage.acked) == (2, 2)


async def test_a_consumer_lets_other_tasks_run_between_budgets(anyio_backend_name: str) -> None:
    """A stage with a backlog handles at most YIELD_BUDGET envelopes between two yields."""
    events: list[str] = []
    bus = Bus()
    stop = anyio.Event()

    @bus.subscribe("budget.backlog", capacity=100)
    async def handle(n: int) -> None:
        events.append("h")

    async def ticker() -> None:
        while not stop.is_set():
            events.append("tick")
            await anyio.lowlevel.checkpoint()

    async with bus:
        for n in range(3 * YIELD_BUDGET + 2):
            bus.publish_nowait("budget.backlog", n)  # a backlog, queued without yielding
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(ticker)
            await bus.drain()
            stop.set()
    runs = [len(run) for run in "".join("h" if e == "h" else " " for e in events).split()]
    assert sum(runs) == 3 * YIELD_BUDGET + 2
    if anyio_backend_name == "trio":
        # Trio runs each batch of ready tasks in a random order, so the consumer can
        # run last in one batch and first in the next: two budgets back to back.
        assert max(runs) <= 2 * YIELD_BUDGET
        assert len(runs) >= 2
    else:
        assert runs == [YIELD_BUDGET] * 3 + [2]  # asyncio steps ready tasks in FIFO order
