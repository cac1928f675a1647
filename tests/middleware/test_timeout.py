"""Timeout: a handler that runs too long is cancelled; the attempt fails and ends as "timeout"."""

from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope, Retry, StageStatistics

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


async def test_handler_running_past_timeout_is_cancelled_and_dead_lettered_timeout() -> None:
    never = anyio.Event()
    started: list[int] = []
    finished: list[int] = []

    async def stuck(env: Envelope) -> None:
        started.append(env.attempt)
        try:
            await never.wait()
        finally:
            finished.append(env.attempt)

    bus = Bus()
    bus.subscribe("slow", stuck, group="g", timeout=0.05)
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("slow", 1)
            await bus.drain()

            assert started == [1]
            assert finished == [1]  # the handler was cancelled, not left running
            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.TIMEOUT
            assert letter.attempts == 1
            assert letter.stage == "slow@g"
            assert letter.envelope.id == receipt.id

            stats = stage_stats(bus, "slow@g")
            assert stats.published == 1
            assert stats.acked == 0
            assert stats.dead_lettered == 1
            assert stats.in_flight == 0


async def test_timed_out_attempt_is_retried_then_dead_lettered_timeout() -> None:
    never = anyio.Event()
    attempts: list[int] = []

    async def stuck(env: Envelope) -> None:
        attempts.append(env.attempt)
        await never.wait()

    bus = Bus()
    bus.subscribe(
        "slow",
        stuck,
        group="g",
        timeout=0.05,
        retry=Retry(max_attempts=2, backoff=0.01),
    )
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("slow", 1)
            await bus.drain()

            assert attempts == [1, 2]
            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.TIMEOUT
            assert letter.attempts == 2
            assert letter.stage == "slow@g"

            stats = stage_stats(bus, "slow@g")
            assert stats.published == 1
            assert stats.retried == 1
            assert stats.acked == 0
            assert stats.dead_lettered == 1
            assert stats.published == (
                stats.acked + stats.dead_lettered + stats.depth + stats.in_flight
            )


async def test_handler_finishing_within_timeout_is_acked() -> None:
    handled: list[Any] = []

    async def quick(payload: Any) -> None:
        handled.append(payload)

    bus = Bus()
    bus.subscribe("fast", quick, group="g", timeout=1.0)
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("fast", 1)
            await bus.drain()

            assert handled == [1]
            assert len(bus.dead_letters) == 0
            stats = stage_stats(bus, "fast@g")
            assert stats.acked == 1
            assert stats.dead_lettered == 0
