"""A subscription the broker refuses for good never stops the running bus.

``subscribe()`` on a running bus refuses at once what no broker could take (a pattern
that could never match); what only the broker refuses (a limit of its own) ends that
stage's pump with a ``ConfigurationError``: the stage is withdrawn, the other stages
go on, and ``await bus.subscribed()`` raises the error. Before, the pump's error ended
the bus's task group: every stage stopped and the error came out of ``async with``.
Here through ``MemoryTransport(direct=False)`` (the broker code path, every backend);
tests/transports/test_refused_subscriptions_over_brokers.py does it on each broker.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _refusals import refusing  # type: ignore[import-not-found]

from asyncbus import Batch, Bus, ConfigurationError
from asyncbus.transports import MemoryTransport

pytestmark = pytest.mark.anyio


class PickyTransport(MemoryTransport):
    """A broker path that refuses any pattern beginning with ``refused`` (a broker limit)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.subscribe = refusing(super().subscribe)  # type: ignore[method-assign]


def _tasks_of(stage: str) -> list[str]:
    return [task.name for task in anyio.get_running_tasks() if stage in (task.name or "")]


@pytest.mark.parametrize(
    "options",
    [{"concurrency": 3}, {"batch": Batch(max_size=4, max_wait=0.01)}],
    ids=["consumers", "batch consumers"],
)
async def test_a_subscription_the_broker_refuses_on_the_running_bus_is_withdrawn_alone(
    options: dict[str, Any],
) -> None:
    bus = Bus(transport=PickyTransport(direct=False))
    handled: list[int] = []

    @bus.subscribe("orders", group="fulfil")
    async def fulfil(n: int) -> None:
        handled.append(n)

    async def late(n: Any) -> None:
        raise AssertionError("never called")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("orders", 1)
            await bus.drain()
            before = [stage.name for stage in bus.statistics().stages]
            bus.subscribe("refused.orders", late, group="late", **options)
            with pytest.raises(ConfigurationError, match="cannot take the pattern"):
                await bus.subscribed()
            await bus.subscribed()  # (raised once)
            # The bus runs on as it was: the same stages, working.
            assert bus.running
            assert [stage.name for stage in bus.statistics().stages] == before
            await bus.publish("orders", 2)
            await bus.drain()
            assert handled == [1, 2]
            assert _tasks_of("refused.orders@late") == []  # its consumers and pump ended
            # The same pattern and group may be subscribed again (refused again).
            bus.subscribe("refused.orders", late, group="late")
            with pytest.raises(ConfigurationError):
                await bus.subscribed()
    assert bus._report is not None
    assert (bus._report.published, bus._report.completed, bus._report.abandoned) == (2, 2, [])


async def test_a_subscription_the_broker_refuses_at_the_start_fails_the_start() -> None:
    bus = Bus(transport=PickyTransport(direct=False))
    bus.subscribe("orders", lambda n: None, group="fulfil", offload="inline")
    bus.subscribe("refused.orders", lambda n: None, group="late", offload="inline")
    with anyio.fail_after(10):
        with pytest.raises(ConfigurationError, match="cannot take the pattern"):
            async with bus:
                pytest.fail("the bus started")  # pragma: no cover
    assert not bus.running
    # Its subscriptions are still the user's: nothing was withdrawn.
    assert [stage.name for stage in bus.statistics().stages] == [
        "orders@fulfil",
        "refused.orders@late",
    ]


@pytest.mark.parametrize("pattern", ["orders.#", "orders created", "orders..created"])
async def test_a_pattern_no_broker_takes_is_refused_by_subscribe_on_the_running_bus(
    pattern: str,
) -> None:
    bus = Bus(transport=PickyTransport(direct=False))
    handled: list[int] = []

    @bus.subscribe("orders.created", group="fulfil")
    async def fulfil(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            with pytest.raises(ConfigurationError, match="NATS syntax"):
                bus.subscribe(pattern, fulfil, group="other")
            await bus.subscribed()  # nothing refused later
            await bus.publish("orders.created", 1)
            await bus.drain()
            assert [stage.name for stage in bus.statistics().stages] == ["orders.created@fulfil"]
    assert handled == [1]
