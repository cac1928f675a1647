"""Drain, aclose and the ShutdownReport; nothing left behind after many cycles."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

from asyncbus import (
    Bus,
    BusClosedError,
    ConfigurationError,
    Envelope,
    Receipt,
    ShutdownReport,
    StageStatistics,
)

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    """Return the statistics of the stage called ``name``."""
    for stage in bus.statistics().stages:
        if stage.name == name:
            return stage
    raise KeyError(name)


async def test_aclose_accounts_for_every_envelope_when_it_drains() -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", concurrency=2)
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        if n % 5 == 4:
            raise ValueError(n)
        handled.append(n)

    with anyio.fail_after(5):
        async with bus:
            for n in range(20):
                await bus.publish("jobs", n)
            report = await bus.aclose(timeout=5)

    assert report.drained is True
    assert (report.published, report.completed, report.dead_lettered) == (20, 16, 4)
    assert report.abandoned == []  # a list of ids
    assert report.completed + report.dead_lettered + len(report.abandoned) == report.published
    assert sorted(handled) == [n for n in range(20) if n % 5 != 4]


async def test_aclose_accounts_for_every_envelope_when_it_cannot_drain() -> None:
    never = anyio.Event()
    both_in = anyio.Event()
    fast_handled: list[str] = []
    stuck: list[str] = []
    bus = Bus()

    @bus.subscribe("jobs", group="fast")
    async def fast(env: Envelope) -> None:
        fast_handled.append(env.id)

    @bus.subscribe("jobs", group="stuck", concurrency=2, capacity=10)
    async def blocked(env: Envelope) -> None:
        stuck.append(env.id)
        if len(stuck) == 2:
            both_in.set()
        await never.wait()

    with anyio.fail_after(5):
        async with bus:
            receipts = [await bus.publish("jobs", n) for n in range(5)]
            await both_in.wait()
            report = await bus.aclose(timeout=0.2)

    ids = sorted(r.id for r in receipts)
    assert report.drained is False
    # fan-out counts once per stage: 5 for "fast", 5 for "stuck"
    assert (report.published, report.completed, report.dead_lettered) == (10, 5, 0)
    # the two blocked in the handler and the three still queued behind them
    assert sorted(report.abandoned) == ids
    assert set(stuck) <= set(report.abandoned)
    assert report.completed + report.dead_lettered + len(report.abandoned) == report.published
    assert sorted(fast_handled) == ids
    stats = stage_stats(bus, "jobs@stuck")
    assert (stats.published, stats.acked, stats.dead_lettered) == (5, 0, 0)
    assert (stats.depth, stats.in_flight) == (0, 0)


async def test_aclose_refuses_outside_publishes_at_once() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        first_in.set()
        await release.wait()

    async def publish_while_closing() -> None:
        # once everything else is blocked, aclose is waiting for the held handler
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(BusClosedError):
            await bus.publish("jobs", 2)
        release.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg, bus:
            await bus.publish("jobs", 1)
            await first_in.wait()
            tg.start_soon(publish_while_closing)
            # aclose runs in the task, and the cancel scope, that entered `async with bus`
            report = await bus.aclose(timeout=5)

    assert report.drained is True
    assert (report.published, report.completed, report.dead_lettered) == (1, 1, 0)
    stats = stage_stats(bus, "jobs@g")
    assert (stats.published, stats.acked) == (1, 1)


async def test_drain_raises_timeout_error_when_it_cannot_finish() -> None:
    release = anyio.Event()
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        await release.wait()
        handled.append(n)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 1)
            await bus.publish("jobs", 2)
            with pytest.raises(TimeoutError) as timed_out:
                await bus.drain(timeout=0.1)
            # It says what it was waiting for.
            said = re.fullmatch(
                r"not drained within 0\.1s: still (\d) envelope\(s\) queued \+ (\d) in flight"
                r" or waiting for a retry \(jobs@g \1 \+ \2\)",
                str(timed_out.value),
            )
            assert said is not None, str(timed_out.value)
            assert int(said[1]) + int(said[2]) == 2
            # the work is untouched by the failed drain
            assert handled == []
            stats = stage_stats(bus, "jobs@g")
            assert stats.depth + stats.in_flight == 2

            release.set()
            await bus.drain(timeout=5)
            assert handled == [1, 2]


async def test_a_three_stage_route_started_just_before_aclose_completes() -> None:
    ends: list[Envelope] = []
    bus = Bus()

    @bus.subscribe("route.one", group="one")
    async def one(n: int) -> int:
        await anyio.lowlevel.checkpoint()
        return n + 1

    @bus.subscribe("route.two", group="two")
    async def two(n: int) -> int:
        await anyio.lowlevel.checkpoint()
        return n * 10

    @bus.subscribe("route.three", group="three")
    async def three(env: Envelope) -> None:
        await anyio.lowlevel.checkpoint()
        ends.append(env)

    with anyio.fail_after(5):
        async with bus:
            receipts = [
                await bus.publish("route.one", n, slip=["route.two", "route.three"])
                for n in range(10)
            ]
            report = await bus.aclose(timeout=5)

    assert report.drained is True
    assert (report.published, report.completed, report.dead_lettered) == (30, 30, 0)
    assert list(report.abandoned) == []
    assert sorted(env.payload for env in ends) == [(n + 1) * 10 for n in range(10)]
    assert sorted(env.correlation_id for env in ends) == sorted(r.id for r in receipts)
    for name in ("route.one@one", "route.two@two", "route.three@three"):
        stats = stage_stats(bus, name)
        assert (stats.published, stats.acked, stats.dead_lettered) == (10, 10, 0)
    assert len(bus.dead_letters) == 0


async def test_aexit_on_an_exception_cancels_at_once_instead_of_draining() -> None:
    never = anyio.Event()
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        entered.set()
        await never.wait()

    with anyio.fail_after(2), pytest.raises(LookupError, match="user code failed"):
        async with bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            raise LookupError("user code failed")

    with pytest.raises(BusClosedError):
        await bus.publish("jobs", 2)


async def test_twenty_start_and_shutdown_cycles_leave_no_task_and_no_thread() -> None:
    async def cycle() -> None:
        bus = Bus()
        handled: list[int] = []

        @bus.subscribe("async.jobs", group="async", concurrency=4)
        async def handle_async(n: int) -> None:
            await anyio.lowlevel.checkpoint()
            handled.append(n)

        @bus.subscribe("sync.jobs", group="sync")
        def handle_sync(n: int) -> None:
            handled.append(n)

        async with bus:
            for n in range(5):
                await bus.publish("async.jobs", n)
                await bus.publish("sync.jobs", n)
            await bus.drain()
        assert sorted(handled) == sorted([*range(5), *range(5)])

    tasks_before = {task.id for task in anyio.get_running_tasks()}
    with anyio.fail_after(10):
        # the first cycle warms anyio's worker-thread pool, which idles by design
        await cycle()
        threads_before = set(threading.enumerate())
        for _ in range(20):
            await cycle()
        await anyio.lowlevel.checkpoint()

    tasks_after = {task.id for task in anyio.get_running_tasks()}
    assert tasks_after == tasks_before
    leftover = [t for t in threading.enumerate() if t not in threads_before]
    # anyio's trio test runner uses trio guest mode, whose I/O wait runs on trio's own
    # thread cache; when a handler's thread job overlaps it, the cache may keep one more
    # idle daemon worker. That is trio's pool, not the bus: anything else is a leak.
    idle_trio_workers = [t for t in leftover if t.daemon and t.name.startswith("Trio thread ")]
    assert leftover == idle_trio_workers
    assert len(idle_trio_workers) in (0, 1)
    assert not [t for t in leftover if not t.daemon]


async def test_aclose_works_from_a_cancel_scope_opened_inside_async_with() -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        handled.append(n)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 1)
            # an ordinary deadline around the call, in the task that entered the bus
            with anyio.move_on_after(5):
                report = await bus.aclose(timeout=2)

    assert report.drained is True
    assert (report.published, report.completed, report.dead_lettered) == (1, 1, 0)
    assert handled == [1]


# -- aclose from inside the bus ---------------------------------------------------


def test_aclose_from_a_handler_requests_the_stop_and_returns(
    run_in_own_loop: Callable[[Callable[[], Awaitable[Bus]], float], Bus],
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[int] = []
    inner: list[ShutdownReport] = []
    outer: list[ShutdownReport] = []

    async def main() -> Bus:
        returned = anyio.Event()
        bus = Bus()

        @bus.subscribe("work", group="work")
        async def work(n: int) -> None:
            await anyio.lowlevel.checkpoint()
            handled.append(n)

        @bus.subscribe("stop", group="stop")
        async def stop(_: object) -> None:
            inner.append(await bus.aclose(timeout=5))
            returned.set()

        with anyio.fail_after(10):
            async with bus:
                for n in range(3):
                    await bus.publish("work", n)
                await bus.publish("stop")
                await returned.wait()
                # the stop is requested: outside publishes are refused at once
                with pytest.raises(BusClosedError):
                    await bus.publish("work", 99)
                # the outside call waits for the shutdown the handler asked for
                outer.append(await bus.aclose(timeout=5))
        return bus

    bus = run_in_own_loop(main, 20)
    assert len(inner) == 1 and isinstance(inner[0], ShutdownReport)
    assert inner[0].drained is False  # provisional: asked from inside, nothing verified
    (report,) = outer
    assert report.drained is True
    assert (report.published, report.completed, report.dead_lettered) == (4, 4, 0)
    assert report.abandoned == []
    assert sorted(handled) == [0, 1, 2]
    assert_settled(bus)


def test_aclose_from_a_handler_stops_the_bus_without_an_outside_call(
    run_in_own_loop: Callable[[Callable[[], Awaitable[Bus]], float], Bus],
    assert_settled: Callable[[Bus], None],
) -> None:
    async def main() -> Bus:
        bus = Bus()

        @bus.subscribe("stop", group="stop")
        async def stop(_: object) -> None:
            await bus.aclose(timeout=5)

        with anyio.fail_after(10):
            async with bus:
                await bus.publish("stop")
                # drain returns once the bus is idle or closed; it stops by itself
                while "closed" not in repr(bus):
                    await bus.drain()
                    await anyio.lowlevel.checkpoint()
                with pytest.raises(BusClosedError):
                    await bus.publish("stop")
        return bus

    bus = run_in_own_loop(main, 20)
    report = anyio.run(bus.aclose)
    assert (report.drained, report.published, report.completed) == (True, 1, 1)
    assert_settled(bus)


def test_aclose_from_a_handler_with_a_deadline_abandons_what_hangs(
    run_in_own_loop: Callable[[Callable[[], Awaitable[ShutdownReport]], float], ShutdownReport],
) -> None:
    async def main() -> ShutdownReport:
        never = anyio.Event()
        hung = anyio.Event()
        bus = Bus()

        @bus.subscribe("hang", group="hang")
        async def hang(_: object) -> None:
            hung.set()
            await never.wait()

        @bus.subscribe("stop", group="stop")
        async def stop(_: object) -> None:
            await bus.aclose(timeout=0.05)

        with anyio.fail_after(10):
            async with bus:
                stuck = await bus.publish("hang")
                await hung.wait()
                await bus.publish("stop")
                report = await bus.aclose(timeout=5)
        assert report.abandoned == [stuck.id]
        return report

    report = run_in_own_loop(main, 20)
    assert report.drained is False
    assert (report.published, report.completed, report.dead_lettered) == (2, 1, 0)


def test_aclose_from_an_offloaded_handler_through_from_thread_returns(
    run_in_own_loop: Callable[[Callable[[], Awaitable[Bus]], float], Bus],
    assert_settled: Callable[[Bus], None],
) -> None:
    inner: list[ShutdownReport] = []
    outer: list[ShutdownReport] = []

    async def main() -> Bus:
        bus = Bus()

        @bus.subscribe("stop", group="stop")
        def stop(_: object) -> None:
            inner.append(anyio.from_thread.run(bus.aclose, 5))

        with anyio.fail_after(10):
            async with bus:
                await bus.publish("stop")
                outer.append(await bus.aclose(timeout=5))
        return bus

    bus = run_in_own_loop(main, 20)
    assert len(inner) == 1
    (report,) = outer
    assert (report.drained, report.published, report.completed) == (True, 1, 1)
    assert_settled(bus)


# -- an interrupted aclose ---------------------------------------------------------


@pytest.mark.timeout(20)
async def test_a_cancelled_aclose_still_stops_the_bus_and_later_calls_return(
    assert_settled: Callable[[Bus], None],
) -> None:
    never = anyio.Event()
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        entered.set()
        await never.wait()

    with anyio.fail_after(10):
        async with bus:
            stuck = await bus.publish("jobs")
            await entered.wait()
            with anyio.move_on_after(0.05) as scope:
                await bus.aclose(timeout=30)
            assert scope.cancelled_caught
            with pytest.raises(BusClosedError):
                await bus.publish("jobs")
            report = await bus.aclose(timeout=5)

    assert report.drained is False
    assert report.abandoned == [stuck.id]
    assert_settled(bus)


@pytest.mark.timeout(20)
async def test_a_second_aclose_honours_its_own_shorter_deadline(
    assert_settled: Callable[[Bus], None],
) -> None:
    never = anyio.Event()
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        entered.set()
        await never.wait()

    reports: list[ShutdownReport] = []

    async def close_slowly() -> None:
        reports.append(await bus.aclose(timeout=60))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            stuck = await bus.publish("jobs")
            await entered.wait()
            tg.start_soon(close_slowly)
            await anyio.wait_all_tasks_blocked()
            reports.append(await bus.aclose(timeout=0.05))

    assert reports[0] is reports[1]
    assert reports[0].drained is False
    assert reports[0].abandoned == [stuck.id]
    assert_settled(bus)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0, "soon", True])
@pytest.mark.timeout(20)
async def test_aclose_refuses_a_timeout_it_cannot_use_and_the_bus_still_stops(
    timeout: Any, assert_settled: Callable[[Bus], None]
) -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            with pytest.raises(ConfigurationError, match="timeout"):
                await bus.aclose(timeout=timeout)
            assert bus.running  # nothing was started by the refused call
            await bus.publish("jobs", 2)
            report = await bus.aclose(timeout=5)
        # and __aexit__ (another aclose) returned at once

    assert (report.drained, report.published, report.completed) == (True, 2, 2)
    assert handled == [1, 2]
    assert_settled(bus)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, "soon"])
async def test_drain_refuses_a_timeout_it_cannot_use(timeout: Any) -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            with pytest.raises(ConfigurationError, match="timeout"):
                await bus.drain(timeout=timeout)


# -- publishes and replays cut off by the deadline ----------------------------------


@pytest.mark.timeout(20)
async def test_a_publish_blocked_for_room_at_the_deadline_fails_and_admits_nothing(
    assert_settled: Callable[[Bus], None],
) -> None:
    never = anyio.Event()
    entered = anyio.Event()
    outcome: list[object] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=1)
    async def handle(_: object) -> None:
        entered.set()
        await never.wait()

    async def publish_blocked() -> None:
        try:
            outcome.append(await bus.publish("jobs", 3))
        except BusClosedError as error:
            outcome.append(error)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            first = await bus.publish("jobs", 1)
            await entered.wait()
            second = await bus.publish("jobs", 2)  # fills the one slot
            tg.start_soon(publish_blocked)
            await anyio.wait_all_tasks_blocked()
            report = await bus.aclose(timeout=0.05)

    assert len(outcome) == 1 and isinstance(outcome[0], BusClosedError)
    assert sorted(report.abandoned) == sorted([first.id, second.id])
    stats = stage_stats(bus, "jobs@g")
    assert (stats.published, stats.acked, stats.abandoned) == (2, 0, 2)
    assert (report.published, report.completed, report.dead_lettered) == (2, 0, 0)
    assert_settled(bus)


@pytest.mark.timeout(20)
async def test_a_fan_out_publish_cut_off_at_the_deadline_balances_every_stage(
    assert_settled: Callable[[Bus], None],
) -> None:
    never = anyio.Event()
    entered = anyio.Event()
    errors: list[BusClosedError] = []
    bus = Bus()

    @bus.subscribe("jobs", group="free")
    async def free(_: object) -> None:
        await never.wait()

    @bus.subscribe("jobs", group="full", capacity=1)
    async def full(_: object) -> None:
        entered.set()
        await never.wait()

    async def publish_blocked() -> None:
        with pytest.raises(BusClosedError) as caught:
            await bus.publish("jobs", 3)
        errors.append(caught.value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            await bus.publish("jobs", 2)
            tg.start_soon(publish_blocked)
            await anyio.wait_all_tasks_blocked()
            report = await bus.aclose(timeout=0.05)

    assert len(errors) == 1
    assert stage_stats(bus, "jobs@full").published == 2
    # the "free" stage admitted all three before "full" blocked the third
    assert stage_stats(bus, "jobs@free").published == 3
    assert len(report.abandoned) == 5
    assert_settled(bus)


@pytest.mark.timeout(20)
async def test_a_publish_woken_for_room_after_the_stop_admits_nothing(
    assert_settled: Callable[[Bus], None],
) -> None:
    gate = anyio.Event()
    entered = anyio.Event()
    outcome: list[object] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=1)
    async def handle(_: object) -> None:
        entered.set()
        await gate.wait()

    async def publish_blocked() -> None:
        try:
            outcome.append(await bus.publish("jobs", 3))
        except BusClosedError as error:
            outcome.append(error)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            await bus.publish("jobs", 2)
            tg.start_soon(publish_blocked)
            await anyio.wait_all_tasks_blocked()
            gate.set()  # room appears while the bus closes at once
            report = await bus.aclose(timeout=0)

    assert len(outcome) == 1
    stats = stage_stats(bus, "jobs@g")
    if isinstance(outcome[0], BusClosedError):
        assert stats.published == 2
    else:  # it got in before the stop: then it is accounted for like the others
        assert stats.published == 3
    assert report.completed + len(report.abandoned) == stats.published
    assert_settled(bus)


# -- drain --------------------------------------------------------------------------


async def test_timed_out_drains_leave_no_waiter_behind() -> None:
    never = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        await never.wait()

    with anyio.fail_after(30):
        async with bus:
            await bus.publish("jobs")
            for _ in range(10_000):
                with pytest.raises(TimeoutError):
                    await bus.drain(timeout=0)
            with anyio.move_on_after(0.01):
                await bus.drain()  # cancelled, not timed out: the same
            assert len(bus._services.idle_waiters) == 0
            never.set()
            await bus.drain(timeout=5)
            assert len(bus._services.idle_waiters) == 0


@pytest.mark.timeout(20)
async def test_drain_from_a_handler_waits_for_the_rest_but_not_for_itself(
    assert_settled: Callable[[Bus], None],
) -> None:
    order: list[str] = []
    bus = Bus()

    @bus.subscribe("downstream", group="down")
    async def downstream(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        order.append(f"down {n}")

    @bus.subscribe("upstream", group="up")
    async def upstream(_: object) -> None:
        for n in range(3):
            await bus.publish("downstream", n)
        await bus.drain()  # no timeout: must not wait for this very handler
        order.append("drained")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("upstream")
            await bus.drain()

    assert order == ["down 0", "down 1", "down 2", "drained"]
    assert_settled(bus)


async def test_a_replay_after_aclose_began_is_refused_and_keeps_its_dead_letter(
    assert_settled: Callable[[Bus], None],
) -> None:
    failing = True
    release = anyio.Event()
    replayed_inside: list[Receipt] = []
    bus = Bus()
    dead_ids: list[str] = []

    @bus.subscribe("jobs", group="g")
    async def handle(payload: object) -> None:
        if payload == "hold":
            await release.wait()  # keeps the bus closing
            # A handler of the bus may still replay while it drains, as it may publish.
            replayed_inside.extend(await bus.dead_letters.replay(dead_ids[1]))
            return
        if failing:
            raise ValueError(payload)

    with anyio.fail_after(10):
        async with bus:
            dead_ids.append((await bus.publish("jobs", "one")).id)
            dead_ids.append((await bus.publish("jobs", "two")).id)
            await bus.drain()
            failing = False
            await bus.publish("jobs", "hold")
            async with anyio.create_task_group() as closing:
                closing.start_soon(bus.aclose, 5)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(BusClosedError, match="closing"):
                    await bus.dead_letters.replay(dead_ids[0])
                with pytest.raises(BusClosedError):
                    await bus.dead_letters.replay(*dead_ids)
                assert [bus.dead_letters.get(id) is not None for id in dead_ids] == [True, True]
                release.set()

    assert [receipt.id for receipt in replayed_inside] == [dead_ids[1]]
    assert [entry.envelope.id for entry in bus.dead_letters.list()] == [dead_ids[0]]
    with pytest.raises(BusClosedError, match="closed"):
        await bus.dead_letters.replay(dead_ids[0])
    assert len(bus.dead_letters) == 1
    assert bus.statistics().stage("jobs@g").acked == 2  # "hold" and the replay
    assert_settled(bus)
