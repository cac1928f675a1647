"""Baselines: raw anyio memory object streams, ``asyncio.Queue``, a plain call loop,
and the fairness floor (the yields the fairness rule asks for, with no other work).

Each is shaped like its workload and calls the same handler as asyncbus does, so
the ratio measures what the bus adds: routing, envelopes, the middleware chain and
the ledger. The streams are used plainly (``await send`` / ``async for``), except
fan-out, which uses the cheapest honest shape: ``send_nowait`` to each stream,
``send`` only when one is full, and one checkpoint per message.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter

import anyio
from anyio.lowlevel import checkpoint
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncbus._runtime import fast_checkpoint

from ._model import Payload, Sample, Tally, counting, echoing, settle

__all__ = [
    "CAPACITY",
    "FAN_OUT",
    "SLIP_STAGES",
    "WORKERS",
    "fairness_floor_runners",
    "queue_runners",
    "raw_runners",
    "sync_runners",
]

#: Queue capacity everywhere (asyncbus's default stage capacity).
CAPACITY = 1024
FAN_OUT = 3
WORKERS = 4
SLIP_STAGES = 3

Run = Callable[[Sequence[Payload]], Awaitable[Sample]]
AsyncHandler = Callable[[Payload], Awaitable[object]]


def _stream(
    capacity: int = CAPACITY,
) -> tuple[MemoryObjectSendStream[Payload], MemoryObjectReceiveStream[Payload]]:
    return anyio.create_memory_object_stream[Payload](capacity)


async def _drain_stream(receive: MemoryObjectReceiveStream[Payload], handle: AsyncHandler) -> None:
    async with receive:
        async for item in receive:
            await handle(item)


# -- raw anyio memory object streams ---------------------------------------------------


async def raw_one(messages: Sequence[Payload]) -> Sample:
    """One stream, one consumer: ``await send`` / ``async for``."""
    tally = Tally()
    send, receive = _stream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain_stream, receive, counting(tally))
        await settle()
        started = perf_counter()
        async with send:
            for message in messages:
                await send.send(message)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def raw_fan_out(messages: Sequence[Payload]) -> Sample:
    """Three streams: ``send_nowait`` to each, ``send`` when full, one checkpoint a message."""
    tally = Tally()
    handle = counting(tally)
    streams = [_stream() for _ in range(FAN_OUT)]
    sends = [send for send, _ in streams]
    async with anyio.create_task_group() as tg:
        for _, receive in streams:
            tg.start_soon(_drain_stream, receive, handle)
        await settle()
        started = perf_counter()
        for message in messages:
            for send in sends:
                try:
                    send.send_nowait(message)
                except anyio.WouldBlock:
                    await send.send(message)
            await checkpoint()
        for send in sends:
            send.close()
    return Sample(perf_counter() - started, len(messages), tally.n)


async def raw_work_queue(messages: Sequence[Payload]) -> Sample:
    """One stream, four consumers on clones of its receiving end."""
    tally = Tally()
    handle = counting(tally)
    send, receive = _stream()
    async with anyio.create_task_group() as tg:
        with receive:
            for _ in range(WORKERS):
                tg.start_soon(_drain_stream, receive.clone(), handle)
        await settle()
        started = perf_counter()
        async with send:
            for message in messages:
                await send.send(message)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def raw_slip(messages: Sequence[Payload]) -> Sample:
    """Three chained streams: each consumer handles, then sends on to the next stream."""
    tally = Tally()
    handle = counting(tally)
    streams = [_stream() for _ in range(SLIP_STAGES)]

    async def hop(
        receive: MemoryObjectReceiveStream[Payload], onward: MemoryObjectSendStream[Payload]
    ) -> None:
        async with receive, onward:
            async for item in receive:
                await handle(item)
                await onward.send(item)

    async with anyio.create_task_group() as tg:
        for index in range(SLIP_STAGES - 1):
            tg.start_soon(hop, streams[index][1], streams[index + 1][0])
        tg.start_soon(_drain_stream, streams[-1][1], handle)
        await settle()
        started = perf_counter()
        first = streams[0][0]
        async with first:
            for message in messages:
                await first.send(message)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def raw_ping_pong(messages: Sequence[Payload]) -> Sample:
    """A request stream and a reply stream; one request in flight at a time."""
    tally = Tally()
    handle = echoing(tally)
    request_send, request_receive = _stream(1)
    reply_send, reply_receive = _stream(1)

    async def serve() -> None:
        async with request_receive, reply_send:
            async for item in request_receive:
                await reply_send.send(await handle(item))

    latencies: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await settle()
        started = perf_counter()
        async with request_send, reply_receive:
            for message in messages:
                sent = perf_counter()
                await request_send.send(message)
                await reply_receive.receive()
                latencies.append(perf_counter() - sent)
        elapsed = perf_counter() - started
    return Sample(elapsed, len(messages), tally.n, tuple(latencies))


def raw_runners() -> dict[str, Run]:
    """Raw stream shape per workload key."""
    return {
        "1": raw_one,
        "2": raw_fan_out,
        "3": raw_work_queue,
        "4": raw_slip,
        "5": raw_ping_pong,
        "6": raw_one,
        "7": raw_one,
        "8": raw_one,  # the per-message stream: what a batch handler must beat
    }


# -- asyncio.Queue ---------------------------------------------------------------------

_Queue = asyncio.Queue[Payload | None]


async def _drain_queue(queue: _Queue, handle: AsyncHandler) -> None:
    while (item := await queue.get()) is not None:
        await handle(item)


async def queue_one(messages: Sequence[Payload], consumers: int = 1) -> Sample:
    """One bounded queue, ``consumers`` consumers, ``None`` as the end marker."""
    tally = Tally()
    handle = counting(tally)
    queue: _Queue = asyncio.Queue(CAPACITY)
    async with anyio.create_task_group() as tg:
        for _ in range(consumers):
            tg.start_soon(_drain_queue, queue, handle)
        await settle()
        started = perf_counter()
        for message in messages:
            await queue.put(message)
        for _ in range(consumers):
            await queue.put(None)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def queue_work_queue(messages: Sequence[Payload]) -> Sample:
    """One bounded queue, four consumers."""
    return await queue_one(messages, WORKERS)


async def queue_fan_out(messages: Sequence[Payload]) -> Sample:
    """Three queues: ``put_nowait`` to each, ``put`` when full, one ``sleep(0)`` a message."""
    tally = Tally()
    handle = counting(tally)
    queues: list[_Queue] = [asyncio.Queue(CAPACITY) for _ in range(FAN_OUT)]
    async with anyio.create_task_group() as tg:
        for queue in queues:
            tg.start_soon(_drain_queue, queue, handle)
        await settle()
        started = perf_counter()
        for message in messages:
            for queue in queues:
                try:
                    queue.put_nowait(message)
                except asyncio.QueueFull:
                    await queue.put(message)
            await asyncio.sleep(0)
        for queue in queues:
            await queue.put(None)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def queue_slip(messages: Sequence[Payload]) -> Sample:
    """Three chained queues."""
    tally = Tally()
    handle = counting(tally)
    queues: list[_Queue] = [asyncio.Queue(CAPACITY) for _ in range(SLIP_STAGES)]

    async def hop(queue: _Queue, onward: _Queue) -> None:
        while (item := await queue.get()) is not None:
            await handle(item)
            await onward.put(item)
        await onward.put(None)

    async with anyio.create_task_group() as tg:
        for index in range(SLIP_STAGES - 1):
            tg.start_soon(hop, queues[index], queues[index + 1])
        tg.start_soon(_drain_queue, queues[-1], handle)
        await settle()
        started = perf_counter()
        for message in messages:
            await queues[0].put(message)
        await queues[0].put(None)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def queue_ping_pong(messages: Sequence[Payload]) -> Sample:
    """A request queue and a reply queue; one request in flight at a time."""
    tally = Tally()
    handle = echoing(tally)
    requests: _Queue = asyncio.Queue(1)
    replies: _Queue = asyncio.Queue(1)

    async def serve() -> None:
        while (item := await requests.get()) is not None:
            await replies.put(await handle(item))

    latencies: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await settle()
        started = perf_counter()
        for message in messages:
            sent = perf_counter()
            await requests.put(message)
            await replies.get()
            latencies.append(perf_counter() - sent)
        elapsed = perf_counter() - started
        await requests.put(None)
    return Sample(elapsed, len(messages), tally.n, tuple(latencies))


def queue_runners() -> dict[str, Run]:
    """``asyncio.Queue`` shape per workload key."""
    return {
        "1": queue_one,
        "2": queue_fan_out,
        "3": queue_work_queue,
        "4": queue_slip,
        "5": queue_ping_pong,
        "6": queue_one,
        "7": queue_one,
        "8": queue_one,
    }


# -- the function-call floor -----------------------------------------------------------


def _sync_publish(messages: Sequence[Payload], fan_out: int, hops: int) -> Sample:
    tally = Tally()

    def handle(payload: Payload) -> None:
        tally.n += 1

    topics = [f"bench.{index}" for index in range(hops)]
    routes = {topic: (handle,) * fan_out for topic in topics}
    onward = dict(zip(topics, [*topics[1:], None], strict=True))

    def publish(topic: str, payload: Payload) -> None:
        next_topic: str | None = topic
        while next_topic is not None:
            for handler in routes[next_topic]:
                handler(payload)
            next_topic = onward[next_topic]

    first = topics[0]
    started = perf_counter()
    for message in messages:
        publish(first, message)
    return Sample(perf_counter() - started, len(messages), tally.n)


async def sync_one(messages: Sequence[Payload]) -> Sample:
    """``publish(topic, payload)`` looks the handlers up and calls them: nothing else."""
    return _sync_publish(messages, 1, 1)


async def sync_fan_out(messages: Sequence[Payload]) -> Sample:
    return _sync_publish(messages, FAN_OUT, 1)


async def sync_slip(messages: Sequence[Payload]) -> Sample:
    return _sync_publish(messages, 1, SLIP_STAGES)


async def sync_request(messages: Sequence[Payload]) -> Sample:
    """``request(topic, payload)`` returns the handler's result."""
    tally = Tally()

    def handle(payload: Payload) -> Payload:
        tally.n += 1
        return payload

    routes = {"bench.rr": handle}

    def request(topic: str, payload: Payload) -> Payload:
        return routes[topic](payload)

    latencies: list[float] = []
    started = perf_counter()
    for message in messages:
        sent = perf_counter()
        request("bench.rr", message)
        latencies.append(perf_counter() - sent)
    return Sample(perf_counter() - started, len(messages), tally.n, tuple(latencies))


def sync_runners() -> dict[str, Run]:
    """Synchronous publish→call loop per workload key (a work queue is a call loop too)."""
    return {
        "1": sync_one,
        "2": sync_fan_out,
        "3": sync_one,
        "4": sync_slip,
        "5": sync_request,
        "6": sync_one,
        "7": sync_one,
        "8": sync_one,
    }


# -- the fairness floor ----------------------------------------------------------------


async def fairness_floor_one(messages: Sequence[Payload]) -> Sample:
    """The yields the bus's fairness rule asks for, and nothing else.

    A publisher task and a consumer task hand messages over through a deque; each
    yields to the event loop once per message (the publisher before it appends, the
    consumer before it takes one), with the bus's own yield, and the consumer waits
    on an event only when the deque is empty. No envelope, no routing, no ledger:
    no bus that publishes and consumes under that rule can go faster than this.
    """
    tally = Tally()
    handle = counting(tally)
    yield_now = fast_checkpoint()
    queued: collections.deque[Payload] = collections.deque()
    wake: list[anyio.Event] = []
    finished = anyio.Event()
    total = len(messages)

    async def consume() -> None:
        for _ in range(total):
            await yield_now()
            while not queued:
                event = anyio.Event()
                wake.append(event)
                await event.wait()
            await handle(queued.popleft())
        finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await settle()
        started = perf_counter()
        for message in messages:
            await yield_now()
            queued.append(message)
            if wake:
                wake.pop().set()
        await finished.wait()
    return Sample(perf_counter() - started, total, tally.n)


def fairness_floor_runners() -> dict[str, Run | str]:
    """The fairness floor per workload key (workload 1 only, beside the peers)."""
    why = "measured on workload 1 only"
    return {"1": fairness_floor_one, **dict.fromkeys(("2", "3", "4", "5", "6", "7", "8"), why)}
