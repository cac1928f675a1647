"""Back-pressure at the door of a stage: BLOCK, REJECT, DROP_NEWEST, DROP_OLDEST."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from asyncbus import (
    Backpressure,
    Bus,
    DeadLetterReason,
    Envelope,
    PublishTimeout,
    Receipt,
    Retry,
    StageStatistics,
)

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    """Return the statistics of the stage called ``name``."""
    for stage in bus.statistics().stages:
        if stage.name == name:
            return stage
    raise KeyError(name)


async def test_block_holds_the_producer_and_never_rejects() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    handled: list[int] = []
    receipts: list[Receipt] = []
    bus = Bus()

    @bus.subscribe("jobs", group="slow", capacity=2, backpressure=Backpressure.BLOCK)
    async def slow(n: int) -> None:
        first_in.set()
        await release.wait()
        handled.append(n)

    async def produce() -> None:
        for n in range(10):
            receipts.append(await bus.publish("jobs", n))

    with anyio.fail_after(5):
        async with bus:
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                await first_in.wait()
                await anyio.wait_all_tasks_blocked()
                # one in the handler, two queued, the fourth publish is held at the door
                held = stage_stats(bus, "jobs@slow")
                assert (len(receipts), held.depth, held.in_flight) == (3, 2, 1)
                assert held.rejected == 0
                release.set()
            await bus.drain()

            assert handled == list(range(10))
            assert all(receipts)
            assert [r.accepted for r in receipts] == [("jobs@slow",)] * 10
            assert [r.rejected for r in receipts] == [()] * 10
            assert [r.dropped for r in receipts] == [()] * 10
            stats = stage_stats(bus, "jobs@slow")
            assert (stats.published, stats.acked, stats.rejected, stats.dropped) == (10, 10, 0, 0)
            assert (stats.dead_lettered, stats.depth, stats.in_flight) == (0, 0, 0)
            assert len(bus.dead_letters) == 0


async def test_block_publish_timeout_raises_publish_timeout_with_the_partial_receipt() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    fast_seen: list[str] = []
    slow_seen: list[str] = []
    bus = Bus()

    @bus.subscribe("jobs", group="fast")
    async def fast(env: Envelope) -> None:
        fast_seen.append(env.id)

    @bus.subscribe("jobs", group="slow", capacity=1)
    async def slow(env: Envelope) -> None:
        first_in.set()
        await release.wait()
        slow_seen.append(env.id)

    with anyio.fail_after(5):
        async with bus:
            first = await bus.publish("jobs", 0)
            await first_in.wait()
            second = await bus.publish("jobs", 1)  # fills the one slot of "slow"
            with pytest.raises(PublishTimeout) as caught:
                await bus.publish("jobs", 2, timeout=0.1)
            assert isinstance(caught.value, TimeoutError)
            partial = caught.value.receipt
            assert partial.accepted == ("jobs@fast",)
            assert partial.id not in (first.id, second.id)

            release.set()
            await bus.drain()

            assert fast_seen == [first.id, second.id, partial.id]
            assert slow_seen == [first.id, second.id]
            slow_stats = stage_stats(bus, "jobs@slow")
            assert (slow_stats.published, slow_stats.acked, slow_stats.dropped) == (2, 2, 0)
            fast_stats = stage_stats(bus, "jobs@fast")
            assert (fast_stats.published, fast_stats.acked) == (3, 3)


async def test_reject_reports_exactly_the_rejections_in_receipts_and_statistics() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    handled: list[str] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=2, backpressure=Backpressure.REJECT)
    async def handle(env: Envelope) -> None:
        first_in.set()
        await release.wait()
        handled.append(env.id)

    with anyio.fail_after(5):
        async with bus:
            first = await bus.publish("jobs", 0)
            await first_in.wait()
            fitted = [await bus.publish("jobs", n) for n in (1, 2)]
            refused = [await bus.publish("jobs", n) for n in (3, 4, 5)]

            for receipt in [first, *fitted]:
                assert receipt
                assert (receipt.accepted, receipt.rejected, receipt.dropped) == (
                    ("jobs@g",),
                    (),
                    (),
                )
            for receipt in refused:
                assert not receipt
                assert (receipt.accepted, receipt.rejected, receipt.dropped) == (
                    (),
                    ("jobs@g",),
                    (),
                )
            full = stage_stats(bus, "jobs@g")
            assert (full.published, full.rejected, full.depth, full.in_flight) == (3, 3, 2, 1)

            release.set()
            await bus.drain()

            assert handled == [first.id, *(r.id for r in fitted)]
            stats = stage_stats(bus, "jobs@g")
            assert (stats.published, stats.acked, stats.rejected) == (3, 3, 3)
            assert (stats.dead_lettered, stats.dropped, stats.depth, stats.in_flight) == (
                0,
                0,
                0,
                0,
            )
            # rejected at the door is its own outcome, not a dead letter
            assert len(bus.dead_letters) == 0


async def test_drop_newest_never_exceeds_capacity_and_dead_letters_the_new_envelope() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    handled: list[str] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=3, backpressure=Backpressure.DROP_NEWEST)
    async def handle(env: Envelope) -> None:
        first_in.set()
        await release.wait()
        handled.append(env.id)

    with anyio.fail_after(5):
        async with bus:
            first = await bus.publish("jobs", 0)
            await first_in.wait()
            receipts: list[Receipt] = []
            for n in range(1, 11):
                receipts.append(await bus.publish("jobs", n))
                depth = stage_stats(bus, "jobs@g").depth
                assert depth <= 3
                assert depth == min(n, 3)

            kept, dropped = receipts[:3], receipts[3:]
            for receipt in kept:
                assert receipt
                assert (receipt.accepted, receipt.dropped) == (("jobs@g",), ())
            for receipt in dropped:
                assert not receipt
                assert (receipt.dropped, receipt.rejected) == (("jobs@g",), ())

            letters = bus.dead_letters.list(reason=DeadLetterReason.DROPPED)
            assert [d.envelope.id for d in letters] == [r.id for r in dropped]
            assert {d.stage for d in letters} == {"jobs@g"}
            assert {d.reason for d in letters} == {DeadLetterReason.DROPPED}
            assert len(bus.dead_letters) == 7

            release.set()
            await bus.drain()

            assert handled == [first.id, *(r.id for r in kept)]
            assert not {r.id for r in dropped} & set(handled)
            stats = stage_stats(bus, "jobs@g")
            assert (stats.published, stats.acked, stats.dead_lettered) == (11, 4, 7)
            assert (stats.dropped, stats.rejected, stats.depth, stats.in_flight) == (7, 0, 0, 0)
            assert stats.published == stats.acked + stats.dead_lettered


async def test_drop_oldest_never_exceeds_capacity_and_dead_letters_the_evicted_envelope() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    handled: list[str] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=3, backpressure=Backpressure.DROP_OLDEST)
    async def handle(env: Envelope) -> None:
        first_in.set()
        await release.wait()
        handled.append(env.id)

    with anyio.fail_after(5):
        async with bus:
            first = await bus.publish("jobs", 0)
            await first_in.wait()
            receipts: list[Receipt] = []
            for n in range(1, 11):
                receipts.append(await bus.publish("jobs", n))
                depth = stage_stats(bus, "jobs@g").depth
                assert depth <= 3
                assert depth == min(n, 3)

            # the newcomer is always admitted; what goes is the oldest queued one
            assert [r.accepted for r in receipts] == [("jobs@g",)] * 10
            evicted, kept = receipts[:7], receipts[7:]
            letters = bus.dead_letters.list(reason=DeadLetterReason.DROPPED)
            assert [d.envelope.id for d in letters] == [r.id for r in evicted]
            assert {d.stage for d in letters} == {"jobs@g"}
            assert len(bus.dead_letters) == 7

            release.set()
            await bus.drain()

            assert handled == [first.id, *(r.id for r in kept)]
            assert not {r.id for r in evicted} & set(handled)
            stats = stage_stats(bus, "jobs@g")
            assert (stats.published, stats.acked, stats.dead_lettered) == (11, 4, 7)
            assert (stats.dropped, stats.rejected, stats.depth, stats.in_flight) == (7, 0, 0, 0)


async def test_drop_oldest_evicting_a_retried_envelope_records_the_attempts_it_had(
    assert_settled: Callable[[Bus], None],
) -> None:
    failed = anyio.Event()
    queued = anyio.Event()
    holding = anyio.Event()
    release = anyio.Event()
    bus = Bus()

    @bus.subscribe(
        "jobs",
        group="g",
        capacity=1,
        backpressure=Backpressure.DROP_OLDEST,
        retry=Retry(max_attempts=3, backoff=0),
    )
    async def handle(env: Envelope) -> None:
        if env.payload == "flaky":
            failed.set()
            await queued.wait()  # fails once "gate" is queued: its retry comes after it
            raise RuntimeError("not yet")
        holding.set()
        await release.wait()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", "flaky")
            await failed.wait()
            await bus.publish("jobs", "gate")
            queued.set()
            await holding.wait()  # the consumer holds "gate"
            await anyio.wait_all_tasks_blocked()  # "flaky" is queued again, attempt 2
            assert stage_stats(bus, "jobs@g").depth == 1
            await bus.publish("jobs", "newest")  # evicts "flaky"
            release.set()
            await bus.drain()
    [entry] = bus.dead_letters.list()
    assert (entry.envelope.payload, entry.reason, entry.envelope.attempt, entry.attempts) == (
        "flaky",
        DeadLetterReason.DROPPED,
        2,
        1,  # it was tried once before it was evicted
    )
    assert_settled(bus)


async def test_publish_nowait_on_a_full_block_stage_raises_would_block() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    handled: list[str] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=1, backpressure=Backpressure.BLOCK)
    async def handle(env: Envelope) -> None:
        first_in.set()
        await release.wait()
        handled.append(env.id)

    with anyio.fail_after(5):
        async with bus:
            first = bus.publish_nowait("jobs", 0)
            await first_in.wait()
            second = bus.publish_nowait("jobs", 1)
            assert second.accepted == ("jobs@g",)
            with pytest.raises(anyio.WouldBlock):
                bus.publish_nowait("jobs", 2)

            release.set()
            await bus.drain()

            assert handled == [first.id, second.id]
            stats = stage_stats(bus, "jobs@g")
            assert (stats.published, stats.acked, stats.dead_lettered, stats.dropped) == (
                2,
                2,
                0,
                0,
            )
            assert len(bus.dead_letters) == 0


async def test_a_publish_cancelled_while_it_waits_for_room_admits_nothing_there(
    assert_settled: Callable[[Bus], None],
) -> None:
    release = anyio.Event()
    entered = anyio.Event()
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=1)
    async def handle(n: int) -> None:
        entered.set()
        await release.wait()
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            await bus.publish("jobs", 2)
            with anyio.move_on_after(0.01) as scope:
                await bus.publish("jobs", 3)  # waits for room, then is cancelled
            assert scope.cancelled_caught
            release.set()
            await bus.drain(timeout=5)  # nothing is left waiting to be admitted
            await bus.publish("jobs", 4)  # and the room it waited for is handed on
            await bus.drain(timeout=5)

    assert handled == [1, 2, 4]
    assert stage_stats(bus, "jobs@g").published == 3
    assert_settled(bus)
