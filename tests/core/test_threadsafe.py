"""publish_threadsafe at the edges: its future always ends, with a receipt or an error."""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from asyncbus import Backpressure, Bus, BusClosedError, ConfigurationError, Receipt

pytestmark = pytest.mark.anyio


def _full_stage(bus: Bus, never: anyio.Event, entered: anyio.Event) -> None:
    @bus.subscribe("jobs", group="g", capacity=1)
    async def handle(_: object) -> None:
        entered.set()
        await never.wait()


async def _outcome(future: concurrent.futures.Future[Receipt]) -> BaseException | None:
    """The future's exception, waited for off the loop (at most 5 s)."""
    return await anyio.to_thread.run_sync(lambda: future.exception(timeout=5))


async def test_a_loop_thread_publish_cut_off_by_the_shutdown_fails_with_bus_closed(
    assert_settled: Callable[[Bus], None],
) -> None:
    never, entered = anyio.Event(), anyio.Event()
    bus = Bus()
    _full_stage(bus, never, entered)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            await bus.publish("jobs", 2)
            future = bus.publish_threadsafe("jobs", 3)  # on the loop's own thread
            await anyio.wait_all_tasks_blocked()
            assert not future.done()  # waiting for room
            report = await bus.aclose(timeout=0.05)
        assert future.done() and not future.cancelled()
        assert isinstance(future.exception(timeout=0), BusClosedError)

    assert len(report.abandoned) == 2
    assert_settled(bus)


async def test_a_publish_from_another_thread_cut_off_by_the_shutdown_fails_with_bus_closed(
    assert_settled: Callable[[Bus], None],
) -> None:
    never, entered = anyio.Event(), anyio.Event()
    bus = Bus()
    _full_stage(bus, never, entered)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await entered.wait()
            await bus.publish("jobs", 2)
            future = await anyio.to_thread.run_sync(bus.publish_threadsafe, "jobs", 3)
            await anyio.wait_all_tasks_blocked()
            await bus.aclose(timeout=0.05)
        error = await _outcome(future)
        assert not future.cancelled()
        assert isinstance(error, BusClosedError)

    assert_settled(bus)


async def test_loop_thread_publishes_made_as_the_bus_stops_all_resolve(
    assert_settled: Callable[[Bus], None],
) -> None:
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        await anyio.lowlevel.checkpoint()

    futures: list[concurrent.futures.Future[Receipt]] = []
    with anyio.fail_after(10):
        async with bus:
            futures += [bus.publish_threadsafe("jobs", n) for n in range(20)]
            # __aexit__ at once: the tasks of those publishes may not have run yet
        futures += [bus.publish_threadsafe("jobs", n) for n in range(3)]

    for future in futures:
        assert future.done() and not future.cancelled()
        error = future.exception(timeout=0)
        assert error is None or isinstance(error, BusClosedError)
    accepted = sum(1 for future in futures if future.exception(timeout=0) is None)
    assert bus.statistics().published == accepted
    assert_settled(bus)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0])
async def test_publish_threadsafe_reports_a_bad_timeout_through_its_future(
    timeout: float,
) -> None:
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        return None

    with anyio.fail_after(10):
        async with bus:
            future = await anyio.to_thread.run_sync(
                lambda: bus.publish_threadsafe("jobs", 1, timeout=timeout)
            )
            assert isinstance(await _outcome(future), ConfigurationError)
            assert bus.statistics().published == 0


async def test_subscribe_from_a_sync_handler_thread_starts_its_consumers(
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[object] = []
    refused: list[BaseException] = []
    bus = Bus()

    def late(payload: object) -> None:
        handled.append(payload)

    @bus.subscribe("setup", group="setup")  # a sync handler: runs in a worker thread
    def setup(_: object) -> None:
        bus.subscribe("late", late, group="late")
        bus.subscribe("late.decorated", group="decorated")(late)
        try:
            bus.subscribe("late.bad", late, group="bad", capacity=0)
        except ConfigurationError as error:
            refused.append(error)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("setup", None)
            await bus.drain()
            first = await bus.publish("late", 1)
            second = await bus.publish("late.decorated", 2)
            await bus.drain()
            report = await bus.aclose(timeout=5)

    assert (first.accepted, second.accepted) == (("late@late",), ("late.decorated@decorated",))
    assert sorted(handled) == [1, 2]  # type: ignore[type-var]
    assert len(refused) == 1
    assert [stage.name for stage in bus.statistics().stages] == [
        "setup@setup",
        "late@late",
        "late.decorated@decorated",
    ]
    assert report.drained
    assert_settled(bus)


async def test_subscribe_from_a_thread_of_its_own_starts_its_consumers(
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[object] = []
    bus = Bus()

    async def late(payload: object) -> None:
        handled.append(payload)

    with anyio.fail_after(10):
        async with bus:
            made: list[object] = []
            thread = threading.Thread(
                target=lambda: made.append(bus.subscribe("late", late, group="late"))
            )
            thread.start()
            await anyio.to_thread.run_sync(thread.join)
            assert len(made) == 1
            await bus.publish("late", 1)
            await bus.drain()

    assert handled == [1]
    assert_settled(bus)


@pytest.mark.parametrize("where", ["sync handler", "thread of its own"])
async def test_publish_nowait_from_another_thread_is_refused_and_admits_nothing(
    where: str, assert_settled: Callable[[Bus], None]
) -> None:
    refused: list[BaseException] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        pass

    def publish_from_thread(_: object = None) -> None:
        try:
            bus.publish_nowait("jobs", 1)
        except RuntimeError as error:
            refused.append(error)

    bus.subscribe("setup", publish_from_thread, group="setup", offload="thread")

    with anyio.fail_after(10):
        async with bus:
            if where == "sync handler":
                await bus.publish("setup", None)
                await bus.drain()
            else:
                thread = threading.Thread(target=publish_from_thread)
                thread.start()
                await anyio.to_thread.run_sync(thread.join)
            assert bus.statistics().stage("jobs@g").published == 0
            bus.publish_nowait("jobs", 2)  # on the loop's thread: fine
            await bus.drain()

    assert len(refused) == 1
    assert isinstance(refused[0], RuntimeError)
    assert "publish_threadsafe" in str(refused[0])
    assert bus.statistics().stage("jobs@g").acked == 1
    assert_settled(bus)


# -- order -------------------------------------------------------------------------


def _busy(iterations: int = 3000) -> int:
    """CPU work in a handler, while the publishing thread keeps calling."""
    total = 0
    for n in range(iterations):
        total += n
    return total


def _publish_in_a_row(bus: Bus, count: int) -> list[Receipt]:
    """``publish_threadsafe("seq", n)`` for n in ``range(count)``, one call after another
    without waiting (from the calling thread), then their receipts."""
    futures = [bus.publish_threadsafe("seq", n) for n in range(count)]
    return [future.result(timeout=60) for future in futures]


def _inversions(seen: list[int]) -> int:
    return sum(1 for earlier, later in itertools.pairwise(seen) if later < earlier)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("capacity", [1, 8])
async def test_publishes_from_one_thread_are_handled_in_call_order_through_a_full_stage(
    capacity: int, assert_settled: Callable[[Bus], None]
) -> None:
    count = 2000
    seen: list[int] = []
    bus = Bus()

    @bus.subscribe("seq", group="g", capacity=capacity)
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()  # whatever is ready runs in between
        seen.append(n)
        _busy()

    with anyio.fail_after(100):
        async with bus:
            receipts = await anyio.to_thread.run_sync(_publish_in_a_row, bus, count)
            await bus.drain()
    assert all(receipt.accepted == ("seq@g",) for receipt in receipts)
    assert (len(seen), _inversions(seen)) == (count, 0)
    assert seen == list(range(count))
    assert_settled(bus)


@pytest.mark.timeout(120)
async def test_publishes_from_one_thread_keep_their_order_in_every_stage_of_a_fan_out(
    assert_settled: Callable[[Bus], None],
) -> None:
    count = 1000
    seen: dict[str, list[int]] = {"a": [], "b": []}
    bus = Bus()

    @bus.subscribe("seq", group="a", capacity=1)
    async def first(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        seen["a"].append(n)
        _busy(1000)

    @bus.subscribe("seq", group="b", capacity=2)
    async def second(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        seen["b"].append(n)
        _busy(2000)

    with anyio.fail_after(100):
        async with bus:
            receipts = await anyio.to_thread.run_sync(_publish_in_a_row, bus, count)
            await bus.drain()
    assert all(sorted(receipt.accepted) == ["seq@a", "seq@b"] for receipt in receipts)
    assert (_inversions(seen["a"]), _inversions(seen["b"])) == (0, 0)
    assert seen == {"a": list(range(count)), "b": list(range(count))}
    assert_settled(bus)


@pytest.mark.timeout(120)
async def test_publishes_from_one_task_are_handled_in_order_through_a_full_stage(
    assert_settled: Callable[[Bus], None],
) -> None:
    count = 2000
    seen: list[int] = []
    bus = Bus()

    @bus.subscribe("seq", group="g", capacity=1)
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(n)
        _busy()

    with anyio.fail_after(100):
        async with bus:
            for n in range(count):
                await bus.publish("seq", n)
            await bus.drain()
    assert seen == list(range(count))
    assert_settled(bus)


async def test_room_handed_to_a_waiting_publish_is_not_taken_by_a_newer_one(
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[str] = []
    refused: list[str] = []
    release = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g", capacity=1, backpressure=Backpressure.BLOCK)
    async def handle(name: str) -> None:
        handled.append(name)
        if name == "first":
            await release.wait()
        elif name == "second":
            # The consumer just took "second" and handed its place to "third", whose
            # task has not run yet: that place is "third"'s, not this newer publish's.
            try:
                bus.publish_nowait("jobs", "newer")
            except anyio.WouldBlock:
                refused.append("newer")

    with anyio.fail_after(10):
        async with bus, anyio.create_task_group() as group:
            await bus.publish("jobs", "first")
            await anyio.wait_all_tasks_blocked()
            await bus.publish("jobs", "second")  # the queue is full now
            group.start_soon(bus.publish, "jobs", "third")
            await anyio.wait_all_tasks_blocked()  # "third" waits for room
            release.set()
    assert (handled, refused) == (["first", "second", "third"], ["newer"])
    assert_settled(bus)
