"""Starting a bus: a middleware factory (or a subscribe) that fails leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncbus import Bus, BusClosedError, ConfigurationError, DeadLetterReason, Envelope

pytestmark = pytest.mark.anyio


class FactoryBroke(LookupError):
    """What the broken middleware factory raises."""


def broken_factory(call_next: Callable[[Envelope], Any]) -> Callable[[Envelope], Any]:
    raise FactoryBroke("the factory broke")


async def handle(_: object) -> None:
    await anyio.lowlevel.checkpoint()


def running_task_ids() -> set[int]:
    return {task.id for task in anyio.get_running_tasks()}


@pytest.mark.parametrize("where", ["bus", "subscription"])
async def test_a_middleware_factory_raising_at_start_fails_async_with_and_stops_the_bus(
    where: str,
) -> None:
    bus = Bus(middleware=[broken_factory] if where == "bus" else ())
    bus.subscribe("fine", handle, group="fine")
    bus.subscribe(
        "jobs", handle, group="g", middleware=[broken_factory] if where == "subscription" else ()
    )
    before = running_task_ids()
    with anyio.fail_after(5):
        with pytest.raises(FactoryBroke, match="the factory broke"):
            async with bus:
                raise AssertionError("the body must not run")
        assert not bus.running
        assert running_task_ids() == before
        with pytest.raises(BusClosedError):
            await bus.publish("fine", 1)
        report = await bus.aclose(timeout=1)
        assert report.published == 0


async def test_a_bus_whose_factory_failed_starts_once_the_factory_is_fixed() -> None:
    broken = True

    def sometimes_broken(call_next: Callable[[Envelope], Any]) -> Callable[[Envelope], Any]:
        if broken:
            raise FactoryBroke("not yet")
        return call_next

    handled: list[int] = []

    async def record(n: int) -> None:
        handled.append(n)

    bus = Bus()
    bus.subscribe("jobs", record, group="g", middleware=[sometimes_broken])
    with anyio.fail_after(5):
        with pytest.raises(FactoryBroke):
            async with bus:
                pass
        broken = False
        async with bus:
            await bus.publish("jobs", 1)
            await bus.drain()
    assert handled == [1]


async def test_a_subscribe_that_raises_on_a_running_bus_registers_nothing(
    assert_settled: Callable[[Bus], None],
) -> None:
    bus = Bus()
    bus.subscribe("fine", handle, group="fine")
    with anyio.fail_after(5):
        async with bus:
            tasks = running_task_ids()
            with pytest.raises(FactoryBroke):
                bus.subscribe("jobs", handle, group="g", middleware=[broken_factory])
            # a second subscription on an existing stage: that stage is unchanged
            with pytest.raises(FactoryBroke):
                bus.subscribe("fine", handle, group="fine", middleware=[broken_factory])
            assert running_task_ids() == tasks
            assert [stage.name for stage in bus.statistics().stages] == ["fine@fine"]
            assert bus.statistics().stages[0].concurrency == 1
            receipt = await bus.publish("jobs", 1)
            assert receipt.accepted == ()
            letter = bus.dead_letters.get(receipt.id)
            assert letter is not None and letter.reason is DeadLetterReason.NO_SUBSCRIBERS
            await bus.publish("fine", 1)
            await bus.drain()
    assert_settled(bus)


async def test_entering_a_bus_twice_is_refused_and_harms_nothing() -> None:
    bus = Bus()
    bus.subscribe("jobs", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            with pytest.raises(RuntimeError, match="already running"):
                await bus.__aenter__()
            await bus.publish("jobs", 1)
            await bus.drain()
    assert bus.statistics().acked == 1


async def test_a_start_cancelled_halfway_leaves_no_running_bus() -> None:
    bus = Bus()
    bus.subscribe("jobs", handle, group="g")
    before = running_task_ids()
    with anyio.fail_after(5):
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with bus:
                raise AssertionError("the body must not run")
        assert not bus.running
        assert running_task_ids() == before
        with pytest.raises(BusClosedError):
            await bus.publish("jobs", 1)


def test_a_bad_bus_middleware_list_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="middleware"):
        Bus(middleware=broken_factory)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="middleware"):
        Bus(middleware=[1])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="middleware"):
        Bus().subscribe("jobs", handle, middleware=broken_factory)  # type: ignore[arg-type]
