"""deduplicate(): an id handled within the window is acked without running the handler again."""

from typing import Any

import anyio
import pytest

from asyncbus import Bus, Envelope, Retry, StageStatistics
from asyncbus.middleware import deduplicate

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


async def test_same_id_twice_runs_handler_once_and_acks_both() -> None:
    handled: list[Any] = []

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.publish("t", 2, id="x")
            await bus.publish("t", 3, id="y")
            await bus.drain()

            assert handled == [1, 3]
            stats = stage_stats(bus, "t@g")
            assert stats.published == 3
            assert stats.acked == 3
            assert stats.dead_lettered == 0
            assert len(bus.dead_letters) == 0


async def test_replayed_dead_letter_is_let_through() -> None:
    seen: list[Envelope] = []

    async def handle(env: Envelope) -> None:
        seen.append(env)

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    with anyio.fail_after(5):
        async with bus:
            # Dead-lettered before anyone listens...
            await bus.publish("t", "dead", id="x")
            await bus.drain()
            assert len(bus.dead_letters) == 1
            bus.subscribe("t", handle, group="g")
            # ...then the same id is handled, so the dedup window knows "x".
            await bus.publish("t", "live", id="x")
            await bus.drain()
            await bus.dead_letters.replay("x")
            await bus.drain()
            # A plain duplicate is still suppressed afterwards.
            await bus.publish("t", "again", id="x")
            await bus.drain()

            assert [env.payload for env in seen] == ["live", "dead"]
            replayed = seen[1]
            assert replayed.id == "x"
            assert replayed.attempt == 1
            assert "asyncbus-replayed" in replayed.headers
            assert len(bus.dead_letters) == 0
            stats = stage_stats(bus, "t@g")
            assert stats.published == 3
            assert stats.acked == 3


async def test_entries_older_than_window_are_forgotten() -> None:
    handled: list[Any] = []

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus(middleware=[deduplicate(window=0.3, maxlen=1000)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            await bus.publish("t", 2, id="x")
            await bus.drain()
            assert handled == [1]

            # Waiting for a clock, not for work: let the window pass.
            await anyio.sleep(0.4)
            await bus.publish("t", 3, id="x")
            await bus.drain()
            assert handled == [1, 3]
            assert stage_stats(bus, "t@g").acked == 3


async def test_maxlen_keeps_only_the_newest_ids() -> None:
    handled: list[Any] = []

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus(middleware=[deduplicate(window=60, maxlen=2)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            for key in ("a", "b", "c"):
                await bus.publish("t", key, id=key)
                await bus.drain()
            await bus.publish("t", "a again", id="a")  # "a" was evicted by "c"
            await bus.drain()
            await bus.publish("t", "c again", id="c")  # "c" is still remembered
            await bus.drain()

            assert handled == ["a", "b", "c", "a again"]
            assert stage_stats(bus, "t@g").acked == 5


async def test_failed_attempt_is_not_remembered_so_the_retry_runs() -> None:
    attempts: list[int] = []

    async def flaky(env: Envelope) -> None:
        attempts.append(env.attempt)
        if env.attempt == 1:
            raise RuntimeError("once")

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    bus.subscribe("t", flaky, group="g", retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()

            assert attempts == [1, 2]
            assert stage_stats(bus, "t@g").acked == 1
            assert len(bus.dead_letters) == 0


async def test_deduplication_is_per_stage_so_fan_out_reaches_every_group() -> None:
    handled: list[tuple[str, Any]] = []

    async def first(payload: Any) -> None:
        handled.append(("first", payload))

    async def second(payload: Any) -> None:
        handled.append(("second", payload))

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    bus.subscribe("t", first, group="one")
    bus.subscribe("t", second, group="two")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            await bus.publish("t", 2, id="x")
            await bus.drain()

            assert sorted(handled) == [("first", 1), ("second", 1)]
            assert stage_stats(bus, "t@one").acked == 2
            assert stage_stats(bus, "t@two").acked == 2
