"""Replay from a process that does not run the stage: only the group that failed gets it."""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, DeadLetterReason, Envelope

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_replay_from_a_bus_without_the_stage_reaches_only_the_group_that_failed(
    kind: str, url: str, unique_prefix: str
) -> None:
    worker = Bus(transport=make_transport(kind, url, unique_prefix))
    audited: list[Envelope] = []
    billed: list[Envelope] = []
    billed_again = anyio.Event()

    @worker.subscribe("orders.created", group="audit")
    async def audit(envelope: Envelope) -> None:
        audited.append(envelope)

    @worker.subscribe("orders.created", group="billing")
    async def bill(envelope: Envelope) -> None:
        billed.append(envelope)
        if len(billed) == 1:
            raise RuntimeError("card declined")
        billed_again.set()

    with anyio.fail_after(45):
        async with worker:
            await worker.publish("orders.created", {"order": 7}, id="order-7")
            await worker.drain(20)
            assert [entry.stage for entry in worker.dead_letters.list()] == [
                "orders.created@billing"
            ]

            # An operator's script: the same broker, no subscriptions at all.
            async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
                (entry,) = console.dead_letters.list()
                assert (entry.envelope.id, entry.reason, entry.stage) == (
                    "order-7",
                    DeadLetterReason.HANDLER_FAILED,
                    "orders.created@billing",
                )
                (receipt,) = await console.dead_letters.replay("order-7")
                assert receipt.accepted == ("orders.created@billing",)
                assert len(console.dead_letters) == 0

            await billed_again.wait()
            await worker.drain(20)

    assert [envelope.id for envelope in audited] == ["order-7"]  # not handled twice
    assert [envelope.id for envelope in billed] == ["order-7", "order-7"]
    assert "asyncbus-replayed" in billed[1].headers and billed[1].attempt == 1


@pytest.mark.parametrize(
    ("name", "topic", "expected"),
    [
        ("orders.created@billing", "orders.created", ("orders.created", "billing")),
        ("orders.*@svc@host", "orders.created", ("orders.*", "svc@host")),
        ("a@b@g", "a@b", ("a@b", "g")),
        ("mail.>@mod:func", "mail.in.x", ("mail.>", "mod:func")),
        ("orders.created@billing", "other.topic", None),
        ("no-at-sign", "no-at-sign", None),
        (None, "t", None),
    ],
)
def test_a_stage_name_splits_where_its_pattern_matches_the_topic(
    name: str | None, topic: str, expected: tuple[str, str] | None
) -> None:
    from asyncbus._modes import split_stage_name

    assert split_stage_name(name, topic) == expected
