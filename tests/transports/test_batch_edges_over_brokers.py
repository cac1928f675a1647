"""``publish_many`` over a broker at its edges: a payload that cannot be encoded in the
middle of a batch names its position, and nothing of the batch is published."""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, EncodeError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_payload_that_cannot_be_encoded_mid_batch_is_named_and_nothing_is_published(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[int] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("edges.t", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(45):
        async with bus:
            with pytest.raises(EncodeError) as caught:
                await bus.publish_many("edges.t", [1, 2, object(), 4])
            receipts = await bus.publish_many("edges.t", [5, 6])
            await bus.drain(30)
    message = str(caught.value)
    assert message.startswith(
        "publish_many('edges.t'), a batch of 4: the payload at position 2 (envelope "
    )
    assert "cannot encode object" in message
    assert isinstance(caught.value.__cause__, EncodeError)
    # Nothing of the failed batch reached the broker; the next batch went through.
    assert handled == [5, 6]
    assert [receipt.accepted for receipt in receipts] == [("edges.t@g",)] * 2
    stage = bus.statistics().stage("edges.t@g")
    assert (stage.published, stage.acked, stage.dead_lettered, stage.abandoned) == (2, 2, 0, 0)
    assert len(bus.dead_letters) == 0
