"""Cancellation inside handlers: the bus's own stops it; anything else is a failure."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from asyncbus import (
    Adaptive,
    Bus,
    BusClosedError,
    DeadLetterReason,
    Envelope,
    Retry,
    StageStatistics,
)
from asyncbus.middleware import middleware

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    """Return the statistics of the stage called ``name``."""
    (stats,) = [stage for stage in bus.statistics().stages if stage.name == name]
    return stats


@pytest.mark.parametrize("concurrency", [1, Adaptive(min=1, max=2)], ids=["static", "adaptive"])
async def test_a_stray_cancellation_in_a_handler_is_dead_lettered_and_the_bus_keeps_going(
    concurrency: int | Adaptive,
    cancelled_elsewhere: Callable[[], Awaitable[None]],
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", concurrency=concurrency)
    async def handle(n: int) -> None:
        if n == 1:
            await cancelled_elsewhere()
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            failed = await bus.publish("jobs", 1)
            await bus.drain()
            assert bus.running
            await bus.publish("jobs", 2)
            await bus.drain()
            report = await bus.aclose(timeout=5)

    assert handled == [2]
    letter = bus.dead_letters.get(failed.id)
    assert letter is not None
    assert letter.reason is DeadLetterReason.HANDLER_FAILED
    assert letter.error is not None and letter.error.startswith("HandlerCancelled: ")
    assert "Cancel" in letter.error
    assert (report.drained, report.published, report.completed, report.dead_lettered) == (
        True,
        2,
        1,
        1,
    )
    assert_settled(bus)


async def test_a_stray_cancellation_is_retried_like_any_failure(
    cancelled_elsewhere: Callable[[], Awaitable[None]],
    assert_settled: Callable[[Bus], None],
) -> None:
    attempts: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", retry=Retry(max_attempts=3, backoff=0, jitter=False))
    async def handle(env: Envelope) -> None:
        attempts.append(env.attempt)
        if env.attempt < 3:
            await cancelled_elsewhere()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await bus.drain()

    assert attempts == [1, 2, 3]
    stats = stage_stats(bus, "jobs@g")
    assert (stats.acked, stats.failed, stats.retried, stats.dead_lettered) == (1, 2, 2, 0)
    assert_settled(bus)


async def test_a_stray_cancellation_in_a_middleware_is_a_failure_too(
    cancelled_elsewhere: Callable[[], Awaitable[None]],
    assert_settled: Callable[[Bus], None],
) -> None:
    @middleware
    async def broken(env: Envelope, call_next: Callable[[Envelope], object]) -> None:
        await cancelled_elsewhere()

    async def handle(_: object) -> None:
        raise AssertionError("not reached")

    bus = Bus()
    bus.subscribe("jobs", handle, group="g", middleware=[broken])
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1)
            await bus.drain()

    letter = bus.dead_letters.get(receipt.id)
    assert letter is not None and letter.reason is DeadLetterReason.HANDLER_FAILED
    assert_settled(bus)


async def test_a_handler_timeout_is_still_a_timeout_not_a_stray_cancellation(
    assert_settled: Callable[[Bus], None],
) -> None:
    bus = Bus()

    @bus.subscribe("jobs", group="g", timeout=0.01)
    async def handle(_: object) -> None:
        await anyio.sleep(10)

    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1)
            await bus.drain()

    letter = bus.dead_letters.get(receipt.id)
    assert letter is not None and letter.reason is DeadLetterReason.TIMEOUT
    assert_settled(bus)


async def test_the_shutdown_still_cancels_a_handler_that_waits(
    assert_settled: Callable[[Bus], None],
) -> None:
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g", retry=Retry(max_attempts=5, retry_on=(BaseException,)))
    async def handle(_: object) -> None:
        entered.set()
        await anyio.sleep(60)

    with anyio.fail_after(10):
        async with bus:
            stuck = await bus.publish("jobs", 1)
            await entered.wait()
            report = await bus.aclose(timeout=0.01)

    # retry_on=BaseException does not turn the bus's own cancellation into a retry
    assert report.abandoned == [stuck.id]
    assert stage_stats(bus, "jobs@g").retried == 0
    assert_settled(bus)


def _asyncio_only(anyio_backend: tuple[str, dict[str, object]]) -> None:
    if anyio_backend[0] != "asyncio":
        pytest.skip("only asyncio lets anything but a cancel scope cancel a task")


@pytest.mark.parametrize("concurrency", [1, Adaptive(min=1, max=2)], ids=["static", "adaptive"])
async def test_a_handler_that_cancels_its_own_task_fails_and_the_bus_keeps_going(
    anyio_backend: tuple[str, dict[str, object]],
    concurrency: int | Adaptive,
    assert_settled: Callable[[Bus], None],
) -> None:
    _asyncio_only(anyio_backend)
    import asyncio

    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", concurrency=concurrency)
    async def handle(n: int) -> None:
        if n == 1:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            failed = await bus.publish("jobs", 1)
            await bus.drain()
            assert bus.running
            await bus.publish("jobs", 2)
            await bus.drain()
            report = await bus.aclose(timeout=5)

    assert handled == [2]
    letter = bus.dead_letters.get(failed.id)
    assert letter is not None and letter.reason is DeadLetterReason.HANDLER_FAILED
    assert letter.error is not None and letter.error.startswith("HandlerCancelled: ")
    assert (report.drained, report.published, report.completed, report.dead_lettered) == (
        True,
        2,
        1,
        1,
    )
    assert_settled(bus)


async def test_a_consumer_cancelled_by_another_task_retries_and_keeps_consuming(
    anyio_backend: tuple[str, dict[str, object]],
    assert_settled: Callable[[Bus], None],
) -> None:
    _asyncio_only(anyio_backend)
    import asyncio

    attempts: list[int] = []
    consumer: list[asyncio.Task[object]] = []
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g", retry=Retry(max_attempts=2, backoff=0, jitter=False))
    async def handle(env: Envelope) -> None:
        attempts.append(env.attempt)
        if env.attempt == 1:
            task = asyncio.current_task()
            assert task is not None
            consumer.append(task)
            entered.set()
            await anyio.sleep(30)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            consumer[0].cancel()  # from this task, not the bus
            await bus.drain()
            assert bus.running
            report = await bus.aclose(timeout=5)

    assert attempts == [1, 2]
    stats = stage_stats(bus, "jobs@g")
    assert (stats.acked, stats.failed, stats.retried, stats.dead_lettered) == (1, 1, 1, 0)
    assert report.drained and report.abandoned == []
    assert_settled(bus)


@pytest.mark.parametrize("concurrency", [1, Adaptive(min=1, max=2)], ids=["static", "adaptive"])
async def test_a_consumer_cancelled_between_envelopes_keeps_consuming(
    anyio_backend: tuple[str, dict[str, object]],
    concurrency: int | Adaptive,
    assert_settled: Callable[[Bus], None],
) -> None:
    _asyncio_only(anyio_backend)
    import asyncio

    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", concurrency=concurrency)
    async def handle(n: int) -> None:
        handled.append(n)
        if n == 1:
            task = asyncio.current_task()
            assert task is not None
            # Returns at once: the cancellation lands where the consumer waits next.
            task.cancel()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await bus.drain()
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            assert bus.running
            await bus.publish("jobs", 2)
            await bus.drain()
            # and one parked, waiting for work, cancelled by another task
            for task in asyncio.all_tasks():
                if task.get_name().startswith("asyncbus"):
                    task.cancel()  # the consumers and the bus's runner
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            assert bus.running
            await bus.publish("jobs", 3)
            await bus.drain()
            report = await bus.aclose(timeout=5)

    assert handled == [1, 2, 3]
    assert (report.drained, report.published, report.completed) == (True, 3, 3)
    assert_settled(bus)


async def test_a_bus_whose_task_group_ends_without_a_stop_raises_from_async_with(
    caplog: pytest.LogCaptureFixture,
    assert_settled: Callable[[Bus], None],
) -> None:
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        entered.set()
        await anyio.sleep(30)

    with anyio.fail_after(10):
        with pytest.raises(BusClosedError, match="stopped by itself"):
            async with bus:
                stuck = await bus.publish("jobs", 1)
                await entered.wait()
                bus._tasks().cancel_scope.cancel()  # not a stop: the bus must say so
                await anyio.sleep_forever()  # interrupted by the bus

    assert not bus.running
    report = await bus.aclose()  # told once; the report is there
    assert report.abandoned == [stuck.id]
    assert any(
        record.levelname == "ERROR" and "stopped by itself" in record.getMessage()
        for record in caplog.records
    )
    assert_settled(bus)


async def test_a_handler_that_cancels_the_bus_task_group_stops_it_loudly() -> None:
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        bus._tasks().cancel_scope.cancel()  # from inside: the same, not a stop
        await anyio.lowlevel.checkpoint()

    with anyio.fail_after(10):
        with pytest.raises(BusClosedError, match="stopped by itself"):
            async with bus:
                await bus.publish("jobs", 1)
                await anyio.sleep_forever()

    report = await bus.aclose()  # told already: now the report
    assert report.published == 1 and len(report.abandoned) == 1
