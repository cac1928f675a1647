"""Request/reply: the caller gets the last stage's return value, a HandlerError, or a timeout."""

from typing import Any

import anyio
import pytest

from asyncbus import (
    Bus,
    DeadLetterReason,
    Envelope,
    HandlerError,
    Reject,
    Retry,
    StageStatistics,
)

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


def f1(x: int) -> int:
    return x + 1


def f2(x: int) -> int:
    return x * 10


def f3(x: int) -> int:
    return x - 3


async def test_request_over_three_stage_slip_returns_composed_result() -> None:
    async def stage1(payload: int) -> int:
        return f1(payload)

    def stage2(payload: int) -> int:  # sync: runs on the worker pool
        return f2(payload)

    async def stage3(payload: int) -> int:
        return f3(payload)

    bus = Bus()
    bus.subscribe("f1", stage1, group="g")
    bus.subscribe("f2", stage2, group="g")
    bus.subscribe("f3", stage3, group="g")
    with anyio.fail_after(5):
        async with bus:
            result = await bus.request("f1", 4, slip=["f2", "f3"], timeout=5)
            assert result == f3(f2(f1(4)))
            await bus.drain()
            for name in ("f1@g", "f2@g", "f3@g"):
                assert stage_stats(bus, name).acked == 1
            assert len(bus.dead_letters) == 0


async def test_request_to_single_handler_returns_its_return_value() -> None:
    async def add(payload: dict[str, int]) -> int:
        return payload["a"] + payload["b"]

    bus = Bus()
    bus.subscribe("math.add", add, group="g")
    with anyio.fail_after(5):
        async with bus:
            assert await bus.request("math.add", {"a": 1, "b": 2}, timeout=5) == 3
            await bus.drain()
            assert stage_stats(bus, "math.add@g").acked == 1


async def test_failing_handler_raises_handler_error_after_retries() -> None:
    attempts: list[int] = []

    async def broken(env: Envelope) -> None:
        attempts.append(env.attempt)
        raise ValueError("nope")

    bus = Bus()
    bus.subscribe("t", broken, group="g", retry=Retry(max_attempts=2, backoff=0.01))
    # timeout=30 inside fail_after(5): the error must arrive at once, not at the deadline.
    with anyio.fail_after(5):
        async with bus:
            with pytest.raises(HandlerError) as caught:
                await bus.request("t", 1, timeout=30)
            await bus.drain()

            error = caught.value
            assert attempts == [1, 2]
            assert error.stage == "t@g"
            assert error.attempts == 2
            assert error.envelope.topic == "t"
            assert error.envelope.payload == 1
            assert isinstance(error.__cause__, ValueError)
            assert str(error.__cause__) == "nope"
            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.HANDLER_FAILED
            assert letter.envelope.id == error.envelope.id


async def test_failure_on_a_later_stage_of_the_route_names_that_stage() -> None:
    async def ok(payload: int) -> int:
        return payload + 1

    async def boom(payload: int) -> int:
        raise RuntimeError(f"cannot take {payload}")

    bus = Bus()
    bus.subscribe("ok", ok, group="a")
    bus.subscribe("boom", boom, group="b", retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            with pytest.raises(HandlerError) as caught:
                await bus.request("ok", 1, slip=["boom"], timeout=30)
            await bus.drain()

    error = caught.value
    assert error.stage == "boom@b"
    assert error.attempts == 3
    assert error.envelope.topic == "boom"
    assert error.envelope.payload == 2
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__) == "cannot take 2"


async def test_rejecting_handler_raises_handler_error_at_once() -> None:
    calls: list[int] = []

    async def picky(env: Envelope) -> None:
        calls.append(env.attempt)
        raise Reject("no thanks")

    bus = Bus()
    bus.subscribe("t", picky, group="g", retry=Retry(max_attempts=5, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            with pytest.raises(HandlerError) as caught:
                await bus.request("t", 1, timeout=30)
            await bus.drain()

    assert calls == [1]
    assert caught.value.attempts == 1
    assert caught.value.stage == "t@g"


async def test_request_without_subscriber_raises_handler_error_at_once() -> None:
    bus = Bus()
    with anyio.fail_after(5):
        async with bus:
            with anyio.fail_after(1), pytest.raises(HandlerError):
                await bus.request("nobody.home", 1, timeout=30)
            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.NO_SUBSCRIBERS
            assert letter.envelope.topic == "nobody.home"
            assert letter.error is None  # no exception happened: the reason says it all


async def test_request_without_reply_in_time_raises_timeout_and_leaves_nothing_waiting() -> None:
    release = anyio.Event()
    finished: list[Any] = []

    async def slow(payload: Any) -> str:
        await release.wait()
        finished.append(payload)
        return "late"

    bus = Bus()
    bus.subscribe("slow", slow, group="g")
    with anyio.fail_after(5):
        async with bus:
            with pytest.raises(TimeoutError) as caught:
                await bus.request("slow", 1, timeout=0.05)
            assert not isinstance(caught.value, HandlerError)

            # The timeout does not cancel the work; once it ends, nothing is left behind.
            release.set()
            await bus.drain()
            assert finished == [1]
            stats = stage_stats(bus, "slow@g")
            assert (stats.published, stats.acked, stats.dead_lettered) == (1, 1, 0)
            assert (stats.depth, stats.in_flight) == (0, 0)

            report = await bus.aclose(timeout=5)
            assert report.drained is True
            assert len(report.abandoned) == 0


async def test_first_reply_wins_on_fan_out() -> None:
    release = anyio.Event()

    async def fast(payload: Any) -> str:
        return "fast"

    async def slow(payload: Any) -> str:
        await release.wait()
        return "slow"

    bus = Bus()
    bus.subscribe("q", fast, group="fast")
    bus.subscribe("q", slow, group="slow")
    with anyio.fail_after(5):
        async with bus:
            assert await bus.request("q", None, timeout=5) == "fast"
            release.set()
            await bus.drain()
            assert stage_stats(bus, "q@fast").acked == 1
            assert stage_stats(bus, "q@slow").acked == 1


async def test_a_later_stage_rejecting_at_the_door_fails_the_request_at_once() -> None:
    """A rejection at the door anywhere on the route raises HandlerError at once."""
    release = anyio.Event()
    bus = Bus()

    @bus.subscribe("first", group="g")
    async def first(n: int) -> int:
        return n + 1

    @bus.subscribe("full", group="g", capacity=1, backpressure="reject")
    async def full(n: int) -> int:
        await release.wait()
        return n

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("full", 0)  # taken by the consumer, which waits
            await anyio.wait_all_tasks_blocked()
            await bus.publish("full", 0)  # queued: the stage is full now
            with anyio.fail_after(1), pytest.raises(HandlerError) as caught:
                await bus.request("first", 1, slip=["full"], timeout=30)
            release.set()
            await bus.drain()
    assert (caught.value.stage, caught.value.attempts) == ("full@g", 0)
    assert "rejected at the door of full@g" in str(caught.value)
    assert stage_stats(bus, "full@g").rejected == 1


async def test_a_stage_returning_none_sends_none_on() -> None:
    """The return value is the next payload, None included."""
    seen: list[Any] = []
    bus = Bus()

    @bus.subscribe("a", group="g")
    async def a(payload: Any) -> None:
        seen.append(("a", payload))

    @bus.subscribe("b", group="g")
    async def b(payload: Any) -> str:
        seen.append(("b", payload))
        return "done"

    with anyio.fail_after(5):
        async with bus:
            assert await bus.request("a", {"original": 1}, slip=["b"]) == "done"
    assert seen == [("a", {"original": 1}), ("b", None)]
