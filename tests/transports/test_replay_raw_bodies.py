"""A body that did not decode is kept byte for byte, and a replay re-sends those bytes."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, DeadLetterReason, Envelope

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

RAW = b'\xff{"order": 9}'


class _PassThrough:
    """A codec that writes bytes as they are: how a foreign client's bytes reach a stage."""

    content_type = "application/octet-stream"

    def encode(self, value: Any) -> bytes:
        return bytes(value)

    def decode(self, data: bytes) -> Any:
        return data


async def test_a_replayed_undecodable_body_is_sent_again_byte_for_byte(
    kind: str, url: str, unique_prefix: str
) -> None:
    worker = Bus(transport=make_transport(kind, url, unique_prefix))
    handled: list[Any] = []

    @worker.subscribe("orders.raw", group="billing")
    async def bill(envelope: Envelope) -> None:
        handled.append(envelope.payload)

    sender = Bus(transport=make_transport(kind, url, unique_prefix, codec=_PassThrough()))
    with anyio.fail_after(60):
        async with worker, sender:
            await sender.publish("orders.raw", RAW, id="raw-9")
            await worker.drain(20)
            (entry,) = worker.dead_letters.list()
            assert (entry.reason, entry.envelope.payload) == (DeadLetterReason.REJECTED, RAW)

            (receipt,) = await worker.dead_letters.replay("raw-9")
            assert receipt.accepted == ("orders.raw@billing",)
            await worker.drain(20)
            # The same bytes came back: not decodable, so rejected again, never handled.
            (again,) = worker.dead_letters.list()
            assert again.reason is DeadLetterReason.REJECTED
            assert "asyncbus-replayed" in again.envelope.headers
            assert bytes(again.envelope.payload) == RAW
            stage = worker.statistics().stage("orders.raw@billing")
            assert (stage.published, stage.acked, stage.dead_lettered) == (2, 0, 2)

        # The broker kept the bytes too: a new bus lists them, and replays them as they are.
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            (stored,) = console.dead_letters.list()
            assert bytes(stored.envelope.payload) == RAW
    assert handled == []
