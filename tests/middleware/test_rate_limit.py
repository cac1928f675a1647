"""``RateLimit``: over the limit is deferred (once, to its turn), never failed.

Counted, not timed: the ledger's ``deferred`` and the handler's calls are exact; the
only clock readings are lower bounds the limit guarantees (no envelope runs before its
turn), read on the event loop's clock the limit itself uses.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest

from asyncbus import Bus, ConfigurationError, Envelope, RateLimit, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

#: How early the event loop may wake a sleeper (asyncio's clock resolution, with room).
EARLY = 0.005


async def test_a_burst_runs_at_once_and_the_rest_is_deferred_once_each_to_its_turn() -> None:
    bus = Bus()
    limit = RateLimit(50, per=1.0, burst=2)  # a turn every 20 ms
    started: list[tuple[int, float]] = []

    @bus.subscribe("t", group="g", concurrency=8, middleware=[limit])
    async def handle(n: int) -> None:
        started.append((n, anyio.current_time()))

    with anyio.fail_after(10):
        async with bus:
            t0 = anyio.current_time()
            await bus.publish_many("t", range(6))
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert sorted(n for n, _ in started) == [0, 1, 2, 3, 4, 5]
    assert (stage.published, stage.acked, stage.deferred) == (6, 6, 4)
    assert (stage.failed, stage.retried, stage.dead_lettered) == (0, 0, 0)
    # Turns: two at once (the burst), then one every 20 ms; none runs before its turn.
    times = sorted(time for _, time in started)
    for index, time in enumerate(times[2:], start=1):
        assert time >= t0 + index * 0.02 - EARLY


async def test_keys_have_buckets_of_their_own() -> None:
    bus = Bus()
    handled: list[str] = []

    def customer(envelope: Envelope) -> str:
        return str(envelope.payload["customer"])

    @bus.subscribe(
        "orders", group="g", concurrency=8, middleware=[RateLimit(1, per=60, key=customer)]
    )
    async def handle(order: dict[str, Any]) -> None:
        handled.append(order["customer"])

    with anyio.fail_after(10):
        async with bus:
            for name in ("ann", "bob", "ann", "cy", "bob"):
                await bus.publish("orders", {"customer": name})
            # One turn per customer now; the second ann and bob wait a minute for theirs.
            while len(handled) < 3 or bus.statistics().stage("orders@g").deferred < 2:
                await anyio.sleep(0.01)
            stage = bus.statistics().stage("orders@g")
            assert sorted(handled) == ["ann", "bob", "cy"]
            assert (stage.acked, stage.deferred, stage.in_flight) == (3, 2, 2)
            report = await bus.aclose(timeout=0.1)
    assert (report.completed, len(report.abandoned)) == (3, 2)


async def test_deferring_never_spends_the_retry_budget() -> None:
    bus = Bus()
    calls: list[tuple[int, int]] = []

    @bus.subscribe(
        "t",
        group="g",
        concurrency=4,
        retry=Retry(max_attempts=2, backoff=0),
        middleware=[RateLimit(100, burst=1)],
    )
    async def handle(envelope: Envelope) -> None:
        calls.append((envelope.payload, envelope.attempt))
        if envelope.attempt == 1:
            raise RuntimeError("transient")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(3))
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert sorted(calls) == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    assert (stage.acked, stage.failed, stage.retried, stage.dead_lettered) == (3, 3, 3, 0)
    assert stage.deferred == 5  # every run after the first waited for its turn, once


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rate": 0}, "rate"),
        ({"rate": math.nan}, "rate"),
        ({"rate": math.inf}, "rate"),
        ({"rate": 1, "per": 0}, "per"),
        ({"rate": 1, "burst": 0}, "burst"),
        ({"rate": 1, "burst": 1.5}, "burst"),
        ({"rate": 1, "burst": True}, "burst"),
        ({"rate": 1, "key": "customer"}, "key"),
    ],
)
def test_a_limit_that_cannot_work_is_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        RateLimit(**options)


def test_the_default_burst_is_the_rate_rounded_up() -> None:
    assert RateLimit(2.5).burst == 3
    assert RateLimit(0.5, per=10).burst == 1
