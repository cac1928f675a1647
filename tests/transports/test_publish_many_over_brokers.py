"""``publish_many`` over a broker: one pipelined write, each envelope once, in order.

The bus hands the whole batch to the transport in one ``publish_routed`` call; the
receipts name the groups the broker reached, and a batch no group takes anywhere is a
``no_subscribers`` dead letter per envelope, kept by the broker.
"""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, DeadLetterReason

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_batch_reaches_a_single_consumer_once_each_and_in_order(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[int] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("batch.orders", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(45):
        async with bus:
            receipts = await bus.publish_many("batch.orders", range(100))
            receipts += await bus.publish_many("batch.orders", (n for n in range(100, 150)))
            await bus.drain(30)
    assert handled == list(range(150))
    assert [receipt.accepted for receipt in receipts] == [("batch.orders@g",)] * 150
    assert len({receipt.id for receipt in receipts}) == 150
    stage = bus.statistics().stage("batch.orders@g")
    assert (stage.published, stage.acked, stage.dead_lettered, stage.abandoned) == (150, 150, 0, 0)
    assert len(bus.dead_letters) == 0


async def test_a_batch_no_group_takes_is_a_stored_no_subscribers_dead_letter_each(
    kind: str, url: str, unique_prefix: str
) -> None:
    with anyio.fail_after(45):
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
            receipts = await publisher.publish_many("batch.nobody", ["a", "b", "c"])
            assert [receipt.accepted for receipt in receipts] == [()] * 3
            entries = publisher.dead_letters.list()
            assert [(e.envelope.id, e.reason) for e in entries] == [
                (receipt.id, DeadLetterReason.NO_SUBSCRIBERS) for receipt in receipts
            ]
        # Kept by the broker: another process of the bus sees them.
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            stored = console.dead_letters.list()
            assert sorted(e.envelope.payload for e in stored) == ["a", "b", "c"]
            assert {e.reason for e in stored} == {DeadLetterReason.NO_SUBSCRIBERS}


async def test_a_batch_fans_out_to_every_group_of_another_process(
    kind: str, url: str, unique_prefix: str
) -> None:
    worker = Bus(transport=make_transport(kind, url, unique_prefix))
    seen: dict[str, list[int]] = {"audit": [], "mail": []}

    @worker.subscribe("batch.*", group="audit")
    async def audit(n: int) -> None:
        seen["audit"].append(n)

    @worker.subscribe("batch.created", group="mail")
    async def mail(n: int) -> None:
        seen["mail"].append(n)

    with anyio.fail_after(45):
        async with worker:
            async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
                receipts = await publisher.publish_many("batch.created", range(20))
            await worker.drain(30)
    assert {receipt.accepted for receipt in receipts} == {("batch.*@audit", "batch.created@mail")}
    assert seen == {"audit": list(range(20)), "mail": list(range(20))}
