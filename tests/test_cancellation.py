"""Cancellation inside handlers: the bus's own stops it; anything else is a failure."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from asyncbus import Adaptive, Bus, DeadLetterReason, Envelope, Retry, StageStatistics
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
