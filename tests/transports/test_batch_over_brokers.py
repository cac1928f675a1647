"""Batch handlers over Redis, NATS and RabbitMQ: each envelope's delivery settled on its own.

The pump feeds the stage's queue (``prefetch`` = capacity); a batch consumer takes up
to ``max_size`` of it and settles each delivery as its envelope ends: acked (written
behind in batches on Redis and RabbitMQ), retried, or dead-lettered into the broker's
own dead-letter store.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Batch, BatchError, Bus, Envelope, Reject, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

COUNT = 60


def _ledger(bus: Bus, topic: str) -> tuple[int, int, int, int, int, int]:
    (stage,) = [stage for stage in bus.statistics().stages if stage.topic == topic]
    return (
        stage.published,
        stage.acked,
        stage.dead_lettered,
        stage.abandoned,
        stage.depth,
        stage.in_flight,
    )


async def _left_in_broker(kind: str, url: str, prefix: str, topic: str, group: str) -> int:
    """What the broker still holds for (topic, group), read by a fresh connection."""
    async with make_transport(kind, url, prefix) as transport:
        return await transport.backlog(topic, group)  # type: ignore[no-any-return]


async def test_a_batch_handler_receives_every_message_exactly_once(
    kind: str, url: str, unique_prefix: str
) -> None:
    batches: list[list[int]] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("jobs", group="g", batch=Batch(max_size=16, max_wait=0.02), capacity=32)
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(60):
        async with bus:
            await bus.subscribed()
            for n in range(COUNT):
                await bus.publish("jobs", n)
            await bus.drain()
            assert _ledger(bus, "jobs") == (COUNT, COUNT, 0, 0, 0, 0)
        assert sorted(n for batch in batches for n in batch) == list(range(COUNT))
        assert all(1 <= len(batch) <= 16 for batch in batches)
        assert await _left_in_broker(kind, url, unique_prefix, "jobs", "g") == 0


async def test_a_failing_batch_is_retried_and_dead_lettered_per_envelope_in_the_broker(
    kind: str, url: str, unique_prefix: str
) -> None:
    attempts: list[tuple[int, int]] = []
    transport = make_transport(kind, url, unique_prefix)
    bus = Bus(transport=transport)

    @bus.subscribe(
        "jobs",
        group="g",
        batch=Batch(max_size=10, max_wait=0.02),
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
    )
    async def handle(items: list[Envelope]) -> None:
        attempts.extend((item.payload, item.attempt) for item in items)
        raise RuntimeError("the batch failed")

    with anyio.fail_after(60):
        async with bus:
            await bus.subscribed()
            for n in range(5):
                await bus.publish("jobs", n)
            await bus.drain()
            assert _ledger(bus, "jobs") == (5, 0, 5, 0, 0, 0)
            stored = await transport.dead_letters()  # type: ignore[attr-defined]
            assert sorted(
                (entry.envelope.payload, entry.reason.value, entry.attempts, entry.error)
                for entry in stored
            ) == [(n, "handler_failed", 2, "RuntimeError: the batch failed") for n in range(5)]
        assert sorted(attempts) == [(n, attempt) for n in range(5) for attempt in (1, 2)]
        assert await _left_in_broker(kind, url, unique_prefix, "jobs", "g") == 0


async def test_a_partial_batch_error_acks_the_rest_and_nothing_comes_back(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[int] = []
    transport = make_transport(kind, url, unique_prefix)
    bus = Bus(transport=transport)

    @bus.subscribe("jobs", group="g", batch=Batch(max_size=10, max_wait=0.02))
    async def handle(items: list[int]) -> None:
        handled.extend(items)
        failures: dict[int, BaseException] = {
            position: Reject(f"odd {item}") for position, item in enumerate(items) if item % 2
        }
        if failures:
            raise BatchError(failures)

    with anyio.fail_after(60):
        async with bus:
            await bus.subscribed()
            for n in range(10):
                await bus.publish("jobs", n)
            await bus.drain()
            assert _ledger(bus, "jobs") == (10, 5, 5, 0, 0, 0)
            stored: list[Any] = await transport.dead_letters()  # type: ignore[attr-defined]
            assert sorted((entry.envelope.payload, entry.reason.value) for entry in stored) == [
                (n, "rejected") for n in (1, 3, 5, 7, 9)
            ]
        assert sorted(handled) == list(range(10))  # each once: nothing redelivered
        assert await _left_in_broker(kind, url, unique_prefix, "jobs", "g") == 0


async def test_batches_that_cannot_fill_within_the_prefetch_do_not_wait_out_max_wait(
    kind: str, url: str, unique_prefix: str
) -> None:
    # Two consumers of up to 10 each, but the stage (prefetch) holds 10: once both hold
    # part of a batch, no delivery comes until one of them runs. Waiting out max_wait
    # each time (about once per 10 envelopes) would take far past the deadline below;
    # only the last, partial batches may wait it out (once, side by side).
    batches: list[list[int]] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe(
        "jobs", group="g", batch=Batch(max_size=10, max_wait=5), capacity=10, concurrency=2
    )
    async def handle(items: list[int]) -> None:
        batches.append(items)

    async with bus:
        await bus.subscribed()
        with anyio.fail_after(25):
            for n in range(COUNT):
                await bus.publish("jobs", n)
            await bus.drain()
        assert _ledger(bus, "jobs") == (COUNT, COUNT, 0, 0, 0, 0)
    assert sorted(n for batch in batches for n in batch) == list(range(COUNT))
    assert all(1 <= len(batch) <= 10 for batch in batches)
    assert await _left_in_broker(kind, url, unique_prefix, "jobs", "g") == 0
