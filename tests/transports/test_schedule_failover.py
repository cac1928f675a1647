"""A replica that loses the broker in the middle of a periodic schedule: the replicas
that still reach it publish every tick, each once.

The first replica reaches a private server through a TCP proxy; once it has published
ticks, the proxy refuses it (its connections cut, as a crash or a partition the broker
notices). Over Redis and NATS the others claim the next ticks in the shared store;
over RabbitMQ the lost replica's connection takes its lock on the schedule with it,
and the next replica to look leads.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import anyio
import pytest
from _brokers import make_transport, url_for  # type: ignore[import-not-found]
from _private_brokers import PrivateServer  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

EVERY = 0.2


def _replica(kind: str, url: str, prefix: str, name: str) -> Bus:
    bus = Bus(transport=make_transport(kind, url, prefix, publish_timeout=1.0), name=name)
    bus.schedule("ticks", every=EVERY, name="heartbeat", payload=name)
    return bus


async def test_the_replicas_left_publish_every_tick_once_when_one_loses_the_broker(
    private_server: tuple[str, PrivateServer], unique_prefix: str
) -> None:
    kind, broker = private_server
    direct = url_for(kind, broker.port)
    ticks: list[tuple[int, Any]] = []
    changed = anyio.Event()

    async def count(envelope: Envelope) -> None:
        nonlocal changed
        ticks.append((int(envelope.id.rpartition("@")[2]), envelope.payload))
        changed.set()
        changed = anyio.Event()

    async def wait_for(condition: Any) -> None:
        while not condition():
            await changed.wait()

    consumer = Bus(transport=make_transport(kind, direct, unique_prefix), name="consumer")
    consumer.subscribe("ticks", count, group="counter")
    with TcpProxy(broker.port) as proxy, anyio.fail_after(90):
        lost = _replica(kind, url_for(kind, proxy.port), unique_prefix, "lost")
        async with consumer, lost:
            await wait_for(lambda: len(ticks) >= 2)  # it publishes (alone so far)
            async with _replica(kind, direct, unique_prefix, "left"):
                await wait_for(lambda: len(ticks) >= 5)
                await anyio.sleep(EVERY - time.time() % EVERY + EVERY / 2)  # between ticks
                proxy.refuse()
                cut_at = time.time()
                await wait_for(lambda: sum(1 for tick, _ in ticks if tick / 1000 > cut_at) >= 10)
    published = sorted(tick for tick, _ in ticks)
    counts = collections.Counter(published)
    assert [tick for tick, seen in counts.items() if seen != 1] == []
    step = round(EVERY * 1000)
    assert published == list(range(published[0], published[0] + step * len(published), step))
    after = {who for tick, who in ticks if tick / 1000 > cut_at + 1.0}
    assert after == {"left"}
