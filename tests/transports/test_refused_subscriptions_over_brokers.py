"""On every broker, a subscription refused for good never stops the running bus.

A subscription the broker refuses only once the pump asks for it is made here by a
wrapper that refuses a pattern as a broker would: the stage is withdrawn, the others go
on, and ``await bus.subscribed()`` raises the error. The patterns no broker takes
(``orders.#``, ``orders created``), and on RabbitMQ one over its 255-byte binding keys (a
limit the transport states), are refused by ``subscribe()`` itself.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]
from _refusals import refusing  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_subscription_the_broker_refuses_on_the_running_bus_leaves_the_rest_running(
    kind: str, url: str, unique_prefix: str
) -> None:
    transport = make_transport(kind, url, unique_prefix)
    transport.subscribe = refusing(transport.subscribe)  # type: ignore[method-assign]
    refused, match = "refused.orders", "cannot take"
    bus = Bus(transport=transport)
    handled: list[int] = []

    @bus.subscribe("orders.created", group="fulfil")
    async def fulfil(n: int) -> None:
        handled.append(n)

    async def late(_: Any) -> None:
        raise AssertionError("never called")

    with anyio.fail_after(45):
        async with bus:
            await bus.publish("orders.created", 1)
            bus.subscribe(refused, late, group="late")
            with pytest.raises(ConfigurationError, match=match):
                await bus.subscribed()
            for pattern in ("orders.#", "orders created"):  # refused by subscribe itself
                with pytest.raises(ConfigurationError, match="NATS syntax"):
                    bus.subscribe(pattern, late, group="late")
            if kind == "rabbit":  # over RabbitMQ's own limit: refused before anything changes
                with pytest.raises(ConfigurationError, match="255 bytes"):
                    bus.subscribe("refused." + "x" * 260, late, group="late")
            assert bus.running
            assert [stage.name for stage in bus.statistics().stages] == ["orders.created@fulfil"]
            receipt = await bus.publish("orders.created", 2)
            assert receipt.accepted == ("orders.created@fulfil",)
            await bus.drain(30)
            assert sorted(handled) == [1, 2]
    stage = bus.statistics().stage("orders.created@fulfil")
    assert (stage.published, stage.acked, stage.dead_lettered, stage.abandoned) == (2, 2, 0, 0)
    assert bus.dead_letters.list() == []
