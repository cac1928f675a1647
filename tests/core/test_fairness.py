"""Fairness: a publish yields once per call, a consumer once per envelope."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from _turns import assert_each_yielded, publish_runs, run_lengths, ticker  # type: ignore[import-not-found]

from asyncbus import Bus, BusClosedError, ConfigurationError
from asyncbus.transports.memory import MemoryTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


async def test_every_publish_is_a_checkpoint_that_admits_nothing_when_cancelled() -> None:
    """Like anyio's send: the yield comes first, so a cancelled publish admits nothing."""
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("fair.cancel", capacity=100)
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        await bus.publish("fair.cancel", 0)
        published: list[int] = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            for n in range(1, 10):
                await bus.publish("fair.cancel", n)
                published.append(n)
        await bus.drain()
    assert scope.cancelled_caught
    assert published == []
    assert handled == [0]
    [stage] = bus.statistics().stages
    assert (stage.published, stage.acked) == (1, 1)


async def test_another_task_runs_between_any_two_publishes(anyio_backend_name: str) -> None:
    """A publishing loop that always finds room still lets other tasks run each call."""
    bus = Bus()

    @bus.subscribe("fair.publish", capacity=1000)
    async def handle(n: int) -> None:
        pass

    async with bus:
        runs = await publish_runs(lambda n: bus.publish("fair.publish", n), 50)
        await bus.drain()
    assert_each_yielded(runs, 50, anyio_backend_name)


async def test_publish_many_yields_once_per_call_however_many_it_publishes(
    anyio_backend_name: str,
) -> None:
    """A batch is one call: one yield, before anything is admitted (a cancelled one
    admits nothing), and other tasks run between any two calls."""
    events: list[str] = []
    stop = anyio.Event()
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("fair.many", capacity=1000)
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await bus.publish_many("fair.many", range(10))
        assert scope.cancelled_caught
        assert bus.statistics().stages[0].published == 0
        stage = bus._stages_by_name["fair.many@" + bus.statistics().stages[0].group]
        yields = 0
        original = bus._services.publish_yield

        async def counted() -> None:
            nonlocal yields
            yields += 1
            await original()

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(ticker, events, stop)
            await anyio.lowlevel.checkpoint()  # the ticker has started
            bus._services.publish_yield = counted
            try:
                for start in range(0, 200, 20):
                    await bus.publish_many("fair.many", range(start, start + 20))
                    events.append("publish")
            finally:
                bus._services.publish_yield = original
            stop.set()
        await bus.drain()
    assert yields == 10
    assert stage.ledger.published == 200 and handled == list(range(200))
    runs = run_lengths(events, "publish")
    assert_each_yielded(runs, 10, anyio_backend_name)


async def test_a_consumer_yields_once_per_envelope(anyio_backend_name: str) -> None:
    """A stage with a backlog lets other tasks run between any two envelopes."""
    events: list[str] = []
    stop = anyio.Event()
    bus = Bus()

    @bus.subscribe("fair.backlog", capacity=100)
    async def handle(n: int) -> None:
        events.append("handled")

    async with bus:
        for n in range(40):
            bus.publish_nowait("fair.backlog", n)  # a backlog, queued without yielding
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(ticker, events, stop)
            await bus.drain()
            stop.set()
    runs = run_lengths(events, "handled")
    assert_each_yielded(runs, 40, anyio_backend_name)


async def test_a_publish_that_waits_for_room_waits() -> None:
    """A full BLOCK stage holds the publisher until there is room (or its scope ends)."""
    bus = Bus()
    release = anyio.Event()

    @bus.subscribe("fair.full", capacity=1)
    async def handle(n: int) -> None:
        await release.wait()

    async with bus:
        await bus.publish("fair.full", 0)  # taken by the consumer, which waits
        await anyio.wait_all_tasks_blocked()
        await bus.publish("fair.full", 1)  # queued: the stage is full now
        with anyio.move_on_after(0.2) as scope:
            await bus.publish("fair.full", 2)
        assert scope.cancelled_caught
        release.set()
        await bus.drain()
    [stage] = bus.statistics().stages
    assert (stage.published, stage.acked) == (2, 2)


@pytest.mark.parametrize("call", ["publish", "request"])
async def test_a_call_at_its_yield_when_aclose_begins_is_refused_and_admits_nothing(
    call: str, anyio_backend_name: str
) -> None:
    """The state is checked after the yield: aclose may have begun meanwhile."""
    bus = Bus()

    @bus.subscribe("fair.closing", group="g")
    async def handle(n: int) -> int:
        return n

    outcome: list[str] = []

    async def caller() -> None:
        try:
            if call == "publish":
                await bus.publish("fair.closing", 1)
            else:
                await bus.request("fair.closing", 1, timeout=5)
        except BusClosedError:
            outcome.append("refused")
        else:
            outcome.append("done")

    async with bus, anyio.create_task_group() as task_group:
        task_group.start_soon(caller)
        await anyio.lowlevel.checkpoint()  # the caller runs up to its yield (asyncio: FIFO)
        report = await bus.aclose()
    if anyio_backend_name != "trio":  # trio may run the caller first or second
        assert outcome == ["refused"]
    # Either way nothing is lost or half-done: refused and nothing admitted, or done.
    expected = 0 if outcome == ["refused"] else 1
    assert (report.published, report.completed, report.abandoned) == (expected, expected, [])


def test_a_closed_bus_refuses_a_publish_under_another_backend() -> None:
    """After a run on asyncio, a publish under trio meets BusClosedError, not asyncio's yield."""
    bus = Bus()

    @bus.subscribe("fair.later", group="g")
    async def handle(n: int) -> None:
        pass

    async def run_once() -> None:
        async with bus:
            await bus.publish("fair.later", 1)

    async def publish_again() -> None:
        with pytest.raises(BusClosedError):
            await bus.publish("fair.later", 2)

    anyio.run(run_once, backend="asyncio")
    anyio.run(publish_again, backend="trio")


#: In memory, and through a transport as through a broker (``MemoryTransport(direct=False)``:
#: the bus's broker mode, whose publish leaves its yield to the broker's wait), on
#: every backend.
MODES = ["memory", "through-a-transport"]


def _bus(mode: str) -> Bus:
    return Bus(MemoryTransport(direct=False)) if mode == "through-a-transport" else Bus()


@pytest.mark.parametrize("mode", MODES)
async def test_a_publish_many_of_nothing_yields(mode: str, anyio_backend_name: str) -> None:
    """No payloads, no broker round trip: the call yields all the same."""
    bus = _bus(mode)

    @bus.subscribe("fair.nothing", group="g")
    async def handle(n: int) -> None:
        pass

    async with bus:
        results: list[object] = []

        async def publish_nothing(n: int) -> None:
            results.append(await bus.publish_many("fair.nothing", []))

        runs = await publish_runs(publish_nothing, 10)
    assert results == [[]] * 10
    assert_each_yielded(runs, 10, anyio_backend_name)
    assert bus.statistics().stages[0].published == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", ["publish", "publish_many"])
async def test_a_refused_publish_yields(mode: str, call: str, anyio_backend_name: str) -> None:
    """A publish the bus refuses (bad options here; a closed bus below) raises after a
    yield: a loop that logs the refusal and goes on does not starve the other tasks."""
    bus = _bus(mode)

    @bus.subscribe("fair.refused", group="g")
    async def handle(n: int) -> None:
        pass

    async def refused(n: int) -> None:
        with pytest.raises(ConfigurationError):
            if call == "publish":
                await bus.publish("fair.refused", n, timeout=-1)
            else:
                await bus.publish_many("fair.refused", [n], timeout=-1)

    async with bus:
        runs = await publish_runs(refused, 10)
    assert_each_yielded(runs, 10, anyio_backend_name)
    assert bus.statistics().stages[0].published == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_publish_refused_while_the_bus_closes_yields(
    mode: str, anyio_backend_name: str
) -> None:
    """While ``aclose`` drains, an outside publish meets BusClosedError after a yield, so
    a loop that goes on after it lets the drain (and everything else) run."""
    release = anyio.Event()
    bus = _bus(mode)

    @bus.subscribe("fair.closing-loop", group="g")
    async def handle(n: int) -> None:
        await release.wait()

    async def refused(n: int) -> None:
        with pytest.raises(BusClosedError):
            await bus.publish("fair.closing-loop", n)

    async with bus:
        await bus.publish("fair.closing-loop", 0)
        while bus.statistics().stages[0].in_flight == 0:
            await anyio.lowlevel.checkpoint()
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(bus.aclose)  # drains: waits for the handler
            while bus._life.state != "closing":
                await anyio.lowlevel.checkpoint()
            runs = await publish_runs(refused, 10)
            release.set()
    assert_each_yielded(runs, 10, anyio_backend_name)
    [stage] = bus.statistics().stages
    assert (stage.published, stage.acked) == (1, 1)


async def test_a_publish_right_after_a_subscribe_on_a_running_bus_reaches_it() -> None:
    """Through a transport, the pump of a subscription made on the running bus starts
    in the background: the next publish yields first, so the pump has subscribed."""
    bus = _bus("through-a-transport")
    handled: list[int] = []

    @bus.subscribe("fair.first", group="first")
    async def first(n: int) -> None:
        pass

    async with bus:
        bus.subscribe("fair.late", handled.append, group="late")
        await bus.publish("fair.late", 1)
        await bus.drain()
    assert handled == [1]
    assert bus.dead_letters.list() == []
