"""``Defer`` over every broker: put back without a failure, an attempt or a delivery.

The envelope's delivery is held while it waits (as for a retry), so it comes back with
the same attempt and the broker does not count it again toward ``max_deliveries``.
"""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]
from _deferring import defer_first_runs  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


async def test_deferred_envelopes_come_back_with_their_attempt_and_one_failure_is_retried(
    kind: str, url: str, unique_prefix: str
) -> None:
    bus = Bus(transport=make_transport(kind, url, unique_prefix))
    calls: dict[int, list[int]] = {}

    @bus.subscribe(
        "jobs",
        group="workers",
        retry=Retry(max_attempts=2, backoff=0),
        middleware=[defer_first_runs(3, delay=0.01)],
    )
    async def work(envelope: Envelope) -> None:
        attempts = calls.setdefault(envelope.payload, [])
        attempts.append(envelope.attempt)
        if envelope.payload == 0 and len(attempts) == 1:
            raise RuntimeError("transient")

    with anyio.fail_after(60):
        async with bus:
            await bus.subscribed()
            for n in range(4):
                await bus.publish("jobs", n)
            await bus.drain(timeout=30)
            stage = bus.statistics().stage("jobs@workers")
            assert calls == {0: [1, 2], 1: [1], 2: [1], 3: [1]}
            assert (stage.published, stage.acked, stage.deferred) == (4, 4, 12)
            assert (stage.failed, stage.retried, stage.dead_lettered) == (1, 1, 0)
            assert (stage.in_flight, stage.depth) == (0, 0)
            assert bus.dead_letters.list() == []
            assert await bus.transport.backlog("jobs", "workers") == 0  # type: ignore[attr-defined]
