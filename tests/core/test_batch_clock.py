"""A batch's ``max_wait`` is measured with the loop's clock (trio's ``MockClock`` here).

With ``autojump_threshold=0`` the clock jumps to the next deadline whenever every task
waits, so a batch that waits a minute to fill does so at once and exactly.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncbus import Batch, Bus, Retry
from asyncbus.middleware import timeout

pytestmark = [pytest.mark.anyio, pytest.mark.backends("trio-mock-clock")]


async def test_a_batch_short_of_max_size_waits_max_wait_then_runs() -> None:
    calls: list[tuple[float, list[int]]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=60))
    async def handle(items: list[int]) -> None:
        calls.append((anyio.current_time(), items))

    with anyio.fail_after(3600):
        async with bus:
            start = anyio.current_time()
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert [(round(at - start, 6), items) for at, items in calls] == [(60.0, [0, 1, 2])]


async def test_envelopes_arriving_within_max_wait_join_the_batch() -> None:
    calls: list[tuple[float, list[int]]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=5, max_wait=60))
    async def handle(items: list[int]) -> None:
        calls.append((anyio.current_time(), items))

    with anyio.fail_after(3600):
        async with bus:
            start = anyio.current_time()
            await bus.publish("t", 0)
            await anyio.sleep(10)
            await bus.publish("t", 1)
            await anyio.sleep(10)
            for n in range(2, 7):  # fills the batch at 4: it runs at once
                await bus.publish("t", n)
            await bus.drain()
    assert [(round(at - start, 6), items) for at, items in calls] == [
        (20.0, [0, 1, 2, 3, 4]),
        (80.0, [5, 6]),
    ]


async def test_what_arrives_while_a_batch_waits_short_of_full_joins_it_at_max_wait() -> None:
    calls: list[tuple[float, list[int]]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=60))
    async def handle(items: list[int]) -> None:
        calls.append((anyio.current_time(), items))

    with anyio.fail_after(3600):
        async with bus:
            start = anyio.current_time()
            await bus.publish("t", 0)
            await anyio.sleep(10)
            await bus.publish("t", 1)
            await anyio.sleep(10)
            await bus.publish("t", 2)
            await bus.drain()
    assert [(round(at - start, 6), items) for at, items in calls] == [(60.0, [0, 1, 2])]


async def test_max_wait_zero_takes_what_is_queued_and_goes() -> None:
    calls: list[tuple[float, list[int]]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=5, max_wait=0))
    async def handle(items: list[int]) -> None:
        calls.append((anyio.current_time(), items))

    with anyio.fail_after(3600):
        async with bus:
            start = anyio.current_time()
            bus.publish_nowait("t", 0)
            bus.publish_nowait("t", 1)
            await bus.drain()
    assert [(at - start, items) for at, items in calls] == [(0.0, [0, 1])]


async def test_retried_envelopes_wait_their_own_backoff_and_are_batched_again() -> None:
    calls: list[tuple[float, list[tuple[int, int]]]] = []
    bus = Bus()

    @bus.subscribe(
        "t",
        batch=Batch(max_size=10, max_wait=0),
        retry=Retry(max_attempts=2, backoff=30, jitter=False),
    )
    async def handle(items: list[Any]) -> None:
        calls.append((anyio.current_time(), items))
        if len(calls) == 1:
            raise RuntimeError("first call fails")

    with anyio.fail_after(3600):
        async with bus:
            start = anyio.current_time()
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    # (The three timers end at the same instant; the order they re-enter in is theirs.)
    assert [(round(at - start, 6), sorted(items)) for at, items in calls] == [
        (0.0, [0, 1, 2]),
        (30.0, [0, 1, 2]),
    ]
    stage = bus.statistics().stages[0]
    assert (stage.published, stage.acked, stage.failed, stage.retried) == (3, 3, 3, 3)


async def test_a_batch_call_ends_at_the_earliest_deadline_of_its_envelopes() -> None:
    ended: list[tuple[float, bool]] = []
    finished = anyio.Event()
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0), middleware=[timeout(30)])
    async def handle(items: list[int]) -> None:
        completed = False
        try:
            await anyio.sleep(100)
            completed = True
        finally:
            ended.append((anyio.current_time(), completed))
            finished.set()

    with anyio.fail_after(3600):
        async with bus:
            start = anyio.current_time()
            for n in range(3):
                bus.publish_nowait("t", n)
            await finished.wait()  # however the call ends
            await bus.drain()
    assert [(round(at - start, 6), completed) for at, completed in ended] == [(30.0, False)]
    letters = bus.dead_letters.list()
    assert sorted((entry.envelope.payload, entry.reason.value) for entry in letters) == [
        (0, "timeout"),
        (1, "timeout"),
        (2, "timeout"),
    ]
