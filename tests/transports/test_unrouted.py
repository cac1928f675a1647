"""A publish over a broker is never silently lost: no group anywhere means a dead letter.

The groups live in the broker (every process's), so a process that only publishes
knows them too: its receipts name the groups reached, and a publish that matches none
is stored as a ``no_subscribers`` dead letter that every process of the bus sees.
"""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, DeadLetterReason, HandlerError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_publish_no_group_matches_anywhere_is_a_no_subscribers_dead_letter(
    kind: str, url: str, unique_prefix: str
) -> None:
    with anyio.fail_after(30):
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
            receipt = await publisher.publish("nobody.listens", {"n": 1}, id="lost-1")
            assert (receipt.accepted, receipt.rejected, receipt.dropped) == ((), (), ())
            (entry,) = publisher.dead_letters.list()
            assert (entry.envelope.id, entry.reason, entry.stage, entry.error) == (
                "lost-1",
                DeadLetterReason.NO_SUBSCRIBERS,
                None,
                None,
            )
        # Kept by the broker: another process of the bus sees it.
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            (stored,) = console.dead_letters.list()
            assert (stored.envelope.id, stored.envelope.payload, stored.reason) == (
                "lost-1",
                {"n": 1},
                DeadLetterReason.NO_SUBSCRIBERS,
            )


async def test_a_publish_only_process_names_the_groups_of_other_processes_it_reached(
    kind: str, url: str, unique_prefix: str
) -> None:
    worker = Bus(transport=make_transport(kind, url, unique_prefix))
    seen: dict[str, list[int]] = {"audit": [], "mail": [], "late": []}

    @worker.subscribe("orders.*", group="audit")
    async def audit(n: int) -> None:
        seen["audit"].append(n)

    @worker.subscribe("orders.created", group="mail")
    async def mail(n: int) -> None:
        seen["mail"].append(n)

    with anyio.fail_after(45):
        # The publisher starts first: groups created later are found too.
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
            async with worker:
                receipt = await publisher.publish("orders.created", 1)
                assert receipt.accepted == ("orders.*@audit", "orders.created@mail")
                receipt = await publisher.publish("orders.shipped", 2)
                assert receipt.accepted == ("orders.*@audit",)

                async def late(n: int) -> None:
                    seen["late"].append(n)

                worker.subscribe("orders.shipped", late, group="late")
                await worker.subscribed()
                receipt = await publisher.publish("orders.shipped", 3)
                assert receipt.accepted == ("orders.*@audit", "orders.shipped@late")
                await worker.drain(20)
            assert len(publisher.dead_letters) == 0
    assert seen == {"audit": [1, 2, 3], "mail": [1], "late": [3]}


async def test_a_request_no_group_can_answer_fails_at_once(
    kind: str, url: str, unique_prefix: str
) -> None:
    with anyio.fail_after(20):
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as requester:
            with pytest.raises(HandlerError, match="no_subscribers"):
                await requester.request("nobody.answers", 1, timeout=15)


async def test_replaying_a_no_subscribers_dead_letter_reaches_the_groups_there_are_now(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[str] = []
    with anyio.fail_after(40):
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as bus:
            await bus.publish("late.topic", "x", id="early-1")
            # Still no group: the replay is dead-lettered again, not lost.
            (receipt,) = await bus.dead_letters.replay("early-1")
            assert receipt.accepted == ()
            (entry,) = bus.dead_letters.list()
            assert (entry.envelope.id, entry.reason) == (
                "early-1",
                DeadLetterReason.NO_SUBSCRIBERS,
            )

            async def late(payload: str) -> None:
                handled.append(payload)

            bus.subscribe("late.topic", late, group="late")
            await bus.subscribed()
            (receipt,) = await bus.dead_letters.replay("early-1")
            assert receipt.accepted == ("late.topic@late",)
            await bus.drain(20)
            assert len(bus.dead_letters) == 0
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            assert console.dead_letters.list() == []  # gone from the broker too
    assert handled == ["x"]
