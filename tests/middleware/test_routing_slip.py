"""Routing slips: each stage's return value travels on to the next topic of the slip."""

from typing import Any

import anyio
import pytest

from asyncbus import Backpressure, Bus, DeadLetterReason, Envelope, StageStatistics

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


def assert_ledger(stats: StageStatistics) -> None:
    assert stats.published == (stats.acked + stats.dead_lettered + stats.depth + stats.in_flight)


def f1(x: int) -> int:
    return x + 1


def f2(x: int) -> int:
    return x * 10


def f3(x: int) -> int:
    return x - 3


async def test_three_stage_slip_with_sync_middle_stage_delivers_composed_result() -> None:
    seen: dict[str, Envelope] = {}

    async def stage1(env: Envelope) -> int:
        seen["f1"] = env
        return f1(env.payload)

    def stage2(env: Envelope) -> int:  # sync: runs on the worker pool
        seen["f2"] = env
        return f2(env.payload)

    async def stage3(env: Envelope) -> int:
        seen["f3"] = env
        return f3(env.payload)

    async def sink(env: Envelope) -> None:
        seen["sink"] = env

    bus = Bus()
    bus.subscribe("f1", stage1, group="g")
    bus.subscribe("f2", stage2, group="g")
    bus.subscribe("f3", stage3, group="g")
    bus.subscribe("sink", sink, group="g")
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("f1", 4, slip=["f2", "f3", "sink"], ttl=60)
            await bus.drain()

            for name in ("f1@g", "f2@g", "f3@g", "sink@g"):
                stats = stage_stats(bus, name)
                assert (stats.published, stats.acked, stats.dead_lettered) == (1, 1, 0)
                assert_ledger(stats)
            assert len(bus.dead_letters) == 0

    first, second, third, last = seen["f1"], seen["f2"], seen["f3"], seen["sink"]
    assert last.payload == f3(f2(f1(4)))
    assert [first.payload, second.payload, third.payload] == [4, f1(4), f2(f1(4))]
    assert [e.topic for e in (first, second, third, last)] == ["f1", "f2", "f3", "sink"]
    assert first.slip == ("f2", "f3", "sink")
    assert second.slip == ("f3", "sink")
    assert third.slip == ("sink",)
    assert last.slip == ()

    assert first.id == receipt.id
    assert len({first.id, second.id, third.id, last.id}) == 4
    for env in (first, second, third, last):
        assert env.correlation_id == receipt.id
        assert env.attempt == 1
        assert env.timestamp == first.timestamp
        assert env.ttl == 60
    assert second.causation_id == first.id
    assert third.causation_id == second.id
    assert last.causation_id == third.id


async def test_handler_returning_none_sends_none_to_the_next_hop() -> None:
    """The return value is the next payload, None included."""
    received: list[Any] = []

    async def observer(payload: Any) -> None:
        received.append(("observer", payload))

    async def sink(payload: Any) -> None:
        received.append(("sink", payload))

    bus = Bus()
    bus.subscribe("observe", observer, group="g")
    bus.subscribe("sink", sink, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("observe", {"k": 1}, slip=["sink"])
            await bus.drain()

    assert received == [("observer", {"k": 1}), ("sink", None)]


async def test_hop_to_topic_without_subscribers_dead_letters_no_subscribers() -> None:
    async def double(payload: int) -> int:
        return payload * 2

    bus = Bus()
    bus.subscribe("a", double, group="g")
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("a", 21, slip=["nowhere"])
            await bus.drain()

            (letter,) = bus.dead_letters.list()
            assert letter.reason == DeadLetterReason.NO_SUBSCRIBERS
            assert letter.envelope.topic == "nowhere"
            assert letter.envelope.payload == 42
            assert letter.envelope.correlation_id == receipt.id
            assert letter.envelope.causation_id == receipt.id
            assert letter.envelope.slip == ()
            # The handler's own work succeeded: only the hop is dead.
            stats = stage_stats(bus, "a@g")
            assert stats.acked == 1
            assert stats.dead_lettered == 0
            assert_ledger(stats)


async def test_slip_hop_goes_through_the_next_stages_backpressure() -> None:
    handled: list[Any] = []
    started = anyio.Event()
    release = anyio.Event()

    async def entry(payload: Any) -> Any:
        if payload == "go":
            # Entry has one consumer: by now the earlier envelope's hop was tried.
            release.set()
            return None
        return "hop"

    async def full(payload: Any) -> None:
        handled.append(payload)
        if payload == "A":
            started.set()
            await release.wait()

    bus = Bus()
    bus.subscribe("entry", entry, group="e", concurrency=1)
    bus.subscribe(
        "full", full, group="f", concurrency=1, capacity=1, backpressure=Backpressure.REJECT
    )
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("full", "A")
            await started.wait()
            queued = await bus.publish("full", "B")  # fills the only slot
            assert queued.accepted == ("full@f",)

            await bus.publish("entry", 1, slip=["full"])
            await bus.publish("entry", "go")
            await bus.drain()

            assert handled == ["A", "B"]
            full_stats = stage_stats(bus, "full@f")
            assert full_stats.published == 2
            assert full_stats.rejected == 1
            assert full_stats.acked == 2
            assert full_stats.dead_lettered == 0
            assert_ledger(full_stats)
            entry_stats = stage_stats(bus, "entry@e")
            assert entry_stats.published == 2
            assert entry_stats.acked == 2
            assert entry_stats.dead_lettered == 0
            assert_ledger(entry_stats)
