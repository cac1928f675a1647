"""Brokers end to end: asyncbus over Redis Streams and NATS JetStream vs hand-written clients.

On the servers of this machine (loopback only), asyncbus's throughput next to the
clients one would otherwise write by hand.
Every run moves ``--messages`` small dicts (``{"id": i, "kind": "order.created",
"amount": 12.5}``, built before timing) from publish to a handler that counts them,
through a fresh set of keys / streams, and is timed from the first publish until the
handler count reaches the total (an ``anyio.Event``). Each side's acks are checked
afterwards (outside the timed span): a run that lost, duplicated or left a message
unacked is an error, not a time.

Redis (``redis://127.0.0.1:6379/0``):

* **asyncbus**: ``Bus(transport=RedisTransport(url, prefix=...))``, one subscription
  (group ``bench``, ``concurrency=8``, ``capacity=256``); a task group of 100
  publisher tasks, each ``await bus.publish(topic, payload)`` in turn, so 100
  publishes are in flight.
* **hand-written single**: redis-py, what asyncbus's single publishes compare with:
  100 publisher tasks each ``await r.xadd(...)`` (JSON body) on one pooled client;
  one task reads with ``XREADGROUP COUNT 100 BLOCK``, handles the batch and XACKs its
  ids in one command.
* **hand-written pipelined**: redis-py, one task XADDs in pipelines of 100 (no
  MULTI); the same consumer. The baseline for batch publishing.
* **asyncbus batch**: the same Bus, ``PUBLISHERS`` (4) tasks each ``await
  bus.publish_many(topic, chunk)`` of the next chunk of 100 in turn; one subscription
  with ``batch=Batch(max_size=100)`` (``concurrency=8``, ``capacity=256``) whose
  handler counts its list. Why 4 tasks where the pipelined loop has one: a
  ``publish_many`` returns only when the broker took the whole batch, so one task
  would leave the connection idle from the last reply of a batch to the first command
  of the next, which the hand-written loops do not pay the same way (redis-py writes
  the next pipeline as soon as it has parsed the replies; nats-py keeps 100 publishes
  pending all the time). A few calls in flight keep about as much on the wire as the
  hand-written loop without turning it into 100 publishers again.
* **FastStream**: ``RedisBroker`` (``logger=None``) with a stream subscriber in a
  consumer group (``StreamSub(stream, group=..., consumer=...)``, otherwise its
  defaults: one worker, no read count, which were its fastest settings here); 100
  publisher tasks each ``await broker.publish(payload, stream=...)``. Its subscriber
  XACKs each message after the handler.

NATS JetStream (``nats://127.0.0.1:4222``):

* **asyncbus**: ``Bus(transport=NatsTransport(url, prefix=...))``, the same
  subscription and the same 100 publisher tasks.
* **hand-written single** (nats-py): the same 100 publisher tasks, each
  ``await js.publish(...)`` in turn, into a stream shaped like the transport's (file
  storage, interest retention); a durable pull consumer ``fetch(100)``, and
  ``msg.ack()`` for each message after the handler. The baseline of asyncbus's
  single publishes.
* **hand-written pipelined** (nats-py): ``js.publish_async`` with
  ``publish_async_max_pending=100`` (100 unconfirmed publishes in flight) from one
  task, the same consumer. The baseline of batch publishing.
* **asyncbus batch**: as for Redis (4 tasks of ``publish_many`` of 100, one batch
  subscription of ``Batch(max_size=100)``).

Runs alternate (A B C A B C ..., after one untimed warm-up of each), so a slow spell
of the shared machine falls on every side. **msg/s** and **µs/msg** are medians
over the rounds; each **x** column is the median of the per-round ratios to one
baseline of the same round, with their spread (min-max over the rounds). With
``--check``, the maintainers' targets are judged too (Redis asyncbus >= 0.8x
hand-written single and >= 10x FastStream; NATS asyncbus >= 0.8x hand-written
single; on both, asyncbus batch >= 0.8x hand-written pipelined; exit status 1 on
FAIL). A run of asyncbus that fails is an error (exit status 1) either way.
A broker whose port is closed is skipped with a note; ``--only redis|nats`` runs one.

Run: ``python -m asyncbus bench brokers [--messages N] [--rounds R] [--check]
[--only redis|nats]`` (or ``python benchmarks/brokers.py``, the same).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio

from asyncbus import Batch, Bus
from asyncbus.transports.nats import NatsTransport
from asyncbus.transports.redis import RedisTransport

REDIS_URL = "redis://127.0.0.1:6379/0"
NATS_URL = "nats://127.0.0.1:4222"
TOPIC = "bench.items"
GROUP = "bench"
IN_FLIGHT = 100
BATCH = 100
CONCURRENCY = 8
CAPACITY = 256
#: Publisher tasks of the asyncbus batch rows, each ``publish_many`` of ``BATCH`` in turn.
PUBLISHERS = 4
WARM_UP = 2000
#: Connection pool size for the sides that publish from 100 tasks. redis-py 8's asyncio
#: pool holds at most 100 connections by default and raises MaxConnectionsError past
#: that (it does not wait), and 100 publishers plus the consumer's connections need more.
REDIS_POOL = 256

Payload = dict[str, Any]


# -- shared pieces -----------------------------------------------------------------


class Counter:
    """The handler body every side runs: count, and say when the last one came."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.handled = 0
        self.done = anyio.Event()

    def handle(self, payload: Payload) -> None:
        self.handled += 1
        if self.handled == self.total:
            self.done.set()


@dataclass
class Run:
    """One timed run: seconds from the first publish to the last handled message."""

    seconds: float
    cpu: float  # CPU time of this process / wall time, over the timed span


class Timer:
    """Wall and process CPU time of the timed span."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def stop(self) -> Run:
        wall = time.perf_counter() - self.wall
        return Run(wall, (time.process_time() - self.cpu) / max(wall, 1e-9))

    def __exit__(self, *exc: object) -> None:
        return None


def payloads(count: int) -> list[Payload]:
    return [{"id": i, "kind": "order.created", "amount": 12.5} for i in range(count)]


def run_timeout(count: int) -> float:
    """Bound of one run (setup, timed span and checks): generous, but never endless."""
    return 60.0 + count / 250


async def publish_concurrently(count: int, publish: Callable[[int], Awaitable[object]]) -> None:
    """``count`` publishes by a task group of ``IN_FLIGHT`` tasks: 100 in flight at once."""
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            await publish(index)

    async with anyio.create_task_group() as task_group:
        for _ in range(min(IN_FLIGHT, count)):
            task_group.start_soon(worker)


def check_count(counter: Counter) -> None:
    if counter.handled != counter.total:
        raise RuntimeError(f"handled {counter.handled} messages, expected {counter.total}")


def token() -> str:
    return secrets.token_hex(4)


async def wait_until(probe: Callable[[], Awaitable[int]], what: str, seconds: float = 10.0) -> None:
    """Poll ``probe`` until it returns 0 (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        left = await probe()
        if left == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{left} {what} after {seconds:.0f} s")
        await anyio.sleep(0.02)


# -- Redis -------------------------------------------------------------------------


async def redis_delete_prefix(url: str, prefix: str) -> int:
    """SCAN + DEL every key under ``{prefix}:``; returns how many went."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    removed = 0
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += await client.delete(*batch)
                batch = []
        if batch:
            removed += await client.delete(*batch)
    finally:
        await client.aclose()
    return removed


async def asyncbus_run(transport: Any, messages: Sequence[Payload]) -> Run:
    """One Bus over ``transport``: one subscription, 100 publishes in flight."""
    counter = Counter(len(messages))
    bus = Bus(transport=transport)

    async def handle(payload: Payload) -> None:
        counter.handle(payload)

    bus.subscribe(TOPIC, handle, group=GROUP, concurrency=CONCURRENCY, capacity=CAPACITY)
    async with bus:
        publish = bus.publish
        with Timer() as timer:
            await publish_concurrently(len(messages), lambda i: publish(TOPIC, messages[i]))
            await counter.done.wait()
            run = timer.stop()
        await bus.drain(timeout=30)  # every ack written (outside the timed span)
        left = await transport.backlog(TOPIC, GROUP)
        if left:
            raise RuntimeError(f"{left} messages left unsettled in the broker")
    check_count(counter)
    return run


async def asyncbus_batch_run(transport: Any, messages: Sequence[Payload]) -> Run:
    """One Bus over ``transport``: ``publish_many`` of 100 from ``PUBLISHERS`` tasks,
    one subscription with ``batch=Batch(max_size=100)`` counting each list."""
    counter = Counter(len(messages))
    bus = Bus(transport=transport)

    async def handle(batch: list[Payload]) -> None:
        counter.handled += len(batch)
        if counter.handled >= counter.total:
            counter.done.set()

    bus.subscribe(
        TOPIC,
        handle,
        group=GROUP,
        concurrency=CONCURRENCY,
        capacity=CAPACITY,
        batch=Batch(max_size=BATCH),
    )
    chunks = [messages[start : start + BATCH] for start in range(0, len(messages), BATCH)]
    async with bus:
        publish_many = bus.publish_many
        with Timer() as timer:
            async with anyio.create_task_group() as task_group:
                next_chunk = 0

                async def publisher() -> None:
                    nonlocal next_chunk
                    while next_chunk < len(chunks):
                        chunk = chunks[next_chunk]
                        next_chunk += 1
                        await publish_many(TOPIC, chunk)

                for _ in range(min(PUBLISHERS, len(chunks))):
                    task_group.start_soon(publisher)
            await counter.done.wait()
            run = timer.stop()
        await bus.drain(timeout=30)  # every ack written (outside the timed span)
        left = await transport.backlog(TOPIC, GROUP)
        if left:
            raise RuntimeError(f"{left} messages left unsettled in the broker")
    check_count(counter)
    return run


def with_pool(url: str) -> str:
    """``url`` with ``max_connections=REDIS_POOL`` in its query (read by redis-py)."""
    parts = urlsplit(url)
    query = "&".join(filter(None, (parts.query, f"max_connections={REDIS_POOL}")))
    return parts._replace(query=query).geturl()


BusRun = Callable[[Any, Sequence[Payload]], Awaitable[Run]]


async def redis_bus(url: str, messages: Sequence[Payload], run: BusRun, tag: str) -> Run:
    """``run`` over a RedisTransport under a fresh prefix, whose keys are deleted after."""
    prefix = f"bench-brokers-{tag}-{token()}"
    try:
        return await run(RedisTransport(with_pool(url), prefix=prefix), messages)
    finally:
        with anyio.CancelScope(shield=True):
            await redis_delete_prefix(url, prefix)


async def redis_asyncbus(url: str, messages: Sequence[Payload]) -> Run:
    return await redis_bus(url, messages, asyncbus_run, "ab")


async def redis_asyncbus_batch(url: str, messages: Sequence[Payload]) -> Run:
    return await redis_bus(url, messages, asyncbus_batch_run, "abb")


async def redis_hand_consume(client: Any, stream: str, counter: Counter) -> None:
    """The hand-written consumer: XREADGROUP COUNT 100 BLOCK, one XACK per batch."""
    loads = json.loads
    while counter.handled < counter.total:
        reply: Any = await client.xreadgroup(
            GROUP, "consumer-1", {stream: ">"}, count=BATCH, block=1000
        )
        for _stream, entries in reply or ():
            ids = []
            for entry, fields in entries:
                counter.handle(loads(fields[b"body"]))
                ids.append(entry)
            if ids:
                await client.xack(stream, GROUP, *ids)


async def redis_hand_run(
    url: str,
    messages: Sequence[Payload],
    produce: Callable[[Any, str], Awaitable[None]],
    name: str,
) -> Run:
    """A hand-written redis-py run: ``produce(client, stream)`` and the one consumer."""
    import redis.asyncio as aioredis

    prefix = f"bench-brokers-{name}-{token()}"
    stream = f"{prefix}:stream"
    counter = Counter(len(messages))
    client = aioredis.Redis.from_url(url, max_connections=REDIS_POOL)
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        with Timer() as timer:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(redis_hand_consume, client, stream, counter)
                task_group.start_soon(produce, client, stream)
                await counter.done.wait()
                run = timer.stop()
        check_count(counter)

        async def pending() -> int:
            summary: Any = await client.xpending(stream, GROUP)
            return int(summary["pending"])

        await wait_until(pending, "messages left pending")
        return run
    finally:
        with anyio.CancelScope(shield=True):
            await client.aclose()
            await redis_delete_prefix(url, prefix)


async def redis_hand_single(url: str, messages: Sequence[Payload]) -> Run:
    """redis-py: 100 tasks each awaiting its own XADD (pooled client); the same consumer."""

    async def produce(client: Any, stream: str) -> None:
        dumps, xadd = json.dumps, client.xadd
        await publish_concurrently(
            len(messages), lambda i: xadd(stream, {"body": dumps(messages[i])})
        )

    return await redis_hand_run(url, messages, produce, "single")


async def redis_hand_pipelined(url: str, messages: Sequence[Payload]) -> Run:
    """redis-py: XADD pipelines of 100, XREADGROUP COUNT 100, one XACK per batch."""

    async def produce(client: Any, stream: str) -> None:
        dumps = json.dumps
        for start in range(0, len(messages), BATCH):
            pipe = client.pipeline(transaction=False)
            for payload in messages[start : start + BATCH]:
                pipe.xadd(stream, {"body": dumps(payload)})
            await pipe.execute()

    return await redis_hand_run(url, messages, produce, "raw")


def faststream_missing() -> str | None:
    if importlib.util.find_spec("faststream") is None:
        return "faststream is not installed"
    try:
        importlib.import_module("faststream.redis")
    except ImportError as error:
        return f"faststream.redis cannot be imported: {error}"
    return None


async def redis_faststream(url: str, messages: Sequence[Payload]) -> Run:
    """FastStream's RedisBroker: a stream subscriber in a consumer group."""
    import redis.asyncio as aioredis

    # Imported by name: the bench extra installs FastStream, the test extra does not.
    faststream_redis: Any = importlib.import_module("faststream.redis")
    StreamSub = faststream_redis.StreamSub
    prefix = f"bench-brokers-fs-{token()}"
    stream = f"{prefix}:stream"
    counter = Counter(len(messages))
    broker = faststream_redis.RedisBroker(url, max_connections=REDIS_POOL, logger=None)

    async def handle(payload: dict[str, Any]) -> None:
        counter.handle(payload)

    # FastStream's defaults otherwise (one worker, no read count): faster here than
    # max_workers=8 / max_records=100 (about 3,100 vs 2,900 msg/s in a trial).
    broker.subscriber(stream=StreamSub(stream, group=GROUP, consumer="consumer-1"))(handle)

    client = aioredis.Redis.from_url(url)
    try:
        await broker.start()
        try:
            publish = broker.publish
            with Timer() as timer:
                await publish_concurrently(
                    len(messages), lambda i: publish(messages[i], stream=stream)
                )
                await counter.done.wait()
                run = timer.stop()

            async def pending() -> int:
                summary: Any = await client.xpending(stream, GROUP)
                return int(summary["pending"])

            await wait_until(pending, "messages left pending")
        finally:
            with anyio.CancelScope(shield=True):
                await broker.stop()
        check_count(counter)
        return run
    finally:
        with anyio.CancelScope(shield=True):
            await client.aclose()
            await redis_delete_prefix(url, prefix)


# -- NATS --------------------------------------------------------------------------


async def nats_delete_streams(url: str, *names: str) -> None:
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        js = nc.jetstream()
        for name in names:
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()


async def nats_bus(url: str, messages: Sequence[Payload], run: BusRun, tag: str) -> Run:
    """``run`` over a NatsTransport under a fresh prefix, whose streams are deleted after."""
    transport = NatsTransport(url, prefix=f"bench-brokers-{tag}-{token()}")
    try:
        return await run(transport, messages)
    finally:
        with anyio.CancelScope(shield=True):
            await nats_delete_streams(url, transport.stream, transport.dead_letter_stream)


async def nats_asyncbus(url: str, messages: Sequence[Payload]) -> Run:
    return await nats_bus(url, messages, asyncbus_run, "ab")


async def nats_asyncbus_batch(url: str, messages: Sequence[Payload]) -> Run:
    return await nats_bus(url, messages, asyncbus_batch_run, "abb")


async def nats_hand_single(url: str, messages: Sequence[Payload]) -> Run:
    """nats-py: 100 tasks each ``await js.publish`` in turn; the pipelined loop's consumer."""
    return await nats_hand(url, messages, pipelined=False)


async def nats_hand_pipelined(url: str, messages: Sequence[Payload]) -> Run:
    """nats-py: publish_async (100 pending), durable pull consumer fetch(100), ack each."""
    return await nats_hand(url, messages, pipelined=True)


async def nats_hand(url: str, messages: Sequence[Payload], *, pipelined: bool) -> Run:
    """The hand-written nats-py loop: a stream shaped like the transport's (file
    storage, interest retention), a durable pull consumer ``fetch(100)`` acking each
    message after the handler; publishes pipelined (``publish_async``, 100 pending)
    or single (100 tasks, each awaiting its own ``js.publish``)."""
    import nats
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    name = f"BENCH_BROKERS_RAW_{token().upper()}"
    subject = f"{name.lower()}.items"
    counter = Counter(len(messages))
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        js = nc.jetstream(publish_async_max_pending=IN_FLIGHT)
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[f"{name.lower()}.>"],
                retention=RetentionPolicy.INTEREST,
                storage=StorageType.FILE,
            )
        )
        pull = await js.pull_subscribe(subject, durable=GROUP, stream=name)
        futures: list[Any] = []

        async def produce() -> None:
            dumps = json.dumps
            if not pipelined:
                publish = js.publish
                await publish_concurrently(
                    len(messages), lambda i: publish(subject, dumps(messages[i]).encode())
                )
                return
            publish_async = js.publish_async
            append = futures.append
            for payload in messages:
                append(await publish_async(subject, dumps(payload).encode()))
            await js.publish_async_completed()

        async def consume() -> None:
            loads = json.loads
            while counter.handled < counter.total:
                try:
                    batch = await pull.fetch(BATCH, timeout=1)
                except NatsTimeout:
                    continue
                for msg in batch:
                    counter.handle(loads(msg.data))
                    await msg.ack()

        with Timer() as timer:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(consume)
                task_group.start_soon(produce)
                await counter.done.wait()
                run = timer.stop()
        check_count(counter)
        failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} publishes were not confirmed: {failed[0]}")
        await nc.flush()

        async def pending() -> int:
            info = await js.consumer_info(name, GROUP)
            return int(info.num_ack_pending or 0) + int(info.num_pending or 0)

        await wait_until(pending, "messages left unacked")
        return run
    finally:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await nc.close()
            await nats_delete_streams(url, name)


# -- the runner --------------------------------------------------------------------


Runner = Callable[[str, Sequence[Payload]], Awaitable[Run]]


@dataclass
class Impl:
    label: str
    run: Runner | None  # None: n/a, see ``why``
    why: str = ""
    runs: list[Run] = field(default_factory=list)  # seconds per message, CPU share
    error: str | None = None

    @property
    def rates(self) -> list[float]:
        return [0.0 if not run.seconds else 1.0 / run.seconds for run in self.runs]


@dataclass
class Broker:
    name: str
    url: str
    impls: list[Impl]
    #: The ratio columns: column title -> label of the baseline impl.
    baselines: dict[str, str] = field(default_factory=lambda: {"x hand": "hand-written"})
    messages: int = 0
    skipped: str | None = None

    def impl(self, label: str) -> Impl:
        return next(impl for impl in self.impls if impl.label == label)


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        where = (parts.hostname or "127.0.0.1", parts.port or default_port)
        with socket.create_connection(where, 1.0):
            return True
    except OSError:
        return False


def describe(error: BaseException) -> str:
    """The first leaf of an exception group, as ``Type: message``."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


def address(url: str) -> str:
    return urlsplit(url).netloc.rpartition("@")[2]


async def measure(broker: Broker, messages: int, rounds: int) -> None:
    """Warm up each side once, then alternate them ``rounds`` times."""
    broker.messages = messages
    data = payloads(messages)
    live = [impl for impl in broker.impls if impl.run is not None]
    for impl in live:
        assert impl.run is not None
        try:
            with anyio.fail_after(run_timeout(WARM_UP)):
                await impl.run(broker.url, data[: min(messages, WARM_UP)])
        except Exception as error:
            impl.error = f"warm-up failed: {describe(error)}"
    for _ in range(rounds):
        for impl in live:
            if impl.error is not None or impl.run is None:
                continue
            gc.collect()
            try:
                with anyio.fail_after(run_timeout(messages)):
                    run = await impl.run(broker.url, data)
            except Exception as error:
                impl.error = describe(error)
                continue
            impl.runs.append(Run(run.seconds / messages, run.cpu))  # seconds per message


def round_ratios(numerator: Impl, denominator: Impl) -> list[float]:
    """Per-round ratios of throughput (rounds where both ran)."""
    return [
        b.seconds / a.seconds
        for a, b in zip(numerator.runs, denominator.runs, strict=False)
        if a.seconds and b.seconds
    ]


def median_ratio(numerator: Impl, denominator: Impl) -> float | None:
    """Median of per-round ratios of throughput (rounds where both ran)."""
    ratios = round_ratios(numerator, denominator)
    return statistics.median(ratios) if ratios else None


def ratio_text(numerator: Impl, denominator: Impl) -> str:
    """``median (min-max)`` of the per-round ratios, ``-`` when there are none."""
    if denominator.error is not None:
        return "-"
    ratios = round_ratios(numerator, denominator)
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def table(broker: Broker, rounds: int) -> list[str]:
    baselines = {title: broker.impl(label) for title, label in broker.baselines.items()}
    named = "; ".join(f"{title} = to {impl.label}" for title, impl in baselines.items())
    columns = "".join(f" {title:>17}" for title in baselines)
    lines = [
        f"{broker.name} ({address(broker.url)}): {broker.messages:,} messages per run, "
        f"{rounds} alternating rounds, medians; x = median of per-round throughput ratios "
        f"(min-max over the rounds): {named}",
        f"  {'implementation':<28} {'msg/s':>10} {'µs/msg':>9}{columns}   rounds (msg/s)",
    ]
    for impl in broker.impls:
        if impl.run is None:
            lines.append(f"  {impl.label:<28} n/a ({impl.why})")
            continue
        if impl.error is not None or not impl.runs:
            lines.append(f"  {impl.label:<28} error: {impl.error}")
            continue
        per_message = statistics.median(run.seconds for run in impl.runs)
        shown = "".join(f" {ratio_text(impl, base):>17}" for base in baselines.values())
        each = " ".join(f"{rate:,.0f}" for rate in impl.rates)
        lines.append(
            f"  {impl.label:<28} {1 / per_message:>10,.0f} {per_message * 1e6:>9.1f}"
            f"{shown}   {each}"
        )
    cpu = [run.cpu for impl in broker.impls for run in impl.runs]
    if cpu:
        lines.append(
            f"  CPU share of this process over the timed spans: {min(cpu):.0%}-{max(cpu):.0%} "
            f"(the server runs in its own process on the same {os.cpu_count()} CPUs)"
        )
    return lines


@dataclass
class Verdict:
    name: str
    goal: str
    measured: str
    verdict: str  # PASS, FAIL or n/a


def judge(broker: Broker, label: str, reference: str, goal: float) -> Verdict:
    name = f"{broker.name}: {label} vs {reference}"
    goal_text = f">= {goal:g}x {reference}"
    ours, theirs = broker.impl(label), broker.impl(reference)
    if broker.skipped is not None:
        return Verdict(name, goal_text, f"skipped ({broker.skipped})", "n/a")
    if theirs.run is None:
        return Verdict(name, goal_text, f"n/a ({theirs.why})", "n/a")
    if ours.error is not None or not ours.runs:
        return Verdict(name, goal_text, f"asyncbus failed: {ours.error}", "FAIL")
    if theirs.error is not None or not theirs.runs:
        return Verdict(name, goal_text, f"{reference} failed: {theirs.error}", "FAIL")
    ratios = round_ratios(ours, theirs)
    ratio = statistics.median(ratios)
    measured = f"{ratio:.3f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"
    return Verdict(name, goal_text, measured, "PASS" if ratio >= goal else "FAIL")


def header(loop: str) -> list[str]:
    versions = []
    for package in ("redis", "nats-py", "faststream", "anyio", "uvloop"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions.append(f"{package} {version(package)}")
    return [
        f"machine: {os.cpu_count()} CPUs ({platform.machine()}), "
        f"CPython {platform.python_version()}, "
        f"event loop: asyncio{' + uvloop' if loop == 'uvloop' else ''}",
        "packages: " + ", ".join(versions),
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]


async def server_versions(redis_url: str | None, nats_url: str | None) -> list[str]:
    found = []
    if redis_url is not None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        try:
            info: Any = await client.info("server")
            found.append(f"Redis {info.get('redis_version', '?')}")
        finally:
            await client.aclose()
    if nats_url is not None:
        import nats

        nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            version = nc.connected_server_version
            found.append(f"NATS {version.major}.{version.minor}.{version.patch}")
        finally:
            await nc.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncbus bench brokers", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--messages", type=int, default=20_000, help="messages per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 3)")
    parser.add_argument(
        "--check", action="store_true", help="judge the targets too; exit 1 on FAIL"
    )
    parser.add_argument(
        "--only", choices=("redis", "nats"), default=None, help="run one broker alone"
    )
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--nats-url", default=NATS_URL)
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
    )
    options = parser.parse_args(argv)
    if options.messages < 1:
        parser.error("--messages must be >= 1")
    if options.rounds < 3:
        parser.error("--rounds must be >= 3 (medians of alternating rounds)")

    started = time.monotonic()
    missing = faststream_missing()
    redis = Broker(
        "Redis Streams",
        options.redis_url,
        [
            Impl("asyncbus", redis_asyncbus),
            Impl("hand-written single", redis_hand_single),
            Impl("hand-written pipelined", redis_hand_pipelined),
            Impl("asyncbus batch", redis_asyncbus_batch),
            Impl("FastStream", redis_faststream if missing is None else None, missing or ""),
        ],
        {"x single": "hand-written single", "x pipelined": "hand-written pipelined"},
    )
    nats = Broker(
        "NATS JetStream",
        options.nats_url,
        [
            Impl("asyncbus", nats_asyncbus),
            Impl("hand-written single", nats_hand_single),
            Impl("hand-written pipelined", nats_hand_pipelined),
            Impl("asyncbus batch", nats_asyncbus_batch),
        ],
        {"x single": "hand-written single", "x pipelined": "hand-written pipelined"},
    )
    if not reachable(options.redis_url, 6379):
        redis.skipped = f"nothing listens on {address(options.redis_url)}"
    if not reachable(options.nats_url, 4222):
        nats.skipped = f"nothing listens on {address(options.nats_url)}"
    for broker, key in ((redis, "redis"), (nats, "nats")):
        if options.only not in (None, key):
            broker.skipped = f"not asked for (--only {options.only})"

    async def run_all() -> list[str]:
        servers = await server_versions(
            None if redis.skipped else options.redis_url,
            None if nats.skipped else options.nats_url,
        )
        for broker in (redis, nats):
            if broker.skipped is None:
                await measure(broker, options.messages, options.rounds)
        return servers

    servers = anyio.run(
        run_all, backend="asyncio", backend_options={"use_uvloop": options.loop == "uvloop"}
    )
    lines = header(options.loop)
    if servers:
        lines.append("servers: " + ", ".join(servers) + " (loopback)")
    lines.append(
        f"asyncbus: one subscription (group {GROUP!r}, concurrency {CONCURRENCY}, capacity "
        f"{CAPACITY}); publishers: a task group of {IN_FLIGHT} tasks (100 publishes in flight)"
    )
    lines.append(
        f"asyncbus batch: the same subscription with batch=Batch(max_size={BATCH}); "
        f"publishers: {PUBLISHERS} tasks, each publish_many of {BATCH} in turn"
    )
    lines.append(
        f"Redis connection pools of asyncbus and FastStream: max_connections={REDIS_POOL} "
        "(redis-py's default of 100 raises MaxConnectionsError with 100 publishers)"
    )
    for broker in (redis, nats):
        lines.append("")
        if broker.skipped is not None:
            lines.append(f"{broker.name}: skipped ({broker.skipped})")
        else:
            lines.extend(table(broker, options.rounds))
    verdicts = []
    if options.check:
        verdicts = [
            judge(redis, "asyncbus", "hand-written single", 0.8),
            judge(redis, "asyncbus", "FastStream", 10.0),
            judge(redis, "asyncbus batch", "hand-written pipelined", 0.8),
            judge(nats, "asyncbus", "hand-written single", 0.8),
            judge(nats, "asyncbus batch", "hand-written pipelined", 0.8),
        ]
        lines += ["", "targets:"]
        for verdict in verdicts:
            lines.append(
                f"  {verdict.verdict:<4}  {verdict.name:<62} {verdict.goal:<34} {verdict.measured}"
            )
    lines.append(f"\ntotal time {time.monotonic() - started:.0f} s")
    print("\n".join(lines))
    broken = [
        f"{broker.name}: {impl.error}"
        for broker in (redis, nats)
        for impl in broker.impls
        if impl.label.startswith("asyncbus") and broker.skipped is None and impl.error is not None
    ]
    for failure in broken:
        print(f"asyncbus failed on {failure}", file=sys.stderr)
    failed = any(verdict.verdict == "FAIL" for verdict in verdicts)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
