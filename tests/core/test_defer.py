"""``Defer(delay)``: back to the stage later, not a failure and not an attempt.

Every test accounts for each envelope (acked, dead-lettered, deferred) and runs on
asyncio, uvloop and trio. The middleware here is written with the public API only, as a
user would write a rate limiter.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
from _deferring import defer_first_runs  # type: ignore[import-not-found]

from asyncbus import (
    Batch,
    Bus,
    ConfigurationError,
    DeadLetterReason,
    Defer,
    Envelope,
    Handler,
    Middleware,
    Retry,
    StageStatistics,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def ledger(stage: StageStatistics) -> dict[str, int]:
    return {
        "published": stage.published,
        "acked": stage.acked,
        "failed": stage.failed,
        "retried": stage.retried,
        "deferred": stage.deferred,
        "dead_lettered": stage.dead_lettered,
        "expired": stage.expired,
        "in_flight": stage.in_flight,
        "depth": stage.depth,
    }


async def test_a_deferred_envelope_comes_back_with_the_same_attempt() -> None:
    bus = Bus()
    attempts: list[int] = []

    @bus.subscribe("t", group="g", middleware=[defer_first_runs(1, delay=0.01)])
    async def handle(envelope: Envelope) -> None:
        attempts.append(envelope.attempt)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            assert attempts == [1]
            assert ledger(stage) == {
                "published": 1,
                "acked": 1,
                "failed": 0,
                "retried": 0,
                "deferred": 1,
                "dead_lettered": 0,
                "expired": 0,
                "in_flight": 0,
                "depth": 0,
            }
            assert bus.statistics().deferred == 1


async def test_a_rate_limiter_that_defers_then_one_failure_does_not_dead_letter() -> None:
    """Deferred once, then one transient failure under Retry(max_attempts=2): the
    second attempt runs and succeeds (a RetryAfter in place of the Defer would have
    spent the budget and dead-lettered it with the handler called once)."""
    bus = Bus()
    calls: list[int] = []

    @bus.subscribe(
        "t",
        group="g",
        retry=Retry(max_attempts=2, backoff=0),
        middleware=[defer_first_runs(1)],
    )
    async def handle(envelope: Envelope) -> None:
        calls.append(envelope.attempt)
        if len(calls) == 1:
            raise RuntimeError("transient")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            assert calls == [1, 2]
            assert ledger(stage) == {
                "published": 1,
                "acked": 1,
                "failed": 1,
                "retried": 1,
                "deferred": 1,
                "dead_lettered": 0,
                "expired": 0,
                "in_flight": 0,
                "depth": 0,
            }
            assert bus.dead_letters.list() == []


async def test_deferred_many_times_never_spends_the_retry_budget() -> None:
    bus = Bus()
    calls: list[int] = []

    @bus.subscribe(
        "t",
        group="g",
        retry=Retry(max_attempts=2, backoff=0),
        middleware=[defer_first_runs(5)],
    )
    async def handle(envelope: Envelope) -> None:
        calls.append(envelope.attempt)

    with anyio.fail_after(10):
        async with bus:
            for n in range(3):
                await bus.publish("t", n)
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            assert calls == [1, 1, 1]
            assert (stage.acked, stage.deferred, stage.failed, stage.dead_lettered) == (3, 15, 0, 0)


async def test_a_deferred_envelope_whose_ttl_passes_is_dead_lettered_expired() -> None:
    bus = Bus()
    handled: list[Any] = []

    @bus.subscribe("t", group="g", middleware=[defer_first_runs(1, delay=0.2)])
    async def handle(payload: Any) -> None:
        handled.append(payload)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", "short", ttl=0.05)
            await bus.publish("t", "long", ttl=60)
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            assert handled == ["long"]
            assert (stage.acked, stage.deferred, stage.dead_lettered, stage.expired) == (1, 2, 1, 1)
            (entry,) = bus.dead_letters.list()
            assert (entry.envelope.payload, entry.reason) == ("short", DeadLetterReason.EXPIRED)


async def test_a_deferred_envelope_waiting_at_the_close_is_abandoned() -> None:
    bus = Bus()

    @bus.subscribe("t", group="g", middleware=[defer_first_runs(1, delay=3600)])
    async def handle(payload: Any) -> None:
        raise AssertionError("deferred for an hour")

    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("t", 1)
            await bus.subscribed()
            while bus.statistics().stage("t@g").deferred == 0:
                await anyio.sleep(0.001)
            report = await bus.aclose(timeout=0.1)
    assert (report.published, report.completed, report.dead_lettered) == (1, 0, 0)
    assert report.abandoned == [receipt.id]


async def test_one_envelope_of_a_batch_is_deferred_and_comes_back_in_a_later_batch() -> None:
    bus = Bus()
    batches: list[list[int]] = []

    def defer_three() -> Middleware:
        deferred: set[str] = set()

        def wrap(call_next: Handler) -> Handler:
            async def handle(envelope: Envelope) -> Any:
                if envelope.payload == 3 and envelope.id not in deferred:
                    deferred.add(envelope.id)
                    return Defer(0)
                return await call_next(envelope)

            return handle

        return wrap

    @bus.subscribe("t", group="g", batch=Batch(max_size=5, max_wait=0), middleware=[defer_three()])
    async def handle(items: list[int]) -> None:
        batches.append(list(items))

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(5))
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            assert batches == [[0, 1, 2, 4], [3]]
            assert (stage.published, stage.acked, stage.deferred, stage.failed) == (5, 5, 1, 0)
            assert (stage.dead_lettered, stage.in_flight, stage.depth) == (0, 0, 0)


@pytest.mark.parametrize("delay", [-1, math.nan, math.inf, "soon"])
def test_a_delay_that_is_not_finite_seconds_is_refused(delay: Any) -> None:
    with pytest.raises(ConfigurationError, match="Defer"):
        Defer(delay)


def test_defer_is_a_frozen_value() -> None:
    assert Defer(1) == Defer(1.0)
    assert Defer(0).delay == 0
    with pytest.raises(AttributeError):
        Defer(1).delay = 2  # type: ignore[misc]
