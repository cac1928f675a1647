"""Expiry: an envelope past its TTL when a consumer picks it up is dead-lettered, not handled."""

from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope, StageStatistics

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


async def test_envelope_whose_ttl_passed_in_the_queue_is_dead_lettered_expired() -> None:
    handled: list[Any] = []
    started = anyio.Event()
    release = anyio.Event()

    async def handle(payload: Any) -> None:
        handled.append(payload)
        if payload == "first":
            started.set()
            await release.wait()

    bus = Bus()
    bus.subscribe("t", handle, group="g", concurrency=1)
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", "first")
            await started.wait()
            doomed = await bus.publish("t", "second", ttl=0.05)
            await bus.publish("t", "third", ttl=60)
            # Waiting for a clock, not for work: let the TTL of "second" pass.
            await anyio.sleep(0.1)
            release.set()
            await bus.drain()

            assert handled == ["first", "third"]
            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.EXPIRED
            assert letter.envelope.id == doomed.id
            assert letter.envelope.payload == "second"
            assert (letter.stage, letter.error) == ("t@g", None)  # no exception: no error

            stats = stage_stats(bus, "t@g")
            assert stats.published == 3
            assert stats.acked == 2
            assert stats.expired == 1
            assert stats.dead_lettered == 1
            assert stats.depth == 0
            assert stats.in_flight == 0
            assert stats.published == (
                stats.acked + stats.dead_lettered + stats.depth + stats.in_flight
            )


async def test_envelope_without_ttl_never_expires_in_the_queue() -> None:
    handled: list[Any] = []
    started = anyio.Event()
    release = anyio.Event()

    async def handle(payload: Any) -> None:
        handled.append(payload)
        if payload == "first":
            started.set()
            await release.wait()

    bus = Bus()
    bus.subscribe("t", handle, group="g", concurrency=1)
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", "first")
            await started.wait()
            await bus.publish("t", "second")
            await anyio.sleep(0.05)
            release.set()
            await bus.drain()

            assert handled == ["first", "second"]
            assert len(bus.dead_letters) == 0
            assert stage_stats(bus, "t@g").expired == 0


async def test_envelope_expired_compares_now_with_timestamp_plus_ttl() -> None:
    captured: list[Envelope] = []

    async def capture(env: Envelope) -> None:
        captured.append(env)

    bus = Bus()
    bus.subscribe("t", capture, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, ttl=10)
            await bus.drain()

    (env,) = captured
    assert env.ttl == 10
    assert env.expired() is False
    assert env.expired(now=env.timestamp + 9.5) is False
    assert env.expired(now=env.timestamp + 10.5) is True

    fixed = env.evolve(timestamp=1000.0, ttl=5.0)
    assert fixed.expired(now=1000.0) is False
    assert fixed.expired(now=1004.5) is False
    assert fixed.expired(now=1005.5) is True
    # evolve leaves the original untouched
    assert env.ttl == 10

    immortal = env.evolve(ttl=None)
    assert immortal.expired(now=env.timestamp + 1e9) is False
