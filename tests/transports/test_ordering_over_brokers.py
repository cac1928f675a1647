"""``ordering="key"`` over every broker, in one process: what the broker delivers is
handled one envelope of a key at a time, in publish order, through retries (which hold
the delivery, and the key, in hand) and dead letters (which free the key)."""

from __future__ import annotations

import random
from collections import defaultdict

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, Reject, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

KEYS = 6
EACH = 20


async def test_each_key_keeps_its_publish_order_through_retries_and_dead_letters(
    kind: str, url: str, unique_prefix: str
) -> None:
    chance = random.Random(11)
    failing = {(k, n) for k in range(KEYS) for n in range(EACH) if chance.random() < 0.15}
    rejected = {(0, 5), (3, 0)}
    handled: dict[int, list[int]] = defaultdict(list)
    running: dict[int, int] = defaultdict(int)
    overlaps = 0
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe(
        "orders",
        group="g",
        concurrency=8,
        ordering="key",
        retry=Retry(max_attempts=3, backoff=0.01, jitter=False),
    )
    async def handle(envelope: Envelope) -> None:
        nonlocal overlaps
        key, n = envelope.payload
        running[key] += 1
        overlaps += running[key] > 1
        try:
            await anyio.sleep(0.001)
            if (key, n) in rejected:
                raise Reject("bad order")
            if (key, n) in failing and envelope.attempt == 1:
                raise RuntimeError("transient")
            handled[key].append(n)
        finally:
            running[key] -= 1

    with anyio.fail_after(45):
        async with bus:
            for n in range(EACH):
                for k in range(KEYS):
                    await bus.publish("orders", [k, n], key=f"order-{k}")
            await bus.drain()
            stage = bus.statistics().stage("orders@g")
            dead = sorted(tuple(e.envelope.payload) for e in bus.dead_letters.list())
    assert overlaps == 0
    for k in range(KEYS):
        assert handled[k] == [n for n in range(EACH) if (k, n) not in rejected], k
    assert dead == sorted(rejected)
    total = KEYS * EACH
    assert (stage.published, stage.acked, stage.dead_lettered) == (total, total - 2, 2)
    assert (stage.depth, stage.in_flight, stage.keys_held) == (0, 0, 0)
    assert stage.retried == len(failing - rejected)
