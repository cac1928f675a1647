"""Over every broker a dead letter is built once, by the bus, and the broker stores that
entry as it is: the broker's copy carries the bus's error, stage, attempts and traceback."""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, DeadLetterReason, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def _fail_deep(payload: int) -> None:
    raise ValueError(f"no stock for item {payload}")


async def test_the_broker_stores_the_bus_entry_traceback_and_all(
    kind: str, url: str, unique_prefix: str
) -> None:
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("orders", group="stock", retry=Retry(max_attempts=2, backoff=0))
    async def reserve(payload: int) -> None:
        _fail_deep(payload)

    with anyio.fail_after(60):
        async with bus:
            await bus.subscribed()
            await bus.publish("orders", 7)
            await bus.drain(timeout=30)
            [recorded] = bus.dead_letters.list()
            stored = await bus.transport.dead_letters()  # type: ignore[attr-defined]
            stage = bus.statistics().stage("orders@stock")
            assert (stage.published, stage.failed, stage.retried, stage.dead_lettered) == (
                1,
                2,
                1,
                1,
            )
    assert recorded.reason is DeadLetterReason.HANDLER_FAILED
    assert recorded.traceback is not None and "_fail_deep" in recorded.traceback
    [entry] = stored
    assert (entry.envelope.id, entry.reason, entry.error, entry.stage, entry.attempts) == (
        recorded.envelope.id,
        DeadLetterReason.HANDLER_FAILED,
        "ValueError: no stock for item 7",
        "orders@stock",
        2,
    )
    assert entry.envelope.attempt == 2
    assert entry.traceback == recorded.traceback
