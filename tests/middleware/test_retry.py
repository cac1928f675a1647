"""Retry: backoff on a timer, re-entry into the own stage only, dead letters when exhausted."""

from typing import Any

import anyio
import pytest

from asyncbus import (
    Bus,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    Reject,
    Retry,
    StageStatistics,
)

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


def assert_ledger(stats: StageStatistics) -> None:
    assert stats.published == (stats.acked + stats.dead_lettered + stats.depth + stats.in_flight)


async def test_handler_failing_twice_then_succeeding_is_called_three_times_and_acked() -> None:
    attempts: list[int] = []

    async def flaky(env: Envelope) -> None:
        attempts.append(env.attempt)
        if len(attempts) < 3:
            raise RuntimeError("not yet")

    bus = Bus()
    bus.subscribe("jobs", flaky, group="worker", retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 1)
            await bus.drain()

            stats = stage_stats(bus, "jobs@worker")
            assert attempts == [1, 2, 3]
            assert stats.published == 1
            assert stats.acked == 1
            assert stats.retried == 2
            assert stats.dead_lettered == 0
            assert stats.depth == 0
            assert stats.in_flight == 0
            assert_ledger(stats)
            assert len(bus.dead_letters) == 0


async def test_handler_always_failing_is_called_max_attempts_times_then_dead_lettered() -> None:
    attempts: list[int] = []

    async def broken(env: Envelope) -> None:
        attempts.append(env.attempt)
        raise ValueError("boom-42")

    bus = Bus()
    bus.subscribe("jobs", broken, group="worker", retry=Retry(max_attempts=4, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("jobs", {"n": 1})
            await bus.drain()

            assert attempts == [1, 2, 3, 4]
            dead = bus.dead_letters.list()
            assert len(dead) == 1
            (letter,) = dead
            assert letter.reason == DeadLetterReason.HANDLER_FAILED
            assert letter.attempts == 4
            assert letter.stage == "jobs@worker"
            assert letter.envelope.id == receipt.id
            assert letter.envelope.payload == {"n": 1}
            assert letter.error is not None
            assert "ValueError" in letter.error
            assert "boom-42" in letter.error
            assert bus.dead_letters.get(receipt.id) == letter

            stats = stage_stats(bus, "jobs@worker")
            assert stats.published == 1
            assert stats.acked == 0
            assert stats.retried == 3
            assert stats.dead_lettered == 1
            assert_ledger(stats)


async def test_envelope_waiting_for_retry_does_not_hold_the_single_consumer() -> None:
    order: list[Any] = []
    five_done = anyio.Event()
    clock: dict[str, float] = {}

    async def handle(env: Envelope) -> None:
        if env.payload == "slow":
            order.append(("slow", env.attempt))
            if env.attempt == 1:
                clock["failed"] = anyio.current_time()
                raise RuntimeError("retry me in 0.5 s")
            clock["retried"] = anyio.current_time()
            return
        order.append(env.payload)
        if len(order) == 6:
            clock["five_done"] = anyio.current_time()
            five_done.set()

    bus = Bus()
    bus.subscribe(
        "work",
        handle,
        group="g",
        concurrency=1,
        retry=Retry(max_attempts=2, backoff=0.5, jitter=False),
    )
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("work", "slow")
            for i in range(5):
                await bus.publish("work", i)
            await five_done.wait()
            # The five were handled while "slow" was still waiting on its timer. A retry
            # re-enters at the back of the queue, so order alone cannot tell a held consumer
            # apart: the five must also be done well inside the 0.5 s backoff.
            assert order == [("slow", 1), 0, 1, 2, 3, 4]
            assert clock["five_done"] - clock["failed"] < 0.4
            stats = stage_stats(bus, "work@g")
            assert stats.published == 6
            assert_ledger(stats)

            await bus.drain()
            assert order == [("slow", 1), 0, 1, 2, 3, 4, ("slow", 2)]
            # jitter=False: the retry waited its full backoff (timers may fire a hair early)
            assert clock["retried"] - clock["failed"] >= 0.45
            stats = stage_stats(bus, "work@g")
            assert stats.acked == 6
            assert stats.retried == 1
            assert stats.in_flight == 0
            assert_ledger(stats)


async def test_fan_out_retry_reruns_only_the_failing_group() -> None:
    good_calls: list[int] = []
    bad_calls: list[int] = []

    async def good(env: Envelope) -> None:
        good_calls.append(env.attempt)

    async def bad(env: Envelope) -> None:
        bad_calls.append(env.attempt)
        raise RuntimeError("always")

    bus = Bus()
    bus.subscribe("orders", good, group="good")
    bus.subscribe("orders", bad, group="bad", retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("orders", 7)
            assert sorted(receipt.accepted) == ["orders@bad", "orders@good"]
            await bus.drain()

            assert good_calls == [1]
            assert bad_calls == [1, 2, 3]
            good_stats = stage_stats(bus, "orders@good")
            bad_stats = stage_stats(bus, "orders@bad")
            assert (good_stats.published, good_stats.acked, good_stats.retried) == (1, 1, 0)
            assert good_stats.dead_lettered == 0
            assert (bad_stats.published, bad_stats.acked, bad_stats.retried) == (1, 0, 2)
            assert bad_stats.dead_lettered == 1
            assert_ledger(good_stats)
            assert_ledger(bad_stats)
            (letter,) = bus.dead_letters.list()
            assert letter.stage == "orders@bad"
            assert letter.attempts == 3


async def test_reject_dead_letters_at_once_without_retry() -> None:
    calls: list[int] = []

    async def picky(env: Envelope) -> None:
        calls.append(env.attempt)
        raise Reject("bad")

    bus = Bus()
    bus.subscribe("jobs", picky, group="g", retry=Retry(max_attempts=5, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("jobs", 1)
            await bus.drain()

            assert calls == [1]
            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.REJECTED
            assert letter.attempts == 1
            assert letter.stage == "jobs@g"
            assert letter.envelope.id == receipt.id
            assert letter.error is not None
            assert "bad" in letter.error
            assert len(bus.dead_letters.list(reason=DeadLetterReason.HANDLER_FAILED)) == 0
            stats = stage_stats(bus, "jobs@g")
            assert stats.retried == 0
            assert stats.dead_lettered == 1
            assert stats.acked == 0
            assert_ledger(stats)


async def test_retry_on_limits_which_exceptions_are_retried() -> None:
    value_calls: list[int] = []
    key_calls: list[int] = []

    async def raises_value_error(env: Envelope) -> None:
        value_calls.append(env.attempt)
        raise ValueError("not retryable")

    async def raises_key_error(env: Envelope) -> None:
        key_calls.append(env.attempt)
        raise KeyError("retryable")

    policy = Retry(max_attempts=3, backoff=0.01, retry_on=(KeyError,))
    bus = Bus()
    bus.subscribe("value", raises_value_error, group="g", retry=policy)
    bus.subscribe("key", raises_key_error, group="g", retry=policy)
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("value", 1)
            await bus.publish("key", 1)
            await bus.drain()

            assert value_calls == [1]
            assert key_calls == [1, 2, 3]
            (value_letter,) = bus.dead_letters.list(topic="value")
            assert value_letter.reason == DeadLetterReason.HANDLER_FAILED
            assert value_letter.attempts == 1
            (key_letter,) = bus.dead_letters.list(topic="key")
            assert key_letter.reason == DeadLetterReason.HANDLER_FAILED
            assert key_letter.attempts == 3
            assert stage_stats(bus, "value@g").retried == 0
            assert stage_stats(bus, "key@g").retried == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"max_attempts": -1}, {"backoff": -1}],
    ids=["max_attempts=0", "max_attempts=-1", "backoff=-1"],
)
async def test_invalid_retry_is_a_configuration_error(kwargs: dict[str, Any]) -> None:
    async def handle(payload: Any) -> None:
        pass

    bus = Bus()
    # Raising at construction or at subscribe both satisfy the contract.
    with pytest.raises(ConfigurationError):
        bus.subscribe("jobs", handle, group="g", retry=Retry(**kwargs))


async def test_single_attempt_retry_is_valid() -> None:
    async def handle(payload: Any) -> None:
        pass

    bus = Bus()
    bus.subscribe("jobs", handle, group="g", retry=Retry(max_attempts=1, backoff=0))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"backoff": 0.25, "multiplier": 2.0, "max_backoff": 1.5},
            [0.25, 0.5, 1.0, 1.5, 1.5],
        ),
        (
            {"backoff": 1.0, "multiplier": 3.0, "max_backoff": 30.0},
            [1.0, 3.0, 9.0, 27.0, 30.0],
        ),
        ({"backoff": 0.5, "multiplier": 1.0, "max_backoff": 30.0}, [0.5] * 5),
        ({"backoff": 0.0, "multiplier": 2.0, "max_backoff": 30.0}, [0.0] * 5),
    ],
)
async def test_backoff_delay_is_capped_exponential(
    kwargs: dict[str, float], expected: list[float]
) -> None:
    policy = Retry(max_attempts=10, jitter=False, **kwargs)
    assert [policy.delay(n) for n in range(1, 6)] == expected


async def test_aclose_abandons_an_envelope_waiting_for_a_long_retry() -> None:
    calls: list[int] = []
    failed = anyio.Event()

    async def handle(env: Envelope) -> None:
        calls.append(env.attempt)
        failed.set()
        raise RuntimeError("try again in 30 s")

    bus = Bus()
    bus.subscribe("jobs", handle, group="g", retry=Retry(max_attempts=2, backoff=30, jitter=False))
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("jobs", 1)
            await failed.wait()
            report = await bus.aclose(timeout=0.2)

    assert calls == [1]
    assert report.drained is False
    assert report.abandoned == [receipt.id]
    assert report.published == 1
    assert report.completed == 0
    assert report.dead_lettered == 0
    assert report.published == (report.completed + report.dead_lettered + len(report.abandoned))
    assert len(bus.dead_letters) == 0


async def test_drain_waits_for_pending_retries() -> None:
    calls: list[int] = []

    async def handle(env: Envelope) -> None:
        calls.append(env.attempt)
        if env.attempt == 1:
            raise RuntimeError("once")

    bus = Bus()
    bus.subscribe("jobs", handle, group="g", retry=Retry(max_attempts=2, backoff=0.2, jitter=False))
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 1)
            await bus.drain()

            assert calls == [1, 2]
            stats = stage_stats(bus, "jobs@g")
            assert stats.acked == 1
            assert stats.retried == 1
            assert stats.in_flight == 0
            assert stats.depth == 0
            assert_ledger(stats)


async def test_drain_timeout_passes_while_a_retry_is_pending() -> None:
    calls: list[int] = []
    failed = anyio.Event()

    async def handle(env: Envelope) -> None:
        calls.append(env.attempt)
        if env.attempt == 1:
            failed.set()
            raise RuntimeError("once")

    bus = Bus()
    bus.subscribe("jobs", handle, group="g", retry=Retry(max_attempts=2, backoff=0.5, jitter=False))
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 1)
            await failed.wait()
            with pytest.raises(TimeoutError):
                await bus.drain(timeout=0.05)
            assert calls == [1]
            await bus.drain()
            assert calls == [1, 2]
            assert stage_stats(bus, "jobs@g").acked == 1
