"""asyncbus itself, one runner per workload, through the public API only."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter

from asyncbus import Batch, Bus, Retry
from asyncbus.middleware import deduplicate

from ._baselines import FAN_OUT, SLIP_STAGES, WORKERS
from ._model import Payload, Sample, Tally, counting, echoing, settle

__all__ = ["Run", "bus_runners"]

Run = Callable[[Sequence[Payload]], Awaitable[Sample]]

#: Every envelope of workload 6 carries a ttl, so the expiry check runs (and passes).
TTL = 60.0
#: Workloads 7 and 8: envelopes per ``publish_many`` call (and workload 8's batch
#: handler's ``max_size``).
BATCH = 100


async def _publish_all(bus: Bus, topic: str, messages: Sequence[Payload]) -> float:
    """Publish every message, wait until the bus has handled all of them; return seconds."""
    await settle()
    publish = bus.publish
    started = perf_counter()
    for message in messages:
        await publish(topic, message)
    await bus.drain()
    return perf_counter() - started


async def bus_one(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """One stage, one async handler (default capacity, BLOCK)."""
    tally = Tally()
    bus = make_bus()
    bus.subscribe("bench.one", counting(tally))
    async with bus:
        seconds = await _publish_all(bus, "bench.one", messages)
    return Sample(seconds, len(messages), tally.n)


async def bus_fan_out(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """One topic, three groups: every group gets every message."""
    tally = Tally()
    bus = make_bus()
    handle = counting(tally)
    for index in range(FAN_OUT):
        bus.subscribe("bench.fan", handle, group=f"group-{index}")
    async with bus:
        seconds = await _publish_all(bus, "bench.fan", messages)
    return Sample(seconds, len(messages), tally.n)


async def bus_work_queue(
    messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus
) -> Sample:
    """One group, four consumers competing for the messages."""
    tally = Tally()
    bus = make_bus()
    bus.subscribe("bench.work", counting(tally), group="workers", concurrency=WORKERS)
    async with bus:
        seconds = await _publish_all(bus, "bench.work", messages)
    return Sample(seconds, len(messages), tally.n)


async def bus_slip(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """A routing slip over three stages; each handler counts and returns None, the next payload."""
    tally = Tally()
    bus = make_bus()
    handle = counting(tally)
    topics = [f"bench.slip.{index}" for index in range(SLIP_STAGES)]
    for topic in topics:
        bus.subscribe(topic, handle)
    first, rest = topics[0], tuple(topics[1:])
    async with bus:
        await settle()
        publish = bus.publish
        started = perf_counter()
        for message in messages:
            await publish(first, message, slip=rest)
        await bus.drain()
        seconds = perf_counter() - started
    return Sample(seconds, len(messages), tally.n)


async def bus_request(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """``await bus.request(...)`` one after another; the handler echoes the payload."""
    tally = Tally()
    bus = make_bus()
    bus.subscribe("bench.rr", echoing(tally))
    latencies: list[float] = []
    async with bus:
        await settle()
        request = bus.request
        started = perf_counter()
        for message in messages:
            sent = perf_counter()
            await request("bench.rr", message)
            latencies.append(perf_counter() - sent)
        seconds = perf_counter() - started
    return Sample(seconds, len(messages), tally.n, tuple(latencies))


async def bus_reliable(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """One stage under the reliability chain: Retry configured, ttl on every envelope,
    ``deduplicate()`` on (and the default dead_letter / routing_slip / expire layers)."""
    tally = Tally()
    bus = make_bus()
    bus.subscribe(
        "bench.reliable",
        counting(tally),
        retry=Retry(max_attempts=3),
        middleware=[deduplicate()],
    )
    async with bus:
        await settle()
        publish = bus.publish
        started = perf_counter()
        for message in messages:
            await publish("bench.reliable", message, ttl=TTL)
        await bus.drain()
        seconds = perf_counter() - started
    return Sample(seconds, len(messages), tally.n)


async def bus_many(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """One stage, one async handler; published ``BATCH`` at a time with ``publish_many``."""
    tally = Tally()
    bus = make_bus()
    bus.subscribe("bench.many", counting(tally))
    async with bus:
        await settle()
        publish_many = bus.publish_many
        started = perf_counter()
        for start in range(0, len(messages), BATCH):
            await publish_many("bench.many", messages[start : start + BATCH])
        await bus.drain()
        seconds = perf_counter() - started
    return Sample(seconds, len(messages), tally.n)


async def bus_batch(messages: Sequence[Payload], *, make_bus: Callable[[], Bus] = Bus) -> Sample:
    """One stage with a batch handler (``Batch(max_size=100)``), 100 envelopes per publish."""
    tally = Tally()
    bus = make_bus()

    async def handle(items: list[Payload]) -> None:
        tally.n += len(items)

    bus.subscribe("bench.batch", handle, batch=Batch(max_size=BATCH))
    async with bus:
        await settle()
        publish_many = bus.publish_many
        started = perf_counter()
        for start in range(0, len(messages), BATCH):
            await publish_many("bench.batch", messages[start : start + BATCH])
        await bus.drain()
        seconds = perf_counter() - started
    return Sample(seconds, len(messages), tally.n)


def bus_runners(make_bus: Callable[[], Bus] = Bus) -> dict[str, Run]:
    """asyncbus runner per workload key, each on a bus from ``make_bus``."""
    runners = (bus_one, bus_fan_out, bus_work_queue, bus_slip, bus_request, bus_reliable)
    by_key = {str(key): runner for key, runner in enumerate(runners, start=1)}
    by_key["7"] = bus_many
    by_key["8"] = bus_batch
    return {key: functools.partial(runner, make_bus=make_bus) for key, runner in by_key.items()}
