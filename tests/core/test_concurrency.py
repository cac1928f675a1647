"""Many producers, many consumers, many threads: every message handled exactly once."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import anyio
import anyio.lowlevel
import pytest

from asyncbus import Bus, Envelope, Receipt, StageStatistics

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    """Return the statistics of the stage called ``name``."""
    for stage in bus.statistics().stages:
        if stage.name == name:
            return stage
    raise KeyError(name)


def run_threads(count: int, target: Callable[[int], None]) -> None:
    """Run ``target(k)`` on ``count`` threads at once and join them all."""
    threads = [threading.Thread(target=target, args=(k,), daemon=True) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)


async def test_several_producers_into_one_group_handle_every_message_exactly_once() -> None:
    handled: list[str] = []
    published: list[str] = []
    bus = Bus()

    def make_consumer() -> Callable[[Envelope], Awaitable[None]]:
        async def consume(env: Envelope) -> None:
            await anyio.lowlevel.checkpoint()
            handled.append(env.id)

        return consume

    # three handlers compete in one group; a small capacity keeps producers held at the door
    for concurrency in (1, 2, 3):
        bus.subscribe("work", make_consumer(), group="pool", concurrency=concurrency, capacity=8)

    async def produce(producer: int) -> None:
        for n in range(250):
            receipt = await bus.publish("work", (producer, n))
            assert receipt.accepted == ("work@pool",)
            published.append(receipt.id)

    with anyio.fail_after(10):
        async with bus:
            async with anyio.create_task_group() as tg:
                for producer in range(4):
                    tg.start_soon(produce, producer)
            await bus.drain()

            assert len(published) == 1000
            assert len(set(published)) == 1000
            assert len(handled) == 1000
            assert sorted(handled) == sorted(published)
            stats = stage_stats(bus, "work@pool")
            assert (stats.published, stats.acked, stats.dead_lettered, stats.concurrency) == (
                1000,
                1000,
                0,
                6,
            )
            assert (stats.rejected, stats.dropped, stats.depth, stats.in_flight) == (0, 0, 0, 0)
            assert len(bus.dead_letters) == 0


async def test_publish_threadsafe_from_four_threads_handles_every_message_exactly_once() -> None:
    handled: list[str] = []
    bus = Bus()

    @bus.subscribe("work", group="pool", concurrency=4)
    async def consume(env: Envelope) -> None:
        handled.append(env.id)

    def publish_from_threads() -> list[Receipt]:
        futures: list[list[Future[Receipt]]] = [[] for _ in range(4)]

        def produce(k: int) -> None:
            for n in range(1000):
                futures[k].append(bus.publish_threadsafe("work", (k, n)))

        run_threads(4, produce)
        return [future.result(timeout=10) for mine in futures for future in mine]

    with anyio.fail_after(15):
        async with bus:
            receipts = await anyio.to_thread.run_sync(publish_from_threads, abandon_on_cancel=True)
            await bus.drain()

            ids = [r.id for r in receipts]
            assert len(ids) == 4000
            assert len(set(ids)) == 4000
            assert {r.accepted for r in receipts} == {("work@pool",)}
            assert len(handled) == 4000
            assert sorted(handled) == sorted(ids)
            stats = stage_stats(bus, "work@pool")
            assert (stats.published, stats.acked, stats.dead_lettered) == (4000, 4000, 0)
            assert (stats.depth, stats.in_flight) == (0, 0)
            assert len(bus.dead_letters) == 0


async def test_drain_waits_for_threadsafe_publishes_made_before_it() -> None:
    handled: list[tuple[int, int]] = []
    bus = Bus()

    @bus.subscribe("work", group="pool", concurrency=2)
    async def consume(pair: tuple[int, int]) -> None:
        await anyio.lowlevel.checkpoint()
        handled.append(pair)

    def produce(k: int) -> None:
        for n in range(250):
            bus.publish_threadsafe("work", (k, n))

    with anyio.fail_after(10):
        async with bus:
            # no future is awaited: drain alone must account for what the threads sent
            await anyio.to_thread.run_sync(run_threads, 4, produce, abandon_on_cancel=True)
            await bus.drain()

            assert len(handled) == 1000
            assert sorted(handled) == [(k, n) for k in range(4) for n in range(250)]
            stats = stage_stats(bus, "work@pool")
            assert (stats.published, stats.acked) == (1000, 1000)


async def test_publish_threadsafe_from_sync_handlers_is_waited_for_by_drain() -> None:
    forwarded: list[int] = []
    bus = Bus()

    @bus.subscribe("first", group="sync", concurrency=4)
    def forward(n: int) -> None:
        # a pool worker thread publishing onwards
        bus.publish_threadsafe("second", n)

    @bus.subscribe("second", group="sink")
    async def sink(n: int) -> None:
        forwarded.append(n)

    with anyio.fail_after(10):
        async with bus:
            for n in range(100):
                await bus.publish("first", n)
            await bus.drain()

            assert sorted(forwarded) == list(range(100))
            assert stage_stats(bus, "first@sync").acked == 100
            assert stage_stats(bus, "second@sink").acked == 100
