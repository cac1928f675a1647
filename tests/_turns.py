"""Counting the event loop's turns around an operation: the fairness tests' helpers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel


async def ticker(events: list[str], stop: anyio.Event) -> None:
    """Another task: one "tick" per turn of the event loop until ``stop``."""
    while not stop.is_set():
        events.append("tick")
        await anyio.lowlevel.checkpoint()


def run_lengths(events: list[str], name: str) -> list[int]:
    """Lengths of the runs of ``name`` in ``events`` (other entries separate runs)."""
    marks = "".join("x" if event == name else " " for event in events)
    return [len(run) for run in marks.split()]


async def publish_runs(publish: Callable[[int], Awaitable[object]], count: int) -> list[int]:
    """Await ``publish(n)`` for each ``n`` below ``count`` while another task ticks once
    per turn of the event loop: the lengths of the runs of publishes no tick separated
    (all 1 when every publish yields; trio, which steps a batch of ready tasks in a
    random order, may pair two across a batch boundary, never three)."""
    events: list[str] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(ticker, events, stop)
        await anyio.lowlevel.checkpoint()  # the ticker has started
        for n in range(count):
            await publish(n)
            events.append("publish")
        stop.set()
    return run_lengths(events, "publish")


def assert_each_yielded(runs: list[int], count: int, backend: str) -> None:
    """``runs`` (from :func:`run_lengths`) show ``count`` calls that each yielded: on
    asyncio, which steps ready tasks in FIFO order, a tick between any two; on trio,
    which steps each batch of ready tasks in a random order, two calls can meet across
    a batch boundary, never three."""
    assert sum(runs) == count
    if backend == "trio":
        assert max(runs) <= 2
    else:
        assert runs == [1] * count
